"""NaN and ±inf logprobs through the NeMo RL adapter: loss, gradient and every metric finite,
the non-finite tokens counted, no large weight (docs/flags.md, "Bad input").

Seeded batches (``random.Random``, reproducible) put NaN, +inf and −inf into
``generation_logprobs`` and ``prev_logprobs`` on valid tokens and on padding, and into the
current logprobs on padding (a NaN current logprob on a valid token is a broken forward pass
and stays visible), with empty samples and ``sample_mask`` zeros, run through NeMo RL's
``BatchedDataDict`` and microbatch loop for the shared presets and NeMo RL's own IS keys.

The extreme values the issue named are measured against NeMo RL's own ``ClippedPGLossFn``: a
−inf engine logprob (NeMo RL's gen-based metrics NaN/inf, ours finite) and a finite log-ratio
of 25 under plain IS (NeMo RL's own weight e^25 through the wrapper; e^20 in shared flags).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from rollout_parity.check.shared_batch import all_config_names, config_for
from integration_tests.support.nemo_anchor import ANCHORS, VERSIONS, skip_unless_available
from integration_tests.support.nemo_harness import aggregate, finite_or_sentinel, load, nemo_data, train_step
from rollout_parity.adapters.nemo_rl import RolloutParityLossFn, correction_from_nemo_rl

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
        yield name, lambda: RolloutParityLossFn(config_for(name), {"reference_policy_kl_penalty": 0.0})
    for name, keys in NEMO_KEYS.items():  # NeMo RL's own IS acting inside, our diagnostics beside
        yield name, (lambda keys=keys: RolloutParityLossFn.from_nemo_config(
            dict(reference_policy_kl_penalty=0.0, rollout_correction={"log_rollout_offpolicy_metrics": True},
                 **keys)))


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


# ----------------------------------------------------------------- the extreme values, measured against NeMo RL


def small_batch(ns, gen_at_0_2):
    """Two samples of six tokens, the engine's logprob of token (0, 2) set to ``gen_at_0_2(old)``."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 6, generator=g) * 2 - 0.1
    gen = old + 0.05 * torch.randn(2, 6, generator=g)
    cur = (old + 0.02 * torch.randn(2, 6, generator=g)).requires_grad_(True)
    gen[0, 2] = gen_at_0_2(old[0, 2])
    return nemo_data(ns, old, gen, cur, torch.ones(2, 6), torch.tensor([1.0, -0.5])), cur


def measure(ns, loss_fn, gen_at_0_2):
    data, cur = small_batch(ns, gen_at_0_2)
    total, mb_metrics = train_step(ns, loss_fn, data, 2)
    return total, cur.grad, aggregate(mb_metrics)


GEN_METRICS = ("gen_kl_error", "token_mult_prob_error", "policy_kl_error", "js_divergence_error", "approx_entropy")


@pytest.mark.parametrize("nemo_is", [False, True])
def test_minus_inf_engine_logprob_nemos_metrics_go_nan_ours_stay_finite(nemo, nemo_is):
    """NeMo RL's own gen_kl_error is NaN and token_mult_prob_error, policy_kl_error,
    js_divergence_error, approx_entropy are inf on a batch with one −inf engine logprob. Through
    the wrapper the same keys are finite (NeMo RL's values with the engine agreeing on that
    token), and the loss and gradient stay NeMo RL's own."""
    keys = dict(reference_policy_kl_penalty=0.0, use_importance_sampling_correction=nemo_is)
    minus_inf = lambda old: float("-inf")  # noqa: E731
    their_loss, their_grad, theirs = measure(nemo, nemo.ClippedPGLossFn(nemo.ClippedPGLossConfig(**keys)), minus_inf)
    our_loss, our_grad, ours = measure(nemo, RolloutParityLossFn.from_nemo_config(
        {**keys, "rollout_correction": {"log_rollout_offpolicy_metrics": True}}), minus_inf)
    _, _, agreed = measure(nemo, nemo.ClippedPGLossFn(nemo.ClippedPGLossConfig(**keys)), lambda old: old)
    assert math.isnan(theirs["gen_kl_error"])
    assert all(theirs[k] == math.inf for k in GEN_METRICS[1:])
    for key in GEN_METRICS:
        assert math.isfinite(ours[key]) and ours[key] == pytest.approx(agreed[key], rel=1e-6), key
    assert our_loss == their_loss and torch.equal(our_grad, their_grad)
    assert ours["rollout_correction/nonfinite_frac"] == pytest.approx(1 / 12)


def test_plain_is_at_log_ratio_25_is_nemos_own_weight_e25_or_the_shared_cap_e20(nemo):
    """A finite log-ratio of 25 (π_old/π_rollout = e^25) under plain IS. NeMo RL's own IS
    (``use_importance_sampling_correction: true``, no type) acting inside the wrapper gives NeMo
    RL's numbers exactly: weight e^25 ≈ 7.2e10. The same setting in shared flags
    (``correction_from_nemo_rl``: ``token_truncate`` at C = e^20) caps it at e^20 ≈ 4.9e8: the
    core clamps every log-ratio to ±20 before exp (as verl's SAFETY_BOUND), so the loss is e^5 ≈
    148x smaller on that token. Both are degenerate weights; docs/nemo_rl_nonfinite.md says why the cap
    stays."""
    keys = dict(reference_policy_kl_penalty=0.0, use_importance_sampling_correction=True)
    at_25 = lambda old: old - 25.0  # noqa: E731
    their_loss, their_grad, theirs = measure(nemo, nemo.ClippedPGLossFn(nemo.ClippedPGLossConfig(**keys)), at_25)
    wrapped_loss, wrapped_grad, _ = measure(nemo, RolloutParityLossFn.from_nemo_config({**keys, "rollout_correction": {}}),
                                            at_25)
    assert wrapped_loss == their_loss and torch.equal(wrapped_grad, their_grad)
    shared = RolloutParityLossFn.from_nemo_config({"reference_policy_kl_penalty": 0.0,
                                                   "rollout_correction": correction_from_nemo_rl(keys).to_dict()})
    shared_loss, shared_grad, _ = measure(nemo, shared, at_25)
    assert float(shared.last_correction.weights.max()) == pytest.approx(math.exp(20), rel=1e-6)
    # The token's share of NeMo RL's loss is e^5 times ours; the rest is the same.
    assert their_grad[0, 2] / shared_grad[0, 2] == pytest.approx(math.exp(5), rel=1e-4)
    others = torch.ones_like(their_grad, dtype=torch.bool)
    others[0, 2] = False
    torch.testing.assert_close(shared_grad[others], their_grad[others], rtol=1e-5, atol=1e-7)
    assert abs(their_loss) > 1e9 and abs(shared_loss) < abs(their_loss) / 100
