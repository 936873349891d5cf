"""The bad-input rules (docs/flags.md): a clear error, or a counted and neutral handling.

One test (or more) per rule of docs/flags.md's "Bad input" list, as far as it concerns the core:
shapes that disagree (both fields and both shapes named), non-finite logprobs (neutral and
counted; the property test in ``test_core_nonfinite.py`` covers every placement), empty masks
and all-rejected batches (a zero loss that still backpropagates, finite metrics). Bad config
values are in ``test_core_config.py``; "correction enabled twice" is the adapters' rule.
"""

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


def assert_names_both(err, field, shape, other, other_shape):
    msg = str(err.value)
    assert f"{field} has shape {shape}" in msg and f"{other} has shape {other_shape}" in msg, msg


@pytest.mark.parametrize("field, cut", [
    ("old_logprobs", (slice(0, 2),)), ("rollout_logprobs", (slice(None), slice(0, 4))),
    ("current_logprobs", (slice(0, 2),)), ("advantages", (slice(0, 2),)),
])
def test_compute_correction_shape_mismatches_name_both_fields_and_shapes(field, cut):
    old, rollout, mask, adv = batch()
    kwargs = dict(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, advantages=adv,
                  current_logprobs=old.clone())
    kwargs[field] = kwargs[field][cut]
    with pytest.raises(ValueError) as err:
        compute_correction(ALL_ON, **kwargs)
    assert_names_both(err, field, tuple(kwargs[field].shape), "response_mask", (3, 5))


def test_token_level_advantages_of_wrong_shape():
    old, rollout, mask, adv = batch()
    with pytest.raises(ValueError) as err:
        compute_correction(ALL_ON, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                           advantages=torch.ones(3, 4), current_logprobs=old)
    assert_names_both(err, "advantages", (3, 4), "response_mask", (3, 5))


def test_response_mask_must_be_two_dimensional():
    old, rollout, mask, adv = batch()
    with pytest.raises(ValueError, match=r"response_mask must be \(batch, tokens\), got shape \(15,\)"):
        compute_correction(ALL_ON, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask.flatten(),
                           advantages=adv, current_logprobs=old)


@pytest.mark.parametrize("field", ["current_logprobs", "old_logprobs", "advantages", "correction"])
def test_policy_loss_shape_mismatches_name_both_fields_and_shapes(field):
    old, rollout, mask, adv = batch()
    cfg = CorrectionConfig(rollout_importance_sampling_mode="token_truncate")
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
    kwargs = dict(current_logprobs=old.clone(), old_logprobs=old, advantages=adv, correction=out, response_mask=mask)
    if field == "correction":  # a correction computed for another batch
        other = compute_correction(cfg, old_logprobs=old[:, :4], rollout_logprobs=rollout[:, :4],
                                   response_mask=mask[:, :4])
        kwargs["correction"] = other
        expected = ("correction_mask", (3, 4), "response_mask", (3, 5))
    elif field == "advantages":
        kwargs["advantages"] = adv[:2]
        expected = ("advantages", (2,), "current_logprobs", (3, 5))
    else:
        kwargs[field] = kwargs[field][:, :4]
        expected = (field, (3, 4), "response_mask", (3, 5))
    with pytest.raises(ValueError) as err:
        policy_loss(cfg, **kwargs)
    assert_names_both(err, *expected)


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


ALL_REJECTED = {
    "token": (dict(rollout_rejection=["token_k2"], rollout_rejection_threshold=1e-12),
              "rollout_correction/rejected_token_frac"),
    "sequence": (dict(rollout_importance_sampling_mode="token_truncate", rollout_rejection=["seq_sum_k3"],
                      rollout_rejection_threshold=1e-12), "rollout_correction/rejected_seq_frac"),
    "off_policy": (dict(off_policy_sequence_mask_delta=1e-6), "rollout_correction/off_policy_masked_frac"),
}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("how", sorted(ALL_REJECTED))
def test_all_rejected_batch_gives_zero_loss_that_backpropagates_and_finite_metrics(how, agg):
    flags, frac = ALL_REJECTED[how]
    cfg = CorrectionConfig(**flags)
    old, rollout, mask, adv = batch()
    rollout = old + 0.05  # every token drifts, so every rule fires
    adv = -adv.abs()  # the off-policy mask only takes negative-advantage sequences
    current = old.clone().requires_grad_()
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                             advantages=adv, current_logprobs=current)
    assert out.mask.sum() == 0
    assert out.metrics[frac] == 1.0
    loss, metrics = policy_loss(cfg, current_logprobs=current, advantages=adv, correction=out, loss_agg_mode=agg)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(current.grad, torch.zeros_like(current))
    assert all(math.isfinite(v) for v in metrics.values())


def test_sequence_mask_dropping_every_sequence_gives_zero_loss():
    """Weights 0 everywhere (the mask stays): still a zero loss with a zero, finite gradient."""
    cfg = CorrectionConfig(rollout_importance_sampling_mode="sequence_mask", rollout_importance_sampling_threshold=1.01,
                           rollout_importance_sampling_threshold_lower=0.99)
    old, rollout, mask, adv = batch()
    current = old.clone().requires_grad_()
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=old + 0.5, response_mask=mask)
    assert out.weights.sum() == 0 and out.metrics["rollout_correction/clipped_frac"] == 1.0
    loss, metrics = policy_loss(cfg, current_logprobs=current, advantages=adv, correction=out)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(current.grad, torch.zeros_like(current))
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("where", ["current", "old"])
def test_nan_logprobs_on_padding_do_not_poison_loss_gradient_or_metrics(where):
    """The reported bug: NaN π_θ on padding made policy/ppo_kl NaN while loss and gradient were finite."""
    cfg = CorrectionConfig(log_rollout_offpolicy_metrics=True)
    old, rollout, mask, adv = batch()
    mask[:, 3:] = 0
    current = old.clone() + 0.01
    (current if where == "current" else old)[:, 3:] = float("nan")
    clean_loss, clean_metrics = policy_loss(cfg, current_logprobs=current[:, :3], old_logprobs=old[:, :3],
                                            advantages=adv, response_mask=mask[:, :3])
    current.requires_grad_()
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, advantages=adv,
                             current_logprobs=current)
    loss, metrics = policy_loss(cfg, current_logprobs=current, old_logprobs=old, advantages=adv, response_mask=mask,
                                correction=out)
    loss.backward()
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert torch.isfinite(current.grad).all() and (current.grad[:, 3:] == 0).all()
    assert loss.item() == pytest.approx(clean_loss.item())
    assert metrics["policy/ppo_kl"] == pytest.approx(clean_metrics["policy/ppo_kl"])
    assert metrics["rollout_correction/nonfinite_frac"] == 0.0  # padding is not counted


def test_nan_current_logprob_on_a_valid_token_leaves_the_loss_and_is_counted():
    cfg = CorrectionConfig(rollout_importance_sampling_mode="token_truncate", off_policy_sequence_mask_delta=0.5)
    old, rollout, mask, adv = batch()
    current = old.clone() + 0.01
    current[1, 2] = float("nan")
    current.requires_grad_()
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, advantages=adv,
                             current_logprobs=current)
    assert out.metrics["rollout_correction/nonfinite_frac"] == pytest.approx(1 / 15)
    assert all(math.isfinite(v) for v in out.metrics.values())
    loss, metrics = policy_loss(cfg, current_logprobs=current, advantages=adv, correction=out)
    loss.backward()
    # The same as the batch without that token.
    without = mask.clone()
    without[1, 2] = 0
    ref, _ = policy_loss(cfg, current_logprobs=current.detach().nan_to_num(0.0), advantages=adv, correction=out,
                         response_mask=without)
    assert loss.item() == pytest.approx(ref.item())
    assert current.grad[1, 2] == 0 and torch.isfinite(current.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


def test_nan_advantage_of_an_empty_sequence_is_ignored():
    """GRPO gives NaN to a group with std 0; an empty (all-padding) sequence must not spread it."""
    cfg = CorrectionConfig(log_rollout_offpolicy_metrics=True, off_policy_sequence_mask_delta=0.5)
    old, rollout, mask, adv = batch()
    mask[2] = 0
    adv[2] = float("nan")
    current = (old + 0.01).requires_grad_()
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, advantages=adv,
                             current_logprobs=current)
    loss, metrics = policy_loss(cfg, current_logprobs=current, advantages=adv, correction=out)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(current.grad).all()
    assert all(math.isfinite(v) for v in metrics.values()), metrics


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


@pytest.mark.parametrize("kwargs, named", [
    (dict(clip_ratio=-0.1), "clip_ratio_low"),
    (dict(clip_ratio_high=float("nan")), "clip_ratio_high"),
    (dict(clip_ratio_c=1.0), "clip_ratio_c"),
])
def test_bad_loss_arguments_are_errors_naming_them(kwargs, named):
    old, rollout, mask, adv = batch()
    with pytest.raises(ValueError, match=named):
        policy_loss(CorrectionConfig(), current_logprobs=old, old_logprobs=old, advantages=adv, response_mask=mask,
                    **kwargs)


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


def test_perplexity_of_a_very_unlikely_token_is_finite_and_right():
    """A one-token sequence at logprob -95 has perplexity e^95, past fp32's range (e^88.7)."""
    from .naive_reference import naive_correction, naive_metrics

    flags = dict(log_rollout_offpolicy_metrics=True)
    old, rollout, mask, adv = batch()
    mask[0, 1:] = 0
    old[0, 0], rollout[0, 0] = -95.0, -94.5
    out = compute_correction(CorrectionConfig(**flags), old_logprobs=old, rollout_logprobs=rollout,
                             response_mask=mask)
    lists = [t.tolist() for t in (old, rollout, mask)]
    ref = naive_metrics(flags, *lists, naive_correction(flags, *lists))
    assert math.isfinite(ref["rollout_correction/training_ppl"]) and ref["rollout_correction/training_ppl"] > 1e40
    for key in ("training_ppl", "rollout_ppl", "ppl_ratio", "log_ppl_diff_max"):
        key = "rollout_correction/" + key
        assert out.metrics[key] == pytest.approx(ref[key], rel=1e-5), key


def test_ess_of_uniformly_tiny_ratios_is_one():
    """−inf π_old makes r = e^-20 on the only valid token: ESS is scale-free, so 1, not 0 from cancellation."""
    cfg = CorrectionConfig(log_rollout_offpolicy_metrics=True)
    old, rollout, mask, adv = batch()
    mask.zero_()
    mask[0, 0] = 1
    old[0, 0] = float("-inf")
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
    assert out.metrics["rollout_correction/ess"] == pytest.approx(1.0)
    assert out.metrics["rollout_correction/is_weight_mean"] == pytest.approx(math.exp(-20), rel=1e-5)
    assert out.metrics["rollout_correction/nonfinite_frac"] == 1.0
