"""The diagnostics only TRL's loss can see, from a pass-through that returns TRL's loss untouched.

C(r) split by the sign of the advantage, the off-policy share and ``rollout_correction/ppo_k1_mean`` (mean
log pi_old - log pi_theta over TRL's loss tokens, the drift PPO's ratio sees; signed, so not called a KL) need
pi_theta of each micro-step: ``observed_forward`` (generation.py) keeps what TRL's loss forward computed, and
:func:`diagnosed_loss` hands it to the core with the batch's pi_old, pi_rollout and masks. Per micro-step
they are read back in one transfer (docs/metrics.md, "One host sync").
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from rollout_parity.adapters.trl.generation import KEY, ORIGINAL, THETA_METRICS, process_group
from rollout_parity.core.correction import compute_correction
from rollout_parity.core.distributed import all_reduce
from rollout_parity.core.readback import read_back

__all__ = ["diagnosed_loss"]


def diagnosed_loss(state: Any, original: Any, model: Any, inputs: Mapping[str, Any]) -> torch.Tensor:
    """TRL's ``_compute_loss``, returned untouched, plus the diagnostics that need its pi_theta."""
    state.loss_logps = []
    try:
        loss = original(model, inputs)
        captured = state.loss_logps
    finally:
        state.loss_logps = None
    if not captured or KEY + "old" not in inputs:
        return loss
    trainer = original.__self__
    current, old = captured[0], inputs[KEY + "old"]
    rollout = inputs.get(ORIGINAL + "sampling_per_token_logps", inputs["sampling_per_token_logps"])
    group = process_group(trainer)
    # pi_theta minus the same log(kept mass): pi_theta / pi_old is TRL's PPO ratio, times r_corr the rollout one.
    out = compute_correction(state.config, old_logprobs=old, rollout_logprobs=rollout,
                             response_mask=inputs[KEY + "response_mask"], advantages=inputs["advantages"],
                             current_logprobs=current - inputs[KEY + "kept_mass"], process_group=group,
                             with_metrics=True, defer_metrics=True)
    in_loss = (inputs["completion_mask"] * inputs.get("tool_mask", 1)) != 0  # TRL's loss tokens
    with torch.no_grad():
        drift = (inputs["old_per_token_logps"] - current).nan_to_num(0.0, 0.0, 0.0)
        drift_sums = all_reduce(torch.stack([torch.where(in_loss, drift.double(), 0.0).sum(), in_loss.sum().double()]),
                                group)
    sums, ours = read_back({"drift": drift_sums[0], "tokens": drift_sums[1]}, out)  # the one host sync
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    trl_own_mask = state.config.off_policy_sequence_mask_delta is None and trainer.off_policy_mask_threshold is not None
    for name in THETA_METRICS:  # TRL's own off_policy_mask_threshold acting: our fraction (of no mask) would say 0
        if not (trl_own_mask and name.endswith("off_policy_masked_frac")):
            metrics[name].append(ours[name])
    total, count = sums["drift"], sums["tokens"]
    metrics["rollout_correction/ppo_k1_mean"].append(total / count if count else 0.0)  # as masked_mean
    return loss
