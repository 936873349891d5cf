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


def _plus_inf_to_nan(x: torch.Tensor) -> torch.Tensor:
    nan = float("nan")
    return x.nan_to_num(nan=nan, posinf=nan, neginf=float("-inf"))


def sanitized_log_ratio(
    numerator: torch.Tensor, denominator: torch.Tensor, valid: torch.Tensor, valid_f: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``numerator − denominator`` per token, made finite, and the non-finite count mask.

    DESIGN.md's rules: a NaN (or a +inf, which no logprob can be) on either side is
    neutral, log-ratio 0 (weight 1); a −inf on one side is maximal mismatch, the clamp
    bound ±20; −inf on both sides agree and are neutral. Padding gets 0.

    The difference itself tells every case apart (a NaN or +inf input, mapped to NaN,
    makes it NaN, as does −inf − (−inf); a lone −inf makes it ±inf), so this is a handful
    of passes over the batch, not one per rule.

    Returns ``(log_ratio, nonfinite)`` with ``nonfinite`` the valid tokens whose inputs
    were not finite (counted in ``rollout_correction/nonfinite_frac``).
    """
    dtype = valid_f.dtype
    diff = _plus_inf_to_nan(numerator.detach().to(dtype)) - _plus_inf_to_nan(denominator.detach().to(dtype))
    # x - x is 0 for finite x and NaN for NaN or ±inf: one cheap pass instead of isfinite's several.
    nonfinite = (diff - diff) != 0
    nonfinite &= valid
    log_ratio = diff.nan_to_num_(0.0, LOG_RATIO_BOUND, -LOG_RATIO_BOUND).clamp_(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return log_ratio.mul_(valid_f), nonfinite


class TokenStats:
    """The per-token quantities every part of the correction reads, each computed once.

    ``log_ratio`` is zero on padding, so ``ratio`` is one there and ``k3 = r − 1 − lr``
    zero: sums over the whole tensor equal sums over valid tokens up to a known count of
    padding, which saves a masking pass per statistic. This matters: the correction is a
    few dozen memory-bound passes over ``(B, T)`` next to a loss of about as many.
    """

    def __init__(self, log_ratio: torch.Tensor, valid: torch.Tensor, valid_f: torch.Tensor,
                 nonfinite: torch.Tensor):
        self.log_ratio = log_ratio
        self.valid = valid
        self.valid_f = valid_f
        self.nonfinite = nonfinite
        self.tokens_per_seq = valid_f.sum(dim=-1)
        self.row_log_ratio = log_ratio.sum(dim=-1)
        self._ratio: Optional[torch.Tensor] = None
        self._k2: Optional[torch.Tensor] = None
        self._k3: Optional[torch.Tensor] = None
        self._finite: Optional[torch.Tensor] = None
        self._finite_row_sums: dict[str, torch.Tensor] = {}

    @property
    def finite(self) -> torch.Tensor:
        """Valid tokens whose two logprobs are finite: what per-sequence means average over."""
        if self._finite is None:
            self._finite = self.valid & ~self.nonfinite
        return self._finite

    @property
    def finite_per_seq(self) -> torch.Tensor:
        return self.finite_row_sum("__count__", None)

    def finite_row_sum(self, name: str, values: Optional[torch.Tensor]) -> torch.Tensor:
        """Σ_t over each sequence's finite tokens of ``values`` (cached under ``name``)."""
        if name not in self._finite_row_sums:
            if values is None:
                total = self.finite.sum(dim=-1).to(self.valid_f.dtype)
            else:
                values = values.detach().to(self.valid_f.dtype)
                total = torch.where(self.finite, values, values.new_zeros(())).sum(dim=-1)
            self._finite_row_sums[name] = total
        return self._finite_row_sums[name]

    @property
    def ratio(self) -> torch.Tensor:
        if self._ratio is None:
            self._ratio = self.log_ratio.exp()
        return self._ratio

    def estimator(self, name: str) -> torch.Tensor:
        """Per-token K1 = −lr, K2 = ½ lr², K3 = r − 1 − lr (all zero on padding)."""
        if name == "k1":
            return -self.log_ratio
        if name == "k2":
            if self._k2 is None:
                self._k2 = 0.5 * self.log_ratio.square()
            return self._k2
        if self._k3 is None:
            # expm1, not exp - 1: K3 ≈ lr²/2 is ~1e-9 for typical mismatch and the
            # paper's tau_seq = 0.001 sums thousands of them; exp - 1 would drown it in fp32.
            self._k3 = torch.expm1(self.log_ratio).sub_(self.log_ratio)
        return self._k3

    def row_sum(self, name: str) -> torch.Tensor:
        """Σ_t K over each sequence's valid tokens, from row sums where possible."""
        if name == "k1":
            return -self.row_log_ratio
        return self.estimator(name).sum(dim=-1)

    def sequence_log_ratio(self, reduction: str) -> torch.Tensor:
        """``log ρ_seq``: mean (geometric mean) or sum (product) of token log-ratios, ±20."""
        total = self.row_log_ratio
        if reduction == "geometric_mean":
            total = total / self.tokens_per_seq.clamp_min(1.0)
        elif reduction != "product":
            raise ValueError(f"rollout_importance_sampling_sequence_reduction: unknown value {reduction!r}")
        return total.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
