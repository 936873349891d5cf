"""``compute_correction``: importance-sampling weights, rejection and off-policy masks.

One vectorised pass over ``(B, T)`` tensors with the response mask; no Python loop over
sequences, and nothing read back to the host before the metrics' one transfer, so ``torch.compile`` can fuse
the whole pass (``compile_correction``). The math, from these sources:

* IS modes and thresholds: ms-swift (../shared/seeds/ms-swift-rollout-importance-sampling.txt),
  ``w_t = min(r_corr,t, C)`` is TIS, paper eq. 6 (../shared/seeds/tim-diagnosis-paper.txt).
* Rejection: paper §4.2 and appendix A.4 (eq. 8-11), ``S_seq = Σ_t K(r_corr,t) ≤ τ_seq``,
  with the K1/K2/K3 estimators and verl's ``rollout_rs`` option names.
* Off-policy sequence mask: DeepSeek-V3.2 as ms-swift ships it.

Weights are detached: they change the measure, not the objective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from .config import CorrectionConfig, RejectionRule
from .distributed import all_reduce
from .metrics import PREFIX, correction_metric_values, finish_correction_metrics, reduce_metric_values
from .ratios import (TokenStats, check_shapes, compute_dtype, nonfinite_to_zero_, sanitized_log_ratio,
                     zero_padding_advantages)


#: The public face; ``importance_weights``, ``rejection_keep`` and ``sequence_advantages`` are its parts.
__all__ = ["CorrectionOutput", "compute_correction"]


class TokenPass(NamedTuple):
    """What :func:`correction_token_pass` returns: ``compute_correction``'s tensors before the one host sync
    (a named tuple, so ``torch.compile`` returns it from one graph as it does a plain one)."""

    weights: Optional[torch.Tensor]
    mask: torch.Tensor
    log_ratio: torch.Tensor
    sequence_log_ratio: torch.Tensor
    rejected: torch.Tensor
    off_policy_masked: torch.Tensor
    nonfinite: torch.Tensor
    pending_metrics: Optional[torch.Tensor]  # the diagnostics as one vector, not yet all-reduced; None: off


@dataclass
class CorrectionOutput:
    """What ``compute_correction`` returns; adapters read ``weights``, ``mask``, ``metrics``.

    ``old_logprobs`` is the π_old the PPO ratio must use: the recomputed trainer logprobs,
    or the rollout logprobs under ``old_logprob_source='bypass'``. ``rejected`` and
    ``nonfinite`` are float 0/1 ``(B, T)`` masks of the valid tokens they name (``nonfinite``:
    a logprob the correction read, π_old, π_rollout or π_θ, is NaN or ±inf);
    ``off_policy_masked`` is a bool ``(B,)``.

    With ``compute_correction(..., defer_metrics=True)`` the diagnostics stay on the device:
    ``metrics`` is empty and ``pending_metrics`` is a float64 vector; ``finish_metrics(values)``
    names its values once read back, so a caller with values of its own reads all in one transfer.
    """

    weights: torch.Tensor
    mask: torch.Tensor
    metrics: dict[str, float]
    old_logprobs: Optional[torch.Tensor] = None
    log_ratio: Optional[torch.Tensor] = None
    sequence_log_ratio: Optional[torch.Tensor] = None
    rejected: Optional[torch.Tensor] = None
    off_policy_masked: Optional[torch.Tensor] = None
    nonfinite: Optional[torch.Tensor] = None
    pending_metrics: Optional[torch.Tensor] = None
    _finish: Optional[Callable[[Sequence[float]], dict[str, float]]] = field(default=None, repr=False)

    def finish_metrics(self, values: Sequence[float]) -> dict[str, float]:
        """The diagnostics named, from ``values`` = ``pending_metrics`` read back (``{}`` when none are pending)."""
        return {} if self._finish is None else self._finish(values)


def importance_weights(
    cfg: CorrectionConfig, stats: TokenStats, seq_log_ratio: torch.Tensor, count_clipped: bool = False
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """IS weights of the four modes and, with ``count_clipped``, how many valid tokens they truncated or zeroed.

    ``token_truncate``: ``w_t = min(r_t, C)`` (and ``max(·, lower)`` when a lower bound is set).
    ``token_mask``: ``w_t = r_t`` inside ``[lower, C]``, else 0.
    ``sequence_truncate``: ``w = min(ρ_seq, C)`` (and ``max(·, lower)``), broadcast.
    ``sequence_mask``: 0 on every token of a sequence with ρ_seq outside ``[lower, C]``;
    kept tokens get ``r_t`` (``sequence_mask_weight='token'``) or ``ρ_seq`` (``'sequence'``).
    Padding gets weight 0. The count (a 0-d tensor, None without ``count_clipped``) feeds
    ``clipped_frac``; no per-token mask of it is kept.
    """
    mode = cfg.rollout_importance_sampling_mode
    upper = cfg.rollout_importance_sampling_threshold
    lower = cfg.rollout_importance_sampling_threshold_lower
    valid_f = stats.valid_f
    # Padding has r = 1: inside the bounds unless they exclude 1, and then it must not be counted.
    one_outside = upper < 1.0 or (lower is not None and lower > 1.0)
    if mode in ("token_truncate", "token_mask"):
        ratio = stats.ratio
        bounded = ratio.clamp(min=lower, max=upper)
        if mode == "token_truncate":
            clipped = None
            if count_clipped:  # r - clamp(r) is nonzero exactly where the clamp moved r
                moved = torch.sub(ratio, bounded, out=stats.scratch)
                clipped = torch.count_nonzero(moved.mul_(valid_f) if one_outside else moved)
            return bounded.mul_(valid_f), clipped
        # sign(|r - clamp(r)|) is 1 exactly where the clamp moved r: float passes, not a bool mask.
        moved = torch.sub(ratio, bounded, out=stats.scratch).abs_().sign_()
        if one_outside:
            moved.mul_(valid_f)
        clipped = moved.sum() if count_clipped else None
        # r where the clamp left it, 0 where it moved it: r·valid − r·valid·moved, exact in both cases.
        weights = torch.mul(ratio, valid_f, out=bounded)
        return weights.addcmul_(weights, moved, value=-1.0), clipped

    rho = seq_log_ratio.exp()
    kept = rho.clamp(min=lower, max=upper)
    seq_clipped = (rho - kept).abs_().sign_()  # 1 where the clamp moved ρ_seq (B,)
    if mode == "sequence_truncate":
        weights = valid_f * kept.unsqueeze(-1)
    else:
        seq_inside = 1.0 - seq_clipped
        if cfg.rollout_importance_sampling_sequence_mask_weight == "sequence":
            weights = valid_f * (rho * seq_inside).unsqueeze(-1)
        else:
            weights = torch.mul(valid_f, seq_inside.unsqueeze(-1)).mul_(stats.ratio)
    clipped = torch.dot(stats.tokens_per_seq, seq_clipped) if count_clipped else None
    return weights, clipped


def rejection_keep(rules: tuple[RejectionRule, ...], stats: TokenStats) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """What every rejection rule keeps (rules are ANDed): a bool per sequence, and per token.

    Per token: ``K1 = −log r``, ``K2 = ½ (log r)²``, ``K3 = r − 1 − log r`` on r_corr.
    ``seq_sum``/``seq_mean``/``seq_max`` reduce them over each sequence's valid tokens
    (paper eq. 8: ``S_seq = Σ_t K3``). K2/K3 keep ``S ≤ τ``; K1 keeps
    ``log lo ≤ S ≤ log hi``. Empty sequences have statistic 0. Returns
    ``(seq_keep (B,), token_keep (B, T) or None when no token-level rule is set)``.
    """
    seq_keep = torch.ones(stats.valid_f.shape[0], dtype=torch.bool, device=stats.valid_f.device)
    token_keep: Optional[torch.Tensor] = None
    for rule in rules:
        if rule.level == "token":
            stat = stats.estimator(rule.estimator)
        elif rule.level == "seq_sum":
            stat = stats.row_sum(rule.estimator)
        elif rule.level == "seq_mean":
            stat = stats.row_sum(rule.estimator) / stats.tokens_per_seq.clamp_min(1.0)
        else:
            k = stats.estimator(rule.estimator)  # K2, K3 >= 0 and 0 on padding: the row max is the valid max
            stat = k.amax(dim=-1)
        if rule.estimator == "k1":
            ok = (stat >= math.log(rule.lower)) & (stat <= math.log(rule.upper))
        else:
            ok = stat <= rule.upper
        if rule.level == "token":
            token_keep = ok if token_keep is None else token_keep & ok
        else:
            seq_keep &= ok
    return seq_keep, token_keep


def sequence_advantages(advantages: torch.Tensor, stats: TokenStats) -> torch.Tensor:
    """One advantage per sequence: ``(B,)`` as given, or the token-mean of a ``(B, T)`` tensor."""
    if advantages.dim() == 1:
        return advantages
    return (advantages * stats.valid_f).sum(dim=-1) / stats.tokens_per_seq.clamp_min(1.0)


def compute_correction(
    cfg: CorrectionConfig,
    *,
    old_logprobs: Optional[torch.Tensor] = None,
    rollout_logprobs: Optional[torch.Tensor] = None,
    response_mask: torch.Tensor,
    advantages: Optional[torch.Tensor] = None,
    current_logprobs: Optional[torch.Tensor] = None,
    process_group: Any = None,
    with_metrics: Optional[bool] = None,
    defer_metrics: bool = False,
) -> CorrectionOutput:
    """Weights, mask and diagnostics for one batch (docs/flags.md).

    Args:
        cfg: the shared flags.
        old_logprobs: ``(B, T)`` π_old recomputed by the trainer (unused under bypass).
        rollout_logprobs: ``(B, T)`` the sampler's logprobs (processed, see the parity layer).
        response_mask: ``(B, T)`` 1 on completion tokens; bool, int or float.
        advantages: ``(B,)`` or ``(B, T)``; needed by the off-policy mask and the
            loss-contribution diagnostics.
        current_logprobs: ``(B, T)`` π_θ; needed by the off-policy mask, by bypass
            diagnostics and rejection (ratio π_θ/π_rollout, as verl), and by C(r).
        process_group: a ``torch.distributed`` group: metric sums and counts are
            all-reduced over it, so diagnostics are global, not per rank.
        with_metrics: force diagnostics on or off; default ``cfg.wants_metrics``.
        defer_metrics: leave the diagnostics on the device (``pending_metrics``, named by
            ``finish_metrics``) instead of reading them back here: no host sync in this call.

    Returns:
        ``CorrectionOutput`` with ``weights`` (1 where no IS mode is set), ``mask`` (the
        response mask after rejection and off-policy masking, in its own dtype) and
        ``metrics`` (``rollout_correction/*`` floats, one host sync).

    The inputs are validated here, eagerly; the tensors come from :func:`correction_token_pass`, run through
    ``torch.compile`` under ``cfg.compile_correction`` (:func:`compiled_token_pass`).
    """
    check_shapes("response_mask", response_mask, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs,
                 current_logprobs=current_logprobs)
    if advantages is not None and advantages.dim() == 2:
        check_shapes("response_mask", response_mask, advantages=advantages)
    elif advantages is not None and tuple(advantages.shape) != (response_mask.shape[0],):
        raise ValueError(
            f"shape mismatch: advantages has shape {tuple(advantages.shape)} but response_mask has shape "
            f"{tuple(response_mask.shape)}; expected ({response_mask.shape[0]},) or {tuple(response_mask.shape)}"
        )
    bypass = cfg.old_logprob_source == "bypass"
    want_metrics = cfg.wants_metrics if with_metrics is None else with_metrics
    # Diagnostics implied only by the off-policy mask do not need rollout logprobs (that
    # mask falls back to pi_old); asked-for diagnostics do.
    asked_metrics = cfg.log_rollout_offpolicy_metrics if with_metrics is None else with_metrics
    needs_rollout = (cfg.rollout_importance_sampling_mode is not None or cfg.rollout_rejection is not None
                     or asked_metrics)
    if rollout_logprobs is None and (needs_rollout or bypass):
        what = ("old_logprob_source='bypass'" if bypass else
                f"rollout_importance_sampling_mode={cfg.rollout_importance_sampling_mode!r}, "
                f"rollout_rejection={cfg.rollout_rejection}, diagnostics={want_metrics}")
        raise ValueError(f"rollout_logprobs is None, but {what} needs the sampler's logprobs")
    if bypass:
        if current_logprobs is None and (cfg.rollout_rejection is not None or want_metrics):
            raise ValueError(
                "current_logprobs is None: under old_logprob_source='bypass' rejection and diagnostics use "
                "pi_theta/pi_rollout (pi_old is pi_rollout), so pass the current policy's logprobs"
            )
    elif old_logprobs is None and rollout_logprobs is not None and needs_rollout:
        raise ValueError("old_logprobs is None, but old_logprob_source='recompute' needs the trainer's pi_old")
    if cfg.off_policy_sequence_mask_delta is not None:
        if current_logprobs is None or advantages is None:
            raise ValueError(
                "off_policy_sequence_mask_delta needs current_logprobs and advantages "
                f"(got current_logprobs={'set' if current_logprobs is not None else None}, "
                f"advantages={'set' if advantages is not None else None})"
            )
        if rollout_logprobs is None and old_logprobs is None:
            raise ValueError("off_policy_sequence_mask_delta needs rollout_logprobs or old_logprobs")

    inputs = tuple(None if t is None else t.detach() for t in (old_logprobs, rollout_logprobs, response_mask,
                                                                advantages, current_logprobs))
    token_pass = compiled_token_pass() if cfg.compile_correction else correction_token_pass
    result: TokenPass = token_pass(cfg, *inputs, want_metrics)
    pending = result.pending_metrics
    finish = None
    if pending is not None and rollout_logprobs is None:
        finish = _off_policy_frac_only
        all_reduce(pending, process_group)
    elif pending is not None:
        finish = finish_correction_metrics
        reduce_metric_values(pending, process_group)
    metrics: dict[str, float] = {}
    if pending is not None and not defer_metrics:
        metrics = finish(pending.tolist())  # the one host sync

    return CorrectionOutput(
        weights=result.weights,
        mask=result.mask,
        metrics=metrics,
        old_logprobs=rollout_logprobs if bypass else old_logprobs,
        log_ratio=result.log_ratio,
        sequence_log_ratio=result.sequence_log_ratio,
        rejected=result.rejected,
        off_policy_masked=result.off_policy_masked,
        nonfinite=result.nonfinite,
        pending_metrics=pending if defer_metrics else None,
        _finish=finish if defer_metrics else None,
    )


def correction_token_pass(
    cfg: CorrectionConfig,
    old_logprobs: Optional[torch.Tensor],
    rollout_logprobs: Optional[torch.Tensor],
    response_mask: torch.Tensor,
    advantages: Optional[torch.Tensor],
    current_logprobs: Optional[torch.Tensor],
    want_metrics: bool,
) -> TokenPass:
    """Every tensor of :func:`compute_correction` from inputs it has validated (and detached).

    Only tensor operations and branches on the flags and dtypes: nothing reads a tensor's value back,
    so ``torch.compile`` takes it as one graph (``compile_correction``). The diagnostics come back as
    one vector, not yet all-reduced (:class:`TokenPass`).
    """
    bypass = cfg.old_logprob_source == "bypass"
    base = current_logprobs if bypass else old_logprobs
    dtype = compute_dtype(old_logprobs, rollout_logprobs, current_logprobs)
    valid_f = response_mask if response_mask.dtype == dtype else (response_mask != 0).to(dtype)

    if rollout_logprobs is not None and base is not None:
        log_ratio, nonfinite = sanitized_log_ratio(base, rollout_logprobs, valid_f)
    else:
        log_ratio, nonfinite = torch.zeros_like(valid_f), torch.zeros_like(valid_f)
    stats = TokenStats(log_ratio, valid_f, nonfinite)
    # Beyond r_corr's two logprobs the correction reads π_θ (diagnostics, off-policy mask) and,
    # without rollout logprobs, π_old for the off-policy mask: a non-finite one there is neutral
    # (drift 0, no C(r)) and counted too. π_θ − π_old is non-finite exactly where either is, and
    # C(r) needs that very difference: one tensor serves both.
    delta_on = cfg.off_policy_sequence_mask_delta is not None
    metrics_on = want_metrics and rollout_logprobs is not None
    if metrics_on:
        stats.finite_f  # noqa: B018 - the perplexities need it; built first, the clean mask below reuses it
    reads_current = current_logprobs is not None and not bypass and (want_metrics or delta_on)
    reads_old = rollout_logprobs is None and old_logprobs is not None and delta_on
    if reads_current and old_logprobs is not None:
        stats.read_also(current_logprobs.to(dtype) - old_logprobs.to(dtype), ppo_log_ratio=True)
    else:
        for values, read in ((current_logprobs, reads_current), (old_logprobs, reads_old)):
            if read:
                stats.read_also(values)
    if advantages is not None and (want_metrics or delta_on):
        advantages = zero_padding_advantages(advantages, valid_f, stats.tokens_per_seq)
    seq_lr = stats.sequence_log_ratio(cfg.rollout_importance_sampling_sequence_reduction)

    clipped = None
    if cfg.rollout_importance_sampling_mode is not None:
        weights, clipped = importance_weights(cfg, stats, seq_lr, count_clipped=metrics_on)
    else:
        weights = torch.ones_like(valid_f)

    # Everything that removes tokens is a per-sequence keep (B,) and, for token-level
    # rejection only, a per-token keep; they meet the mask in one product at the end.
    seq_keep = torch.ones(valid_f.shape[0], dtype=torch.bool, device=valid_f.device)
    token_keep: Optional[torch.Tensor] = None
    if cfg.rollout_rejection is not None:
        seq_keep, token_keep = rejection_keep(cfg.rejection_rules, stats)
    keep_before_off_policy = seq_keep

    off_policy = torch.zeros_like(seq_keep)
    if delta_on:
        behaviour = rollout_logprobs if rollout_logprobs is not None else old_logprobs
        # δ_i = mean_t (log π_behaviour − log π_θ) over the sequence's valid tokens. A token π_θ gives no mass
        # (−inf) that the behaviour policy sampled with a finite logprob is infinite drift, maximal mismatch: its
        # sequence's δ_i is +inf (TRL's own mask computes the same). Any other non-finite logprob (NaN, +inf, an
        # engine's −inf for a token it sampled, −inf on both sides) is neutral, drift 0, and counted.
        behaviour, current = behaviour.to(dtype), current_logprobs.to(dtype)
        infinite = (torch.isneginf(current) & torch.isfinite(behaviour)).to(dtype).mul_(valid_f).sum(dim=-1) > 0
        drift = torch.sub(behaviour, current, out=stats.scratch)
        drift = nonfinite_to_zero_(drift).mul_(stats.clean_f).sum(dim=-1)
        delta = drift / stats.tokens_per_seq.clamp_min(1.0)
        off_policy = (infinite | (delta > cfg.off_policy_sequence_mask_delta)) & (
            sequence_advantages(advantages, stats) < 0)
        seq_keep = seq_keep & ~off_policy

    keep_f = valid_f * seq_keep.to(dtype).unsqueeze(-1)
    rejected = None
    if cfg.rollout_rejection is not None:
        if token_keep is None:  # whole sequences only: the rejected ones' valid tokens
            rejected = valid_f * (~keep_before_off_policy).to(dtype).unsqueeze(-1)
        else:
            token_keep_f = token_keep.to(dtype)
            keep_f.mul_(token_keep_f)
            rejected = valid_f - valid_f * keep_before_off_policy.to(dtype).unsqueeze(-1) * token_keep_f

    if response_mask.dtype == torch.bool:
        mask = keep_f > 0
    elif response_mask.dtype == dtype:
        mask = keep_f if response_mask is valid_f else response_mask * keep_f
    else:
        mask = response_mask * keep_f.to(response_mask.dtype)

    pending = None
    if want_metrics and rollout_logprobs is None:
        seq_valid = stats.tokens_per_seq > 0  # masked and non-empty sequences: two counts, summed over ranks
        pending = torch.stack([(off_policy & seq_valid).sum(), seq_valid.sum()]).to(torch.float64)
    elif metrics_on:
        pending = correction_metric_values(
            stats=stats,
            seq_log_ratio=seq_lr,
            base_logprobs=base,
            base_name="current" if bypass else "old",
            rollout_logprobs=rollout_logprobs,
            weights=weights if cfg.rollout_importance_sampling_mode is not None else None,
            clipped=clipped,
            rejected=rejected,
            rejected_rows=None if rejected is None or token_keep is not None else ~keep_before_off_policy,
            off_policy=off_policy,
            advantages=advantages,
            current_logprobs=current_logprobs,
            bypass=bypass,
        )
    return TokenPass(weights, mask, log_ratio, seq_lr, rejected if rejected is not None else torch.zeros_like(valid_f),
                     off_policy, stats.read_nonfinite_f, pending)


_COMPILED: list = []


def compiled_token_pass() -> Callable[..., TokenPass]:
    """:func:`correction_token_pass` through ``torch.compile`` (``compile_correction``), built once per process.

    torch's automatic dynamic shapes: the first batch compiles for its exact shape, and the first batch of
    another shape once more with the dimension that changed left symbolic; later shapes reuse that graph.
    Frameworks change one dimension from step to step (TRL and NeMo RL the length, verl with dynamic batch
    sizes the rows), and on CPU a graph with that one dimension symbolic ran well under half the eager time,
    ``dynamic=True`` (both symbolic) about 0.7x (benchmarks/correction_overhead.py). The flags are
    constants of the graph: a run with one configuration compiles per shape family only.
    """
    if not _COMPILED:
        _COMPILED.append(torch.compile(correction_token_pass))
    return _COMPILED[0]


def _off_policy_frac_only(values: Sequence[float]) -> dict[str, float]:
    """The one diagnostic without rollout logprobs (the off-policy mask on π_old): masked / non-empty sequences."""
    masked, sequences = values
    return {PREFIX + "off_policy_masked_frac": float(masked) / sequences if sequences > 0 else 0.0}
