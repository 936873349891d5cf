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

This module is torch-free and never imports vLLM: the installed version is read with
``importlib.metadata`` and engines are duck-typed, so it works for ``vllm.LLM`` and
``AsyncLLM`` alike (and across the vLLM versions that expose the same config objects).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping

from .config import configs_dir
from .vllm_features import VLLM_DISTRIBUTIONS, VLLM_FEATURES, VllmKnobMissingError, installed_vllm_version, \
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
    "normalize_prefix_cache_policy",
]

#: The engine settings the recipe pins (the seed's ``vllm_kwargs`` block).
RECIPE_ENGINE_KWARGS: dict[str, Any] = {
    "logprobs_mode": "processed_logprobs",
    "enable_prefix_caching": False,
    "async_scheduling": False,
}

#: How the prefix cache is treated across in-flight weight updates (see weight_update.py).
#: ``off``: no prefix cache (the recipe). ``reset``: cache on, reset after each weight load
#: (vllm#9744); requests in flight recompute under the new weights. ``salt``: cache on, every
#: request carries ``cache_salt`` = its weight version; requests in flight keep their own KV.
PREFIX_CACHE_POLICIES = ("off", "reset", "salt")

#: First vLLM release that has each knob (the table is ``core/vllm_features.py``). ``async_scheduling``
#: older than its knob means the engine never schedules asynchronously, so the kwarg is left out there.
MIN_VLLM_VERSION: dict[str, str] = {name: f.since for name, f in VLLM_FEATURES.items()}

_DISTRIBUTIONS = VLLM_DISTRIBUTIONS


def _recipe_file() -> Path:
    """``configs/vllm_parity.yaml``, found where the presets are."""
    return configs_dir() / "vllm_parity.yaml"


class EngineParityError(RuntimeError):
    """``verify_engine(strict=True)`` found settings that break parity."""


# ----------------------------------------------------------------------------- versions


def _parse_version(text: str) -> tuple[int, ...]:
    return parse_vllm_version(text)


def _has_knob(knob: str, version: str | None) -> bool:
    return vllm_has(knob, version)


def normalize_prefix_cache_policy(policy: Any) -> str:
    """``off`` / ``reset`` / ``salt``. YAML's bare ``off`` loads as False: that means ``off``."""
    if policy is None or policy is False:
        return "off"
    if not isinstance(policy, str) or policy.lower() not in PREFIX_CACHE_POLICIES:
        raise ValueError(
            f"prefix_cache_policy must be one of {PREFIX_CACHE_POLICIES}, got {policy!r}"
        )
    return policy.lower()


# ----------------------------------------------------------------------------- recipe


def vllm_parity_kwargs(
    fp32_lm_head: bool = False,
    prefix_cache_policy: str = "off",
    *,
    vllm_version: str | None = None,
    sampling_replay: bool = False,
    **overrides: Any,
) -> dict[str, Any]:
    """Engine kwargs for ``vllm.LLM(...)`` / ``AsyncEngineArgs(...)`` that hold the recipe.

    ``sampling_replay=True`` (the ``rollout_sampling_replay`` flag) adds ``return_sampling_mask=True``:
    each sampled token comes back with the kept set vLLM sampled it from (Model Runner V2, which
    needs Triton; every request needs temperature > 0 and top_k > 0; ``core/replay.py``).

    ``prefix_cache_policy`` other than ``off`` keeps prefix caching on (the weight-update
    helper then resets or salts it). ``overrides`` are extra engine kwargs (e.g.
    ``gpu_memory_utilization``); one that contradicts the recipe raises, naming the argument
    that controls it. ``hf_overrides`` are merged with the head dtype.
    ``vllm_version`` defaults to the installed one (None when vLLM is absent: assume current).

    Raises ``VllmKnobMissingError`` when the installed vLLM lacks ``logprobs_mode``, or lacks
    ``hf_overrides["head_dtype"]`` and ``fp32_lm_head=True``.
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
        if not _has_knob("head_dtype", version):
            raise VllmKnobMissingError(
                f"vLLM {version} does not honour hf_overrides={{'head_dtype': 'float32'}} for "
                f"generation models (needs >= {MIN_VLLM_VERSION['head_dtype']}): upgrade vLLM; for "
                "an in-process engine, call rollout_parity.adapters.vllm.apply_vllm_fp32_logits_patch() "
                "before building it and pass fp32_lm_head=False here"
            )
        if hf_overrides.get("head_dtype", "float32") not in ("float32", "fp32"):
            raise ValueError(
                f"hf_overrides['head_dtype']={hf_overrides['head_dtype']!r} contradicts fp32_lm_head=True"
            )
        hf_overrides["head_dtype"] = "float32"
    if hf_overrides:
        kwargs["hf_overrides"] = hf_overrides
    if sampling_replay:
        require_vllm_feature("return_sampling_mask", version, option="rollout_sampling_replay")
        kwargs["return_sampling_mask"] = True

    for key, value in overrides.items():
        if key in kwargs and kwargs[key] != value:
            hint = {
                "enable_prefix_caching": "use prefix_cache_policy='reset' or 'salt' to keep it on safely",
                "logprobs_mode": "the recipe needs processed_logprobs",
                "async_scheduling": "the recipe needs synchronous scheduling",
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
    kw = vllm_parity_kwargs(fp32_lm_head, prefix_cache_policy, vllm_version=vllm_version)
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


def _head_dtype(model_config: Any) -> str:
    head = getattr(model_config, "head_dtype", None)  # a property on vLLM >= 0.31
    if head is None:
        head = getattr(getattr(model_config, "hf_config", None), "head_dtype", None)
    if head is None or head == "model":
        head = getattr(model_config, "dtype", None)
    head = str(head).replace("torch.", "")
    if head != "float32":
        # rollout_parity.adapters.vllm's patch for vLLM without head_dtype; seen here only
        # if applied in this process (it covers in-process engines only). The string is the
        # marker of the adapters' patch layer (adapters/_patching.MARK), which core cannot import.
        lp = sys.modules.get("vllm.model_executor.layers.logits_processor")
        cls = getattr(lp, "LogitsProcessor", None)
        if getattr(getattr(cls, "_get_logits", None), "__rollout_parity_patch__", False):
            head = "float32 (rollout-parity logits patch, in-process)"
    return head


def describe_engine(engine: Any) -> dict[str, Any]:
    """The resolved values of the settings the recipe pins, read from a live engine."""
    vc = _vllm_config(engine)
    mc, cc, sc = vc.model_config, vc.cache_config, vc.scheduler_config
    return {
        "vllm_version": installed_vllm_version(),
        "logprobs_mode": str(getattr(mc, "logprobs_mode", "raw_logprobs (no logprobs_mode knob)")),
        "enable_prefix_caching": bool(getattr(cc, "enable_prefix_caching", False)),
        "async_scheduling": bool(getattr(sc, "async_scheduling", False)),
        "model_dtype": str(getattr(mc, "dtype", None)).replace("torch.", ""),
        "head_dtype": _head_dtype(mc),
    }


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
    """
    policy = normalize_prefix_cache_policy(prefix_cache_policy)
    d = describe_engine(engine)
    held: dict[str, bool] = {
        "logprobs_mode": d["logprobs_mode"] == "processed_logprobs",
        "async_scheduling_off": not d["async_scheduling"],
    }
    if policy == "off":
        held["prefix_caching_off"] = not d["enable_prefix_caching"]
    if fp32_lm_head:
        held["fp32_lm_head"] = d["head_dtype"].startswith("float32")
    if strict:
        bad = [k for k, ok in held.items() if not ok]
        if bad:
            detail = ", ".join(
                {
                    "logprobs_mode": f"logprobs_mode={d['logprobs_mode']} (want processed_logprobs)",
                    "async_scheduling_off": "async_scheduling=True (want False)",
                    "prefix_caching_off": "enable_prefix_caching=True (want False, or a reset/salt policy)",
                    "fp32_lm_head": f"head dtype {d['head_dtype']} (want float32 via hf_overrides)",
                }[k]
                for k in bad
            )
            raise EngineParityError(f"engine violates the parity recipe: {detail}")
    return held


def _recipe_as_mapping() -> Mapping[str, Any]:  # used by tests to compare with the YAML
    return {
        "engine": dict(RECIPE_ENGINE_KWARGS),
        "fp32_lm_head": False,
        "prefix_cache_policy": "off",
        "weight_update": {"pause_mode": "keep", "clear_cache": False},
    }
