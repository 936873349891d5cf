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


def test_precision_option_reaches_the_adapters_flag_on_both_sides(tim, tmp_path):
    """``--precision fp16`` hands the shared flag to the adapter, whose own code then sets the engine's dtype and
    TRL's trainer (fp16, and float16 weights on this CPU device); unset, the runs reported keep their float32
    trainer, the checkpoint's engine dtype and their saved settings (``--reuse`` still finds them)."""
    from rollout_parity.adapters.trl.engine import colocated_engine_kwargs, engine_options
    from rollout_parity.adapters.trl.precision import precision_onto_args

    condition = tim.CONDITIONS["ref_trunc"]
    for precision, engine, fp16, bf16, load in (("fp16", "float16", True, False, "float16"),
                                                ("bf16", "bfloat16", False, True, None)):  # None: TRL's float32
        args = tim.sized(tim.build_parser().parse_args(["--precision", precision]), "truncated")
        cfg = tim.correction_for(condition, None, args.precision)
        assert cfg.precision == precision and cfg.fp32_lm_head
        assert colocated_engine_kwargs({}, **engine_options(cfg))["dtype"] == engine
        config = tim.grpo_config(condition, args, str(tmp_path), 0)
        precision_onto_args(cfg.precision, config, "a-model-path", None)  # what ParityGRPOTrainer runs first
        assert (config.fp16, config.bf16, config.model_init_kwargs.get("dtype")) == (fp16, bf16, load)
        assert tim._settings(args, condition, None)["precision"] == precision and tim._tag(args) == f"-{precision}"

    default = tim.sized(tim.build_parser().parse_args([]), "truncated")
    assert default.precision is None and tim._tag(default) == ""
    cfg = tim.correction_for(condition, None, default.precision)
    assert cfg.precision is None and "dtype" not in colocated_engine_kwargs({}, **engine_options(cfg))
    config = tim.grpo_config(condition, default, str(tmp_path), 0)
    assert (config.fp16, config.bf16, config.model_init_kwargs["dtype"]) == (False, False, "float32")
    assert "precision" not in tim._settings(default, condition, None)


def test_precision_refuses_a_condition_with_its_own_engine_dtype(tim):
    args = tim.build_parser().parse_args(["--precision", "fp16", "--conditions", "ref_trunc", "parity"])
    with pytest.raises(SystemExit, match="--precision fp16: parity is defined by its own engine dtype"):
        tim.refuse_precision(args, [tim.CONDITIONS[c] for c in args.conditions])
    tim.refuse_precision(tim.build_parser().parse_args(["--conditions", "parity"]), [tim.CONDITIONS["parity"]])


def test_a_diverged_run_is_recorded_with_its_first_nonfinite_step(tim):
    """A run whose loss or gradient norm turns NaN/inf (fp16 on CPU can) is a result: its first such step is kept
    in the summary and its CONDITION line, and the run's other numbers still come out."""
    nan = float("nan")
    history = [{"step": 1, "loss": 0.1, "grad_norm": 0.5}, {"step": 2, "loss": 0.0, "grad_norm": 0.4},
               {"train_runtime": 1.0}, {"step": 3, "loss": 0.0, "grad_norm": nan}, {"step": 4, "loss": nan}]
    assert tim.nonfinite_step(history) == 3
    assert tim.nonfinite_step([{"step": 4, "loss": float("inf"), "grad_norm": 1.0}]) == 4
    assert tim.nonfinite_step(history[:3]) is None

    runs = [{**_run("ref_trunc", 0, [0.5, 0.0], eval_reward=nan), "nonfinite_step": 3}]
    table = tim.summarize(runs, {"truncated": 1, "noharm": 1})
    assert table["ref_trunc"]["nonfinite_steps"] == [3] and table["ref_trunc"]["final_reward"] == 0.0
    line, = tim.condition_lines(table, runs, "fp16")
    assert line.startswith("CONDITION fp16/ref_trunc: final=0.000 ") and line.endswith(" nonfinite_step=3")
    assert " heldout=nan " in line
