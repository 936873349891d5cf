"""Every ``DoctorOptions`` field and every ``rollout-parity doctor`` / ``check`` flag changes what runs.

The doctor runs end to end here except for its vLLM engines: ``measure._sample`` is replaced by a stand-in
that records what the doctor asked of the engines (their sizing kwargs, sampling settings, prompts,
weight versions) and returns rollouts of the prompts' own tokens. Everything else is the doctor's:
the preset, the weight versions, the trainer (a tiny local model) scoring with ``trainer_scores``,
the rows, the report. Expected values come from the doctor's own building blocks
(``grpo_prompt``, ``weight_versions``, ``CorrectionConfig.preset``). The real engines:
integration_tests/test_doctor_smoke.py.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import types

import pytest
import torch

from rollout_parity import CorrectionConfig, cli, doctor
from rollout_parity import grpo_rounds
from rollout_parity.doctor import DoctorOptions, measure, run_doctor
from rollout_parity.doctor.rows import CONFIGS
from rollout_parity.testing.tiny_model import build_tiny_model

ROWS = ("d", "s/full-vocab", "s/sampler")
SMALL = dict(rows=ROWS, steps=2, num_prompts=1, samples=2, max_tokens=4, sentences=2)


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model()


@pytest.fixture
def stand_in_engines(monkeypatch):
    """``_sample`` recorded and answered without vLLM; ``trainer_scores``'s batch size recorded."""
    seen: dict = {"batch_sizes": set(), "trainer_sampling": []}

    def sample(vllm, model_path, specs, sizing, sampling, prompts, warm, weights, opts, timings):
        seen.update(sizing=dict(sizing), sampling={k: dict(v) for k, v in sampling.items()}, prompts=prompts,
                    warm=warm, weights=weights, torch_threads=torch.get_num_threads())
        batches = {}
        for config in dict.fromkeys(s.config for s in specs):
            batches[config] = []
            for v, ps in enumerate(prompts):
                rows = [p for p in ps for _ in range(opts.samples)]
                completions = [p[10:10 + opts.max_tokens] for p in rows]
                batches[config].append(grpo_rounds.Batch(
                    version=v, prompts=rows, completions=completions, logprobs=[[-1.0] * len(c) for c in completions],
                    seconds=1.0, tokens=sum(map(len, completions)), cached_tokens=0, update_seconds=0.0))
        return {"batches": batches, "resolved": {CONFIGS[c][0]: {} for c in batches},
                "held": {s.name: {} for s in specs}}

    real_scores = grpo_rounds.trainer_scores

    def scores(*args, batch_size, sampling, **kwargs):
        seen["batch_sizes"].add(batch_size)
        seen["trainer_sampling"].append(dict(sampling))
        return real_scores(*args, batch_size=batch_size, sampling=sampling, **kwargs)

    monkeypatch.setattr(measure, "_sample", sample)
    monkeypatch.setattr(grpo_rounds, "trainer_scores", scores)
    monkeypatch.setattr(grpo_rounds, "supports_reload_weights", lambda: True)
    stub = types.ModuleType("vllm")  # the doctor imports vllm before its engines; never used here
    stub.__version__, stub.__spec__ = "0.31.0", importlib.machinery.ModuleSpec("vllm", None)
    monkeypatch.setitem(sys.modules, "vllm", stub)
    return seen


def test_every_doctor_option_reaches_what_runs(model_path, stand_in_engines, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seen = stand_in_engines
    base = run_doctor(DoctorOptions(model=model_path, progress=False, **SMALL))
    base_seen = dict(seen, batch_sizes=set(seen["batch_sizes"]))
    assert "[doctor]" not in capsys.readouterr().err  # progress=False: no progress lines
    seen["batch_sizes"].clear()
    seen["trainer_sampling"].clear()
    json_path = tmp_path / "report.json"
    changed = run_doctor(DoctorOptions(
        model=model_path, progress=True, preset="icepop", temperature=0.9, top_k=20, min_p=0.05, seed=3,
        update_scale=0.05, gpu_memory_utilization=0.25, trainer_batch=1, threads=2, json_path=str(json_path),
        **SMALL))
    assert "[doctor] scoring the rollouts" in capsys.readouterr().err

    # model: the given one, not the built-in trained model
    assert changed["model"] == model_path and changed["tiny_model_built"] is False
    # preset: the correction every row's metrics and the recommendation come from
    assert changed["correction_config"] == CorrectionConfig.preset("icepop", log_rollout_offpolicy_metrics=True).to_dict()
    assert base["correction_config"] == CorrectionConfig.preset("tis_srs_k3", log_rollout_offpolicy_metrics=True).to_dict()
    assert changed["recommendation"]["flags"]["rollout_importance_sampling_mode"] == "token_mask"
    assert {r["rejected_seq_frac"] for r in changed["rows"]} == {0.0} != {r["rejected_seq_frac"] for r in base["rows"]}
    # the sampling of the engines and of the trainer: temperature, and the truncating sampler of s/*
    assert seen["sampling"] == {"temperature": {"temperature": 0.9},
                                "truncating": {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.05}}
    assert base_seen["sampling"]["truncating"] == {"temperature": 0.7, "top_k": -1, "top_p": 0.9, "min_p": 0.0}
    assert seen["sampling"]["truncating"] in seen["trainer_sampling"]
    assert changed["sampling"]["truncating"] == "top-k 20, top-p 0.9, min-p 0.05"
    # seed: the prompts, the weight versions and the engines' seed; update_scale: the versions' step
    tok = AutoTokenizer.from_pretrained(model_path)
    assert seen["prompts"] == [[grpo_rounds.grpo_prompt(tok, v, 0, sentences=2, seed=3)] for v in range(2)]
    assert seen["prompts"] != base_seen["prompts"]
    state = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).state_dict()
    want = grpo_rounds.weight_versions(state, 2, scale=0.05, seed=3)
    assert all(torch.equal(seen["weights"][1][k], want[1][k]) for k in want[1])
    default_step = grpo_rounds.weight_versions(state, 2, scale=0.02, seed=0)[1]
    assert all(torch.equal(base_seen["weights"][1][k], default_step[k]) for k in want[1])
    assert changed["weight_updates"] == dict(changed["weight_updates"], real=True, scale=0.05)
    # engine sizing: memory share and seed
    assert (seen["sizing"]["gpu_memory_utilization"], seen["sizing"]["seed"]) == (0.25, 3)
    assert (base_seen["sizing"]["gpu_memory_utilization"], base_seen["sizing"]["seed"]) == (0.1, 0)
    # trainer_batch: the trainer's forward batch; threads: torch's threads while the engines run
    assert seen["batch_sizes"] == {1} and base_seen["batch_sizes"] == {32}
    assert changed["cpu_threads"] == seen["torch_threads"] == 2
    if grpo_rounds.is_vllm_cpu_build():
        assert base["cpu_threads"] == base_seen["torch_threads"] == 1
    # json_path: the report, as returned
    assert json.loads(json_path.read_text())["correction_config"] == changed["correction_config"]


# ----------------------------------------------------------------------------- the command lines

DOCTOR_FLAGS = [
    (["--model", "/models/m"], "model", "/models/m"),
    (["--json", "/tmp/r.json", "--plot", "none"], "json_path", "/tmp/r.json"),  # the plot beside it: test_doctor_cli
    (["--plot", "/tmp/p.png"], "plot_path", "/tmp/p.png"),
    (["--preset", "icepop"], "preset", "icepop"),
    (["--num_prompts", "3"], "num_prompts", 3),
    (["--samples", "5"], "samples", 5),
    (["--max_tokens", "7"], "max_tokens", 7),
    (["--steps", "2"], "steps", 2),
    (["--sentences", "3"], "sentences", 3),
    (["--temperature", "0.9"], "temperature", 0.9),
    (["--top_k", "20"], "top_k", 20),
    (["--top_p", "0.8"], "top_p", 0.8),
    (["--min_p", "0.05"], "min_p", 0.05),
    (["--update_scale", "0.05"], "update_scale", 0.05),
    (["--seed", "3"], "seed", 3),
    (["--gpu_memory_utilization", "0.25"], "gpu_memory_utilization", 0.25),
    (["--threads", "2"], "threads", 2),
    (["--rows", "a,d"], "rows", ("a", "d")),
    (["--no_progress"], "progress", False),
]


def _fake_report(recipe_delta):
    return {"recipe_delta_abs_mean": recipe_delta}


@pytest.mark.parametrize("argv,field,value", DOCTOR_FLAGS, ids=lambda x: x[0] if isinstance(x, list) else "")
def test_each_doctor_flag_sets_its_option(monkeypatch, argv, field, value):
    got = []
    monkeypatch.setattr(doctor, "run_doctor", lambda opts: got.append(opts) or _fake_report(1e-3))
    monkeypatch.setattr(doctor, "format_table", lambda report: "")
    monkeypatch.setattr(doctor, "format_recommendation", lambda report: "")
    assert cli.main(["doctor", *argv]) == 0
    assert getattr(got[0], field) == value != getattr(DoctorOptions(), field)
    assert {f: getattr(got[0], f) for f in vars(got[0]) if f != field} == {
        f: getattr(DoctorOptions(), f) for f in vars(got[0]) if f != field}


def test_fail_above_fails_the_command_only_above_its_value(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "format_table", lambda report: "")
    monkeypatch.setattr(doctor, "format_recommendation", lambda report: "")
    monkeypatch.setattr(doctor, "run_doctor", lambda opts: _fake_report(8e-3))
    assert cli.main(["doctor", "--no_progress"]) == 0
    assert cli.main(["doctor", "--no_progress", "--fail_above", "1e-2"]) == 0
    assert cli.main(["doctor", "--no_progress", "--fail_above", "5e-3"]) == 1
    assert "8.000e-03 > 5.000e-03" in capsys.readouterr().err
    monkeypatch.setattr(doctor, "run_doctor", lambda opts: _fake_report(None))  # row d not run
    assert cli.main(["doctor", "--no_progress", "--fail_above", "5e-3"]) == 1


CHECK_FLAGS = [
    (["--model", "/models/m"], dict(model="/models/m")),
    (["--nemo_rl_source", "/src/RL"], dict(nemo_rl_source="/src/RL")),
    (["--only", "core,verl"], dict(frameworks=("core", "verl"))),
    (["--skip", "vllm,nemo-rl"], dict(frameworks=("core", "trl", "verl", "sglang"))),
    (["--engine", "sglang"], dict(frameworks=("core", "trl", "verl", "nemo_rl", "sglang"))),
    (["--only", "core,vllm", "--engine", "SGLang"], dict(frameworks=("core", "sglang"))),
    (["--require", "trl"], dict(require=("trl",))),
    (["--max_delta", "0.01"], dict(max_delta=0.01)),
    (["--gpu_memory_utilization", "0.5"], dict(gpu_memory_utilization=0.5)),
    (["--no_progress"], dict(progress=False)),
]


@pytest.mark.parametrize("argv,fields", CHECK_FLAGS, ids=lambda x: x[0] if isinstance(x, list) else "")
def test_each_check_flag_sets_its_option(monkeypatch, argv, fields):
    import rollout_parity.check as check

    from rollout_parity.check import CheckOptions

    got = []
    skipped = check.FrameworkReport("core", "rollout-parity core", status="skipped", reason="stand-in")
    monkeypatch.setattr(check, "run_check", lambda opts: got.append(opts) or ([skipped], 0.0))
    monkeypatch.setattr(check, "environment", lambda: {})
    assert cli.main(["check", *argv]) == 0
    default = CheckOptions()
    for name, value in fields.items():
        assert getattr(got[0], name) == value != getattr(default, name), name
    assert all(getattr(got[0], f) == getattr(default, f) for f in vars(default) if f not in fields)


def test_skipping_every_framework_is_a_usage_error(capsys):
    from rollout_parity import registry

    assert cli.main(["check", "--no_progress", "--skip", ",".join(("core", *registry.keys()))]) == 2
    assert "no framework left to check" in capsys.readouterr().err


def test_an_unknown_engine_is_a_usage_error_naming_the_known_ones(capsys):
    assert cli.main(["check", "--no_progress", "--engine", "tgi"]) == 2
    assert "--engine tgi: unknown engine; rollout-parity knows vllm, sglang" in capsys.readouterr().err


def test_json_dash_prints_the_report(monkeypatch, capsys):
    import rollout_parity.check as check

    monkeypatch.setattr(check, "run_check", lambda opts: ([], 1.5))
    monkeypatch.setattr(check, "environment", lambda: {"torch": "x"})
    assert cli.main(["check", "--json", "-", "--no_progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == check.report_dict([], seconds=1.5, environment={"torch": "x"})
    assert os.path.exists("-") is False


def test_check_options_reach_the_probe_and_the_nemo_checks(monkeypatch):
    """``run_check``: the vLLM probe gets the model, the accepted |delta| and the memory share; the NeMo RL
    checks get the source tree; ``require`` turns a skip into an error; the rest run as selected."""
    import rollout_parity.check.nemo_checks as nemo_checks
    import rollout_parity.check.vllm_probe as vllm_probe
    from rollout_parity.check import CheckOptions, run_check
    from rollout_parity.check import runner

    calls = {}
    monkeypatch.setattr(vllm_probe, "run_vllm_probe", lambda report, **kw: calls.setdefault("vllm", kw))
    monkeypatch.setattr(nemo_checks, "run_nemo_checks", lambda report, source, tick: calls.setdefault("nemo", source))
    monkeypatch.setattr(runner, "_installed", lambda spec: spec.key != "trl")
    opts = CheckOptions(frameworks=("trl", "nemo_rl", "vllm"), require=("trl",), nemo_rl_source="/src/RL",
                        model="/models/m", max_delta=0.01, gpu_memory_utilization=0.5, progress=False)
    reports, _ = run_check(opts)
    assert [r.key for r in reports] == ["trl", "nemo_rl", "vllm"]
    assert reports[0].status == "error" and "--require trl" in reports[0].reason
    assert calls["nemo"] == "/src/RL"
    vllm = calls["vllm"]
    assert (vllm["model"], vllm["max_delta"], vllm["gpu_memory_utilization"]) == ("/models/m", 0.01, 0.5)
    calls.clear()
    run_check(CheckOptions(frameworks=("vllm",), progress=False))
    assert (calls["vllm"]["model"], calls["vllm"]["max_delta"], calls["vllm"]["gpu_memory_utilization"]) == (
        None, vllm_probe.MAX_DELTA, 0.3)


def test_every_row_takes_its_own_path(model_path, stand_in_engines):
    """All nine rows (the default): each row's engine settings, trainer head and trainer view are its
    own. The stand-in engines return the same rollouts for every configuration, so rows differ only
    by what the doctor does on the trainer's side; the engine side is in the report's kwargs."""
    from rollout_parity.engines.vllm.recipe import vllm_parity_kwargs

    report = run_doctor(DoctorOptions(model=model_path, progress=False, steps=2, num_prompts=1, samples=2,
                                      max_tokens=4, sentences=2))
    rows = {r["row"]: r for r in report["rows"]}
    assert list(rows) == list(doctor.DEFAULT_ROWS)
    kwargs = {name: r["engine_kwargs"] for name, r in rows.items()}
    assert kwargs["a"] == {} and kwargs["b"] == {"logprobs_mode": "processed_logprobs"}
    assert kwargs["c"] == vllm_parity_kwargs(fp32_lm_head=False)
    assert kwargs["d"] == kwargs["d/vllm-only"] == kwargs["s/full-vocab"] == vllm_parity_kwargs(fp32_lm_head=True)
    assert kwargs["d/reset"] == kwargs["d/salt"] == vllm_parity_kwargs(fp32_lm_head=True, prefix_cache_policy="reset")
    assert {n: r["prefix_cache_policy"] for n, r in rows.items() if n.startswith("d/")} == {
        "d/vllm-only": "off", "d/reset": "reset", "d/salt": "salt"}
    assert [n for n, r in rows.items() if r["trainer_head"] == "fp32"] == ["d", "s/full-vocab", "s/sampler",
                                                                         "d/reset", "d/salt", "p/fp16+head"]
    # the precision rows: an fp16 engine (p/fp16, p/fp16+head) or row c's (p/mixed), an fp16 trainer for all three
    assert kwargs["p/fp16"] == vllm_parity_kwargs(precision="fp16") and kwargs["p/mixed"] == kwargs["c"]
    assert kwargs["p/fp16+head"] == vllm_parity_kwargs(fp32_lm_head=True, precision="fp16")
    assert {n: r["trainer_dtype"] for n, r in rows.items()} == {
        n: "float16" if n.startswith("p/") else "bfloat16" for n in rows}
    assert rows["p/mixed"]["delta_abs_mean"] != rows["c"]["delta_abs_mean"]
    # the same rollouts scored by a bf16 head (d/vllm-only) or over the full vocabulary (s/full-vocab)
    assert rows["d/vllm-only"]["delta_abs_mean"] != rows["d"]["delta_abs_mean"]
    assert rows["a"]["delta_abs_mean"] == rows["b"]["delta_abs_mean"] == rows["c"]["delta_abs_mean"]
    assert rows["s/full-vocab"]["delta_abs_mean"] != rows["s/sampler"]["delta_abs_mean"]
    assert "mean_log_kept_mass" in rows["s/full-vocab"] and "mean_log_kept_mass" not in rows["s/sampler"]
    assert report["lengths"]["advice"] and [s["rows"] for s in report["recommendation"]["steps"]] == [
        "a -> b", "b -> c", "c -> d", "s/full-vocab -> s/sampler"]


def test_every_engine_fits_the_longest_prompt_and_its_completion(model_path, stand_in_engines):
    """``max_model_len``: a power of two at least the longest prompt plus ``max_tokens`` (plus one), here
    with ``max_tokens`` chosen so that the prompt alone would round to a smaller power of two."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    # the prompts of versions 0 and 1 and the warm-up prompt (version steps + 1)
    longest = max(len(grpo_rounds.grpo_prompt(tok, v, 0, sentences=2, seed=0)) for v in (0, 1, 3))
    room = 2 ** (longest.bit_length()) - longest  # the prompt alone fits 2**bit_length; this many more do not
    run_doctor(DoctorOptions(model=model_path, progress=False, rows=("d",), steps=2, num_prompts=1, samples=1,
                             max_tokens=room, sentences=2))
    seen = stand_in_engines
    assert longest == max(len(p) for p in [*seen["warm"], *(p for ps in seen["prompts"] for p in ps)])
    size = seen["sizing"]["max_model_len"]
    assert size >= longest + room + 1 and size & (size - 1) == 0
