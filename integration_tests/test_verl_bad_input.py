"""Bad input through the verl adapter gives the core's clear error or neutral result (issue 10).

docs/flags.md, "Bad input": shapes that disagree are an error naming both shapes; NaN/±inf
logprobs are neutralised and counted; an all-rejected batch is a zero loss that still
backpropagates, with finite metrics. Here each rule is exercised through verl's own code:
the driver helper verl calls (our hook), verl's GRPO ``compute_advantage`` and verl's own
policy losses fetched through ``get_policy_loss_fn`` (our wrapper), with verl's
``global_batch_info`` normalisers. The property test poisons π_rollout, π_old and π_θ on
valid tokens and on padding (hypothesis, derandomised so a failure reproduces).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_parity.testing.stack import need

need("verl", extra="verl")

from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo import rollout_corr_helper as helper  # noqa: E402

from rollout_parity import CorrectionConfig, compute_correction, policy_loss  # noqa: E402
from rollout_parity.adapters import verl as adapter  # noqa: E402

from rollout_parity.check.shared_batch import make_shared_batch  # noqa: E402
from .support.verl_configs import actor_config as verl_actor_config  # noqa: E402
from .support.verl_configs import flags  # noqa: E402,F401 (a fixture)

pytestmark = [pytest.mark.verl]

NO_CORRECTION = {"rollout_is": None, "rollout_rs": None, "bypass_mode": False}
BAD = (float("nan"), float("inf"), float("-inf"))


@pytest.fixture(scope="module")
def actor_config():
    return verl_actor_config()


def proto(old, rollout, mask, **extra):
    tensors = {"old_log_probs": old.clone(), "rollout_log_probs": rollout.clone(), "response_mask": mask.clone()}
    tensors.update(extra)
    uid = extra.pop("uid", None)
    return DataProto.from_dict(tensors=tensors, non_tensors=None if uid is None else {"uid": uid})


def loss_of(actor_config, mode, old, current, adv, mask, weights, global_info=None):
    actor_config.global_batch_info.clear()
    actor_config.global_batch_info.update(global_info or {})
    torch.manual_seed(0)
    fn = core_algos.get_policy_loss_fn(mode)
    return fn(old_log_prob=old, log_prob=current, advantages=adv, response_mask=mask.bool(),
              loss_agg_mode="token-mean", config=actor_config, rollout_is_weights=weights)


# ============================================================================= shapes

def test_rollout_logprobs_one_token_longer_is_an_error_naming_both_shapes(flags):
    flags(CorrectionConfig.preset("tis_srs_k3"))
    batch = make_shared_batch()
    longer = torch.nn.functional.pad(batch.rollout_logprobs, (0, 1), value=-1.0)
    p = DataProto.from_dict(tensors={"old_log_probs": batch.old_logprobs, "rollout_log_probs": longer,
                                     "response_mask": batch.response_mask})
    with pytest.raises(ValueError, match=r"rollout_logprobs has shape \(8, 13\) but response_mask has shape "
                                         r"\(8, 12\) \(rollout_logprobs is 1 token longer"):
        helper.compute_rollout_correction_and_add_to_batch(p, NO_CORRECTION)


def test_a_shape_mismatch_inside_verls_loss_is_an_error_naming_both_shapes(actor_config, flags):
    flags(CorrectionConfig.preset("tis_srs_k3"))
    batch = make_shared_batch()
    shorter = batch.old_logprobs[:, :-1]
    with pytest.raises(ValueError, match=r"old_log_prob has shape \(8, 11\) but response_mask has shape \(8, 12\)"):
        loss_of(actor_config, "vanilla", shorter, batch.fresh_current(), batch.advantages[:, None] * batch.response_mask,
                batch.response_mask, None)


# ============================================================================= all rejected

@pytest.mark.parametrize("mode", ["vanilla", "gspo", "geo_mean"])
@pytest.mark.parametrize("global_info", [None, "verl_v1"])
def test_an_all_rejected_batch_is_a_zero_loss_that_backpropagates(actor_config, flags, mode, global_info):
    from verl.trainer.ppo.ray_trainer import compute_advantage  # (imports verl's rollout-server client)

    cfg = flags(CorrectionConfig(rollout_importance_sampling_mode="token_truncate", rollout_rejection=["seq_max_k2"],
                                 rollout_rejection_threshold=1e-9, log_rollout_offpolicy_metrics=True))
    batch = make_shared_batch()
    B = batch.response_mask.shape[0]
    uid = np.array([f"p{i // 4}" for i in range(B)], dtype=object)
    rewards = batch.response_mask * torch.linspace(0, 1, B)[:, None]
    p = proto(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask, token_level_rewards=rewards, uid=uid)
    p, driver_metrics = helper.compute_rollout_correction_and_add_to_batch(p, NO_CORRECTION)
    mask = p.batch["response_mask"]
    assert mask.sum() == 0 and driver_metrics["rollout_correction/rejected_seq_frac"] == 1.0
    p = compute_advantage(p, adv_estimator="grpo", num_repeat=4)  # verl's GRPO on the emptied batch
    adv = p.batch["advantages"]
    assert torch.isfinite(adv).all() and adv.abs().max() == 0
    # verl's V1 normaliser is the rollout's token count, before rejection
    info = {"dp_size": 1, "batch_num_tokens": int(batch.response_mask.sum()), "global_batch_size": B} \
        if global_info else None
    current = batch.fresh_current()
    loss, metrics = loss_of(actor_config, mode, batch.old_logprobs, current, adv, mask, p.batch["rollout_is_weights"],
                            info)
    loss.backward()
    assert loss.item() == 0.0 and current.grad is not None and current.grad.abs().max() == 0
    assert all(math.isfinite(float(v)) for v in {**driver_metrics, **metrics}.values())
    # the core's own answer on the same batch: a zero loss
    out = compute_correction(cfg, old_logprobs=batch.old_logprobs, rollout_logprobs=batch.rollout_logprobs,
                             response_mask=batch.response_mask)
    core_loss, _ = policy_loss(cfg, current_logprobs=batch.fresh_current(), old_logprobs=batch.old_logprobs,
                               advantages=batch.advantages, correction=out)
    assert core_loss.item() == 0.0


# ============================================================================= NaN / ±inf anywhere

@st.composite
def poisoned(draw):
    B, T = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 3 - 0.01
    rollout = old + torch.randn(B, T, generator=g) * 0.05
    current = old + torch.randn(B, T, generator=g) * 0.2
    adv = torch.randn(B, 1, generator=g) * mask  # verl's GRPO advantages: 0 on padding
    tensors = {"old": old, "rollout": rollout, "current": current}
    valid = mask.nonzero().tolist() or [[0, 0]]
    anywhere = [[i, t] for i in range(B) for t in range(T)]
    cells = st.tuples(st.sampled_from(sorted(tensors)), st.booleans(), st.integers(0, 10**6), st.sampled_from(BAD))
    for field, on_valid, k, value in draw(st.lists(cells, min_size=1, max_size=6)):
        pool = valid if on_valid else anywhere
        i, t = pool[k % len(pool)]
        tensors[field][i, t] = value
    for i, t in draw(st.lists(st.tuples(st.integers(0, B - 1), st.integers(0, T - 1)), max_size=2)):
        if mask[i, t] == 0:
            adv[i, t] = float("nan")  # an empty group's NaN advantage on padding
    return tensors["old"], tensors["rollout"], tensors["current"], mask, adv


FLAG_SETS = {
    "tis_srs_k3": dict(rollout_importance_sampling_mode="token_truncate", rollout_rejection=["seq_sum_k3"],
                       rollout_rejection_threshold=0.01, log_rollout_offpolicy_metrics=True,
                       off_policy_sequence_mask_delta=0.05),
    "bypass_rejection": dict(old_logprob_source="bypass", rollout_rejection=["token_k3"], rollout_rejection_threshold=0.5,
                             log_rollout_offpolicy_metrics=True),
    "bypass_in_loss": dict(old_logprob_source="bypass", log_rollout_offpolicy_metrics=True,
                           off_policy_sequence_mask_delta=0.05),
}


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "cispo"])
@pytest.mark.parametrize("name", sorted(FLAG_SETS))
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=poisoned())
def test_nan_and_inf_logprobs_never_reach_loss_gradient_or_metrics(actor_config, name, mode, batch):
    old, rollout, current, mask, adv = batch
    cfg = CorrectionConfig(**FLAG_SETS[name])
    adapter.set_active_config(cfg)
    try:
        # the driver (verl's helper, our hook) when verl calls it; verl's bypass switch copies the rollout
        if cfg.old_logprob_source == "bypass" and cfg.rollout_rejection is None:
            loss_old, loss_mask, weights, driver_metrics = rollout, mask, None, {}
        else:
            p, driver_metrics = helper.compute_rollout_correction_and_add_to_batch(proto(old, rollout, mask),
                                                                                  NO_CORRECTION)
            loss_old, loss_mask = p.batch["old_log_probs"], p.batch["response_mask"]
            weights = p.batch["rollout_is_weights"] if "rollout_is_weights" in p.batch.keys() else None
        leaf = current.clone().requires_grad_(True)
        info = {"dp_size": 1, "batch_num_tokens": max(int(mask.sum()), 1), "global_batch_size": mask.shape[0]}
        loss, metrics = loss_of(actor_config, mode, loss_old, leaf, adv, loss_mask, weights, info)
        loss.backward()
    finally:
        adapter.set_active_config(None)
    assert torch.isfinite(loss), (name, mode, loss)
    assert torch.isfinite(leaf.grad).all()
    assert leaf.grad[~torch.isfinite(current)].abs().max() == 0 if (~torch.isfinite(current)).any() else True
    every = {**driver_metrics, **metrics}
    bad = [k for k, v in every.items() if not math.isfinite(float(v))]
    assert not bad, bad
    # counted: a non-finite logprob on a valid token shows up in a nonfinite count
    valid = mask.bool()
    read = [rollout, current] if name == "bypass_in_loss" else [old, rollout, current]  # verl's bypass drops pi_old
    poisoned_valid = valid & ~torch.stack([torch.isfinite(t) for t in read]).all(0)
    if poisoned_valid.any():
        counts = driver_metrics.get("rollout_correction/nonfinite_frac", 0.0) + metrics["policy/nonfinite_frac"]
        assert counts > 0, (name, mode, every)
