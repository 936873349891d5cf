"""Every verl policy loss runs with the shared flags, on the shared batch (issue 11, item 2).

The adapter never replaces verl's loss: the user's ``loss_mode`` (each entry of verl's
``POLICY_LOSS_REGISTRY`` but its own ``bypass_mode`` correction) is fetched through verl's
``get_policy_loss_fn`` and runs on our driver's ``response_mask`` and ``rollout_is_weights``.
For every loss mode and every shared-batch configuration:

* the loss and its gradient are finite, and the gradient is exactly zero on every token the
  correction removed (rejected, off-policy masked, padding);
* the loss and gradient are bit-identical to verl's own, unwrapped loss function called with
  the same weights and mask: the wrapper hands data over and adds metrics, nothing else;
* where verl's own rollout correction expresses the configuration, our weights and mask equal
  verl's (``rollout_corr_helper``, unpatched) on the finite part of the batch, so every loss
  receives the weights exactly as verl's own correction would hand them.
"""

from __future__ import annotations


import pytest
import torch

from rollout_parity.testing.stack import need

need("verl", extra="verl")

from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo import rollout_corr_helper as helper  # noqa: E402

from rollout_parity.adapters import verl as adapter  # noqa: E402,F401 (importing it applies the patches)
from integration_tests.support.verl_equivalent import verl_equivalent  # noqa: E402
from rollout_parity import CorrectionConfig  # noqa: E402
from rollout_parity.check.verl_checks import call_verl_loss  # noqa: E402

from rollout_parity.check.shared_batch import all_config_names, config_for, make_shared_batch  # noqa: E402
from .support.verl_configs import actor_config as verl_actor_config  # noqa: E402
from .support.verl_configs import flags  # noqa: E402,F401 (a fixture)

pytestmark = [pytest.mark.verl]

LOSS_MODES = sorted(name for name in core_algos.POLICY_LOSS_REGISTRY if name != "bypass_mode")
NO_CORRECTION = {"rollout_is": None, "rollout_rs": None, "bypass_mode": False}


@pytest.fixture(scope="module")
def actor_config():
    # verl >= 0.9: dro needs its penalty coefficient
    return verl_actor_config(*(["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"] if "dro" in LOSS_MODES else []))


def driver(batch, old, rollout, mask, helper_fn=None, rc=NO_CORRECTION):
    proto = DataProto.from_dict(tensors={"old_log_probs": old.clone(), "rollout_log_probs": rollout.clone(),
                                         "response_mask": mask.clone()})
    proto, _ = (helper_fn or helper.compute_rollout_correction_and_add_to_batch)(proto, rc)
    weights = proto.batch["rollout_is_weights"] if "rollout_is_weights" in proto.batch.keys() else None
    return proto.batch["response_mask"], weights


@pytest.mark.parametrize("name", all_config_names())
@pytest.mark.parametrize("loss_mode", LOSS_MODES)
def test_every_verl_loss_runs_on_our_weights_and_mask(loss_mode, name, actor_config, flags):
    cfg = flags(config_for(name))
    batch = make_shared_batch()
    mask, weights = driver(batch, batch.old_logprobs, batch.rollout_logprobs, batch.response_mask)
    wrapped = core_algos.get_policy_loss_fn(loss_mode)
    original = core_algos.POLICY_LOSS_REGISTRY[loss_mode]
    assert wrapped is not original and wrapped.__wrapped__ is original

    loss, grad, metrics = call_verl_loss(wrapped, actor_config, batch, mask, weights)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    # what the loss finally saw: our mask, narrowed by the off-policy mask in the wrapper
    seen = mask.bool()
    if cfg.off_policy_sequence_mask_delta is not None:
        assert metrics["rollout_correction/off_policy_masked_frac"] > 0
        drift = ((batch.old_logprobs - batch.current_logprobs.detach()) * seen).sum(-1) / seen.sum(-1).clamp_min(1)
        seen = seen & ~((drift > cfg.off_policy_sequence_mask_delta) & (batch.advantages < 0))[:, None]
    assert grad[~seen].abs().max() == 0, "a removed token received gradient"
    assert grad[seen].abs().max() > 0, "the loss trained nothing"
    if cfg.rollout_rejection is not None:
        assert mask.sum() < batch.response_mask.sum(), "this configuration should reject on the shared batch"
    assert "rollout_correction/loss_nonfinite_frac" in metrics  # ours; clip fractions and ppo_kl: the loss's own
    assert not [k for k in metrics if k.startswith("policy/")]
    assert ("rollout_correction/ppo_k1_mean" in metrics) is ("actor/ppo_kl" not in metrics)  # never beside verl's
    assert all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values())

    # the wrapper adds nothing to the loss: verl's own function on the same (narrowed) mask
    their_loss, their_grad, _ = call_verl_loss(original, actor_config, batch, seen, weights)
    assert torch.equal(loss, their_loss) and torch.equal(grad, their_grad)


@pytest.mark.parametrize("loss_mode", ["vanilla", "gpg"])
def test_the_wrapper_reads_the_device_back_once_per_micro_batch(loss_mode, actor_config, flags):
    """Host syncs (counted on CPU, rollout_parity/testing/host_sync.py) of the wrapped loss beyond verl's own
    loss on the same mask: one, for the side correction's diagnostics, the empty-mask check and every
    policy-side sum together (three before: one each; seven before that: one per count)."""
    from rollout_parity.testing.host_sync import host_syncs

    flags(config_for("off_policy_mask"))
    batch = make_shared_batch()
    mask, weights = driver(batch, batch.old_logprobs, batch.rollout_logprobs, batch.response_mask)
    with host_syncs() as ours:
        _, _, metrics = call_verl_loss(core_algos.get_policy_loss_fn(loss_mode), actor_config, batch, mask, weights)
    with host_syncs() as theirs:
        call_verl_loss(core_algos.POLICY_LOSS_REGISTRY[loss_mode], actor_config, batch, mask, weights)
    assert sum(ours.values()) - sum(theirs.values()) == 1, (dict(ours), dict(theirs))
    assert {"rollout_correction/loss_nonfinite_frac", "rollout_correction/off_policy_masked_frac",
            "rollout_correction/loss_contrib_pos"} <= set(metrics)
    assert ("rollout_correction/ppo_k1_mean" in metrics) is (loss_mode == "gpg")


def verl_expressible(name):
    try:
        verl_equivalent(config_for(name))
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("name", [n for n in all_config_names() if verl_expressible(n)])
@pytest.mark.parametrize("loss_mode", LOSS_MODES)
def test_weights_reach_every_loss_as_verls_own_correction_would_hand_them(loss_mode, name, actor_config, flags):
    """On the finite part of the batch our driver writes what verl's own helper writes for the same flags."""
    cfg = flags(config_for(name))
    batch = make_shared_batch()
    rollout = torch.nan_to_num(batch.rollout_logprobs, nan=-1.0, neginf=-8.0)  # verl has no NaN rules
    mask_in = batch.response_mask.clone()
    ours = driver(batch, batch.old_logprobs, rollout, mask_in)
    theirs = driver(batch, batch.old_logprobs, rollout, mask_in,
                    helper_fn=helper.compute_rollout_correction_and_add_to_batch.__wrapped__,
                    rc=verl_equivalent(cfg))
    torch.testing.assert_close(ours[0], theirs[0].to(ours[0].dtype), atol=0, rtol=0)
    if cfg.rollout_importance_sampling_mode is not None:
        torch.testing.assert_close(ours[1], theirs[1], atol=1e-6, rtol=1e-6)
    loss, grad, _ = call_verl_loss(core_algos.get_policy_loss_fn(loss_mode), actor_config, batch, *ours)
    their_loss, their_grad, _ = call_verl_loss(core_algos.POLICY_LOSS_REGISTRY[loss_mode], actor_config, batch, *theirs)
    torch.testing.assert_close(loss, their_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, their_grad, atol=1e-6, rtol=1e-6)


def test_every_loss_mode_is_covered():
    """verl's registry, not a list of ours: a loss added upstream is tested without editing this file."""
    assert {"vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo"} <= set(LOSS_MODES)


def _naive_clip_fractions(mode, old, cur, adv, kept, low, high, c=3.0):
    """verl's clip fractions written out: the token ratio (vanilla, with dual clip) or gspo's sequence ratio."""
    log_r = cur - old
    if mode == "gspo":
        seq = (log_r * kept).sum(-1) / kept.sum(-1).clamp_min(1)
        ratio = seq.clamp(max=10.0).exp()[:, None].expand_as(log_r)
    else:
        ratio = log_r.clamp(-20.0, 20.0).exp()
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - low, 1 + high)
    frac = (clipped > unclipped)[kept].float().mean().item()
    lower = 0.0 if mode == "gspo" else ((torch.maximum(unclipped, clipped) > -adv * c) & (adv < 0))[kept].float().mean().item()
    return frac, lower


@pytest.mark.parametrize("mode", ["vanilla", "gspo"])
def test_policy_metrics_through_verls_ppo_loss_mean_what_verls_mean(mode, flags):
    """verl's own ``ppo_loss`` on a micro-batch after rejection, with clip_ratio_low=0.05 != clip_ratio_high=0.3.

    verl's ``actor/ppo_kl`` is the mean of -log r over the tokens the loss kept (once it was a sum over them divided
    by the rollout's token count: half of verl's value when half was rejected). The clip fractions are the loss's
    own (gspo: its sequence ratio), with the asymmetric range; no copy of ours stands beside either (each was
    once logged twice). Naive references for each.
    """
    from verl.workers.utils.losses import ppo_loss

    from .support.verl_dp_metrics import _micro_batch

    flags(config_for("tis_srs_k3"))
    batch = make_shared_batch()
    mask, weights = driver(batch, batch.old_logprobs, batch.rollout_logprobs, batch.response_mask)
    kept = mask.bool()
    assert 0 < kept.sum() < batch.response_mask.sum()  # rejection removed tokens: the two normalisers differ
    config = verl_actor_config(f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}",
                               "actor_rollout_ref.actor.clip_ratio_low=0.05", "actor_rollout_ref.actor.clip_ratio_high=0.3")
    current = batch.fresh_current()
    advantages = batch.advantages[:, None] * batch.response_mask
    B = mask.shape[0]
    info = {"batch_num_tokens": int(batch.response_mask.sum()), "global_batch_size": B}
    data, output = _micro_batch(batch, mask, weights, advantages, list(range(B)), current, 1, info)
    _, metrics = ppo_loss(config, output, data)
    logged = {k: float(v.aggregate()) for k, v in metrics.items()}

    old, cur = batch.old_logprobs, batch.current_logprobs.detach()
    assert torch.isfinite(old[kept]).all() and torch.isfinite(cur[kept]).all()
    log_r = (cur - old).clamp(-20.0, 20.0)
    ppo_kl = (-log_r)[kept].mean().item()
    assert logged["actor/ppo_kl"] == pytest.approx(ppo_kl, abs=1e-6)
    assert not [k for k in logged if k.endswith("ppo_k1_mean") or k.startswith("policy/")]
    before_fix = (-log_r)[kept].sum().item() / info["batch_num_tokens"]
    assert abs(before_fix - ppo_kl) > 0.05 * abs(ppo_kl)

    frac, lower = _naive_clip_fractions(mode, old, cur, advantages, kept, low=0.05, high=0.3)
    assert logged["actor/pg_clipfrac"] == pytest.approx(frac, abs=1e-6)
    assert logged["actor/pg_clipfrac_lower"] == pytest.approx(lower, abs=1e-6)
    symmetric, _ = _naive_clip_fractions(mode, old, cur, advantages, kept, low=0.2, high=0.2)
    assert abs(symmetric - frac) > 1e-3, "the batch does not tell the asymmetric range from the default one"


@pytest.mark.parametrize("mode, clamped, own", [("vanilla", True, True), ("gspo", False, True), ("gpg", True, False)])
def test_ppo_kl_is_each_losss_own_and_vanillas_where_a_loss_has_none(mode, clamped, own, flags, actor_config):
    """A kept token 30 nats off: verl's vanilla clamps log r to +-20 in its actor/ppo_kl, gspo does not, and gpg
    reports none. Where the loss has its own number (seen in a real main_ppo run, where gspo's unclamped value
    differed from a clamped copy) we add nothing; where not, ``rollout_correction/ppo_k1_mean`` is vanilla's clamped
    mean over the kept tokens."""
    flags(CorrectionConfig(log_rollout_offpolicy_metrics=True))
    batch = make_shared_batch()
    mask = batch.response_mask.clone()
    far = mask.nonzero()[0].tolist()
    old = batch.old_logprobs.clone()
    old[far[0], far[1]] = batch.current_logprobs[far[0], far[1]] + 30.0  # log r = -30 on one kept token
    current = batch.fresh_current()
    config = verl_actor_config(f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}")
    config.global_batch_info.clear()
    loss_fn = core_algos.get_policy_loss_fn(mode)
    _, metrics = loss_fn(old_log_prob=old, log_prob=current, advantages=batch.advantages[:, None] * mask,
                         response_mask=mask.bool(), loss_agg_mode="token-mean", config=config)
    log_r = (batch.current_logprobs - old).clamp(-20.0, 20.0) if clamped else batch.current_logprobs - old
    expected = (-log_r)[mask.bool()].mean().item()
    assert ("actor/ppo_kl" in metrics) is own
    assert ("rollout_correction/ppo_k1_mean" in metrics) is not own
    logged = metrics["actor/ppo_kl" if own else "rollout_correction/ppo_k1_mean"]
    assert float(logged) == pytest.approx(expected, rel=1e-5)
    unclamped = (-(batch.current_logprobs - old))[mask.bool()].mean().item()
    assert (abs(unclamped - expected) > 1e-3) is clamped  # the batch tells the two formulas apart
