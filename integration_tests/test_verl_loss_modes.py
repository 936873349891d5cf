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
    assert {"policy/pg_clipfrac", "policy/ppo_kl", "policy/pg_clipfrac_lower"} <= set(metrics)
    assert all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values())

    # the wrapper adds nothing to the loss: verl's own function on the same (narrowed) mask
    their_loss, their_grad, _ = call_verl_loss(original, actor_config, batch, seen, weights)
    assert torch.equal(loss, their_loss) and torch.equal(grad, their_grad)


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
