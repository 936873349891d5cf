"""Property test: NaN and ±inf anywhere (padding or valid tokens, π_old, π_rollout, π_θ, and
advantages on padding) never leak into the loss, its gradient or any metric.

docs/flags.md, "Bad input": a non-finite logprob is neutral and counted in ``nonfinite_frac``,
never a silent NaN. Every number is also checked against the naive per-token reference,
which applies those rules one token at a time, so "finite" cannot hide "wrong".
Derandomised, so a failure reproduces.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_parity import CorrectionConfig, compute_correction, policy_loss
from rollout_parity.core.config import IS_MODES, REJECTION_OPTIONS

from .naive_reference import naive_everything

BAD = (float("nan"), float("inf"), float("-inf"))
FIELDS = ("old", "rollout", "current")


@st.composite
def poisoned_batches(draw):
    B = draw(st.integers(1, 5))
    T = draw(st.integers(1, 8))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 3 - 0.01
    rollout = old + torch.randn(B, T, generator=g) * draw(st.sampled_from((0.0, 0.05, 0.5)))
    current = old + torch.randn(B, T, generator=g) * 0.2
    token_adv = draw(st.booleans())
    adv = torch.randn(B, T, generator=g) if token_adv else torch.randn(B, generator=g)
    tensors = {"old": old, "rollout": rollout, "current": current}
    valid = mask.nonzero().tolist() or [[0, 0]]
    anywhere = [[i, t] for i in range(B) for t in range(T)]
    # Half on valid tokens (where the rules act), the rest anywhere; sometimes the same cell in
    # two fields (−inf on both sides of a ratio is its own rule).
    cells = st.tuples(st.sampled_from(FIELDS), st.booleans(), st.integers(0, 10**6), st.sampled_from(BAD),
                      st.one_of(st.none(), st.sampled_from(FIELDS)))
    for field, on_valid, k, value, also in draw(st.lists(cells, min_size=1, max_size=6)):
        i, t = (valid if on_valid else anywhere)[k % len(valid if on_valid else anywhere)]
        tensors[field][i, t] = value
        if also is not None:
            tensors[also][i, t] = value
    # Advantages are not logprobs: poison them on padding only (an empty sequence's NaN GRPO advantage).
    for i, t in draw(st.lists(st.tuples(st.integers(0, B - 1), st.integers(0, T - 1)), max_size=3)):
        if token_adv and mask[i, t] == 0:
            adv[i, t] = float("nan")
        elif not token_adv and mask[i].sum() == 0:
            adv[i] = float("nan")
    return old, rollout, current, mask, adv


@st.composite
def raw_flags(draw):
    bypass = draw(st.booleans())
    flags = dict(log_rollout_offpolicy_metrics=True)
    if bypass:
        flags["old_logprob_source"] = "bypass"
    else:
        flags["rollout_importance_sampling_mode"] = draw(st.sampled_from((None,) + IS_MODES))
        flags["rollout_importance_sampling_threshold"] = draw(st.sampled_from((1.2, 2.0)))
        flags["rollout_importance_sampling_threshold_lower"] = draw(st.sampled_from((None, 0.5)))
        flags["rollout_importance_sampling_sequence_reduction"] = draw(st.sampled_from(("geometric_mean", "product")))
        flags["rollout_importance_sampling_sequence_mask_weight"] = draw(st.sampled_from(("token", "sequence")))
    rejection = draw(st.lists(st.sampled_from(REJECTION_OPTIONS), max_size=2, unique=True))
    if rejection:
        flags["rollout_rejection"] = rejection
        flags["rollout_rejection_threshold"] = [2.0 if r.endswith("k1") else 0.1 for r in rejection]
    if draw(st.booleans()):
        flags["off_policy_sequence_mask_delta"] = 0.05
    return flags


@settings(max_examples=150, deadline=None, derandomize=True)
@given(poisoned_batches(), raw_flags(), st.sampled_from((None, 3.0)),
       st.sampled_from(("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")))
def test_nonfinite_inputs_are_neutral_and_counted(batch, flags, clip_c, agg):
    old, rollout, current, mask, adv = batch
    cfg = CorrectionConfig(**flags)
    bypass = cfg.old_logprob_source == "bypass"
    cur = current.clone().requires_grad_()
    out = compute_correction(cfg, old_logprobs=None if bypass else old, rollout_logprobs=rollout,
                             response_mask=mask, advantages=adv, current_logprobs=cur)
    loss, metrics = policy_loss(cfg, current_logprobs=cur, advantages=adv, correction=out, clip_ratio=0.2,
                                clip_ratio_c=clip_c, loss_agg_mode=agg)
    loss.backward()

    # Finite: loss, gradient, weights, every metric (policy/* and rollout_correction/*).
    assert math.isfinite(loss.item())
    assert torch.isfinite(cur.grad).all()
    assert torch.isfinite(out.weights).all()
    nonfinite_metrics = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    assert not nonfinite_metrics
    # Padding and removed tokens get exactly no gradient.
    assert (cur.grad[out.mask == 0] == 0).all()

    # Counted: a valid token with a non-finite logprob among those read (π_old is not read under bypass).
    read = [rollout, current] + ([] if bypass else [old])
    bad = torch.zeros_like(mask, dtype=torch.bool)
    for x in read:
        bad |= ~torch.isfinite(x)
    n_valid = mask.sum().item()
    expected_frac = (bad & (mask > 0)).sum().item() / n_valid if n_valid else 0.0
    assert metrics["rollout_correction/nonfinite_frac"] == pytest.approx(expected_frac)

    # Neutral, and right: the same numbers as the naive per-token reference.
    ref = naive_everything(flags, old.tolist(), rollout.tolist(), mask.tolist(), adv.tolist(), current.tolist(),
                           eps_low=0.2, eps_high=0.2, clip_c=clip_c, agg=agg)
    torch.testing.assert_close(out.weights, torch.tensor(ref["weights"]), rtol=1e-5, atol=1e-6)
    assert out.mask.tolist() == [[float(k) for k in row] for row in ref["keep"]]
    assert loss.item() == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6)
    torch.testing.assert_close(cur.grad, torch.tensor(ref["grad"]), rtol=1e-5, atol=1e-6)
    assert set(metrics) == set(ref["metrics"])
    for key, value in ref["metrics"].items():
        assert metrics[key] == pytest.approx(value, rel=2e-5, abs=2e-6), key
