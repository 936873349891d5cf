"""Log-ratios with DESIGN.md's bad-input rules, shared by weights, rejection and metrics.

``δ_t = log π_old^train − log π_old^rollout`` is the paper's token mismatch (eq. 1,
../shared/seeds/tim-diagnosis-paper.txt); ``r_corr,t = exp(δ_t)``.
"""

from __future__ import annotations

from typing import Optional

import torch

#: The token or sequence log-ratio is clamped to ±20 before exp (verl's SAFETY_BOUND).
LOG_RATIO_BOUND = 20.0


def check_shapes(reference_name: str, reference: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    """Raise a ``ValueError`` naming both fields and both shapes on any disagreement.

    The common real case is rollout logprobs one token longer than the completion (an
    engine that also scored the EOS or the first prompt token).
    """
    if reference.dim() != 2:
        raise ValueError(f"{reference_name} must be (batch, tokens), got shape {tuple(reference.shape)}")
    for name, tensor in others.items():
        if tensor is None:
            continue
        if tuple(tensor.shape) != tuple(reference.shape):
            hint = ""
            if tensor.dim() == 2 and tensor.shape[0] == reference.shape[0]:
                diff = tensor.shape[1] - reference.shape[1]
                if diff:
                    hint = (f" ({name} is {abs(diff)} token{'s' if abs(diff) > 1 else ''} "
                            f"{'longer' if diff > 0 else 'shorter'}; align it to the completion tokens)")
            raise ValueError(
                f"shape mismatch: {name} has shape {tuple(tensor.shape)} but {reference_name} has shape "
                f"{tuple(reference.shape)}{hint}"
            )


def compute_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    """At least fp32: bf16 logprobs are upcast before any difference is taken."""
    dtype = torch.float32
    for t in tensors:
        if t is not None and t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def sanitized_log_ratio(
    numerator: torch.Tensor, denominator: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``numerator − denominator`` per token, made finite, and the non-finite count mask.

    DESIGN.md's rules: a NaN (or a +inf, which no logprob can be) on either side is
    neutral, log-ratio 0 (weight 1); a −inf on one side is maximal mismatch, the clamp
    bound ±20; −inf on both sides agree and are neutral. Padding gets 0.

    Returns ``(log_ratio, nonfinite)`` with ``nonfinite`` the valid tokens whose inputs
    were not finite (counted in ``rollout_correction/nonfinite_frac``).
    """
    num = numerator.detach().to(dtype)
    den = denominator.detach().to(dtype)
    finite = torch.isfinite(num) & torch.isfinite(den)
    neutral = (
        torch.isnan(num) | torch.isnan(den) | torch.isposinf(num) | torch.isposinf(den)
        | (torch.isneginf(num) & torch.isneginf(den))
    )
    log_ratio = torch.where(neutral | ~valid, torch.zeros((), dtype=dtype, device=num.device), num - den)
    log_ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return log_ratio, valid & ~finite


def sequence_log_ratio(log_ratio: torch.Tensor, valid_f: torch.Tensor, reduction: str) -> torch.Tensor:
    """``log ρ_seq`` per sequence: mean (geometric mean) or sum (product) of token log-ratios.

    ``log_ratio`` is already zero on padding. Clamped to ±20. Empty sequences give 0.
    """
    total = log_ratio.sum(dim=-1)
    if reduction == "geometric_mean":
        total = total / valid_f.sum(dim=-1).clamp_min(1.0)
    elif reduction != "product":
        raise ValueError(f"rollout_importance_sampling_sequence_reduction: unknown value {reduction!r}")
    return total.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
