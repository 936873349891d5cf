"""verl's own rollout-correction keys and entry points, answered by the core: what verl's correction gave, ours on.

verl 0.9's ``algorithm.rollout_correction`` speaks in ``rollout_is`` (``token``/``sequence``),
``rollout_is_threshold`` (a float: TIS; ``"lo_hi"``: IcePop), ``rollout_is_batch_normalize``, ``rollout_rs`` and
``rollout_rs_threshold`` (comma-separated options and thresholds). :func:`correction_config_from_verl_keys` turns
those keys into the shared flags (every combination verl accepts has one), and the functions below take the
calling conventions of verl's ``rollout_corr_helper`` entry points and answer them with ``compute_correction``:

* :func:`rollout_correction_and_rejection_mask` for ``compute_rollout_correction_and_rejection_mask``;
* :func:`offpolicy_metrics` for ``compute_offpolicy_metrics`` (with or without rollout logprobs);
* :func:`is_metrics` for ``compute_is_metrics``;
* :func:`rollout_correction_weights` and :func:`rollout_rejection_mask` for ``compute_rollout_correction_weights``
  and ``compute_rollout_rejection_mask`` (a log-ratio handed over alone).

:func:`verl_metrics` is what the driver hook logs too: the core's numbers, named through
``core/metric_names.py``, plus verl's one convention the table does not carry (``rollout_corr/kl``, the signed k1
estimate under verl's name). :func:`batch_normalized` is verl's ``rollout_is_batch_normalize`` (self-normalised
IS). docs/verl_own_correction.md, "verl's own keys" and
"What differs on purpose".
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable, Optional

import torch

from rollout_parity.core.config import CorrectionConfig
from rollout_parity.core.correction import CorrectionOutput, compute_correction
from rollout_parity.core.metric_names import verl_names
from rollout_parity.core.metrics import PREFIX, perplexity_metrics, rejection_rule_metrics, \
    weight_distribution_metrics

__all__ = ["VERL_PREFIX", "correction_config_from_verl_keys", "verl_metrics", "batch_normalized",
           "rollout_correction_and_rejection_mask", "offpolicy_metrics", "is_metrics", "bypass_loss_correction",
           "inside_bypass_loss", "rollout_correction_weights", "rollout_rejection_mask"]

VERL_PREFIX = "rollout_corr/"


def _is_threshold(spec: Any) -> tuple[float, Optional[float]]:
    """verl's ``rollout_is_threshold``: ``(upper, lower)``; a ``"lo_hi"`` text has a lower bound (IcePop)."""
    if isinstance(spec, bool):  # bool is an int: refused before it reads as 1.0
        raise TypeError("rollout_is_threshold must be a float or a 'lo_hi' string, not a boolean")
    if isinstance(spec, (int, float)):
        return float(spec), None
    if not isinstance(spec, str) or not spec.strip():
        raise TypeError(f"rollout_is_threshold must be a float or a 'lo_hi' string, got {spec!r}")
    text = spec.strip()
    try:
        if "_" in text:
            lo, hi = text.split("_", 1)
            return float(hi), float(lo)
        return float(text), None
    except ValueError as exc:
        raise ValueError(f"rollout_is_threshold: invalid value {spec!r}") from exc


def correction_config_from_verl_keys(rollout_is: Optional[str] = None, rollout_is_threshold: Any = 2.0,
                                     rollout_rs: Optional[str] = None, rollout_rs_threshold: Any = None,
                                     **flags: Any) -> CorrectionConfig:
    """The shared flags with the semantics of verl's ``rollout_is``/``rollout_rs`` keys (``flags``: any others).

    ``token`` + a float is ``token_truncate`` (TIS), ``token`` + ``"lo_hi"`` is ``token_mask`` with that lower
    bound (IcePop), ``sequence`` the same with the product ratio (``sequence_mask`` weighting kept sequences by
    ρ_seq, as verl does), and verl's sequence ratio is always the product (its ``chi2_seq`` too); ``rollout_rs`` and
    its thresholds are our ``rollout_rejection`` options as they are.
    """
    flags.setdefault("rollout_importance_sampling_sequence_reduction", "product")  # verl's chi2_seq and ρ_seq
    if rollout_is is not None and rollout_is_threshold is not None:
        if rollout_is not in ("token", "sequence"):
            raise ValueError(f"rollout_is: {rollout_is!r} is not one of 'token', 'sequence'")
        upper, lower = _is_threshold(rollout_is_threshold)
        kind = "mask" if lower is not None else "truncate"
        flags.update(rollout_importance_sampling_mode=f"{rollout_is}_{kind}",
                     rollout_importance_sampling_threshold=upper, rollout_importance_sampling_threshold_lower=lower)
        if rollout_is == "sequence":
            flags.update(rollout_importance_sampling_sequence_mask_weight="sequence")
    if rollout_rs is not None:
        if not isinstance(rollout_rs, str):
            raise ValueError("rollout_rs must be a non-empty string (comma separated for multiple options)")
        options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
        if rollout_rs_threshold is None:
            raise ValueError(f"rollout_rs_threshold must be provided for rejection sampling (rollout_rs={rollout_rs!r})")
        flags.update(rollout_rejection=options, rollout_rejection_threshold=rollout_rs_threshold)
    return CorrectionConfig(**flags)


def verl_metrics(cfg: CorrectionConfig, out: CorrectionOutput, response_mask: torch.Tensor,
                 extra: Optional[dict[str, float]] = None) -> dict[str, float]:
    """The correction's diagnostics as a verl user reads them: every quantity verl's own correction logs, under
    verl's name with verl's value (``core/metric_names.py``), the rest under ours; and ``rollout_corr/kl``."""
    if not out.metrics:  # diagnostics off (``log_rollout_offpolicy_metrics`` and no flag that implies them)
        return dict(extra or {})
    metrics = dict(out.metrics)
    if cfg.rollout_importance_sampling_mode is not None and out.log_ratio is not None:
        sequence = cfg.rollout_importance_sampling_mode.startswith("sequence")
        metrics.update(weight_distribution_metrics(
            out.weights, out.log_ratio, response_mask, upper=cfg.rollout_importance_sampling_threshold,
            lower=cfg.rollout_importance_sampling_threshold_lower,
            sequence_log_ratio=out.sequence_log_ratio if sequence else None))
    if cfg.rollout_rejection is not None and out.log_ratio is not None:
        metrics.update(rejection_rule_metrics(cfg.rejection_rules, out.log_ratio, response_mask))
    metrics.update(extra or {})
    named = verl_names(metrics, cfg)
    if cfg.rollout_importance_sampling_mode is not None:
        _release_seq_fractions(named, out.weights, response_mask, cfg.rollout_importance_sampling_threshold,
                               cfg.rollout_importance_sampling_threshold_lower)
    k1 = metrics.get(PREFIX + "k1_mean")
    if k1 is not None:  # verl's name and its signed convention, beside ours (docs/metrics.md)
        named[VERL_PREFIX + "kl"] = k1
    return named


_SEQ_FRACTIONS = ("seq_fraction_high", "seq_fraction_low")


def _release_seq_fractions(named: dict[str, float], weights: torch.Tensor, response_mask: torch.Tensor,
                           upper: float, lower: Optional[float]) -> None:
    """verl < 0.9.0's ``rollout_is_seq_fraction_high``/``_low`` under verl's names, in ``named``.

    There verl's ``compute_is_metrics`` (0.8.0, ``rollout_corr_helper.py``) reads each sequence's mean APPLIED
    weight w̄_i (after truncation or masking, before batch normalisation): shares of sequences with w̄_i above
    ``upper`` / below ``lower`` (``1/upper`` without one), over the rows with a valid token as ours. Ours (the raw
    mean, verl >= 0.9.0's formula) then keeps our names. Nothing changes on verl >= 0.9.0.
    """
    from rollout_parity.adapters.verl.compat import seq_fractions_of_raw_weights

    keys = [VERL_PREFIX + "rollout_is_" + k for k in _SEQ_FRACTIONS]
    if seq_fractions_of_raw_weights() or not all(k in named for k in keys):
        return
    valid = (response_mask != 0).to(torch.float64)
    per_row = valid.sum(dim=-1)
    live = per_row > 0
    rows = (weights.detach().to(torch.float64) * valid).sum(dim=-1)[live] / per_row[live]
    lo = 1.0 / upper if lower is None else lower
    for leaf, key, share in zip(_SEQ_FRACTIONS, keys, (rows > upper, rows < lo)):
        named[PREFIX + "is_" + leaf] = named[key]
        named[key] = share.double().mean().item() if rows.numel() else 0.0


def batch_normalized(cfg: CorrectionConfig, weights: torch.Tensor,
                     response_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``rollout_is_batch_normalize``: the weights divided by their mean over the batch (self-normalised IS).

    The mean is over valid tokens for the token modes, over sequences with a valid token (each one's weight
    once) for the sequence modes; with a process group initialised, over every rank, as verl does. A mean at
    or below 1e-8 leaves the weights as they are (factor 1).
    """
    valid = (response_mask != 0).to(torch.float64)
    w = weights.detach().to(torch.float64) * valid
    if cfg.rollout_importance_sampling_mode.startswith("token"):
        sums = torch.stack([w.sum(), valid.sum()])
    else:
        per_row = valid.sum(dim=-1)
        rows = (per_row > 0).to(torch.float64)
        sums = torch.stack([(w.sum(dim=-1) / per_row.clamp_min(1.0) * rows).sum(), rows.sum()])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    mean = (sums[0] / sums[1].clamp_min(1e-8)).item()
    if mean <= 1e-8:
        return weights, {PREFIX + "is_batch_norm_factor": 1.0}
    return weights / mean, {PREFIX + "is_batch_norm_factor": mean}


def _check_inputs(old_log_prob: torch.Tensor, rollout_log_prob: Optional[torch.Tensor],
                  response_mask: torch.Tensor) -> None:
    if not bool(response_mask.any()):
        raise ValueError("response_mask must contain at least one valid token (1)")
    if rollout_log_prob is not None and old_log_prob.shape != rollout_log_prob.shape:
        raise ValueError(f"old_log_prob shape {tuple(old_log_prob.shape)} does not match rollout_log_prob shape "
                         f"{tuple(rollout_log_prob.shape)}")
    if old_log_prob.shape != response_mask.shape:
        raise ValueError(f"old_log_prob shape {tuple(old_log_prob.shape)} does not match response_mask shape "
                         f"{tuple(response_mask.shape)}")


def rollout_correction_and_rejection_mask(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                                          response_mask: torch.Tensor, rollout_is: Optional[str] = None,
                                          rollout_is_threshold: Any = 2.0, rollout_is_batch_normalize: bool = False,
                                          rollout_rs: Optional[str] = None, rollout_rs_threshold: Any = None):
    """verl's ``compute_rollout_correction_and_rejection_mask``, computed by the core.

    Returns verl's ``(DataProto of rollout_is_weights or None, response mask after rejection, metrics)``, the
    metrics under verl's ``rollout_corr/*`` names where verl logs the same formula and ours elsewhere.
    """
    from verl.protocol import DataProto

    _check_inputs(old_log_prob, rollout_log_prob, response_mask)
    cfg = correction_config_from_verl_keys(rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold)
    with torch.no_grad():
        out = compute_correction(cfg, old_logprobs=old_log_prob, rollout_logprobs=rollout_log_prob,
                                 response_mask=response_mask, with_metrics=True)
    weights, extra = out.weights, {}
    if cfg.rollout_importance_sampling_mode is not None and rollout_is_batch_normalize:
        weights, extra = batch_normalized(cfg, weights, response_mask)
    metrics = verl_metrics(cfg, out, response_mask, extra)
    proto = None
    if cfg.rollout_importance_sampling_mode is not None:
        proto = DataProto.from_dict(tensors={"rollout_is_weights": weights.to(old_log_prob.dtype).detach()})
    return proto, out.mask, metrics


def _from_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor, cfg: CorrectionConfig) -> CorrectionOutput:
    """The core on a log-ratio handed over alone (log π_old − log π_rollout): π_old := it, π_rollout := 0."""
    with torch.no_grad():
        return compute_correction(cfg, old_logprobs=log_ratio, rollout_logprobs=torch.zeros_like(log_ratio),
                                  response_mask=response_mask, with_metrics=True)


def rollout_correction_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_is: str = "token",
                               rollout_is_threshold: Any = 2.0,
                               rollout_is_batch_normalize: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``compute_rollout_correction_weights``: the IS weights and verl's unprefixed ``rollout_is_*`` metrics."""
    if rollout_is not in ("token", "sequence"):
        raise ValueError(f"Invalid rollout_is: {rollout_is}. Must be one of {{'token', 'sequence'}}.")
    cfg = correction_config_from_verl_keys(rollout_is, rollout_is_threshold)
    out = _from_log_ratio(log_ratio, response_mask, cfg)
    weights, extra = out.weights, {}
    if rollout_is_batch_normalize:
        weights, extra = batch_normalized(cfg, weights, response_mask)
    named = _unprefixed(verl_metrics(cfg, out, response_mask, extra))
    return weights.to(log_ratio.dtype), {k: v for k, v in named.items() if k.startswith("rollout_is_")}


def rollout_rejection_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_rs: str = "token_k1",
                           rollout_rs_threshold: Any = None) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``compute_rollout_rejection_mask``: the mask after rejection and verl's unprefixed ``rollout_rs_*``
    metrics."""
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    cfg = correction_config_from_verl_keys(rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold)
    out = _from_log_ratio(log_ratio, response_mask, cfg)
    named = _unprefixed(verl_metrics(cfg, out, response_mask))
    return out.mask, {k: v for k, v in named.items() if k.startswith("rollout_rs_")}


def _unprefixed(named: dict[str, float]) -> dict[str, float]:
    return {k[len(VERL_PREFIX):]: v for k, v in named.items() if k.startswith(VERL_PREFIX)}


def offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: Optional[torch.Tensor],
                      response_mask: torch.Tensor) -> dict[str, float]:
    """verl's ``compute_offpolicy_metrics``: verl's unprefixed names, the core's values. Without rollout logprobs,
    the trainer's perplexities alone (``training_ppl``, ``training_log_ppl``)."""
    _check_inputs(old_log_prob, rollout_log_prob, response_mask)
    cfg = correction_config_from_verl_keys(log_rollout_offpolicy_metrics=True)
    if rollout_log_prob is None:
        return _unprefixed(verl_names(perplexity_metrics(old_log_prob, response_mask, "training"), cfg))
    with torch.no_grad():
        out = compute_correction(cfg, old_logprobs=old_log_prob, rollout_logprobs=rollout_log_prob,
                                 response_mask=response_mask, with_metrics=True)
    return _unprefixed(verl_metrics(cfg, out, response_mask))


def is_metrics(rollout_is_weights: torch.Tensor, raw_rollout_is_weights: torch.Tensor,
               log_ratio_for_metrics: torch.Tensor, response_mask: torch.Tensor, rollout_is: str,
               rollout_is_threshold: float, rollout_is_threshold_lower: Optional[float] = None) -> dict[str, float]:
    """verl's ``compute_is_metrics`` on weights computed elsewhere: the core's weight statistics, verl's
    unprefixed ``rollout_is_*`` names. ``log_ratio_for_metrics`` is ``(B, T)`` token log-ratios or, for
    ``rollout_is='sequence'``, ``(B, 1)`` sequence log-ratios, as verl hands them."""
    if not bool(response_mask.any()):
        raise ValueError("response_mask must contain at least one valid token (1)")
    threshold = rollout_is_threshold if rollout_is_threshold_lower is None \
        else f"{rollout_is_threshold_lower}_{rollout_is_threshold}"
    cfg = correction_config_from_verl_keys(rollout_is, threshold)
    sequence = rollout_is == "sequence"
    log_ratio = torch.log(raw_rollout_is_weights.clamp_min(1e-30)) if sequence else log_ratio_for_metrics
    metrics = weight_distribution_metrics(
        rollout_is_weights, log_ratio, response_mask, upper=float(rollout_is_threshold),
        lower=rollout_is_threshold_lower, with_mean_and_ess=True,
        sequence_log_ratio=log_ratio_for_metrics.reshape(-1) if sequence else None)
    named = verl_names(metrics, cfg)
    _release_seq_fractions(named, rollout_is_weights, response_mask, float(rollout_is_threshold),
                           rollout_is_threshold_lower)
    return _unprefixed(named)


#: True while verl's ``bypass_mode`` loss runs under the adapter's loss wrapper (``loss.py``).
_in_bypass_loss: contextvars.ContextVar[bool] = contextvars.ContextVar("rollout_parity_bypass_loss", default=False)


def inside_bypass_loss(loss_fn: Callable) -> Callable:
    """verl's ``bypass_mode`` loss, marked while it runs: only there does :func:`bypass_loss_correction` act."""
    @functools.wraps(loss_fn)
    def bypass_mode_loss(*args: Any, **kwargs: Any) -> Any:
        token = _in_bypass_loss.set(True)
        try:
            return loss_fn(*args, **kwargs)
        finally:
            _in_bypass_loss.reset(token)

    return bypass_mode_loss


def bypass_loss_correction(original: Any, old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                           response_mask: torch.Tensor, rollout_is: Optional[str] = None, rollout_is_threshold: Any = 2.0,
                           rollout_is_batch_normalize: bool = False, rollout_rs: Optional[str] = None,
                           rollout_rs_threshold: Any = None):
    """verl's ``compute_rollout_correction_and_rejection_mask`` while the flags are active: the core computes it.

    Acts only inside verl's ``bypass_mode`` loss under the adapter's loss wrapper (:func:`inside_bypass_loss`;
    ``policy_loss.loss_mode=bypass_mode`` is accepted with ``old_logprob_source=bypass``), verl's own elsewhere. There
    verl calls it with
    ``old_log_prob`` = π_θ of the micro-batch. The IS weights of π_θ/π_rollout are those of verl's own keys there
    (``policy_loss.rollout_correction.rollout_is``/``rollout_is_threshold``/``rollout_is_batch_normalize``: the
    shared flags have no IS mode under bypass, where a PPO ratio already is π_θ/π_rollout, but verl's
    ``loss_type=reinforce`` has no ratio and applies them), computed by the core; verl's ``ppo_clip`` leaves
    them to its ratio, as verl does. Rejection is the flags' and stays on the driver, before the advantages
    (``policy_loss.rollout_correction.rollout_rs`` is refused at start), the off-policy mask in the loss wrapper.
    """
    from rollout_parity.adapters.verl.flags import active_config

    cfg = active_config()
    if cfg is None or not _in_bypass_loss.get():  # verl's own everywhere but inside its bypass loss under the flags
        return original(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask,
                        rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold,
                        rollout_is_batch_normalize=rollout_is_batch_normalize, rollout_rs=rollout_rs,
                        rollout_rs_threshold=rollout_rs_threshold)
    if rollout_rs is not None:
        raise ValueError(f"policy_loss.rollout_correction.rollout_rs={rollout_rs!r} with rollout_parity's flags: "
                         "rejection is the flags' (rollout_rejection), on the driver; set it to null")
    if not bool(response_mask.any()):  # a micro-batch the driver rejected whole: the loss wrapper makes its loss 0
        from verl.protocol import DataProto

        weights = None if rollout_is is None or rollout_is_threshold is None else \
            DataProto.from_dict(tensors={"rollout_is_weights": torch.zeros_like(old_log_prob)})
        return weights, response_mask, {}
    return rollout_correction_and_rejection_mask(old_log_prob, rollout_log_prob, response_mask, rollout_is=rollout_is,
                                                 rollout_is_threshold=rollout_is_threshold,
                                                 rollout_is_batch_normalize=rollout_is_batch_normalize)
