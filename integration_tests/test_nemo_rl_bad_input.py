"""NaN and ±inf logprobs through the NeMo RL adapter: loss, gradient and every metric finite,
the non-finite tokens counted, no large weight (DESIGN.md, "Bad input").

Seeded batches (``random.Random``, reproducible) put NaN, +inf and −inf into
``generation_logprobs`` and ``prev_logprobs`` on valid tokens and on padding, and into the
current logprobs on padding (a NaN current logprob on a valid token is a broken forward pass
and stays visible), with empty samples and ``sample_mask`` zeros, run through NeMo RL's
``BatchedDataDict`` and microbatch loop for the shared presets and NeMo RL's own IS keys.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from rollout_parity.check.shared_batch import all_config_names, config_for
from integration_tests.support.nemo_anchor import ANCHORS, VERSIONS, skip_unless_available
from integration_tests.support.nemo_harness import aggregate, finite_or_sentinel, load, nemo_data, train_step
from rollout_parity.adapters.nemo_rl import RolloutParityLossFn

pytestmark = [pytest.mark.nemo_rl]

NEMO_KEYS = {
    "nemo_plain_is": dict(use_importance_sampling_correction=True),
    "nemo_tis_floor": dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                           truncated_importance_sampling_ratio=1.5, truncated_importance_sampling_ratio_min=0.5),
    "nemo_icepop_seq_level": dict(use_importance_sampling_correction=True,
                                  truncated_importance_sampling_type="icepop",
                                  truncated_importance_sampling_ratio=2.0,
                                  truncated_importance_sampling_ratio_min=0.5,
                                  token_level_loss=False, ratio_clip_c=3.0),
    "nemo_seq_mask_tis": dict(use_importance_sampling_correction=True,
                              truncated_importance_sampling_type="seq-mask-tis",
                              truncated_importance_sampling_ratio=1.5,
                              truncated_importance_sampling_ratio_min=0.5),
}
BAD = (float("nan"), float("inf"), float("-inf"))


@pytest.fixture(scope="module", params=VERSIONS)
def nemo(request):
    skip_unless_available()
    with ANCHORS.activate(request.param) as ns:
        yield load(ns)


def bad_batch(seed: int, B: int = 6, T: int = 10):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lengths = [rng.choice([0, 1, 3, T, rng.randint(1, T)]) for _ in range(B)]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths])
    old = -torch.rand(B, T, generator=g) * 3 - 0.01
    gen = old + torch.randn(B, T, generator=g) * 0.3
    cur = old + torch.randn(B, T, generator=g) * 0.1
    valid = [(i, t) for i in range(B) for t in range(lengths[i])]
    for i, t in rng.sample(valid, min(len(valid), rng.randint(2, 5))):
        target = rng.choice([gen, gen, old])  # mostly the engine's, sometimes π_old
        target[i, t] = rng.choice(BAD)
    for i in range(B):  # padding: anything goes, on every side
        for t in range(lengths[i], T):
            if rng.random() < 0.5:
                for x in (old, gen, cur):
                    x[i, t] = rng.choice(BAD)
    sample_mask = torch.tensor([0.0 if rng.random() < 0.2 else 1.0 for _ in range(B)])
    adv = torch.tensor([rng.uniform(-1.5, 1.5) for _ in range(B)])
    return old, gen, cur.requires_grad_(True), mask, adv, sample_mask


def loss_fns():
    for name in all_config_names():
        yield name, lambda: RolloutParityLossFn(config_for(name))
    for name, keys in NEMO_KEYS.items():
        yield name, (lambda keys=keys: RolloutParityLossFn.from_nemo_config(
            dict(reference_policy_kl_penalty=0.0, **keys)))


@pytest.mark.parametrize("seed", range(6))
def test_nonfinite_logprobs_give_finite_counted_results(nemo, seed):
    old, gen, cur, mask, adv, sample_mask = bad_batch(seed)
    valid = (mask * sample_mask[:, None]) > 0
    expected_bad = int((valid & ~(torch.isfinite(old) & torch.isfinite(gen))).sum())
    gvt = float(valid.sum())
    for name, make in loss_fns():
        for mbs in (2, 6):
            current = cur.detach().clone().requires_grad_(True)
            data = nemo_data(nemo, old, gen, current, mask, adv, sample_mask=sample_mask)
            loss_fn = make()
            total, mb_metrics = train_step(nemo, loss_fn, data, mbs)
            assert math.isfinite(total), (name, mbs)
            assert current.grad is None or bool(torch.isfinite(current.grad).all()), (name, mbs)
            for metrics in mb_metrics:
                assert finite_or_sentinel(metrics) == [], (name, mbs, finite_or_sentinel(metrics))
            if not mb_metrics:
                continue
            agg = aggregate(mb_metrics)
            assert all(math.isfinite(v) for v in agg.values()), (name, mbs)
            assert agg["rollout_correction/nonfinite_frac"] * gvt == pytest.approx(expected_bad, abs=1e-4), \
                (name, mbs)
            weights = loss_fn.last_correction.weights
            assert bool(torch.isfinite(weights).all()) and float(weights.max()) < 1e3, (name, mbs)
