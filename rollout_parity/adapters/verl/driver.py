"""The correction on verl's driver, once per batch, through verl's own rollout-correction helper.

verl calls ``compute_rollout_correction_and_add_to_batch`` before the advantages; with our flags
active, :func:`driver_correction` takes its place: ``compute_correction`` from ``old_log_probs`` and
``rollout_log_probs``, the corrected ``response_mask`` and ``rollout_is_weights`` written for every
verl loss to read, rejected tokens and rows kept out of the GRPO/RLOO baselines, and under bypass
``old_log_probs := pi_rollout`` for the loss. In verl 0.9's V1 trainer the worker outputs live in
the TransferQueue: :func:`batch_in_flight` tells the hook which batch it is. docs/verl_pi_old.md,
"Where π_old comes from" and "Sampler-aware ratios".
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable, Optional

import torch

from rollout_parity.adapters.verl.config import check_no_double_correction
from rollout_parity.adapters.verl.flags import MODULE, active_config, active_sampler, require_config
from rollout_parity.core.correction import compute_correction
from rollout_parity.adapters.verl.verl_keys import batch_normalized, verl_metrics
from rollout_parity.core.sampler import kept_mass_metrics, rollout_on_full_vocabulary

__all__ = ["PROCESSED_FIELD", "OUTSIDE_FIELD", "driver_correction", "rollout_correction_helper", "batch_in_flight"]

#: The actor's log-prob pass writes pi_old's sampler-processed logprobs under this batch field ...
PROCESSED_FIELD = "rollout_parity_old_processed_log_probs"
#: ... and 1.0 where its recomputed kept set missed the sampled token (the boundary rule applied) under this one.
OUTSIDE_FIELD = "rollout_parity_old_outside_kept_set"
# Diagnostics that need pi_theta or the advantages: the loss wrapper logs them, not the driver.
_METRICS_NEED_POLICY = ("loss_contrib_pos", "loss_contrib_neg", "loss_contrib_rollout_pos",
                        "loss_contrib_rollout_neg", "off_policy_masked_frac")
#: The TransferQueue batch being processed by ``_compute_advantage`` (TransferQueue trainers only).
_current_batch: contextvars.ContextVar[Any] = contextvars.ContextVar("rollout_parity_batch", default=None)


def batch_in_flight(original: Callable, self: Any, batch: Any, metrics: Any) -> Any:
    """verl 0.9's ``PPOTrainer._compute_advantage``, with its TransferQueue batch visible to the hook."""
    token = _current_batch.set(batch)
    try:
        return original(self, batch, metrics)
    finally:
        _current_batch.reset(token)


def rollout_correction_helper(original: Callable, batch: Any, rollout_corr_config: Any) -> Any:
    """verl's ``compute_rollout_correction_and_add_to_batch``; ours while flags are active."""
    if active_config() is None:
        return original(batch, rollout_corr_config)
    return driver_correction(batch, rollout_corr_config)


def _select(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def _processed_old_log_probs(batch: Any, like: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """pi_old's sampler-processed view written by the actor's log-prob pass (:data:`PROCESSED_FIELD`), and
    where its recomputed kept set missed the token (:data:`OUTSIDE_FIELD`; None when the pass wrote none)."""
    tensors = batch.batch
    if PROCESSED_FIELD in tensors.keys():  # a trainer that hands the worker output on in the batch itself
        value = tensors[PROCESSED_FIELD]
        if tuple(value.shape) != tuple(like.shape):
            raise ValueError(f"{PROCESSED_FIELD} has shape {tuple(value.shape)} but old_log_probs has shape "
                             f"{tuple(like.shape)}: sampler-aware pi_old supports verl's TransferQueue trainers")
        outside = tensors[OUTSIDE_FIELD].bool() if OUTSIDE_FIELD in tensors.keys() else None
        return value, outside
    meta = _current_batch.get()
    if meta is None:
        raise RuntimeError(
            f"sampler-aware pi_old: {PROCESSED_FIELD} is not in the batch and no TransferQueue batch is in "
            "flight; the actor's log-prob pass did not run rollout-parity's hook (is "
            f"{MODULE} in actor_rollout_ref.model.external_lib?)")
    import transfer_queue as tq
    from verl.workers.utils.padding import response_from_nested

    data = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id,
                           select_fields=[PROCESSED_FIELD, OUTSIDE_FIELD, "response_mask"])

    def padded(name: str) -> torch.Tensor:
        nested = response_from_nested(data[name], data["response_mask"])
        return torch.nested.to_padded_tensor(nested, 0.0, output_size=tuple(like.shape))

    return padded(PROCESSED_FIELD).to(like.dtype), padded(OUTSIDE_FIELD) != 0


def _write_old_log_probs(batch: Any, old: torch.Tensor) -> None:
    """Bypass: ``old_log_probs := pi_rollout`` for the loss, in the batch and in the TransferQueue."""
    batch.batch["old_log_probs"] = old
    meta = _current_batch.get()
    if meta is None:
        return  # legacy trainer: the batch itself travels on to the actor
    import transfer_queue as tq
    from tensordict import TensorDict
    from verl.workers.utils.padding import response_to_nested

    mask = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=["response_mask"])
    nested = response_to_nested(old, mask["response_mask"])
    tq.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id,
                    fields=TensorDict({"old_log_probs": nested}, batch_size=len(meta.keys)))


def driver_correction(batch: Any, rollout_corr_config: Any = None) -> tuple[Any, dict[str, float]]:
    """Our correction of one batch on the driver, with verl's helper's calling convention.

    ``batch`` is a ``DataProto`` with ``old_log_probs``, ``rollout_log_probs`` and
    ``response_mask``. Writes the corrected ``response_mask``, ``rollout_is_weights`` when an IS
    mode is set, keeps what rejection removed out of the GRPO/RLOO baselines, and under bypass
    sets ``old_log_probs := pi_rollout`` (on the trainer's full-vocabulary support when the sampler
    truncates). verl's own ``rollout_is_batch_normalize`` in ``rollout_corr_config`` divides the weights by
    their batch mean (``verl_keys.batch_normalized``). Returns ``(batch, metrics)``: every quantity verl's own
    correction logs under verl's ``rollout_corr/*`` name with verl's value (``core/metric_names.py``,
    ``verl_keys.verl_metrics``), the rest under ours.
    """
    cfg = require_config("driver_correction")
    if rollout_corr_config is not None:
        check_no_double_correction({"algorithm": {"rollout_correction": rollout_corr_config}}, cfg)
    tensors = batch.batch
    response_mask = tensors["response_mask"]
    old = tensors["old_log_probs"]
    rollout = tensors["rollout_log_probs"]
    sampler = active_sampler()
    trainer_old, outside = _processed_old_log_probs(batch, old) if sampler is not None else (old, None)
    driver_cfg = cfg.replace(off_policy_sequence_mask_delta=None)
    with torch.no_grad():
        if cfg.old_logprob_source == "bypass":
            # pi_theta at the start of the update is the recomputed pi_old: the core's bypass semantics.
            out = compute_correction(driver_cfg, rollout_logprobs=rollout, current_logprobs=trainer_old,
                                     response_mask=response_mask, with_metrics=cfg.wants_metrics)
        else:
            out = compute_correction(driver_cfg, old_logprobs=trainer_old, rollout_logprobs=rollout,
                                     response_mask=response_mask, with_metrics=cfg.wants_metrics)
    tensors["response_mask"] = out.mask
    extra: dict[str, float] = {}
    if cfg.rollout_importance_sampling_mode is not None:
        weights = out.weights
        if _select(rollout_corr_config, "rollout_is_batch_normalize", False):  # verl's own key, self-normalised IS
            weights, extra = batch_normalized(cfg, weights, response_mask)
        tensors["rollout_is_weights"] = weights.to(torch.float32)
    if cfg.rollout_rejection is not None:
        _keep_rejected_out_of_baselines(batch, response_mask, out.mask)
    if cfg.old_logprob_source == "bypass":
        behaviour = rollout if sampler is None else rollout_on_full_vocabulary(rollout, old, trainer_old)
        _write_old_log_probs(batch, behaviour)
    # verl's own rollout_corr/* names and values where verl computes the same formula, and rollout_corr/kl
    # (docs/metrics.md); what needs pi_theta or the advantages comes from the loss wrapper
    out.metrics = {k: v for k, v in out.metrics.items() if k.split("/", 1)[-1] not in _METRICS_NEED_POLICY}
    metrics = verl_metrics(cfg, out, response_mask, extra)
    if sampler is not None:
        # log S = full - processed per token (over the kept set with the sampled token added, where the
        # actor's recomputed kept set missed it: ``outside``)
        metrics.update(kept_mass_metrics(old.float() - trainer_old.float(), response_mask, outside_mask=outside))
    return batch, metrics


def _keep_rejected_out_of_baselines(batch: Any, before: torch.Tensor, after: torch.Tensor) -> None:
    """Make verl's outcome estimators see what rejection kept, and only that (verl#6362, verl#6452).

    verl's GRPO/RLOO sum ``token_level_rewards`` without the mask and group rows by ``uid``; GAE
    drops a reward sitting on a masked position. A row that keeps some tokens keeps its whole
    reward: what sat on its rejected tokens (the outcome reward sits on the last one) moves to its
    last kept token, so ``token_level_rewards.sum(-1)`` is the row's score as before. A fully
    rejected row trains nothing (its mask is all zero): its rewards are zeroed and it gets a uid of
    its own, so it leaves its siblings' baselines.
    """
    tensors = batch.batch
    kept_rows = after.bool().any(dim=-1)
    if "token_level_rewards" in tensors.keys():
        rewards = tensors["token_level_rewards"]
        rejected = (before.bool() & ~after.bool()).to(rewards.dtype)
        moved = (rewards * rejected).sum(dim=-1)
        positions = torch.arange(after.shape[-1], device=after.device).expand_as(after)
        last_kept = torch.where(after.bool(), positions, torch.full_like(positions, -1)).max(dim=-1).values
        new = rewards * (1 - rejected)
        rows = kept_rows.nonzero(as_tuple=True)[0]
        new[rows, last_kept[rows]] += moved[rows]
        tensors["token_level_rewards"] = torch.where(kept_rows.unsqueeze(-1), new, torch.zeros_like(new))
    uids = getattr(batch, "non_tensor_batch", {}).get("uid")
    if uids is not None:
        dropped = (before.bool().any(dim=-1) & ~kept_rows).tolist()
        if any(dropped):
            uids = uids.copy()
            for i, gone in enumerate(dropped):
                if gone:
                    uids[i] = f"{uids[i]}#rollout_parity_rejected_{i}"
            batch.non_tensor_batch["uid"] = uids
