"""NeMo RL's own importance-sampling settings carried out by our correction, against NeMo RL's own ``ClippedPGLossFn``
(both anchors): GSPO's sequence weight, ``is_oob_ratio`` and its normalisation, a single-point truncation range, and
``metric_normalizations`` with our flags off (exactly NeMo RL's).

``RolloutParityLossFn.from_nemo_is_config(cfg)`` is what a NeMo RL user gets by switching a ``loss_fn`` to our flags
(``correction_from_nemo_rl``): NeMo RL's truncation keys leave its loss and our weight goes in through ``advantages``.
Everything is run microbatched through NeMo RL's own ``BatchedDataDict`` and global counts (``nemo_harness``).
"""

from __future__ import annotations

import math

import pytest
import torch

from integration_tests.support.nemo_anchor import ANCHORS, VERSIONS, skip_unless_available
from integration_tests.support.nemo_harness import aggregate, load, nemo_data, train_step
from rollout_parity.adapters.nemo_rl import RolloutParityLossFn, correction_from_nemo_rl
from rollout_parity.core.config import CorrectionConfig

pytestmark = [pytest.mark.nemo_rl]

IS = dict(use_importance_sampling_correction=True)
GSPO = dict(IS, sequence_level_importance_ratios=True, token_level_loss=False)


def tis(ratio, ratio_min=None, **more):
    return dict(IS, truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=ratio,
                truncated_importance_sampling_ratio_min=ratio_min, **more)


def icepop(ratio, ratio_min, **more):
    return dict(IS, truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=ratio,
                truncated_importance_sampling_ratio_min=ratio_min, **more)


def seq_mask_tis(ratio, ratio_min, **more):
    return dict(IS, truncated_importance_sampling_type="seq-mask-tis", truncated_importance_sampling_ratio=ratio,
                truncated_importance_sampling_ratio_min=ratio_min, **more)


GSPO_CONFIGS = {
    "gspo_plain": GSPO,
    "gspo_tis_floor": tis(2.0, 0.5, **GSPO),
    "gspo_tis_0.8": tis(0.8, **GSPO),
    "gspo_icepop": icepop(2.0, 0.5, **GSPO),
    "gspo_icepop_dual_clip_kl": icepop(1.5, 0.7, **GSPO, ratio_clip_c=3.0, reference_policy_kl_penalty=0.01),
}
OOB_CONFIGS = {
    "tis": tis(1.1),
    "tis_floor": tis(1.1, 0.9),
    "icepop": icepop(1.1, 0.9),
    "seq_mask_tis": seq_mask_tis(1.05, 0.95),
    "seq_mask_tis_seq_loss": seq_mask_tis(1.05, 0.95, token_level_loss=False),
    "tis_seq_loss": tis(1.1, 0.9, token_level_loss=False),
    **{k: v for k, v in GSPO_CONFIGS.items() if k != "gspo_plain"},
}
SINGLE_POINT = {
    "tis_1.2_1.2": tis(1.2, 1.2),
    "tis_1_1_gspo": tis(1.0, 1.0, **GSPO),
    "icepop_1_1": icepop(1.0, 1.0),
    "seq_mask_tis_1_1": seq_mask_tis(1.0, 1.0),
}


@pytest.fixture(scope="module", params=VERSIONS)
def nemo(request):
    skip_unless_available()
    with ANCHORS.activate(request.param) as ns:
        yield load(ns)


def batch(ns, seed=0, B=6, T=8):
    """Random logprobs with padding, one sample off by ``sample_mask``, and two rows (and a few tokens) where the
    engine agreed exactly with π_old (weight exactly 1: what a single-point range at 1 keeps)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 2 - 0.05
    gen = old + torch.randn(B, T, generator=g) * 0.4
    gen[0] = old[0]
    gen[3] = old[3]
    gen[1, :2] = old[1, :2]
    current = (old + torch.randn(B, T, generator=g) * 0.05).detach()
    lengths = [T, 5, T, 3, 7, T]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths])
    sample_mask = torch.ones(B)
    sample_mask[4] = 0.0
    advantages = torch.randn(B, generator=g)
    return lambda: nemo_data(ns, old, gen, current.clone().requires_grad_(), mask, advantages, sample_mask)


def run(ns, loss_fn, make, microbatch=2):
    data = make()
    total, mb = train_step(ns, loss_fn, data, microbatch)
    return total, data["next_token_logprobs"].grad, aggregate(mb)


def theirs_and_ours(ns, cfg, seed=0, microbatch=2):
    make = batch(ns, seed)
    theirs = run(ns, ns.ClippedPGLossFn(ns.ClippedPGLossConfig(**cfg)), make, microbatch)
    ours = run(ns, RolloutParityLossFn.from_nemo_is_config(cfg), make, microbatch)
    return theirs, ours


def assert_same(theirs, ours, own_truncation_metric=True):
    (loss_t, grad_t, m_t), (loss_o, grad_o, m_o) = theirs, ours
    assert loss_o == pytest.approx(loss_t, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad_o, grad_t, rtol=1e-5, atol=1e-7)
    for key, value in m_t.items():
        # NeMo RL's sampling_importance_ratio is its weight after ITS truncation, which is off while ours acts
        # (docs/nemo_rl_metrics.md): ours logs the raw ratio there.
        if key == "sampling_importance_ratio" and own_truncation_metric:
            continue
        assert m_o[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


# ----------------------------------------------------------------------------- 1. GSPO with importance sampling


def test_gspo_maps_to_one_weight_per_sequence():
    """NeMo RL: w_i = exp(Σ_t (log π_old − log π_rollout)) over the valid tokens, clamped (tis) or zeroed
    (icepop) per sequence: our sequence modes with the product reduction, the sequence's weight on its tokens."""
    assert correction_from_nemo_rl(GSPO) == CorrectionConfig(
        rollout_importance_sampling_mode="sequence_truncate", rollout_importance_sampling_threshold=math.exp(20.0),
        rollout_importance_sampling_sequence_reduction="product",
        rollout_importance_sampling_sequence_mask_weight="sequence")
    flags = correction_from_nemo_rl(GSPO_CONFIGS["gspo_tis_floor"])
    assert (flags.rollout_importance_sampling_mode, flags.rollout_importance_sampling_threshold,
            flags.rollout_importance_sampling_threshold_lower,
            flags.rollout_importance_sampling_sequence_reduction) == ("sequence_truncate", 2.0, 0.5, "product")
    flags = correction_from_nemo_rl(GSPO_CONFIGS["gspo_icepop"])
    assert (flags.rollout_importance_sampling_mode, flags.rollout_importance_sampling_sequence_reduction,
            flags.rollout_importance_sampling_sequence_mask_weight) == ("sequence_mask", "product", "sequence")
    # Token-level settings are unchanged by the fix.
    assert correction_from_nemo_rl(tis(2.0)).rollout_importance_sampling_mode == "token_truncate"


@pytest.mark.parametrize("name", list(GSPO_CONFIGS))
@pytest.mark.parametrize("microbatch", [1, 3])
def test_gspo_importance_sampling_equals_nemo_rl(nemo, name, microbatch):
    theirs, ours = theirs_and_ours(nemo, GSPO_CONFIGS[name], seed=5, microbatch=microbatch)
    assert_same(theirs, ours, own_truncation_metric=name != "gspo_plain")


def test_gspo_with_seq_mask_tis_refused_as_nemo_rl_refuses(nemo):
    cfg = seq_mask_tis(1.5, 0.5, **GSPO)
    with pytest.raises(AssertionError, match="incompatible with sequence_level_importance_ratios"):
        nemo.ClippedPGLossFn(nemo.ClippedPGLossConfig(**cfg))
    with pytest.raises(ValueError, match="sequence_level_importance_ratios"):
        correction_from_nemo_rl(cfg)
    with pytest.raises(AssertionError, match="incompatible with sequence_level_importance_ratios"):
        RolloutParityLossFn.from_nemo_is_config(cfg)  # NeMo RL's own check, its own message


# ----------------------------------------------------------------------------- 2. flags off: NeMo RL's table


@pytest.mark.parametrize("cfg", [{}, tis(2.0), seq_mask_tis(1.5, 0.7), dict(GSPO), icepop(2.0, 0.5)])
def test_flags_off_metric_normalizations_are_nemo_rls(nemo, cfg):
    if nemo.MetricNormalizer is None:
        pytest.skip(f"NeMo RL {nemo.version} has no metric_normalizations (main only)")
    theirs = nemo.ClippedPGLossFn(nemo.ClippedPGLossConfig(**cfg))
    ours = RolloutParityLossFn(None, cfg)
    assert ours.metric_normalizations == theirs.metric_normalizations
    assert ours.metric_normalizations is ours.nemo_loss_fn.metric_normalizations  # NeMo RL's own object


@pytest.mark.parametrize("correction", [None, "ours_tis", "ours_seq_mask_tis", "ours_gspo", "preset"])
def test_every_advertised_metric_is_returned(nemo, correction):
    """main's split step rescales every key of ``metric_normalizations`` (NeMo RL's own
    test_split_rescale_matches_sync_normalization indexes them): none may be missing from the returned metrics."""
    if nemo.MetricNormalizer is None:
        pytest.skip(f"NeMo RL {nemo.version} has no metric_normalizations (main only)")
    cfg = {"ours_tis": tis(1.1), "ours_seq_mask_tis": seq_mask_tis(1.05, 0.95),
           "ours_gspo": GSPO_CONFIGS["gspo_tis_floor"]}.get(correction, {})
    if correction == "preset":
        loss_fn = RolloutParityLossFn(CorrectionConfig.preset("tis_srs_k3"), {})
    elif correction is None:
        loss_fn = RolloutParityLossFn(None, {})
    else:
        loss_fn = RolloutParityLossFn.from_nemo_is_config(cfg)
    _, _, metrics = run(nemo, loss_fn, batch(nemo))
    assert set(loss_fn.metric_normalizations) <= set(metrics)


# ----------------------------------------------------------------------------- 3. is_oob_ratio, single-point ranges


@pytest.mark.parametrize("name", list(OOB_CONFIGS))
@pytest.mark.parametrize("microbatch", [1, 3])
def test_is_oob_ratio_equals_nemo_rls(nemo, name, microbatch):
    theirs, ours = theirs_and_ours(nemo, OOB_CONFIGS[name], seed=5, microbatch=microbatch)
    assert 0.0 < theirs[2]["is_oob_ratio"] < 1.0  # the bounds bite on this batch, and not everywhere
    assert_same(theirs, ours)
    if nemo.MetricNormalizer is not None:  # main: the same normaliser as NeMo RL's own entry
        cfg = OOB_CONFIGS[name]
        own = nemo.ClippedPGLossFn(nemo.ClippedPGLossConfig(**cfg)).metric_normalizations["is_oob_ratio"]
        assert RolloutParityLossFn.from_nemo_is_config(cfg).metric_normalizations["is_oob_ratio"] is own


@pytest.mark.parametrize("name", list(SINGLE_POINT))
def test_single_point_range_equals_nemo_rls(nemo, name):
    """NeMo RL allows ``ratio_min == ratio``: tis then weighs every token by ``ratio``, icepop and seq-mask-tis keep
    only weights of exactly ``ratio``. Ours: lower bound the float just below ``ratio`` (the same in float32)."""
    cfg = SINGLE_POINT[name]
    flags = correction_from_nemo_rl(cfg)
    assert flags.rollout_importance_sampling_threshold_lower == math.nextafter(
        cfg["truncated_importance_sampling_ratio"], 0.0)
    theirs, ours = theirs_and_ours(nemo, cfg, seed=2)
    assert_same(theirs, ours)


def test_ratio_min_above_ratio_refused_with_nemo_rls_own_assertion(nemo):
    cfg = tis(1.0, 2.0)
    with pytest.raises(AssertionError, match="truncated_importance_sampling_ratio_min must be <="):
        RolloutParityLossFn.from_nemo_is_config(cfg)
    with pytest.raises(ValueError, match="must be <="):
        correction_from_nemo_rl(cfg)


def test_from_nemo_is_config_takes_a_plain_nemo_block_only(nemo):
    with pytest.raises(ValueError, match="from_nemo_config"):
        RolloutParityLossFn.from_nemo_is_config({"rollout_correction": {}, **tis(2.0)})
    loss_fn = RolloutParityLossFn.from_nemo_is_config(nemo.ClippedPGLossConfig(**tis(2.0, 0.5)))
    assert loss_fn.truncated_importance_sampling_type is None  # NeMo RL's truncation left its loss: ours acts
    assert loss_fn.use_importance_sampling_correction is False
    assert loss_fn.correction == correction_from_nemo_rl(tis(2.0, 0.5))
    plain = RolloutParityLossFn.from_nemo_is_config({"ratio_clip_max": 0.28})
    assert plain.correction == CorrectionConfig() and plain.ratio_clip_max == 0.28


def test_from_nemo_is_config_metrics_local_gives_each_microbatchs_own_means(nemo):
    """``metrics="local"``: our diagnostics as each microbatch's own means; the default ``"nemo"`` pre-divides them
    by NeMo RL's global counts, so that NeMo RL's sum over the microbatches is the batch's mean."""
    cfg = tis(1.1)
    make = batch(nemo, 3)
    _, _, shares = run(nemo, RolloutParityLossFn.from_nemo_is_config(cfg), make, microbatch=2)
    _, _, local = run(nemo, RolloutParityLossFn.from_nemo_is_config(cfg, metrics="local"), make, microbatch=2)
    key = "rollout_correction/is_weight_mean"
    assert 0.5 < shares[key] < 1.5  # the batch's mean weight (summed shares)
    assert local[key] > 1.5 * shares[key]  # summed microbatch means: one per microbatch, not a share of one mean
