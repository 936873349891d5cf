"""The metric of ``benchmarks/tim_truncated.py`` (evidence 2), on hand-made runs: no engine, no trainer.

The RESULT line's ``harm`` must be the worse of TRL's correction and the full-vocabulary preset against the
truncated reference, ``recovered`` the calibrated condition against the same reference, ``calibrated_vs_parity``
the do-no-harm pair; the final reward is each experiment's own window of the last generation batches.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from tests.script_loader import load_script

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def tim():
    yield load_script(BENCHMARKS / "tim_truncated.py", "tim_truncated_under_test")
    sys.modules.pop("tim_truncated_under_test", None)


def _run(condition: str, seed: int, rewards: list, eval_reward: float = 0.5) -> dict:
    """A run record as ``run_one`` writes it: the reward on the first step of each generation batch (two
    optimizer steps per batch), None on the second, as TRL logs it."""
    steps = []
    for i, reward in enumerate(rewards):
        steps.append({"step": 2 * i + 1, "reward": reward, "delta_abs_mean": 0.01, "delta_abs_max": 0.1})
        steps.append({"step": 2 * i + 2, "reward": None})
    return dict(condition=condition, seed=seed, steps=steps, eval_reward=eval_reward, eval_reward_trunc=eval_reward,
                train_s=1.0)


def test_final_reward_is_the_mean_of_the_last_logged_batches(tim):
    run = _run("ref_trunc", 0, [0.1, 0.2, float("nan"), 0.6, 1.0])
    assert tim.final_reward(run, 2) == pytest.approx(0.8)  # NaN and the None of second steps are skipped
    assert tim.final_reward(run, 3) == pytest.approx(0.6)


def test_summary_uses_each_experiments_window_and_result_line_names_the_worst(tim):
    # 12 generation batches: the last 5 (truncated window) and the last 10 (do-no-harm window) differ.
    def rewards(early: float, late: float) -> list:
        return [early] * 7 + [late] * 5

    runs = []
    for seed in (0, 1):
        runs += [_run("ref_full", seed, rewards(0.2, 1.0), eval_reward=0.8),
                 _run("ref_trunc", seed, rewards(0.2, 1.0), eval_reward=0.4),
                 _run("trl_default", seed, rewards(0.2, 0.9)),
                 _run("preset_full_vocab", seed, rewards(0.2, 0.5 if seed == 0 else 0.7)),
                 _run("calibrated", seed, rewards(0.2, 0.95)),
                 _run("parity", seed, rewards(0.5, 1.0)),
                 _run("preset_sigma", seed, rewards(0.5, 0.5)),
                 _run("calibrated_sigma", seed, rewards(0.5, 1.0))]
    table = tim.summarize(runs, {"truncated": 5, "noharm": 10})
    assert table["preset_full_vocab"]["final_reward_seeds"] == pytest.approx([0.5, 0.7])
    assert table["ref_trunc"]["final_reward"] == pytest.approx(1.0)  # last 5 only
    assert table["parity"]["final_reward"] == pytest.approx((5 * 0.5 + 5 * 1.0) / 10)  # last 10
    assert table["calibrated"]["mean_reward"] == pytest.approx((7 * 0.2 + 5 * 0.95) / 12)

    result = tim.result_line(table)
    assert result["harm"] == pytest.approx(0.6)  # preset_full_vocab (0.6), not trl_default (0.9)
    assert result["final_trl_default_vs_ref_trunc"] == pytest.approx(0.9)
    assert result["recovered"] == pytest.approx(0.95)
    assert result["calibrated_vs_parity"] == pytest.approx(1.0)
    assert result["final_preset_sigma_vs_parity"] == pytest.approx(0.5 / 0.75)
    assert result["heldout_ref_trunc_vs_ref_full"] == pytest.approx(0.5)  # held-out compares across samplers
    assert list(result)[:3] == ["harm", "recovered", "calibrated_vs_parity"]


def test_result_line_leaves_out_what_did_not_run(tim):
    runs = [_run("parity", 0, [0.5, 1.0]), _run("calibrated_sigma", 0, [0.5, 0.9])]
    result = tim.result_line(tim.summarize(runs, {"truncated": 5, "noharm": 1}))
    assert "harm" not in result and "recovered" not in result
    assert result["calibrated_vs_parity"] == pytest.approx(0.9)
    assert all(math.isfinite(v) for v in result.values())


def test_correction_for_each_condition(tim):
    c = tim.CONDITIONS
    none = tim.correction_for(c["ref_trunc"], None)
    trl = tim.correction_for(c["trl_default"], None)
    preset = tim.correction_for(c["preset_full_vocab"], None)
    flags = {"rollout_importance_sampling_mode": "token_truncate", "rollout_rejection": ["seq_sum_k3"],
             "rollout_rejection_threshold": 0.01}
    calibrated = tim.correction_for(c["calibrated"], flags)
    for cfg in (none, trl, preset, calibrated):
        assert cfg.fp32_lm_head and cfg.log_rollout_offpolicy_metrics
    assert none.to_dict() == trl.to_dict()  # TRL's own correction is switched on in GRPOConfig, not here
    assert not none.rollout_rejection
    assert list(preset.rollout_rejection) == ["seq_sum_k3"] and preset.rollout_rejection_threshold == 0.001
    assert list(calibrated.rollout_rejection) == ["seq_sum_k3"] and calibrated.rollout_rejection_threshold == 0.01
    assert calibrated.rollout_importance_sampling_mode == preset.rollout_importance_sampling_mode == "token_truncate"
    with pytest.raises(ValueError, match="calibration"):
        tim.correction_for(c["calibrated"], None)


def test_conditions_share_everything_but_what_they_test(tim):
    truncated = [c for c in tim.CONDITIONS.values() if c.experiment == "truncated"]
    assert {c.top_p for c in truncated if c.name != "ref_full"} == {tim.TOP_P} and tim.TOP_P < 1
    assert tim.CONDITIONS["ref_full"].top_p == 1.0
    assert all(c.sigma == 0 and c.engine_dtype is None for c in truncated)
    assert tim.CONDITIONS["preset_sigma"].sigma == tim.CONDITIONS["calibrated_sigma"].sigma > 0
    assert tim.EXPERIMENTS["truncated"]["answer_words"] >= 32
