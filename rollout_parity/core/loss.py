"""``policy_loss``: the clipped PPO/GRPO surrogate with the correction applied in one place.

Per token (paper eq. 2, ../shared/seeds/tim-diagnosis-paper.txt):
``L_t = w_t · max(−r_t A_t, −clip(r_t, 1−ε_low, 1+ε_high) A_t)`` with ``r_t = π_θ/π_old``
and, when ``clip_ratio_c`` is set (dual clip), ``min(L_t, −c A_t)`` for ``A_t < 0``.
``w_t`` are the detached IS weights of ``compute_correction`` (TIS is eq. 6); they multiply
the policy term only, never a KL-to-reference term the caller may add.

Aggregation over the corrected mask (verl's names):

* ``token-mean``: ``Σ L / N_tok``
* ``seq-mean-token-mean``: mean over sequences of each sequence's token mean
* ``seq-mean-token-sum``: mean over sequences of each sequence's token sum
* ``seq-mean-token-sum-norm``: ``Σ L / (N_seq · loss_scale_factor)`` (default factor: T)

``global_num_tokens``/``global_num_seqs`` replace the local ``N_tok``/``N_seq`` for
data-parallel or NeMo RL-style global normalisation. An empty mask gives a zero loss that
still backpropagates.

Non-finite inputs (docs/flags.md, "Bad input"): a NaN or +inf π_old is neutral (ratio 1, the
token keeps ∇ log π_θ); a −inf π_θ or π_old is maximal mismatch (log-ratio at ±20, no
gradient; 0 when the other side is NaN or −inf too); a NaN or +inf π_θ has neither a value
nor a gradient to give, so that token leaves the loss and its metrics (``compute_correction``
counts it in ``nonfinite_frac``). NaN advantages on padding are ignored. Loss, gradient and
``policy/*`` stay finite.
"""

from __future__ import annotations

from typing import Optional

import torch

from .config import CorrectionConfig
from .correction import CorrectionOutput
from .ratios import LOG_RATIO_BOUND, check_shapes, zero_padding_advantages

#: The public face; ``aggregate`` and ``clipped_surrogate`` are its parts.
__all__ = ["LOSS_AGG_MODES", "policy_loss"]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
) -> torch.Tensor:
    """Reduce a ``(B, T)`` per-token loss to a scalar under ``mask`` (see module doc)."""
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if loss_agg_mode == "token-mean":
        denom = mask.sum() if global_num_tokens is None else global_num_tokens
        return masked.sum() / _at_least_one(denom, per_token)
    tokens_per_seq = mask.sum(dim=-1)
    seq_sum = masked.sum(dim=-1)
    n_seq = (tokens_per_seq > 0).to(per_token.dtype).sum() if global_num_seqs is None else global_num_seqs
    n_seq = _at_least_one(n_seq, per_token)
    if loss_agg_mode == "seq-mean-token-mean":
        return (seq_sum / tokens_per_seq.clamp_min(1.0)).sum() / n_seq
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sum.sum() / n_seq
    if loss_agg_mode == "seq-mean-token-sum-norm":
        factor = per_token.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return seq_sum.sum() / n_seq / factor
    raise ValueError(f"loss_agg_mode: unknown value {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")


def _at_least_one(value, like: torch.Tensor) -> torch.Tensor:
    if not torch.is_tensor(value):
        value = torch.tensor(float(value), dtype=like.dtype, device=like.device)
    return value.to(like.dtype).clamp_min(1.0)


def clipped_surrogate(
    current_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped PPO loss, the float 0/1 masks of clipped and dual-clipped tokens, and log r.

    A NaN (or +inf) π_old (an engine's NaN under bypass, where π_old is π_rollout) is
    neutral: that token's ratio is 1 and it still carries the policy gradient, ``∇ log π_θ``.
    A −inf π_old or π_θ is maximal mismatch, the ratio at its ±20 log bound, as in
    ``compute_correction``. A NaN/+inf π_θ gives a finite value with zero gradient; the
    caller removes that token from the mask. Every output is finite where the advantages are.
    """
    current = current_logprobs
    old = old_logprobs.detach()
    # cur - old where π_old is a number; cur - stop_grad(cur) (value 0, gradient 1) where it is NaN/+inf.
    old = torch.where(torch.isnan(old).logical_or_(torch.isposinf(old)), current.detach(), old)
    # Every non-finite case ends here as a non-finite difference: −inf on one side gives ±inf (the
    # bound), a NaN/+inf π_θ or −inf on both sides gives NaN (0). nan_to_num passes no gradient to
    # the entries it replaces, so none flows from or into a non-finite π_θ.
    log_ratio = (current - old).nan_to_num(0.0, LOG_RATIO_BOUND, -LOG_RATIO_BOUND)
    log_ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    # sign(max(c - u, 0)) is 1 exactly where clipping bound the loss: float passes, no bool mask.
    was_clipped = (clipped - unclipped).detach().clamp_(min=0.0).sign_()
    dual = torch.zeros_like(was_clipped)
    if clip_ratio_c is not None:
        if not clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c must be > 1.0 for dual clip, got {clip_ratio_c}")
        # For A < 0: min(loss, -c A), as a minimum: the float form loss - max(loss + c A, 0) cancels
        # to nothing in fp32 at the ratios dual clip exists for (e^20 at the log-ratio bound).
        bound = torch.where(advantages < 0, -clip_ratio_c * advantages, float("inf"))
        dual = (loss.detach() > bound).to(loss.dtype)
        loss = torch.minimum(loss, bound)
    return loss, was_clipped, dual, log_ratio


def policy_loss(
    cfg: CorrectionConfig,
    *,
    current_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    old_logprobs: Optional[torch.Tensor] = None,
    correction: Optional[CorrectionOutput] = None,
    response_mask: Optional[torch.Tensor] = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: Optional[float] = None,
    clip_ratio_high: Optional[float] = None,
    clip_ratio_c: Optional[float] = None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
    with_metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The corrected policy loss and its metrics.

    ``old_logprobs`` defaults to ``correction.old_logprobs`` (the rollout logprobs under
    bypass). The mask is ``response_mask`` and/or ``correction.mask`` (both when both
    are given); the weights are ``correction.weights``. Metrics are ``policy/*`` plus the
    correction's ``rollout_correction/*``.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode: unknown value {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")
    clip_low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    clip_high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    for name, value in (("clip_ratio_low", clip_low), ("clip_ratio_high", clip_high)):
        if not value >= 0:  # also catches NaN
            raise ValueError(f"{name} (or clip_ratio) must be >= 0, got {value}")
    if correction is None and cfg.changes_loss:
        raise ValueError(
            "policy_loss got no correction, but the config changes the loss "
            f"(rollout_importance_sampling_mode={cfg.rollout_importance_sampling_mode!r}, "
            f"rollout_rejection={cfg.rollout_rejection}, "
            f"off_policy_sequence_mask_delta={cfg.off_policy_sequence_mask_delta}): call compute_correction first"
        )
    if old_logprobs is None:
        old_logprobs = correction.old_logprobs if correction is not None else None
    if old_logprobs is None:
        raise ValueError("old_logprobs is None and no correction carries pi_old")
    if response_mask is None and correction is None:
        raise ValueError("policy_loss needs response_mask or a correction carrying its mask")

    reference = response_mask if response_mask is not None else correction.mask
    check_shapes("response_mask", reference, current_logprobs=current_logprobs, old_logprobs=old_logprobs,
                 correction_mask=None if correction is None else correction.mask,
                 correction_weights=None if correction is None else correction.weights)
    if advantages.dim() == 1:
        if advantages.shape[0] != current_logprobs.shape[0]:
            raise ValueError(f"shape mismatch: advantages has shape {tuple(advantages.shape)} but "
                             f"current_logprobs has shape {tuple(current_logprobs.shape)}")
    else:
        check_shapes("current_logprobs", current_logprobs, advantages=advantages)

    dtype = torch.promote_types(current_logprobs.dtype, torch.float32)
    mask_f = reference.to(dtype)
    if correction is not None and response_mask is not None:
        mask_f = mask_f * correction.mask.to(dtype)
    # A NaN/+inf π_θ has no value and no gradient to give: that token leaves the loss.
    cur = current_logprobs.detach()
    mask_f = mask_f * torch.isnan(cur).logical_or_(torch.isposinf(cur)).logical_not_()
    # Every input is made finite where the mask is 0, so masking by multiplication is exact (0 * NaN would be NaN).
    advantages = zero_padding_advantages(advantages.detach().to(dtype), mask_f)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)

    per_token, was_clipped, dual, log_ratio = clipped_surrogate(
        current_logprobs.to(dtype), old_logprobs.to(dtype), advantages, clip_low, clip_high, clip_ratio_c,
    )
    if correction is not None and cfg.rollout_importance_sampling_mode is not None:
        per_token = per_token * correction.weights.to(dtype)
    loss = aggregate(per_token, mask_f, loss_agg_mode, global_num_tokens=global_num_tokens,
                     global_num_seqs=global_num_seqs, loss_scale_factor=loss_scale_factor)

    metrics: dict[str, float] = {}
    if with_metrics:
        n = mask_f.sum().clamp_min(1.0)
        stats = torch.stack([
            (was_clipped * mask_f).sum() / n,
            (-log_ratio.detach() * mask_f).sum() / n,
            (dual * mask_f).sum() / n,
        ]).tolist()
        metrics = dict(zip(("policy/pg_clipfrac", "policy/ppo_kl", "policy/pg_clipfrac_lower"), stats))
        if correction is not None:
            metrics.update(correction.metrics)
    return loss, metrics
