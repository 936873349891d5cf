"""The ``precision`` flag: one compute dtype for the rollout engine and the trainer, set together.

Qi et al., "Defeating the Training-Inference Mismatch via FP16" (2025): with both sides in fp16
instead of bf16 the same weights give logprobs that agree far better (fp16 keeps 10 mantissa bits
to bf16's 7), at the price of fp16's range (largest finite value 65504) and, in training, loss
scaling. The known failure is a precision set on one side only; this flag names one value that the
adapters write to both sides (verl's actor and rollout dtype keys, TRL's ``fp16``/``bf16`` and its
engine's ``dtype``, NeMo RL's ``policy.precision`` and its generation's).

Torch-free at import (the config imports it before anything heavy loads). The spellings users write in each framework (``bfloat16``, ``float16``, ``half``, ...)
are accepted and normalised to ``bf16`` / ``fp16`` / ``fp32``.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["PRECISIONS", "FP16_MAX", "normalize_precision", "engine_dtype", "torch_dtype", "precision_of_dtype"]

PRECISIONS = ("bf16", "fp16", "fp32")

#: fp16's largest finite value (``torch.finfo(torch.float16).max``): beyond it a value is +-inf in fp16.
FP16_MAX = 65504.0

_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
}
_ENGINE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def precision_of_dtype(value: object) -> Optional[str]:
    """``bf16`` / ``fp16`` / ``fp32`` for a dtype as a framework writes it (text or ``torch.dtype``);
    None for anything else (``auto``, None, an unknown spelling)."""
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        value = str(value)
    if not isinstance(value, str):
        return None
    return _ALIASES.get(value.strip().lower())


def normalize_precision(value: object, flag: str = "precision") -> Optional[str]:
    """None (off) or one of :data:`PRECISIONS`; any other value raises ``ValueError`` naming ``flag``."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    found = precision_of_dtype(value)
    if found is None:
        raise ValueError(f"{flag}: unknown precision {value!r}; expected null, bf16, fp16 or fp32 "
                         "(bfloat16, float16 and float32 are accepted too)")
    return found


def engine_dtype(precision: str) -> str:
    """The engine's ``dtype`` argument (vLLM, SGLang): ``bfloat16`` / ``float16`` / ``float32``."""
    return _ENGINE[normalize_precision(precision)]


def torch_dtype(precision: str) -> Any:
    """The ``torch.dtype`` of a precision."""
    import torch

    return getattr(torch, engine_dtype(precision))
