"""The hand-over to verl's own policy loss, and the metrics only the loss can see.

Whatever ``actor.policy_loss.loss_mode`` names runs unchanged (:func:`with_rollout_parity` wraps
what ``get_policy_loss_fn`` returns): it reads our weights (``rollout_is_weights``) and mask
(``response_mask``) from the driver, its inputs made finite by the bad-input rules (docs/flags.md), the
mask narrowed by the off-policy sequence mask (which needs pi_theta). The policy-side metrics are
left per micro-batch for verl's ``ppo_loss``, whose wrapper (:func:`ppo_loss_with_global_metrics`)
turns them into exact global means with verl's own normalisers. docs/verl.md, "Your loss stays yours".
"""

from __future__ import annotations

import contextvars
import functools
import math
from typing import Any, Callable, Optional

import torch

from rollout_parity.adapters._patching import is_ours, mark
from rollout_parity.adapters.verl.flags import active_config
from rollout_parity.core.config import CorrectionConfig
from rollout_parity.core.correction import compute_correction
from rollout_parity.core.readback import read_back
from rollout_parity.core.metric_names import verl_names
from rollout_parity.core.ratios import check_shapes

__all__ = ["with_rollout_parity", "policy_loss_fn", "ppo_loss_with_global_metrics"]

#: The loss wrapper leaves its metric sums here for the ``ppo_loss`` wrapper of the same micro-batch.
_loss_sums: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("rollout_parity_loss_sums", default=None)


def _sanitize_for_loss(old: torch.Tensor, current: torch.Tensor, mask: torch.Tensor):
    """The bad-input rules (docs/flags.md) on what the loss reads; returns ``(old, current, mask, nonfinite)``.

    pi_old: a NaN or +inf is neutral (pi_old := pi_theta, ratio 1, the token keeps its policy
    gradient); -inf is maximal mismatch (the log ratio at its +20 bound). pi_theta: a non-finite
    value on a valid token cannot be trained on, so that token leaves the mask; on padding it is
    zeroed. Each valid token with a non-finite input is counted once in ``nonfinite``.
    """
    valid = mask.bool()
    finite_cur = torch.isfinite(current)
    cur = torch.where(finite_cur, current, torch.zeros((), dtype=current.dtype, device=current.device))
    anchor = cur.detach().to(old.dtype)
    neutral = torch.isnan(old) | torch.isposinf(old)
    maximal = torch.isneginf(old)
    old = torch.where(neutral, anchor, torch.where(maximal, anchor - 20.0, old))
    nonfinite = valid & (neutral | maximal | ~finite_cur)
    kept = valid & finite_cur
    return old, cur, kept if mask.dtype == torch.bool else kept.to(mask.dtype), nonfinite


def _loss_side_correction(cfg: CorrectionConfig, old: torch.Tensor, current: torch.Tensor, mask: torch.Tensor,
                          advantages: torch.Tensor, bypass_in_loss: bool):
    """The part of the correction that needs pi_theta or A: the off-policy mask and C(r) (paper eq. 5).

    The behaviour policy the loss can see is ``old`` (pi_old in decoupled mode, docs/verl.md;
    pi_rollout under bypass). Under verl's own bypass (no rejection) the diagnostics of pi_theta
    against pi_rollout are computed here too, per micro-batch. Its diagnostics stay on the device
    (``pending_metrics``): the wrapper reads them back with its own values, in one transfer.
    """
    if bypass_in_loss:
        side_cfg = cfg.replace(rollout_rejection=None, rollout_rejection_threshold=None)
        return compute_correction(side_cfg, rollout_logprobs=old, response_mask=mask, advantages=advantages,
                                  current_logprobs=current.detach(), with_metrics=cfg.wants_metrics,
                                  defer_metrics=True)
    side_cfg = cfg.replace(rollout_importance_sampling_mode=None, rollout_rejection=None,
                           rollout_rejection_threshold=None, old_logprob_source="recompute")
    return compute_correction(side_cfg, old_logprobs=old, rollout_logprobs=old, response_mask=mask,
                              advantages=advantages, current_logprobs=current.detach(), with_metrics=cfg.wants_metrics,
                              defer_metrics=True)


def with_rollout_parity(loss_fn: Callable, name: str = "?") -> Callable:
    """Wrap a verl ``PolicyLossFn`` (``core_algos`` signature) with the loss side of the flags.

    The wrapped loss runs unchanged on pi_old and pi_theta made finite, ``response_mask`` narrowed
    by the off-policy sequence mask (and by non-finite pi_theta), and verl's ``rollout_is_weights``
    (our driver's weights) as given. Adds the policy-side metrics (``rollout_correction/loss_contrib_pos/neg``,
    ``off_policy_masked_frac``, ``loss_nonfinite_frac``, and ``ppo_k1_mean`` where the loss logs no
    ``actor/ppo_kl`` of its own) as micro-batch means.
    """
    if is_ours(loss_fn):
        return loss_fn  # already ours

    @functools.wraps(loss_fn)
    def policy_loss_with_rollout_parity(old_log_prob, log_prob, advantages, response_mask,
                                        loss_agg_mode: str = "token-mean", config: Any = None,
                                        rollout_is_weights: Optional[torch.Tensor] = None):
        cfg = active_config()
        if cfg is None:
            return loss_fn(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                           response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
                           rollout_is_weights=rollout_is_weights)
        check_shapes("response_mask", response_mask, old_log_prob=old_log_prob, log_prob=log_prob,
                     advantages=advantages if advantages.dim() == 2 else None, rollout_is_weights=rollout_is_weights)
        old, cur, mask, nonfinite = _sanitize_for_loss(old_log_prob, log_prob, response_mask)
        if advantages.dim() == 2:  # padding's advantage never matters, but NaN * 0 would reach verl's sums
            advantages = torch.where(response_mask.bool(), advantages, torch.zeros_like(advantages))
        bypass_in_loss = cfg.old_logprob_source == "bypass" and cfg.rollout_rejection is None
        side, side_mask = None, mask
        if cfg.off_policy_sequence_mask_delta is not None or cfg.wants_metrics:
            # the core applies its own non-finite rules to what the diagnostics read: hand it the raw pi_old
            side = _loss_side_correction(cfg, old_log_prob, cur, mask, advantages, bypass_in_loss)
            mask = side.mask
        loss, metrics = loss_fn(old_log_prob=old, log_prob=cur, advantages=advantages, response_mask=mask,
                                loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=rollout_is_weights)
        metrics = dict(metrics)
        own_kl = "actor/ppo_kl" in metrics  # the loss's own, over the mask we handed it: not logged twice
        got, side_metrics = _read_back(loss, old, cur, mask, side_mask, nonfinite, side, own_kl)
        if not got["any_kept"] and not got["loss_finite"]:
            # All tokens rejected or masked: verl's token-mean without a global normaliser divides
            # 0 by 0. The neutral result of docs/flags.md instead: a zero loss that still backpropagates.
            loss = cur.sum() * 0.0
            metrics = {k: 0.0 if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        sums = _policy_metric_sums(cfg, got, side is not None, side_metrics, bypass_in_loss, own_kl)
        _loss_sums.set(sums)
        metrics.update({name: value / max(n, 1.0) for name, (value, n, _) in sums.items()})
        return loss, metrics

    return mark(policy_loss_with_rollout_parity)


def _read_back(loss, old, cur, mask, side_mask, nonfinite_valid, side, own_kl) -> tuple[dict[str, float], dict]:
    """Every value the wrapper needs on the host, in one transfer: whether any token is kept, whether the
    loss is finite, the policy-side counts and sums, and the side correction's pending diagnostics.

    ``mask`` is what the loss trained on; ``side_mask`` what the core's diagnostics read. Without the
    loss's own ``actor/ppo_kl`` the k1 sums of :func:`_policy_metric_sums` are read too.
    """
    f32 = torch.float32
    with torch.no_grad():
        side_f = side_mask.to(f32)
        off_policy = side_f.new_zeros(()) if side is None else side.off_policy_masked.to(f32).sum()
        parts = {"any_kept": mask.bool().any().to(f32), "loss_finite": torch.isfinite(loss.detach()).all().to(f32),
                 "n_side": side_f.sum(), "n_valid": (side_mask.bool() | nonfinite_valid).to(f32).sum(),
                 "nonfinite": nonfinite_valid.to(f32).sum(), "side_seqs": (side_f.sum(-1) > 0).to(f32).sum(),
                 "off_policy": off_policy}
        if not own_kl:
            log_ratio = (cur.detach().to(f32) - old.to(f32)).clamp(-20.0, 20.0)
            mask_f = mask.to(f32)
            parts.update(k1=(-log_ratio * mask_f).sum(), n_kept=mask_f.sum())
    return read_back(parts, side)  # the one host sync of the wrapper


def _policy_metric_sums(cfg, got: dict[str, float], has_side: bool, side_metrics: dict[str, float],
                        bypass_in_loss: bool, own_kl: bool = False) -> dict[str, tuple[float, float, str]]:
    """The loss-side metrics as ``{name: (local sum, local count, kind)}``, from :func:`_read_back`'s values.

    ``kind`` names verl's global normaliser a sum is divided by: ``token`` or ``seq``; ``mean``
    entries (count 1) stay micro-batch means, which verl averages over micro-batches and ranks as
    it averages its own ``actor/ppo_kl``.

    Where the loss logs its own ``actor/ppo_kl`` (``own_kl``; each loss has its own formula: gspo does not
    clamp log r) nothing is added beside it. A loss without one (gpg, a loss the user registered) gets
    ``rollout_correction/ppo_k1_mean``: vanilla's ``masked_mean(-log r, mask)`` with log r clamped to +-20,
    named for its estimator (it is signed). The clip fractions are the loss's own (``actor/pg_clipfrac``,
    ``actor/pg_clipfrac_lower``): each verl loss computes them over the mask handed to it, with its own ratio
    (gspo's sequence ratio) and the clip range it reads from verl's config; a token-level copy next to them
    would say something else. Under verl's bypass the core's diagnostics of pi_theta against pi_rollout take
    verl's ``rollout_corr/*`` names where verl's bypass loss logs the same formula.
    """
    sums: dict[str, tuple[float, float, str]] = {}
    if not own_kl:
        sums["rollout_correction/ppo_k1_mean"] = (got["k1"] / max(got["n_kept"], 1.0), 1.0, "mean")
    sums["rollout_correction/loss_nonfinite_frac"] = (got["nonfinite"], got["n_valid"], "token")
    if has_side:
        n_side = got["n_side"]
        for key in ("loss_contrib_pos", "loss_contrib_neg"):  # the core's: sum C / (tokens it read)
            name = f"rollout_correction/{key}"
            if name in side_metrics:
                sums[name] = (side_metrics[name] * n_side, n_side, "token")
        sums["rollout_correction/off_policy_masked_frac"] = (got["off_policy"], got["side_seqs"], "seq")
        if bypass_in_loss:
            for name, value in verl_names(side_metrics, cfg).items():
                if name not in sums and not name.endswith(("nonfinite_frac", "off_policy_masked_frac")):
                    sums[name] = (value, 1.0, "mean")
    return sums


def _global_means(sums: dict, global_batch_info: dict) -> dict[str, Any]:
    """verl ``Metric`` objects whose aggregation gives the global mean over the mini-batch.

    verl sums a ``SUM`` metric over micro-batches and averages it over data-parallel ranks
    (``Metric.aggregate_dp``), so a micro-batch contributes ``local_sum / N_global * dp_size``,
    exactly as verl scales its own ``pg_loss``, with the normalisers verl's ``ppo_loss`` put in
    ``config.global_batch_info`` (``batch_num_tokens``, ``global_batch_size``).
    """
    from verl.utils.metric import AggregationType, Metric

    info = dict(global_batch_info or {})
    dp = float(info.get("dp_size") or 1)
    n_tokens, n_seqs = info.get("batch_num_tokens"), info.get("global_batch_size")
    out: dict[str, Any] = {}
    for name, (value, _, kind) in sums.items():
        denom = None if kind == "mean" else n_tokens if kind == "token" else n_seqs
        if denom is None:
            continue  # no global normaliser: the micro-batch mean stays
        denom = float(denom.item() if torch.is_tensor(denom) else denom)
        out[name] = Metric(aggregation=AggregationType.SUM, value=value / max(denom, 1.0) * dp)
    return out


def policy_loss_fn(original: Callable, name: str) -> Callable:
    """verl's ``get_policy_loss_fn``: the loss it names, wrapped while flags are active."""
    loss_fn = original(name)
    if active_config() is None:
        return loss_fn
    return _wrapped_loss(loss_fn, name)


@functools.lru_cache(maxsize=None)
def _wrapped_loss(loss_fn: Callable, name: str) -> Callable:
    if name == "bypass_mode":  # verl's bypass loss: its correction inside is the core's (verl_keys.py)
        from rollout_parity.adapters.verl.verl_keys import inside_bypass_loss

        loss_fn = inside_bypass_loss(loss_fn)
    return with_rollout_parity(loss_fn, name)


def ppo_loss_with_global_metrics(original: Callable, config: Any, model_output: Any, data: Any,
                                 dp_group: Any = None) -> Any:
    """verl's ``ppo_loss``, with the wrapped loss's metrics as exact global means."""
    token = _loss_sums.set(None)
    try:
        loss, metrics = original(config, model_output, data, dp_group)
        sums = _loss_sums.get()
    finally:
        _loss_sums.reset(token)
    if sums is not None:
        metrics.update(_global_means(sums, getattr(config, "global_batch_info", None)))
    return loss, metrics
