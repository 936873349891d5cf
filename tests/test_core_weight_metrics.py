"""The IS weights' distribution and one policy's perplexity (core/metrics.py), against naive per-row readings.

verl logs them under its own names (``rollout_corr/rollout_is_*``, ``training_ppl``; the verl adapter's tests check
them against verl's own functions); here each option of the core functions is pinned against a plain reading.
"""

from __future__ import annotations

import math

import torch

from rollout_parity.core.metrics import PREFIX, perplexity_metrics, weight_distribution_metrics


def _batch():
    g = torch.Generator().manual_seed(11)
    log_ratio = torch.randn(5, 7, generator=g, dtype=torch.float64) * 0.6
    mask = torch.ones(5, 7, dtype=torch.float64)
    mask[1, 4:] = 0
    mask[3] = 0  # an empty row
    return log_ratio * mask, mask


def test_the_lower_bound_decides_the_share_below_it():
    lr, mask = _batch()
    w = lr.exp().clamp(max=2.0) * mask
    raw = lr.exp()
    valid = mask.bool()
    default = weight_distribution_metrics(w, lr, mask, upper=2.0)  # lower: 1 / upper
    given = weight_distribution_metrics(w, lr, mask, upper=2.0, lower=0.8)
    assert default[PREFIX + "is_ratio_fraction_low"] == float((raw[valid] < 0.5).double().mean())
    assert given[PREFIX + "is_ratio_fraction_low"] == float((raw[valid] < 0.8).double().mean())
    assert given[PREFIX + "is_ratio_fraction_low"] > default[PREFIX + "is_ratio_fraction_low"]


def test_a_sequence_log_ratio_judges_the_bounds_per_row():
    lr, mask = _batch()
    seq = (lr.sum(-1) / mask.sum(-1).clamp_min(1))  # a geometric-mean sequence ratio
    w = seq.exp().clamp(max=1.1).unsqueeze(-1) * mask
    out = weight_distribution_metrics(w, lr, mask, upper=1.1, lower=0.9, sequence_log_ratio=seq)
    live = seq[mask.sum(-1) > 0]
    assert out[PREFIX + "is_ratio_fraction_high"] == float((live > math.log(1.1)).double().mean())
    assert out[PREFIX + "is_ratio_fraction_low"] == float((live < math.log(0.9)).double().mean())
    assert math.isclose(out[PREFIX + "is_seq_ratio_max"], float(live.max().exp()))
    assert PREFIX + "is_seq_ratio_max" not in weight_distribution_metrics(w, lr, mask, upper=1.1)


def test_mean_and_ess_of_weights_from_elsewhere():
    lr, mask = _batch()
    w = lr.exp().clamp(max=2.0) * mask
    out = weight_distribution_metrics(w, lr, mask, upper=2.0, with_mean_and_ess=True)
    vals = w[mask.bool()]
    assert math.isclose(out[PREFIX + "is_weight_mean"], float(vals.mean()))
    assert math.isclose(out[PREFIX + "ess"], float(vals.sum() ** 2 / (vals.numel() * vals.square().sum())))
    assert PREFIX + "ess" not in weight_distribution_metrics(w, lr, mask, upper=2.0)


def test_perplexity_of_one_policy_under_the_name_given():
    lr, mask = _batch()
    logprobs = -lr.abs() - 0.5
    logprobs[0, 2] = -math.inf  # a non-finite token is left out of its row's mean
    use = mask.bool() & torch.isfinite(logprobs)
    rows = [-(logprobs[i][use[i]]).mean() for i in range(5) if use[i].any()]
    out = perplexity_metrics(logprobs, mask, name="rollout")
    assert set(out) == {PREFIX + "rollout_ppl", PREFIX + "rollout_log_ppl"}
    assert math.isclose(out[PREFIX + "rollout_log_ppl"], float(torch.stack(rows).mean()))
    assert math.isclose(out[PREFIX + "rollout_ppl"], float(torch.stack(rows).exp().mean()))
    assert set(perplexity_metrics(logprobs, mask)) == {PREFIX + "training_ppl", PREFIX + "training_log_ppl"}
