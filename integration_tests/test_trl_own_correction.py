"""TRL's own correction tests, with ours in place: a user switching keeps TRL's weights, masks, loss and metrics.

TRL (tests/test_grpo_trainer.py; the newest copy reachable here is its main branch at 1.10.dev, whose
``get_off_policy_mask`` and ratio code are 1.16's but for 1.16's NaN rule) tests its correction with:

* ``test_train_vllm_importance_sampling_correction``: (clip_min, clip_max) in (None, 3.0) (only max, the default),
  (0.5, None) (only min), (0.5, 5.0) (both, IcePop); a training step has a loss and changes every parameter;
* ``test_get_off_policy_mask``: threshold 1.0; a positive advantage with a high drift is kept, a negative one with
  a low drift kept, a negative one with a high drift dropped; ``..._padding``: padding is left out of the mean drift;
* ``test_train_with_off_policy_mask``: threshold 0.5, a training step changes every parameter.

Here that grid runs on each of TRL's four ``vllm_importance_sampling_mode`` values and at off-policy thresholds
None, 0.5, 1.0 and 0 (48 settings), through a real ``GRPOTrainer`` (the tiny local model, its real forward, TRL's
generation and loss code; the sampler is a recorded batch through TRL's ``rollout_func``,
``integration_tests/support/trl_own_grid.py``): once with TRL's own correction, once with the shared flags a user
switching writes (``trl_ratio_as_flags``), on the same inputs. Equal: the weights in TRL's
``importance_sampling_ratio``, TRL's loss mask, its off-policy mask, the loss, every parameter's gradient and every
``sampling/*`` metric. On a batch with a NaN and two -inf from the engine, what differs is exactly the list in
docs/trl_own_correction.md, "What differs on purpose".
"""

from __future__ import annotations

import logging
import math

import pytest

from rollout_parity.testing.stack import need

need("trl", extra="trl")

import torch  # noqa: E402

from integration_tests.support.trl_own_grid import (  # noqa: E402
    TRL_IS_MODES,
    TrlSetting,
    compare,
    recorded_batch,
    run,
    trl_grid,
)
from integration_tests.support.trl_runs import restored_distributed_env  # noqa: E402
from rollout_parity.adapters.trl.config import NO_UPPER_BOUND, ParityGRPOConfig, as_correction_config  # noqa: E402
from rollout_parity.core.config import CorrectionConfig  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.slow]  # 48 settings x 2 batches x 2 runs of a real GRPOTrainer

GRID = trl_grid()
#: (row, token) of the bad batch -> the engine's value: a NaN on a kept row, a -inf on a negative-advantage row
#: drifting 0.8 (TRL's mask keeps it at 0.5: -inf reads as a drift of -3.4e38; ours: neutral, drift 0.6, masked)
#: and a -inf on a positive-advantage row.
BAD = {(0, 2): math.nan, (3, 1): -math.inf, (7, 0): -math.inf}
#: Rows the off-policy mask drops at each threshold (support/trl_own_grid.py's ``_ROWS``: drift = -log r).
DROPPED = {None: set(), 0.0: {2, 3, 6}, 0.5: {3, 6}, 1.0: {6}}
SEQUENCE_ROWS_IN_LOSS = 7  # of 8: row 5 has no token in TRL's loss


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    from rollout_parity.check.trl_batch import pretend_vllm_trainer

    logging.getLogger("rollout_parity").setLevel(logging.ERROR)  # the replaced-ratio warning, once per setting
    with restored_distributed_env():
        trainer = pretend_vllm_trainer(str(tmp_path_factory.mktemp("trl-own")), 8, 10, loss_type="dapo")
    healthy, bad = recorded_batch(trainer), recorded_batch(trainer, bad=BAD)
    cache: dict = {}

    def both(which: str, setting: TrlSetting):
        key = (which, setting)
        if key not in cache:
            batch = healthy if which == "healthy" else bad
            cache[key] = (run(trainer, batch, setting, ours=False), run(trainer, batch, setting, ours=True))
        return cache[key]

    yield trainer, both
    logging.getLogger("rollout_parity").setLevel(logging.NOTSET)


@pytest.mark.parametrize("setting", GRID, ids=[s.name for s in GRID])
def test_trls_setting_through_our_flags_equals_trls_own(grid, setting):
    """Weights, loss mask, off-policy mask, loss, gradient and every sampling/* metric equal TRL's own."""
    _, both = grid
    theirs, ours = both("healthy", setting)
    assert compare(theirs, ours) == [], setting.name
    # TRL's assertions, their meaning: a loss, and a gradient on every parameter (TRL: every parameter changes)
    assert math.isfinite(ours.loss) and all(bool(g.abs().sum() > 0) for g in ours.grads)
    # TRL's off-policy mask cases: positive advantage kept whatever its drift (rows 0, 7), a negative one kept
    # at a low drift (1, 4) and dropped at a high one, the drift a mean over the row's own tokens (padding out)
    keep = ours.off_policy_keep
    dropped = set() if keep is None else set(torch.nonzero(keep == 0).flatten().tolist())
    assert dropped == DROPPED[setting.off_policy]
    # the bounds act on this batch: something is clipped or masked on each side that is set
    lossy = ours.loss_mask
    if setting.clip_max is not None:
        assert (ours.ratio[lossy] == setting.clip_max).any() or (ours.ratio[lossy] == 0).any()
    if setting.clip_min is not None:
        assert (ours.ratio[lossy] == setting.clip_min).any() or (ours.ratio[lossy] == 0).any()


def _differs_on_purpose(setting: TrlSetting) -> set[str]:
    """docs/trl_own_correction.md, "What differs on purpose", on the bad batch (a NaN and two -inf from the engine)."""
    out = {"sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"}  # TRL: inf
    if setting.clip_max is None:  # TRL's weight is inf (a -inf engine logprob, no upper bound): its loss NaN
        out |= {"weights", "loss", "grad", "sampling/importance_sampling_ratio/mean",
                "sampling/importance_sampling_ratio/max"}
    if setting.off_policy == 0.5:  # TRL reads a -inf engine logprob as a drift of -3.4e38 and keeps row 3
        out |= {"off_policy_mask"}
        zeroed = setting.mode == "sequence_mask" or (setting.mode == "token_mask" and setting.clip_min is not None)
        if not zeroed or setting.clip_max is None:  # row 3 carries weight in the loss unless its IS mask zeroes it
            out |= {"loss", "grad"}
    return out


@pytest.mark.parametrize("setting", GRID, ids=[s.name for s in GRID])
def test_bad_engine_logprobs_differ_only_as_documented(grid, setting):
    _, both = grid
    theirs, ours = both("bad", setting)
    assert set(compare(theirs, ours)) == _differs_on_purpose(setting), setting.name
    assert math.isfinite(ours.loss) and all(torch.isfinite(g).all() for g in ours.grads)
    assert theirs.metrics["sampling/sampling_logp_difference/max"] == math.inf
    assert ours.metrics["sampling/sampling_logp_difference/max"] == 20.0  # the clamp of log r
    if setting.clip_max is None:
        assert math.isnan(theirs.loss)
        assert ours.metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(20.0), rel=1e-6)
    if setting.off_policy == 0.5:
        assert theirs.off_policy_keep[3] == 1 and ours.off_policy_keep[3] == 0


@pytest.mark.parametrize("mode", [m for m in TRL_IS_MODES if m.startswith("sequence")])
def test_sequence_ratio_metrics_count_a_completion_without_loss_tokens(grid, mode):
    """TRL's sampling/importance_sampling_ratio/* of a sequence mode read all its (B, 1) ratios, a completion with
    no loss token among them at exp(0) = 1 (clamped or masked); ours used to leave that completion out."""
    _, both = grid
    setting = TrlSetting(mode, None, 3.0, None)
    theirs, ours = both("healthy", setting)
    assert not ours.loss_mask[5].any()
    key = "sampling/importance_sampling_ratio/mean"
    assert ours.metrics[key] == pytest.approx(theirs.metrics[key], abs=1e-7)
    rows = torch.tensor([r for r in range(8) if r != 5])
    first = ours.ratio[rows].gather(1, ours.loss_mask[rows].to(torch.uint8).argmax(-1, keepdim=True)).squeeze(1)
    without = float(first.double().mean())  # the old reading: the 7 rows with loss tokens
    assert len(rows) == SEQUENCE_ROWS_IN_LOSS
    assert ours.metrics[key] == pytest.approx((without * 7 + 1.0) / 8, abs=1e-6)  # ratio 1, inside (None, 3.0)
    assert abs(without - theirs.metrics[key]) > 1e-3, (without, theirs.metrics[key])


# ----------------------------------------------------------------------------- TRL's options as our flags


@pytest.mark.parametrize("spelling", [None, "none", "null", "inf", float("inf")])
def test_no_upper_bound_is_reachable_through_the_shared_flag(tmp_path, spelling):
    """TRL's vllm_importance_sampling_clip_max=None (lower bound only) is rollout_importance_sampling_threshold
    null / inf here: the core takes it as a bound no weight reaches (every log-ratio is clamped to +-20)."""
    args = ParityGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                            rollout_importance_sampling_mode="token_mask",
                            rollout_importance_sampling_threshold=spelling,
                            rollout_importance_sampling_threshold_lower=0.5)
    cfg = args.correction_config()
    assert cfg.rollout_importance_sampling_threshold == NO_UPPER_BOUND > math.exp(20.0)
    assert as_correction_config({"rollout_importance_sampling_mode": "token_mask",
                                 "rollout_importance_sampling_threshold": spelling,
                                 "rollout_importance_sampling_threshold_lower": 0.5}, None) == cfg


def test_truncation_without_either_bound_is_refused_as_trl_does(tmp_path):
    from trl import GRPOConfig

    with pytest.raises(ValueError, match="At least one of `vllm_importance_sampling_clip_min`"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, vllm_importance_sampling_mode="token_truncate",
                   vllm_importance_sampling_clip_max=None)
    with pytest.raises(ValueError, match=r"rollout_importance_sampling_threshold: None \(no upper bound\) with "
                                         "rollout_importance_sampling_mode='token_truncate' needs "
                                         "rollout_importance_sampling_threshold_lower"):
        ParityGRPOConfig(output_dir=str(tmp_path), use_cpu=True, rollout_importance_sampling_mode="token_truncate",
                         rollout_importance_sampling_threshold=None)


def test_off_policy_delta_zero_is_refused_naming_trls_own_field(tmp_path):
    with pytest.raises(ValueError, match="off_policy_sequence_mask_delta: 0 is refused .* TRL's own "
                                         "off_policy_mask_threshold=0 works beside the flags"):
        ParityGRPOConfig(output_dir=str(tmp_path), use_cpu=True, off_policy_sequence_mask_delta=0)
    # ... and TRL's own 0 beside the flags is accepted (the grid checks it masks as TRL does)
    args = ParityGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", off_policy_mask_threshold=0.0,
                            rollout_importance_sampling_mode="token_truncate")
    assert args.off_policy_mask_threshold == 0.0


def test_trls_own_ratio_beside_ours_is_refused_with_the_flags_that_give_it(tmp_path):
    from rollout_parity.adapters.trl.refusals import refuse

    args = ParityGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", use_vllm=True,
                            vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=None,
                            vllm_importance_sampling_clip_min=0.5, rollout_rejection=["seq_sum_k3"],
                            rollout_rejection_threshold=["0.01"])
    with pytest.raises(ValueError, match=r"vllm_importance_sampling_clip_max=None, .* set only one of the two \(TRL's "
                                         r"ratio as rollout-parity's flags: rollout_importance_sampling_mode="
                                         r"'token_mask', rollout_importance_sampling_threshold=None, "
                                         r"rollout_importance_sampling_threshold_lower=0.5\)"):
        refuse(args.correction_config(), args, args, model_config=None, off_policy_mask_threshold=None)


def test_trl_own_threshold_beside_ours_logs_no_off_policy_fraction_of_ours(grid):
    """TRL's own off_policy_mask_threshold acting (0 here) while our delta is unset: our off_policy_masked_frac
    would describe no mask (0) while TRL's drops three sequences, so it is left out."""
    _, both = grid
    _, ours = both("healthy", TrlSetting("token_truncate", None, 3.0, 0.0))
    assert "rollout_correction/off_policy_masked_frac" not in ours.metrics
    _, with_delta = both("healthy", TrlSetting("token_truncate", None, 3.0, 0.5))
    assert with_delta.metrics["rollout_correction/off_policy_masked_frac"] == pytest.approx(2 / 7)


def test_shared_core_config_from_trl_setting_is_what_the_grid_uses():
    flags, own = TrlSetting("sequence_mask", None, 3.0, 0.0).our_flags()
    assert own == 0.0
    assert CorrectionConfig(**flags) == CorrectionConfig.preset("trl_default")
