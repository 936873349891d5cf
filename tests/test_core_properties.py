"""Property tests (hypothesis): on-policy is the identity, weights are non-negative and inert."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_parity import CorrectionConfig, compute_correction, policy_loss
from rollout_parity.core.config import IS_MODES, REJECTION_OPTIONS

modes = st.sampled_from((None,) + IS_MODES)
reductions = st.sampled_from(("geometric_mean", "product"))
rejections = st.lists(st.sampled_from(REJECTION_OPTIONS), max_size=3, unique=True)


@st.composite
def batches(draw):
    B = draw(st.integers(1, 5))
    T = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * draw(st.floats(0.01, 8.0))
    noise = torch.randn(B, T, generator=g) * draw(st.floats(0.0, 3.0))
    adv = torch.randn(B, generator=g)
    return old, noise, mask, adv


def config(mode, reduction, rejection, upper, lower_frac):
    lower = lower_frac  # in [0, 1): on-policy r = 1 lies inside [lower, upper]
    thresholds = None
    if rejection:
        thresholds = [2.0 if r.endswith("k1") else 0.05 for r in rejection]
    return CorrectionConfig(rollout_importance_sampling_mode=mode, rollout_importance_sampling_threshold=upper,
                            rollout_importance_sampling_threshold_lower=lower,
                            rollout_importance_sampling_sequence_reduction=reduction,
                            rollout_rejection=rejection or None, rollout_rejection_threshold=thresholds,
                            off_policy_sequence_mask_delta=0.05, log_rollout_offpolicy_metrics=True)


@settings(max_examples=120, deadline=None)
@given(batches(), modes, reductions, rejections, st.floats(1.01, 10.0), st.one_of(st.none(), st.floats(0.0, 0.99)))
def test_on_policy_is_the_identity(batch, mode, reduction, rejection, upper, lower_frac):
    old, _, mask, adv = batch
    cfg = config(mode, reduction, rejection, upper, lower_frac)
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=old.clone(), response_mask=mask,
                             advantages=adv, current_logprobs=old.clone())
    if mode is not None:
        assert torch.equal(out.weights, mask)  # 1 on every valid token, 0 on padding
    assert torch.equal(out.mask, mask)  # nothing rejected, nothing masked
    m = out.metrics
    assert m["rollout_correction/k1_mean"] == 0.0 and m["rollout_correction/k3_kl"] == 0.0
    assert m["rollout_correction/ess"] == pytest.approx(1.0)
    assert m["rollout_correction/clipped_frac"] == 0.0 and m["rollout_correction/rejected_token_frac"] == 0.0


@settings(max_examples=120, deadline=None)
@given(batches(), modes, reductions, rejections, st.floats(1.01, 10.0), st.one_of(st.none(), st.floats(0.0, 0.99)))
def test_weights_are_nonnegative_finite_detached_and_masks_shrink(batch, mode, reduction, rejection, upper,
                                                                   lower_frac):
    old, noise, mask, adv = batch
    cfg = config(mode, reduction, rejection, upper, lower_frac)
    old = old.clone().requires_grad_()
    rollout = (old + noise).detach()
    current = (old + 0.1 * noise).detach().requires_grad_()
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                             advantages=adv, current_logprobs=current)
    assert not out.weights.requires_grad and out.weights.grad_fn is None
    assert (out.weights >= 0).all() and torch.isfinite(out.weights).all()
    if mode is not None and mode.endswith("truncate"):
        assert (out.weights <= upper * (1 + 1e-6)).all()
    assert ((out.mask > 0) <= (mask > 0)).all()  # corrections only ever remove tokens
    assert all(v == v and abs(v) != float("inf") for v in out.metrics.values())
    loss, _ = policy_loss(cfg, current_logprobs=current, old_logprobs=old.detach(), advantages=adv, correction=out)
    loss.backward()
    assert old.grad is None  # nothing flows into pi_old through the weights
    assert torch.isfinite(current.grad).all()
