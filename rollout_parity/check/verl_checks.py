"""The shared batch through verl's own code with our adapter applied.

* ``verl/driver``: verl's driver helper ``compute_rollout_correction_and_add_to_batch`` (which
  the adapter wraps) writes the packaged weights, mask and metrics into a ``DataProto``;
* ``verl/vanilla``: verl's ``vanilla`` loss, fetched through ``get_policy_loss_fn`` and called as
  verl's ``ppo_loss`` calls it with a real ``ActorConfig`` from verl's own Hydra defaults, gives
  the packaged loss and gradient;
* ``verl/loss-modes``: every loss in verl's ``POLICY_LOSS_REGISTRY`` (but verl's own
  ``bypass_mode``) runs on our weights and mask: finite, no gradient on a removed token, and
  bit-identical to verl's unwrapped function on the same inputs;
* ``verl/native``: verl's own rollout correction (the helper unwrapped), given verl's own
  config block for a configuration it can express, writes the weights and mask we write.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from rollout_parity.check.report import Check, FrameworkReport, corrupt
from rollout_parity.check.shared_batch import all_config_names, config_for, load_expected, make_shared_batch
from rollout_parity.core.metric_names import verl_names

__all__ = ["VERL_CHECKS", "VERL_OWN", "BASE_OVERRIDES", "compose_verl", "actor_config", "run_verl_checks", "run"]

#: name -> what it compares; each takes the self-test knob (report.CORRUPT_ENV).
VERL_CHECKS = {
    "verl/driver": "driver helper: weights, mask & metrics vs packaged",
    "verl/vanilla": "verl's vanilla loss & gradient vs packaged numbers",
    "verl/loss-modes": "each registered loss on our weights = verl's own",
    "verl/native": "verl's own rollout correction = shared flags",
}
BASE_OVERRIDES = ["actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                  "actor_rollout_ref.rollout.name=vllm"]
NO_CORRECTION = {"rollout_is": None, "rollout_rs": None, "bypass_mode": False}
#: verl's own ``algorithm.rollout_correction`` block (its documented keys) for the shared-batch
#: configs it can express with the same semantics (docs/verl.md).
VERL_OWN = {
    "verl_decoupled_token_is": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "icepop": {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0"},
    "tis_srs_k3": {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_sum_k3",
                   "rollout_rs_threshold": "0.001"},
}
_VERL_DEFAULTS = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_rs": None, "rollout_rs_threshold": None,
                  "bypass_mode": False, "loss_type": "ppo_clip", "rollout_is_batch_normalize": False}


def compose_verl(*overrides: str, base: bool = True) -> Any:
    """verl's own ``ppo_trainer`` Hydra config with :data:`BASE_OVERRIDES` (unless ``base=False``)."""
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo import core_algos

    config_dir = os.path.abspath(os.path.join(os.path.dirname(core_algos.__file__), "..", "config"))
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=[*(BASE_OVERRIDES if base else []), *overrides])


def actor_config(*overrides: str) -> Any:
    """A real verl ActorConfig (``FSDPActorConfig``) from verl's own defaults and ``overrides``."""
    from verl.utils.config import omega_conf_to_dataclass

    return omega_conf_to_dataclass(compose_verl(*overrides).actor_rollout_ref.actor)


def _driver(helper_fn: Callable, old, rollout, mask, rc: dict):
    from verl import DataProto

    proto = DataProto.from_dict(tensors={"old_log_probs": old.clone(), "rollout_log_probs": rollout.clone(),
                                         "response_mask": mask.clone()})
    proto, metrics = helper_fn(proto, rc)
    weights = proto.batch["rollout_is_weights"] if "rollout_is_weights" in proto.batch.keys() else None
    return proto.batch["response_mask"], weights, metrics


def call_verl_loss(fn: Callable, actor: Any, batch: Any, mask, weights):
    """One call of a verl PolicyLossFn as verl's ppo_loss makes it; returns (loss, grad, metrics)."""
    actor.global_batch_info.clear()
    torch.manual_seed(0)  # clip_cov / kl_cov pick their tokens at random
    current = batch.fresh_current()
    loss, metrics = fn(old_log_prob=batch.old_logprobs, log_prob=current,
                       advantages=batch.advantages[:, None] * batch.response_mask, response_mask=mask.bool(),
                       loss_agg_mode="token-mean", config=actor, rollout_is_weights=weights)
    loss.backward()
    return loss.detach(), current.grad, metrics


def run_verl_checks(report: FrameworkReport, tick: Callable[[], None] = lambda: None) -> None:
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo import rollout_corr_helper as helper

    from rollout_parity import compute_correction
    from rollout_parity.adapters import verl as adapter

    report.tested = adapter.TESTED_VERL
    adapter.apply()  # importing the adapter applies it; idempotent
    checks = {name: Check(name, what) for name, what in VERL_CHECKS.items()}
    checks["verl/loss-modes"].tolerance = 0.0
    modes = sorted(n for n in core_algos.POLICY_LOSS_REGISTRY if n != "bypass_mode")
    actor = actor_config(*(["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"] if "dro" in modes else []))
    expected_all = load_expected()
    previous = adapter.active_config()
    try:
        for name in all_config_names():
            cfg, expected, batch = config_for(name), expected_all[name], make_shared_batch()
            adapter.set_active_config(cfg)
            mask, weights, metrics = _driver(helper.compute_rollout_correction_and_add_to_batch, batch.old_logprobs,
                                             batch.rollout_logprobs, batch.response_mask, NO_CORRECTION)
            _check_driver(checks["verl/driver"], name, cfg, batch, mask, weights, metrics, expected, compute_correction)
            if cfg.off_policy_sequence_mask_delta is None:
                vanilla = core_algos.get_policy_loss_fn("vanilla")
                loss, grad, _ = call_verl_loss(vanilla, actor, batch, mask, corrupt("verl/vanilla", weights, mask))
                checks["verl/vanilla"].close(name, "loss", loss, expected["loss"], rtol=1e-6)
                checks["verl/vanilla"].close(name, "gradient", grad, expected["grad"], rtol=1e-6)
            for mode in modes:
                _check_mode(checks["verl/loss-modes"], name, mode, cfg, batch, actor, mask, weights, core_algos)
            tick()
        _check_native(checks["verl/native"], helper, adapter)
        tick()
    finally:
        adapter.set_active_config(previous)
    report.checks += [c.result() for c in checks.values()]


def _check_driver(check, name, cfg, batch, mask, weights, metrics, expected, compute_correction) -> None:
    if cfg.off_policy_sequence_mask_delta is None:
        want_mask, want_weights = torch.tensor(expected["mask"]), torch.tensor(expected["weights"])
        want_metrics = expected["metrics"]
    else:  # the off-policy mask needs pi_theta: verl's loss wrapper applies it, not the driver
        out = compute_correction(cfg.replace(off_policy_sequence_mask_delta=None), old_logprobs=batch.old_logprobs,
                                 rollout_logprobs=batch.rollout_logprobs, response_mask=batch.response_mask)
        want_mask, want_weights, want_metrics = out.mask, out.weights, {}
    check.close(name, "response_mask", mask, want_mask, atol=0.0)
    if cfg.rollout_importance_sampling_mode is None:
        check.expect(name, weights is None, "rollout_is_weights written without an IS mode")
    else:
        check.expect(name, weights is not None, "no rollout_is_weights written")
        if weights is not None:
            check.close(name, "rollout_is_weights", corrupt("verl/driver", weights, mask), want_weights, rtol=1e-6)
    if cfg.wants_metrics:
        check.expect(name, "rollout_corr/k3_kl" in metrics, "no rollout_corr/k3_kl among the driver's metrics")
    want_metrics = verl_names(want_metrics, cfg)  # verl's names where verl has the same formula
    for key, value in metrics.items():
        if key in want_metrics:
            check.close(name, key, value, want_metrics[key], rtol=1e-5)


def _check_mode(check, name, mode, cfg, batch, actor, mask, weights, core_algos) -> None:
    case = f"{mode}:{name}"
    wrapped, original = core_algos.get_policy_loss_fn(mode), core_algos.POLICY_LOSS_REGISTRY[mode]
    check.expect(case, getattr(wrapped, "__wrapped__", None) is original, "the loss is not wrapped by the adapter")
    loss, grad, metrics = call_verl_loss(wrapped, actor, batch, mask, corrupt("verl/loss-modes", weights, mask))
    check.expect(case, bool(torch.isfinite(loss)) and bool(torch.isfinite(grad).all()), "non-finite loss or gradient")
    seen = mask.bool()  # what the loss finally sees: our mask, narrowed by the off-policy mask in the wrapper
    if cfg.off_policy_sequence_mask_delta is not None:
        drift = ((batch.old_logprobs - batch.current_logprobs.detach()) * seen).sum(-1) / seen.sum(-1).clamp_min(1)
        seen = seen & ~((drift > cfg.off_policy_sequence_mask_delta) & (batch.advantages < 0))[:, None]
    check.expect(case, bool(grad[~seen].abs().max() == 0), "a removed token received gradient")
    check.expect(case, bool(grad[seen].abs().max() > 0), "the loss trained nothing")
    check.expect(case, "rollout_correction/loss_nonfinite_frac" in metrics, "our policy metrics are missing")
    ours = metrics.get("rollout_correction/ppo_k1_mean")
    if "actor/ppo_kl" in metrics:  # the loss's own: not logged twice
        check.expect(case, ours is None, "rollout_correction/ppo_k1_mean beside the loss's own actor/ppo_kl")
    else:  # a loss without one: vanilla's formula over the kept tokens
        log_r = (batch.current_logprobs.detach() - batch.old_logprobs).clamp(-20.0, 20.0)
        want = float((-log_r * seen).sum() / seen.sum().clamp_min(1))
        check.expect(case, ours is not None and abs(float(ours) - want) <= 1e-5 * max(1.0, abs(want)),
                     f"rollout_correction/ppo_k1_mean {ours} is not vanilla's ppo_kl over the kept tokens ({want:.6g})")
    their_loss, their_grad, _ = call_verl_loss(original, actor, batch, seen, weights)
    check.close(case, "loss vs verl's unwrapped", loss, their_loss, atol=0.0)
    check.close(case, "gradient vs verl's unwrapped", grad, their_grad, atol=0.0)


def _check_native(check, helper, adapter) -> None:
    """verl's own correction on the finite part of the batch (verl has no NaN rules) vs ours."""
    batch = make_shared_batch()
    rollout = torch.nan_to_num(batch.rollout_logprobs, nan=-1.0, neginf=-8.0)
    patched = helper.compute_rollout_correction_and_add_to_batch
    own = getattr(patched, "__wrapped__", patched)  # verl's own function under our wrapper
    for name, block in VERL_OWN.items():
        adapter.set_active_config(config_for(name))
        ours_mask, ours_w, _ = _driver(patched, batch.old_logprobs, rollout, batch.response_mask, NO_CORRECTION)
        adapter.set_active_config(None)
        their_mask, their_w, _ = _driver(own, batch.old_logprobs, rollout, batch.response_mask,
                                         {**_VERL_DEFAULTS, **block})
        check.close(name, "response_mask", ours_mask, their_mask.to(ours_mask.dtype), atol=0.0)
        check.close(name, "rollout_is_weights", corrupt("verl/native", ours_w, ours_mask), their_w, rtol=1e-6)


def run(report: FrameworkReport, opts: Any, tick: Callable[[], None]) -> None:
    """``rollout-parity check``'s entry for verl (``registry.py``)."""
    run_verl_checks(report, tick)
