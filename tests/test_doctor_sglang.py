"""The doctor's SGLang rows without SGLang: the table, the refusals before anything loads, the engines each row
builds, and the weight loads' calls per release. The live run is integration_tests/test_doctor_sglang.py."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from rollout_parity import registry
from rollout_parity.doctor import engine_sglang, engine_vllm, measure
from rollout_parity.doctor.rows import (DoctorOptions, MissingExtraError, check_requirements, engine_driver,
                                        engine_rows, selected_rows, validate)
from rollout_parity.engines.sglang.recipe import ORIGINAL_LOGPROB_ENV, sglang_parity_kwargs


def test_every_registered_engine_has_the_doctors_rows_and_an_unknown_one_is_named():
    for key in registry.keys("engine"):
        table = engine_rows(key)
        assert table.key == key and set(table.default_rows) <= set(table.rows)
        assert {"a", "c", "d"} <= set(table.rows), key  # the recipe's steps on every engine
    with pytest.raises(ValueError, match="--engine 'trl': the doctor measures vllm, sglang"):
        engine_driver("trl")  # a framework, not an engine
    with pytest.raises(ValueError, match="--engine 'nope'"):
        DoctorOptions(engine="nope")


def test_sglangs_default_rows_and_a_vllm_only_row_refused_by_name():
    opts = DoctorOptions(engine="sglang")
    assert opts.rows == engine_sglang.DEFAULT_ROWS != DoctorOptions().rows
    assert [s.name for s in selected_rows(opts)] == list(engine_sglang.DEFAULT_ROWS)
    for row in ("b", "s/sampler", "d/salt", "p/fp16"):  # no logprobs mode, tempered logprobs, no salt, no fp16 rows
        with pytest.raises(ValueError, match=f"unknown row '{row}' for --engine sglang \\(a vLLM row"):
            validate(DoctorOptions(engine="sglang", rows=("d", row)))
    with pytest.raises(ValueError, match="unknown row 'd/sglang-only' for --engine vllm; rows are"):
        validate(DoctorOptions(rows=("d/sglang-only",)))
    with pytest.raises(ValueError, match="--rows: no row given"):
        validate(DoctorOptions(engine="sglang", rows=()))


def test_sglangs_logprobs_before_the_temperature_are_refused_before_anything_loads(monkeypatch):
    monkeypatch.setenv(ORIGINAL_LOGPROB_ENV, "1")
    with pytest.raises(ValueError, match=f"{ORIGINAL_LOGPROB_ENV}=1 with temperature 0.7"):
        validate(DoctorOptions(engine="sglang"))
    validate(DoctorOptions(engine="sglang", temperature=1.0))  # the two forms agree at T = 1
    validate(DoctorOptions(temperature=0.7))  # vLLM's rows never read SGLang's switch


def test_requirements_name_each_engines_extra(monkeypatch):
    present = {"sglang", "transformers", "tqdm", "vllm"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in present else None)
    check_requirements("sglang", plot=False)
    with pytest.raises(MissingExtraError, match="--plot needs matplotlib: pip install matplotlib, or --plot none"):
        check_requirements("sglang", plot=True)
    with pytest.raises(MissingExtraError, match=r"the doctor needs matplotlib: pip install 'rollout-parity\[vllm"):
        check_requirements("vllm", plot=False)  # vLLM's extras bring matplotlib: it is always there
    present.discard("sglang")
    with pytest.raises(MissingExtraError, match=r"the doctor on SGLang needs sglang: pip install 'rollout-parity\["
                                                r"sglang\]'"):
        check_requirements("sglang", plot=False)


def test_each_sglang_row_builds_its_own_engine_with_the_recipe_and_the_sizing():
    """``measure._sample`` over SGLang's rows with ``sglang.Engine`` recorded: each row's engine kwargs."""
    built, rounds = [], {}

    class Engine:
        def __init__(self, **kwargs):
            self.kwargs = kwargs
            built.append(self)

    from rollout_parity import grpo_rounds
    from rollout_parity.engines.sglang import recipe

    opts = DoctorOptions(engine="sglang", progress=False, steps=1)
    sizing = engine_sglang.sizing(opts, 512)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=Engine))
        mp.setattr(grpo_rounds, "warm_up", lambda *a, **k: None)
        mp.setattr(grpo_rounds, "run_rounds", lambda configs, *a, **k: rounds.update({c.name: c for c in configs})
                   or {c.name: [] for c in configs})
        mp.setattr(recipe, "describe_engine", lambda e: {})
        mp.setattr(recipe, "verify_engine", lambda e, **k: dict(k))
        mp.setattr(Engine, "shutdown", lambda self: None, raising=False)
        out = measure._sample(engine_sglang, "/models/m", selected_rows(opts), sizing,
                              {"temperature": {"temperature": 0.7}, "truncating": {"temperature": 0.7, "top_p": 0.9}},
                              [[[1, 2]]], [[1, 2]], None, opts, {})
    assert all(e.kwargs["model_path"] == "/models/m" and {k: e.kwargs[k] for k in sizing} == sizing for e in built)
    assert sizing["dtype"] == "bfloat16" and sizing["sleep_on_idle"] is True and sizing["device"] == "cpu"
    by_config = {name: {k: v for k, v in c.llm.kwargs.items() if k not in sizing and k != "model_path"}
                 for name, c in rounds.items()}
    assert by_config == {"a": {}, "c": sglang_parity_kwargs(), "d": sglang_parity_kwargs(fp32_lm_head=True),
                         "s": sglang_parity_kwargs(fp32_lm_head=True),
                         "reset": sglang_parity_kwargs(fp32_lm_head=True, prefix_cache_policy="reset")}
    assert rounds["s"].llm is rounds["d"].llm and len(built) == 4
    assert (rounds["reset"].policy, by_config["reset"]["disable_radix_cache"]) == ("reset", False)
    assert out["held"]["d/sglang-only"] == {"fp32_lm_head": False, "prefix_cache_policy": "off"}


class _Engine:
    """Records SGLang's weight-update calls in order; answers as the release asked for would."""

    def __init__(self, answer=(True, "Success")):
        self.calls, self.answer = [], answer

    def begin_weight_update(self):
        self.calls.append("begin")
        return True, "Success"

    def end_weight_update(self):
        self.calls.append("end")
        return True, "Success"

    def update_weights_from_tensor(self, named):
        self.calls.append(("tensors", [n for n, _ in named]))
        return self.answer

    def flush_cache(self):
        self.calls.append("flush")
        return types.SimpleNamespace(success=True, message="")


@pytest.mark.parametrize("version,session", [("0.5.23", True), ("0.5.21", True), ("0.5.20", False),
                                             ("0.5.12", False)])
def test_weight_loads_open_a_session_where_the_release_requires_one(monkeypatch, version, session):
    from rollout_parity.engines.sglang import features
    from rollout_parity.engines.vllm.weight_update import WeightVersion

    monkeypatch.setattr(features, "installed_sglang_version", lambda: version)
    engine, counter = _Engine(), WeightVersion()
    engine_sglang.load(engine, {"w": 1, "b": 2}, "off", counter)
    update = ("tensors", ["w", "b"])
    assert engine.calls == (["begin", update, "end"] if session else [update])
    engine_sglang.load(engine, None, "reset", counter)  # a load that changes nothing: the policy's action only
    assert engine.calls[-1] == "flush" and counter.value == 2


def test_a_refused_weight_load_raises_naming_sglangs_message(monkeypatch):
    from rollout_parity.engines.sglang import features
    from rollout_parity.engines.vllm.weight_update import WeightVersion

    monkeypatch.setattr(features, "installed_sglang_version", lambda: "0.5.23")
    engine = _Engine(answer=(False, "update_weights_from_tensor must run between begin_weight_update() and "
                                    "end_weight_update()", 0))
    with pytest.raises(RuntimeError, match="SGLang's update_weights_from_tensor failed: update_weights_from_tensor "
                                           "must run between"):
        engine_sglang.load(engine, {"w": 1}, "off", WeightVersion())
    assert engine.calls[-1] == "end"  # the session is closed even so


def test_the_sampler_reaches_sglang_in_its_own_terms():
    got = {}

    class Engine:
        def generate(self, input_ids, sampling_params, return_logprob):
            got.update(ids=input_ids, params=sampling_params, logprob=return_logprob)
            return [{"output_ids": [7, 8], "meta_info": {"output_token_logprobs": [(-0.5, 7, None), (-1.5, 8, None)],
                                                         "cached_tokens": 3}} for _ in input_ids]

    from rollout_parity.grpo_rounds import Config

    cfg = Config("s", Engine(), "off", {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "min_p": 0.0})
    batch = engine_sglang.generate(cfg, [[1, 2], [3]], samples=2, max_tokens=2)
    assert got["ids"] == [[1, 2], [1, 2], [3], [3]] and got["logprob"] is True  # a GRPO group per prompt
    assert got["params"] == {"temperature": 0.7, "top_k": -1, "top_p": 0.9, "min_p": 0.0, "max_new_tokens": 2,
                             "ignore_eos": True}  # top_k 0 ("off" to the doctor) is SGLang's -1
    assert batch.prompts == got["ids"] and batch.logprobs == [[-0.5, -1.5]] * 4
    assert (batch.tokens, batch.cached_tokens) == (8, 12)


def test_vllms_driver_keeps_the_rows_and_kwargs_it_had():
    from rollout_parity.doctor import rows

    assert rows.ROW_SPECS is engine_vllm.ROW_SPECS and rows.engine_kwargs is engine_vllm.engine_kwargs
    assert engine_rows("vllm").parity_rows == ("d", "s/sampler")
    assert engine_rows("sglang").parity_rows == ("d", "s/full-vocab")


def test_the_saved_sglang_run_reads_back_with_verls_lines_and_names_only():
    """docs/data/doctor_sglang.json (a live run in SGLang's venv) through today's advice, lines and watch block."""
    import json
    from pathlib import Path

    from rollout_parity.doctor import format_recommendation, recommend
    from rollout_parity.doctor.watch import format_watch

    report = json.loads((Path(__file__).resolve().parents[1] / "docs/data/doctor_sglang.json").read_text())
    report["recommendation"] = rec = recommend(report)
    assert report["engine"] == "sglang" and [s["rows"] for s in rec["steps"]] == ["a -> c", "c -> d"]
    assert set(rec["lines"]) == {"verl"}
    assert rec["lines"]["verl"].startswith("    actor_rollout_ref.rollout.name=sglang")
    text = format_recommendation(report)
    assert "no sampler-aware pi_old under SGLang" in text and "adapters recompute pi_old" not in text
    watch = format_watch(report)
    assert "verl rollout_corr/k3_kl" in watch and "TRL" not in watch and "NeMo RL" not in watch
    vllm = {**report, "engine": "vllm", "engine_name": "vLLM"}  # the same numbers read as a vLLM run
    vllm["recommendation"] = recommend(vllm)
    assert "TRL rollout_correction/k3_kl" in format_watch(vllm)


def test_the_environment_picks_sglangs_cpu_path_without_a_gpu_and_restores_what_was_there(monkeypatch):
    import os

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # the caller's value wins
    with engine_sglang.environment(None) as threads:
        assert threads is None and os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
        assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
    assert "SGLANG_USE_CPU_ENGINE" not in os.environ and os.environ["TOKENIZERS_PARALLELISM"] == "true"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with engine_sglang.environment(None):
        assert "SGLANG_USE_CPU_ENGINE" not in os.environ  # a GPU: SGLang's own device
