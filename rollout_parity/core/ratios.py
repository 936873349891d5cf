"""Log-ratios with the bad-input rules of docs/flags.md, shared by weights, rejection and metrics.

``δ_t = log π_old^train − log π_old^rollout`` is the paper's token mismatch (eq. 1,
../shared/seeds/tim-diagnosis-paper.txt); ``r_corr,t = exp(δ_t)``.
"""

from __future__ import annotations

import math

from typing import Optional

import torch

#: What adapters read; ``TokenStats`` and the sanitising helpers are the correction's parts.
__all__ = ["LOG_RATIO_BOUND", "check_shapes"]

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


# Under torch.compile (``compile_correction``) NaN tests are written as comparisons (x == x, x - x == 0): Inductor's
# CPU code runs isnan one element at a time inside its vectorised loops, where a comparison stays vectorised. Eager
# keeps torch's one-pass in-place nan_to_num.

def _plus_inf_to_nan(x: torch.Tensor) -> torch.Tensor:
    """A fresh copy of ``x`` with +inf (which no logprob can be) turned to NaN."""
    nan = float("nan")
    if torch.compiler.is_compiling():
        return torch.where(x == math.inf, nan, x)
    return x.nan_to_num(nan=nan, posinf=nan, neginf=float("-inf"))


def nan_to_(x: torch.Tensor, value: float) -> torch.Tensor:
    """``x`` with NaN set to ``value`` (in place in eager, where ±inf also become ±max: every caller clamps them
    or has none)."""
    if torch.compiler.is_compiling():
        return torch.where(x == x, x, value)
    return x.nan_to_num_(nan=value)


def nonfinite_to_zero_(x: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN and ±inf set to 0 (in place in eager)."""
    if torch.compiler.is_compiling():
        return torch.where(x - x == 0, x, 0.0)
    return x.nan_to_num_(0.0, 0.0, 0.0)


def sanitized_log_ratio(
    numerator: torch.Tensor, denominator: torch.Tensor, valid_f: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``numerator − denominator`` per token, made finite, and the non-finite count mask.

    The rules (docs/flags.md, "Bad input"): a NaN (or a +inf, which no logprob can be) on either side is
    neutral, log-ratio 0 (weight 1); a −inf on one side is maximal mismatch, the clamp
    bound ±20; −inf on both sides agree and are neutral. Padding gets 0.

    The difference itself tells every case apart (a NaN or +inf input, mapped to NaN,
    makes it NaN, as does −inf − (−inf); a lone −inf makes it ±inf), so this is a handful
    of float passes over the batch, not one per rule.

    Returns ``(log_ratio, nonfinite)``; ``nonfinite`` is a float 0/1 mask of the valid
    tokens whose inputs were not finite (counted in ``rollout_correction/nonfinite_frac``).
    """
    dtype = valid_f.dtype
    diff = _plus_inf_to_nan(numerator.detach().to(dtype))
    other = _plus_inf_to_nan(denominator.detach().to(dtype))
    diff.sub_(other)  # both are fresh copies: work in place, a new (B, T) buffer costs more than the math
    # x - x is 0 for a finite x and NaN for NaN or ±inf, so this is 1 exactly where diff is not finite.
    nonfinite = nan_to_(torch.sub(diff, diff, out=other), 1.0).mul_(valid_f)
    log_ratio = nan_to_(diff, 0.0).clamp_(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return log_ratio.mul_(valid_f), nonfinite


def nonfinite_mask(values: torch.Tensor, valid_f: torch.Tensor) -> torch.Tensor:
    """Float 0/1 mask of the valid tokens where ``values`` is NaN or ±inf."""
    x = values.detach().to(valid_f.dtype)
    # x - x is 0 for a finite x and NaN for NaN or ±inf (a fresh tensor, so the rest is in place).
    return nan_to_(torch.sub(x, x), 1.0).mul_(valid_f)


def zero_padding_advantages(advantages: torch.Tensor, valid_f: torch.Tensor,
                            tokens_per_seq: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Advantages with padding (``(B, T)``) or empty sequences (``(B,)``) set to 0.

    Frameworks fill padding as they like; a NaN there (an empty sequence's GRPO advantage
    with std 0) would turn into NaN through ``0 * NaN`` however it is masked afterwards.
    A NaN advantage on a valid token is left alone: that is a reward bug, and a NaN loss says so.
    ``tokens_per_seq`` (``valid_f.sum(-1)``, when the caller has it) spares a pass for ``(B,)`` advantages.
    """
    if advantages.dim() == 2:
        keep = valid_f > 0
    else:
        keep = (valid_f.sum(dim=-1) if tokens_per_seq is None else tokens_per_seq) > 0
    return torch.where(keep, advantages, advantages.new_zeros(()))


class TokenStats:
    """The per-token quantities every part of the correction reads, each computed once.

    Masks are float 0/1 tensors and masking is multiplication: on CPU torch's ``where`` and
    ``masked_fill`` over a bool mask cost ~30x an elementwise product (measured here), and
    the correction is a few dozen passes over ``(B, T)`` next to a loss of about as many.
    ``log_ratio`` is zero on padding, so ``ratio`` is one there and every K estimator zero.

    Fresh ``(B, T)`` buffers are the dearest thing on CPU (a new allocation of that size costs a
    page-faulting ``mmap``; measured at ~100x an in-place pass on a loaded machine), so the
    correction works in place where it can and shares one :attr:`scratch` buffer between the
    passes whose per-token result only feeds a sum.
    """

    def __init__(self, log_ratio: torch.Tensor, valid_f: torch.Tensor, nonfinite_f: torch.Tensor,
                 read_nonfinite_f: Optional[torch.Tensor] = None):
        self.log_ratio = log_ratio
        self.valid_f = valid_f
        #: valid tokens where a logprob of r_corr (π_old or π_rollout) is not finite
        self.nonfinite_f = nonfinite_f
        #: ... or any other logprob the correction reads (π_θ, the off-policy mask's π_old): counted
        self.read_nonfinite_f = nonfinite_f if read_nonfinite_f is None else read_nonfinite_f
        self.tokens_per_seq = valid_f.sum(dim=-1)
        self.row_log_ratio = log_ratio.sum(dim=-1)
        #: π_θ − π_old as read (not sanitised), kept by :meth:`read_also` for C(r); None until then
        self.ppo_log_ratio: Optional[torch.Tensor] = None
        self._ratio: Optional[torch.Tensor] = None
        self._k2: Optional[torch.Tensor] = None
        self._k3: Optional[torch.Tensor] = None
        self._finite_f: Optional[torch.Tensor] = None
        self._clean_f: Optional[torch.Tensor] = None
        self._scratch: Optional[torch.Tensor] = None
        self._finite_row_sums: dict[str, torch.Tensor] = {}
        self._row_sums: dict[str, torch.Tensor] = {}

    @property
    def ratio(self) -> torch.Tensor:
        if self._ratio is None:
            self._ratio = self.log_ratio.exp()
        return self._ratio

    @property
    def scratch(self) -> torch.Tensor:
        """One ``(B, T)`` work buffer, reused by every pass whose per-token result only feeds a sum.

        Its contents are the last user's: each user fills it whole (``out=``) and reduces it before the next.
        """
        if self._scratch is None:
            self._scratch = torch.empty_like(self.valid_f)
        return self._scratch

    @property
    def finite_f(self) -> torch.Tensor:
        """Valid tokens whose two logprobs of r_corr are finite (float 0/1): the perplexities' tokens."""
        if self._finite_f is None:
            self._finite_f = self.valid_f - self.nonfinite_f
        return self._finite_f

    @property
    def clean_f(self) -> torch.Tensor:
        """Valid tokens whose every logprob read is finite (float 0/1): the off-policy drift's and C(r)'s."""
        if self._clean_f is None:
            self._clean_f = self.finite_f if self.read_nonfinite_f is self.nonfinite_f else (
                self.valid_f - self.read_nonfinite_f)
        return self._clean_f

    def read_also(self, values: torch.Tensor, *, ppo_log_ratio: bool = False) -> None:
        """Count the non-finite entries of one more logprob tensor the correction reads (``values``, detached).

        ``values − values`` is 0 where a value is finite and NaN where it is not; added to the tokens clean so
        far, NaN turns to 0, so the clean mask and the count come from two in-place passes. With
        ``ppo_log_ratio`` the values are π_θ − π_old (non-finite where either is), kept for C(r).
        """
        values = values.detach().to(self.valid_f.dtype)
        if ppo_log_ratio:
            self.ppo_log_ratio = values
        probe = torch.sub(values, values)
        if self._clean_f is None and self.read_nonfinite_f is self.nonfinite_f and self._finite_f is None:
            probe.add_(self.valid_f).sub_(self.nonfinite_f)  # the r_corr-finite tokens, without a buffer for them
        else:
            probe.add_(self.clean_f)
        self._clean_f = nan_to_(probe, 0.0)
        self.read_nonfinite_f = self.valid_f - self._clean_f

    @property
    def finite_per_seq(self) -> torch.Tensor:
        if "__count__" not in self._finite_row_sums:
            self._finite_row_sums["__count__"] = self.finite_f.sum(dim=-1)
        return self._finite_row_sums["__count__"]

    def finite_row_sum(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """Σ_t over each sequence's finite tokens of ``values`` (cached under ``name``).

        ``values · finite_f`` is NaN exactly where ``values`` is not finite (and ``finite_f`` is 0
        there), so ``nansum`` skips those tokens without a cleaned copy of ``values``.
        """
        if name not in self._finite_row_sums:
            product = torch.mul(values.detach(), self.finite_f, out=self.scratch)
            # compiled: a NaN-to-0 comparison and a plain sum (Inductor's nansum tests isnan element by element)
            self._finite_row_sums[name] = (nan_to_(product, 0.0).sum(dim=-1) if torch.compiler.is_compiling()
                                           else torch.nansum(product, dim=-1))
        return self._finite_row_sums[name]

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
        """Σ_t K over each sequence's valid tokens (cached: rejection and the diagnostics share it).

        K3's per-token values are built in :attr:`scratch` when nothing asked for them as a tensor (a
        ``seq_sum``/``seq_mean`` rule and the diagnostics need only the sums): one fresh buffer fewer.
        """
        if name == "k1":
            return -self.row_log_ratio
        if name not in self._row_sums:
            if name == "k3" and self._k3 is None:
                k3 = torch.expm1(self.log_ratio, out=self.scratch).sub_(self.log_ratio)  # as estimator("k3")
            else:
                k3 = self.estimator(name)
            self._row_sums[name] = k3.sum(dim=-1)
        return self._row_sums[name]

    def sequence_log_ratio(self, reduction: str) -> torch.Tensor:
        """``log ρ_seq``: mean (geometric mean) or sum (product) of token log-ratios, ±20."""
        total = self.row_log_ratio
        if reduction == "geometric_mean":
            total = total / self.tokens_per_seq.clamp_min(1.0)
        elif reduction != "product":
            raise ValueError(f"rollout_importance_sampling_sequence_reduction: unknown value {reduction!r}")
        return total.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
