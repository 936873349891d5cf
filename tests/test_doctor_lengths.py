"""The doctor's length model (``rollout_parity/doctor/lengths.py``) on synthetic parity data.

* the block bootstrap concatenates whole measured completions, and at the measured length the
  statistics equal what ``compute_correction`` rejects;
* a sum's predicted share at a long length matches a direct simulation of long answers drawn from
  the same per-token law;
* the advice: dense mismatch or an unknown length moves a sum to ``seq_mean``; sparse mismatch at a
  stated length keeps the sum, fitted to it; a preset that fits is left alone; K1 is not touched.
"""

from __future__ import annotations

import pytest
import torch

from rollout_parity import CorrectionConfig, compute_correction
from rollout_parity.doctor.lengths import BUDGET, DENSE_SHARE, GRID, dropped_share, fit_rejection, resample, statistic


def _dense(b=192, m=32, sigma=5.5e-3, seed=0):
    """Every token mismatches a little (per-token K3 ~ sigma^2 / 2 = 1.5e-5, the doctor's row d)."""
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, m, generator=g)
    return rollout + torch.randn(b, m, generator=g) * sigma, rollout, torch.ones(b, m)


def _sparse(b=192, m=32, share=2e-4, size=0.05, seed=1):
    """Most tokens bit-identical, a rare one off by ``size`` (the paper's regime)."""
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, m, generator=g)
    old = rollout.clone()
    hit = torch.rand(b, m, generator=g) < share
    old[hit] += size
    return old, rollout, torch.ones(b, m)


def test_resample_concatenates_whole_completions_and_equals_the_core_at_the_measured_length():
    old, rollout, mask = _dense(b=6, m=5)
    mask[2, 3:] = 0  # one shorter completion: the general path
    o, r, mk = resample((old, rollout, mask), 12, draws=50)
    assert o.shape == r.shape == mk.shape == (50, 12) and bool((mk == 1).all())
    valid_pairs = {(float(a), float(b)) for a, b in zip(old[mask != 0], rollout[mask != 0])}
    assert {(float(a), float(b)) for a, b in zip(o.reshape(-1), r.reshape(-1))} <= valid_pairs
    # the first completion of each pseudo-answer is a whole measured one, from its first token
    starts = {(float(old[i, 0]), float(rollout[i, 0])) for i in range(6)}
    assert all((float(o[d, 0]), float(r[d, 0])) in starts for d in range(50))
    # statistics on the measured rows are what compute_correction rejects
    data = _dense()
    for option in ("seq_sum_k3", "seq_mean_k3", "seq_max_k2"):
        tau = float(statistic(option, data).quantile(0.7))
        cfg = CorrectionConfig(rollout_rejection=[option], rollout_rejection_threshold=tau)
        share = float((statistic(option, data) > tau).double().mean())
        out = compute_correction(cfg, old_logprobs=data[0], rollout_logprobs=data[1], response_mask=data[2],
                                 with_metrics=True)
        assert share == pytest.approx(out.metrics["rollout_correction/rejected_seq_frac"])
        assert dropped_share(cfg, data) == pytest.approx(share)
        assert 0.05 < share < 0.95  # a threshold that splits the rows: the comparison means something


def test_predicted_sum_share_at_a_long_length_matches_long_answers_of_the_same_law():
    short = _dense(b=256, m=32)
    long = _dense(b=400, m=1024, seed=7)  # the truth: answers of 1024 tokens, same per-token law
    truth = statistic("seq_sum_k3", long)
    predicted = statistic("seq_sum_k3", resample(short, 1024))
    for tau in (0.014, 0.016, 0.018):
        p, t = float((predicted > tau).double().mean()), float((truth > tau).double().mean())
        assert abs(p - t) < 0.1, (tau, p, t)
    # and 32-token answers say nothing of it: the preset's 0.001 passes most short ones, drops every long one
    assert float((statistic("seq_sum_k3", short) > 0.001).double().mean()) < 0.3
    assert float((truth > 0.001).double().mean()) == 1.0


def test_dense_mismatch_moves_a_sum_to_the_mean_at_any_length():
    cfg = CorrectionConfig.preset("tis_srs_k3")
    rows = {"d": _dense(), "s/sampler": _dense(seed=3)}
    for length in (None, 1024, 8192):
        advice = fit_rejection(cfg, rows, 32, length)
        assert advice["option"] == "seq_mean_k3" and advice["threshold"] in GRID
        assert all(s <= BUDGET for per in advice["shares"].values() for s in per.values())
        assert sorted(advice["shares"]["d"]) == sorted(advice["checked_at"])
        if length is None:
            assert advice["checked_at"] == [32, 1024, 8192] and "give --response_length" in advice["reason"]
        else:
            assert "dense mismatch" in advice["reason"] and f"{length:,}-token" in advice["reason"]
    # the mean it picked also holds on long answers drawn directly
    tau = fit_rejection(cfg, rows, 32, None)["threshold"]
    assert float((statistic("seq_mean_k3", _dense(b=200, m=1024, seed=9)) > tau).double().mean()) <= BUDGET


def test_sparse_mismatch_keeps_a_sum_fitted_to_the_stated_length():
    cfg = CorrectionConfig.preset("tis_srs_k3")
    rows = {"d": _sparse()}
    advice = fit_rejection(cfg, rows, 32, 1024)
    assert advice["option"] == "seq_sum_k3"
    assert advice["threshold"] >= 0.001
    at = resample(rows["d"], 1024)
    assert float((statistic("seq_sum_k3", at) > advice["threshold"]).double().mean()) <= BUDGET
    assert float(statistic("seq_sum_k3", at).median()) < DENSE_SHARE * advice["threshold"]
    # the preset already fits these rows (fewer than 5% of answers hold a mismatched token): left as it is
    if advice["threshold"] == 0.001:
        assert advice["reason"] is None
    else:
        assert "set for answers of up to 1,024 tokens" in advice["reason"]


def test_a_preset_that_fits_is_not_tightened_and_k1_is_left_alone():
    rows = {"d": _dense()}
    loose = CorrectionConfig(rollout_rejection=["seq_mean_k3"], rollout_rejection_threshold=0.5)
    advice = fit_rejection(loose, rows, 32, 4096)
    assert advice["option"] == "seq_mean_k3" and advice["threshold"] == 0.5 and advice["reason"] is None
    k1 = CorrectionConfig(rollout_rejection=["seq_mean_k1"], rollout_rejection_threshold="0.5_2.0")
    assert fit_rejection(k1, rows, 32, 4096)["option"] is None
    token = CorrectionConfig(rollout_rejection=["token_k3"], rollout_rejection_threshold=1e-7)
    advice = fit_rejection(token, rows, 32, None)
    assert advice["option"] == "token_k3" and advice["threshold"] > 1e-7  # loosened to the token budget
    assert max(advice["shares"]["d"].values()) <= BUDGET
    seq_max = CorrectionConfig(rollout_rejection=["seq_max_k3"], rollout_rejection_threshold=1e-5)
    assert fit_rejection(seq_max, rows, 32, None)["option"] == "token_k3"  # a max needs the length too


def test_grouped_resampling_keeps_the_between_prompt_spread_and_only_that():
    """Prompts that differ in mismatch level: pseudo-answers keep it (a grouped draw), but not the noise of
    each group's own mean estimated from a few completions (drawing only inside the group would)."""
    from rollout_parity.doctor.lengths import _within_group_share

    g = torch.Generator().manual_seed(4)
    groups, size, m = 24, 8, 32
    level = torch.where(torch.arange(groups) % 2 == 0, 3e-3, 8e-3).repeat_interleave(size)[:, None]  # two kinds
    rollout = -torch.rand(groups * size, m, generator=g)
    old = rollout + torch.randn(groups * size, m, generator=g) * level
    data = (old, rollout, torch.ones_like(old))
    q = _within_group_share(data, size)
    assert 0.7 < q <= 1.0  # most of the spread of group means is real
    homogeneous = (rollout + torch.randn(groups * size, m, generator=g) * 5e-3, rollout, torch.ones_like(old))
    assert _within_group_share(homogeneous, size) < 0.5  # only estimation noise: mostly free draws
    assert _within_group_share(data, 1) == 0.0
    # long answers of this law: a prompt's level holds through the answer. The grouped prediction follows
    # the truth's spread; free draws from all completions would average the two kinds away
    truth_level = torch.where(torch.rand(400, 1, generator=g) < 0.5, 3e-3, 8e-3)
    truth_roll = -torch.rand(400, 1024, generator=g)
    truth = statistic("seq_sum_k3", (truth_roll + torch.randn(400, 1024, generator=g) * truth_level, truth_roll,
                                     torch.ones(400, 1024)))
    grouped = statistic("seq_sum_k3", resample(data, 1024, group=size))
    free = statistic("seq_sum_k3", resample(data, 1024))
    tau = float(truth.quantile(0.9))
    t, p, f = (float((x > tau).double().mean()) for x in (truth, grouped, free))
    assert abs(p - t) < 0.1 and f < t / 2, (t, p, f)
