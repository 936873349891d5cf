"""DESIGN.md's bad-input rules: a clear error, or a counted and neutral handling."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_parity import CorrectionConfig, compute_correction, policy_loss

ALL_ON = CorrectionConfig(rollout_importance_sampling_mode="sequence_mask", rollout_rejection=["seq_sum_k3"],
                          rollout_rejection_threshold=0.01, off_policy_sequence_mask_delta=0.1)


def batch(B=3, T=5):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(B, T, generator=g) - 0.1
    return old, old + 0.01 * torch.randn(B, T, generator=g), torch.ones(B, T), torch.tensor([1.0, -1.0, 0.5])


def test_rollout_one_token_longer_names_both_shapes():
    old, rollout, mask, adv = batch()
    longer = torch.cat([rollout, rollout[:, :1]], dim=1)
    with pytest.raises(ValueError) as err:
        compute_correction(ALL_ON, old_logprobs=old, rollout_logprobs=longer, response_mask=mask,
                           advantages=adv, current_logprobs=old)
    msg = str(err.value)
    assert "rollout_logprobs" in msg and "(3, 6)" in msg and "(3, 5)" in msg and "1 token longer" in msg


@pytest.mark.parametrize("field", ["old_logprobs", "current_logprobs"])
def test_other_shape_mismatches_name_the_field(field):
    old, rollout, mask, adv = batch()
    kwargs = dict(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, advantages=adv,
                  current_logprobs=old)
    kwargs[field] = kwargs[field][:2]
    with pytest.raises(ValueError, match=field):
        compute_correction(ALL_ON, **kwargs)


def test_advantages_of_wrong_shape():
    old, rollout, mask, adv = batch()
    with pytest.raises(ValueError, match=r"advantages has shape \(2,\)"):
        compute_correction(ALL_ON, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                           advantages=adv[:2], current_logprobs=old)


def test_nan_is_neutral_and_neg_inf_is_maximal_mismatch_and_both_are_counted():
    cfg = CorrectionConfig(rollout_importance_sampling_mode="token_truncate", rollout_importance_sampling_threshold=2.0)
    old, rollout, mask, adv = batch()
    rollout[0, 1] = float("nan")
    rollout[1, 2] = float("-inf")  # the engine says impossible, the trainer disagrees
    old[2, 3] = float("-inf")      # the trainer says impossible (e.g. outside its top-k set)
    rollout[2, 4] = float("inf")
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
    assert out.weights[0, 1] == 1.0
    assert out.weights[1, 2] == 2.0            # truncated at C: maximal mismatch
    assert out.weights[2, 3] == pytest.approx(math.exp(-20))
    assert out.weights[2, 4] == 1.0
    assert out.metrics["rollout_correction/nonfinite_frac"] == pytest.approx(4 / 15)
    assert out.metrics["rollout_correction/delta_abs_max"] == pytest.approx(20.0)
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_nonfinite_outside_the_mask_is_not_counted():
    cfg = CorrectionConfig(log_rollout_offpolicy_metrics=True)
    old, rollout, mask, adv = batch()
    mask[0, 4] = 0
    rollout[0, 4] = float("nan")
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
    assert out.metrics["rollout_correction/nonfinite_frac"] == 0.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_empty_mask_gives_zero_loss_that_backpropagates(agg):
    old, rollout, mask, adv = batch()
    mask.zero_()
    current = old.clone().requires_grad_()
    out = compute_correction(ALL_ON, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                             advantages=adv, current_logprobs=current)
    loss, metrics = policy_loss(ALL_ON, current_logprobs=current, advantages=adv, correction=out, loss_agg_mode=agg)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(current.grad, torch.zeros_like(current))
    assert all(math.isfinite(v) for v in metrics.values())


def test_all_rejected_batch_gives_zero_loss_and_finite_metrics():
    cfg = CorrectionConfig(rollout_rejection=["token_k2"], rollout_rejection_threshold=1e-12)
    old, rollout, mask, adv = batch()
    current = old.clone().requires_grad_()
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                             advantages=adv, current_logprobs=current)
    assert out.mask.sum() == 0
    assert out.metrics["rollout_correction/rejected_token_frac"] == 1.0
    loss, metrics = policy_loss(cfg, current_logprobs=current, advantages=adv, correction=out)
    loss.backward()
    assert loss.item() == 0.0 and current.grad is not None
    assert all(math.isfinite(v) for v in metrics.values())


def test_nan_current_logprobs_on_padding_do_not_poison_the_loss():
    cfg = CorrectionConfig()
    old, rollout, mask, adv = batch()
    mask[:, 3:] = 0
    current = old.clone()
    current[:, 3:] = float("nan")
    current.requires_grad_()
    loss, _ = policy_loss(cfg, current_logprobs=current, old_logprobs=old, advantages=adv, response_mask=mask)
    assert math.isfinite(loss.item())


def test_missing_inputs_are_errors_naming_them():
    old, rollout, mask, adv = batch()
    cfg = CorrectionConfig(rollout_importance_sampling_mode="token_truncate")
    with pytest.raises(ValueError, match="rollout_logprobs is None"):
        compute_correction(cfg, old_logprobs=old, rollout_logprobs=None, response_mask=mask)
    with pytest.raises(ValueError, match="old_logprobs is None"):
        compute_correction(cfg, old_logprobs=None, rollout_logprobs=rollout, response_mask=mask)
    with pytest.raises(ValueError, match="current_logprobs"):
        compute_correction(CorrectionConfig(off_policy_sequence_mask_delta=0.1), old_logprobs=old,
                           rollout_logprobs=rollout, response_mask=mask, advantages=adv)
    with pytest.raises(ValueError, match="compute_correction first"):
        policy_loss(cfg, current_logprobs=old, old_logprobs=old, advantages=adv, response_mask=mask)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        policy_loss(CorrectionConfig(), current_logprobs=old, old_logprobs=old, advantages=adv, response_mask=mask,
                    loss_agg_mode="token-sum-ish")


def test_nan_pi_old_under_bypass_is_a_neutral_token_not_a_nan_loss():
    cfg = CorrectionConfig(old_logprob_source="bypass", log_rollout_offpolicy_metrics=True)
    old, rollout, mask, adv = batch()
    rollout[1, 2] = float("nan")
    current = rollout.nan_to_num(-0.5).clone().requires_grad_()
    out = compute_correction(cfg, rollout_logprobs=rollout, response_mask=mask, advantages=adv,
                             current_logprobs=current)
    loss, _ = policy_loss(cfg, current_logprobs=current, advantages=adv, correction=out)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(current.grad).all()
    # Every token sits at ratio 1 (the NaN one by the neutral rule): d loss / d logp = -A / N.
    torch.testing.assert_close(current.grad, -adv[:, None].expand_as(mask) / mask.sum())
    assert out.metrics["rollout_correction/nonfinite_frac"] == pytest.approx(1 / 15)
