"""The vLLM parity recipe: engine kwargs, ``vllm serve`` flags, and a check of a live engine.

Source: ../shared/seeds/pipelinerl-vllm-v1-parity.txt ("V1 Backend Fixes", "Runtime
Defaults", "The Remaining Gap: fp32 lm_head"). vLLM V1 returns raw logprobs by default, turns
prefix caching on and may schedule asynchronously; the trainer assumes logprobs of the
distribution actually sampled from, and one fixed execution path. The recipe makes each
choice explicit:

    logprobs_mode=processed_logprobs   (the sampler's distribution, after temperature/top-k/top-p)
    enable_prefix_caching=False        (a hit may reuse KV computed before a weight update)
    async_scheduling=False
    hf_overrides={"head_dtype": "float32"}   (only with fp32_lm_head=True: the final
                                              projection in fp32, as the trainer does it)

The head dtype is asked for the same way on every vLLM: >= 0.26 honours it itself, older ones
through rollout-parity's vLLM plugin, in every engine process (``engines/vllm/head.py``).
``verify_engine`` reads the head from the processes that run the model.

This module is torch-free and never imports vLLM: the installed version is read with
``importlib.metadata`` and engines are duck-typed, so it works for ``vllm.LLM`` and
``AsyncLLM`` alike (and across the vLLM versions that expose the same config objects).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping

from rollout_parity.core.config import configs_dir
from rollout_parity.core.precision import engine_dtype
from rollout_parity.engines.spec import PREFIX_CACHE_POLICIES, EngineParityError, normalize_prefix_cache_policy

from .head import asks_fp32_head, fp32_head_plugin_problem, head_reports, head_reports_async, summarize_head
from .features import VLLM_FEATURES, VllmKnobMissingError, installed_vllm_version, \
    parse_vllm_version, require_vllm_feature, vllm_has

__all__ = [
    "RECIPE_ENGINE_KWARGS",
    "PREFIX_CACHE_POLICIES",
    "MIN_VLLM_VERSION",
    "VllmKnobMissingError",
    "EngineParityError",
    "installed_vllm_version",
    "vllm_parity_kwargs",
    "vllm_serve_flags",
    "load_recipe",
    "describe_engine",
    "verify_engine",
    "verify_engine_async",
    "normalize_prefix_cache_policy",
]

#: The engine settings the recipe pins (the seed's ``vllm_kwargs`` block).
RECIPE_ENGINE_KWARGS: dict[str, Any] = {
    "logprobs_mode": "processed_logprobs",
    "enable_prefix_caching": False,
    "async_scheduling": False,
}


#: First vLLM release that has each knob (the table is ``engines/vllm/features.py``). ``async_scheduling``
#: older than its knob means the engine never schedules asynchronously, so the kwarg is left out there.
#: ``head_dtype``: the first release that honours it for generation models; older ones get it from the plugin.
MIN_VLLM_VERSION: dict[str, str] = {name: f.since for name, f in VLLM_FEATURES.items()}



def _recipe_file() -> Path:
    """``configs/vllm_parity.yaml``, found where the presets are."""
    return configs_dir() / "vllm_parity.yaml"


# ----------------------------------------------------------------------------- versions


def _parse_version(text: str) -> tuple[int, ...]:
    return parse_vllm_version(text)


def _has_knob(knob: str, version: str | None) -> bool:
    return vllm_has(knob, version)


# ----------------------------------------------------------------------------- recipe


def vllm_parity_kwargs(
    fp32_lm_head: bool = False,
    prefix_cache_policy: str = "off",
    *,
    vllm_version: str | None = None,
    sampling_replay: bool = False,
    routed_experts: bool = False,
    precision: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Engine kwargs for ``vllm.LLM(...)`` / ``AsyncEngineArgs(...)`` that hold the recipe.

    ``sampling_replay=True`` (the ``rollout_sampling_replay`` flag) adds ``return_sampling_mask=True``:
    each sampled token comes back with the kept set vLLM sampled it from (Model Runner V2, which
    needs Triton; every request needs temperature > 0 and top_k > 0; ``core/replay.py``).

    ``routed_experts=True`` (the ``moe_routing_replay`` flag) adds ``enable_return_routed_experts=True``.
    vLLM 0.31 returns routes only from Model Runner V2 *and with prefix caching on* (``vllm/config/vllm.py``,
    ``_verify_aux_output_compatibility``: "AuxOutput Connector requires prefix caching"), so it needs
    ``prefix_cache_policy`` ``reset`` or ``salt``; ``off`` raises, naming them.

    ``precision`` (the ``precision`` flag: ``bf16`` / ``fp16`` / ``fp32``) sets the engine's ``dtype``
    (``bfloat16`` / ``float16`` / ``float32``), the one the trainer computes in; None leaves vLLM's
    ``auto`` (the checkpoint's dtype).

    ``prefix_cache_policy`` other than ``off`` keeps prefix caching on (the weight-update
    helper then resets or salts it). ``overrides`` are extra engine kwargs (e.g.
    ``gpu_memory_utilization``); one that contradicts the recipe raises, naming the argument
    that controls it. ``hf_overrides`` are merged with the head dtype.
    ``vllm_version`` defaults to the installed one (None when vLLM is absent: assume current).

    ``fp32_lm_head=True`` sets ``hf_overrides["head_dtype"] = "float32"`` on every vLLM. Below
    vLLM 0.26 (which applies it to pooling models only) rollout-parity's vLLM plugin reads it in
    each engine process and projects in fp32; for the installed vLLM the plugin must then be
    loadable here (installed, not excluded by ``VLLM_PLUGINS``). For an engine elsewhere (an
    explicit ``vllm_version``) it must be installed in that engine's environment.

    Raises ``VllmKnobMissingError`` when the installed vLLM lacks ``logprobs_mode``, or when
    ``fp32_lm_head=True`` needs the plugin on the installed vLLM and it would not load.
    """
    policy = normalize_prefix_cache_policy(prefix_cache_policy)
    version = vllm_version if vllm_version is not None else installed_vllm_version()
    if not _has_knob("logprobs_mode", version):
        raise VllmKnobMissingError(
            f"vLLM {version} has no `logprobs_mode` (added in {MIN_VLLM_VERSION['logprobs_mode']}): "
            "its V1 engine returns raw logprobs, not the sampled distribution's. Upgrade vLLM."
        )
    kwargs: dict[str, Any] = dict(RECIPE_ENGINE_KWARGS)
    kwargs["enable_prefix_caching"] = policy != "off"
    if not _has_knob("async_scheduling", version):
        del kwargs["async_scheduling"]
    hf_overrides = dict(overrides.pop("hf_overrides", None) or {})
    if fp32_lm_head:
        problem = None if _has_knob("head_dtype", version) or vllm_version is not None else fp32_head_plugin_problem()
        if problem:
            raise VllmKnobMissingError(
                f"vLLM {version} applies hf_overrides={{'head_dtype': 'float32'}} to pooling models only "
                f"(generation models from {MIN_VLLM_VERSION['head_dtype']}); below that rollout-parity's vLLM "
                f"plugin projects the head in fp32 in every engine process, but it {problem}"
            )
        if not asks_fp32_head(hf_overrides.get("head_dtype", "float32")):
            raise ValueError(
                f"hf_overrides['head_dtype']={hf_overrides['head_dtype']!r} contradicts fp32_lm_head=True"
            )
        hf_overrides["head_dtype"] = "float32"
    if hf_overrides:
        kwargs["hf_overrides"] = hf_overrides
    if precision is not None:
        kwargs["dtype"] = engine_dtype(precision)
    if sampling_replay:
        require_vllm_feature("return_sampling_mask", version, option="rollout_sampling_replay")
        kwargs["return_sampling_mask"] = True
    if routed_experts:
        if policy == "off":
            raise ValueError(
                "routed_experts=True (moe_routing_replay) with prefix_cache_policy='off': vLLM returns routed "
                "experts only with prefix caching on ('AuxOutput Connector requires prefix caching'); use "
                "prefix_cache_policy='reset' (the cache is reset after every weight update) or 'salt'"
            )
        kwargs["enable_return_routed_experts"] = True

    for key, value in overrides.items():
        if key in kwargs and kwargs[key] != value:
            hint = {
                "enable_prefix_caching": "use prefix_cache_policy='reset' or 'salt' to keep it on safely",
                "logprobs_mode": "the recipe needs processed_logprobs",
                "async_scheduling": "the recipe needs synchronous scheduling",
                "dtype": "the precision flag sets the engine's and the trainer's dtype together",
            }.get(key, "")
            raise ValueError(
                f"override {key}={value!r} contradicts the parity recipe ({key}={kwargs[key]!r})"
                + (f": {hint}" if hint else "")
            )
        kwargs[key] = value
    return kwargs


def vllm_serve_flags(
    fp32_lm_head: bool = False,
    prefix_cache_policy: str = "off",
    *,
    style: str = "vllm",
    vllm_version: str | None = None,
    precision: str | None = None,
) -> list[str]:
    """The recipe as command-line flags.

    ``style="vllm"``: flags for ``vllm serve MODEL ...``.
    ``style="trl"``: flags for ``trl vllm-serve --model MODEL ...``. TRL's own option is
    ``--enable_prefix_caching`` (underscores, a bool value); it always passes
    ``--logprobs-mode processed_logprobs`` itself, and forwards unknown flags to
    ``vllm serve`` unchanged (so ``--no-async-scheduling`` / ``--hf-overrides`` go through).
    """
    if style not in ("vllm", "trl"):
        raise ValueError(f"style must be 'vllm' or 'trl', got {style!r}")
    kw = vllm_parity_kwargs(fp32_lm_head, prefix_cache_policy, vllm_version=vllm_version, precision=precision)
    flags: list[str] = []
    if style == "vllm":
        flags += ["--logprobs-mode", kw["logprobs_mode"]]
        flags.append("--enable-prefix-caching" if kw["enable_prefix_caching"] else "--no-enable-prefix-caching")
    else:
        flags += ["--enable_prefix_caching", str(bool(kw["enable_prefix_caching"]))]
    if "async_scheduling" in kw:
        flags.append("--async-scheduling" if kw["async_scheduling"] else "--no-async-scheduling")
    if "hf_overrides" in kw:
        flags += ["--hf-overrides", json.dumps(kw["hf_overrides"], sort_keys=True)]
    if "dtype" in kw:
        flags += ["--dtype", kw["dtype"]]
    return flags


def load_recipe(path: str | Path | None = None) -> dict[str, Any]:
    """Load ``configs/vllm_parity.yaml`` with OmegaConf and return it as a plain dict.

    Keys: ``engine`` (the engine kwargs), ``fp32_lm_head``, ``prefix_cache_policy``,
    ``weight_update`` (``pause_mode``, ``clear_cache``). Feed it back with
    ``vllm_parity_kwargs(r["fp32_lm_head"], r["prefix_cache_policy"], **extra)``.
    """
    from omegaconf import OmegaConf

    p = Path(path) if path is not None else _recipe_file()
    if not p.is_file():
        raise FileNotFoundError(f"vLLM parity recipe not found: {p}")
    data = OmegaConf.to_container(OmegaConf.load(p), resolve=True)
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a mapping at top level")
    data["prefix_cache_policy"] = normalize_prefix_cache_policy(data.get("prefix_cache_policy", "off"))
    data["fp32_lm_head"] = bool(data.get("fp32_lm_head", False))
    unknown = set(data.get("engine", {})) - set(RECIPE_ENGINE_KWARGS)
    if unknown:
        raise ValueError(f"{p}: unknown engine keys {sorted(unknown)}")
    return data


# ----------------------------------------------------------------------------- live engines


def _vllm_config(engine: Any) -> Any:
    """Find the resolved VllmConfig of an ``LLM``, ``LLMEngine``, ``AsyncLLM`` or a config."""
    seen = []
    obj = engine
    for attr in (None, "llm_engine", "engine", "engine_client"):
        target = obj if attr is None else getattr(obj, attr, None)
        if target is None:
            continue
        seen.append(type(target).__name__)
        if hasattr(target, "model_config") and hasattr(target, "cache_config"):
            return target  # a VllmConfig itself
        vc = getattr(target, "vllm_config", None)
        if vc is not None:
            return vc
    raise TypeError(
        f"cannot find a vllm_config on {type(engine).__name__} (looked at {seen}); "
        "pass a vllm.LLM, an LLMEngine, an AsyncLLM or a VllmConfig"
    )


def _asked_head(model_config: Any) -> str:
    """The head dtype the engine's config asks for (``hf_overrides["head_dtype"]``, else the model's)."""
    asked = getattr(getattr(model_config, "hf_config", None), "head_dtype", None)
    if asked is None or asked == "model":
        asked = getattr(model_config, "dtype", None)
    return "float32" if asks_fp32_head(asked) else str(asked).replace("torch.", "")


def _described(vc: Any, head: str) -> dict[str, Any]:
    mc, cc, sc = vc.model_config, vc.cache_config, vc.scheduler_config
    return {
        "vllm_version": installed_vllm_version(),
        "logprobs_mode": str(getattr(mc, "logprobs_mode", "raw_logprobs (no logprobs_mode knob)")),
        "enable_prefix_caching": bool(getattr(cc, "enable_prefix_caching", False)),
        "async_scheduling": bool(getattr(sc, "async_scheduling", False)),
        "model_dtype": str(getattr(mc, "dtype", None)).replace("torch.", ""),
        "head_dtype_asked": _asked_head(mc),
        "head_dtype": head,
    }


def describe_engine(engine: Any) -> dict[str, Any]:
    """The resolved values of the settings the recipe pins, read from a live engine.

    ``head_dtype`` is what the engine's model processes computed their head in (``float32``,
    ``bfloat16``, ``mixed: ...`` or ``unknown (why)``, see ``engines/vllm/head.py``);
    ``head_dtype_asked`` is what its config asks for.
    """
    vc = _vllm_config(engine)
    try:
        head = summarize_head(*head_reports(engine))
    except TypeError as exc:  # an AsyncLLM: its processes are asked from its event loop only
        head = f"unknown ({exc})"
    return _described(vc, head)


def _held(d: Mapping[str, Any], fp32_lm_head: bool, policy: str, strict: bool) -> dict[str, bool]:
    held: dict[str, bool] = {
        "logprobs_mode": d["logprobs_mode"] == "processed_logprobs",
        "async_scheduling_off": not d["async_scheduling"],
    }
    if policy == "off":
        held["prefix_caching_off"] = not d["enable_prefix_caching"]
    if fp32_lm_head:
        held["fp32_lm_head"] = d["head_dtype"] == "float32"
    bad = [k for k, ok in held.items() if not ok] if strict else []
    if bad:
        why = {"logprobs_mode": f"logprobs_mode={d['logprobs_mode']} (want processed_logprobs)",
               "async_scheduling_off": "async_scheduling=True (want False)",
               "prefix_caching_off": "enable_prefix_caching=True (want False, or a reset/salt policy)",
               "fp32_lm_head": f"head dtype {d['head_dtype']} in the engine's processes, asked "
                               f"{d['head_dtype_asked']} (want float32 via hf_overrides head_dtype)"}
        raise EngineParityError("engine violates the parity recipe: " + ", ".join(why[k] for k in bad))
    return held


def verify_engine(
    engine: Any,
    *,
    fp32_lm_head: bool = False,
    prefix_cache_policy: str = "off",
    strict: bool = False,
) -> dict[str, bool]:
    """Check a live engine against the recipe: ``{setting: held}``.

    Settings: ``logprobs_mode`` (processed_logprobs), ``prefix_caching_off`` (only under
    policy ``off``; under ``reset``/``salt`` the cache may stay on and the weight-update
    helper guards it), ``async_scheduling_off``, and ``fp32_lm_head`` (only when asked for).
    ``strict=True`` raises ``EngineParityError`` listing every violated setting.

    ``fp32_lm_head`` is read from the processes that run the model (vLLM's ``collective_rpc`` to
    every worker, ``engines/vllm/head.py``): held when each worker that holds the head measured an
    fp32 projection. An engine whose processes cannot be asked (a bare ``VllmConfig``, or the
    plugin not loaded there) does not hold it. For an ``AsyncLLM``, use :func:`verify_engine_async`.
    """
    policy = normalize_prefix_cache_policy(prefix_cache_policy)
    vc = _vllm_config(engine)
    head = summarize_head(*head_reports(engine)) if fp32_lm_head else "not read"
    return _held(_described(vc, head), fp32_lm_head, policy, strict)


async def verify_engine_async(
    engine: Any,
    *,
    fp32_lm_head: bool = False,
    prefix_cache_policy: str = "off",
    strict: bool = False,
) -> dict[str, bool]:
    """:func:`verify_engine` for an ``AsyncLLM``, awaited in its event loop."""
    policy = normalize_prefix_cache_policy(prefix_cache_policy)
    vc = _vllm_config(engine)
    head = summarize_head(*await head_reports_async(engine)) if fp32_lm_head else "not read"
    return _held(_described(vc, head), fp32_lm_head, policy, strict)


def _recipe_as_mapping() -> Mapping[str, Any]:  # used by tests to compare with the YAML
    return {
        "engine": dict(RECIPE_ENGINE_KWARGS),
        "fp32_lm_head": False,
        "prefix_cache_policy": "off",
        "weight_update": {"pause_mode": "keep", "clear_cache": False},
    }
