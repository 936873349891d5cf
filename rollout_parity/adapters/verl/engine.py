"""verl's rollout engine (``actor_rollout_ref.rollout.name``): the engine's parity recipe written through verl's own
``engine_kwargs.<engine>``, what verl's path to that engine cannot carry refused by name.

vLLM: the recipe's engine kwargs in ``engine_kwargs.vllm``, and verl's own ``enable_prefix_caching`` /
``logprobs_mode`` fields set to the recipe's (verl passes both to vLLM too). SGLang: the recipe's server arguments
in ``engine_kwargs.sglang`` (verl 0.9.1 spreads that dict last into ``ServerArgs(...)``,
``verl/workers/rollout/sglang_rollout/async_sglang_server.py``). SGLang's logprobs are ``log_softmax(logits / T)``
over the full vocabulary, the form verl's actor recomputes pi_old in, so there is no sampler-aware pi_old for it.
docs/verl_sglang.md.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from rollout_parity import registry
from rollout_parity.adapters.verl.compat import verl_version
from rollout_parity.adapters.verl.flags import CONFIG_KEY
from rollout_parity.core.config import CorrectionConfig

__all__ = ["rollout_engine", "engine_recipe", "refuse_engine", "refuse_recipe_contradictions", "merge_engine_recipe",
           "engine_reproduces_sampler"]

_ROLLOUT = "actor_rollout_ref.rollout."
#: verl's own rollout fields that feed the vLLM engine beside engine_kwargs.vllm.
_VLLM_OWN_FIELDS = ("enable_prefix_caching", "logprobs_mode")


def _select(config: Any, key: str, default: Any = None) -> Any:
    from rollout_parity.adapters.verl.config import select

    return select(config, key, default)


def rollout_engine(config: Any) -> str:
    """``actor_rollout_ref.rollout.name`` (verl's default: ``vllm``), refused by name when no engine of ours."""
    name = str(_select(config, _ROLLOUT + "name", "vllm"))
    engines = registry.keys("engine")
    if name not in engines:
        raise ValueError(f"{_ROLLOUT}name={name!r}: rollout-parity's verl adapter writes the parity recipe of "
                         f"{', '.join(engines)} only; no {name} equivalent is written or tested. Set {_ROLLOUT}name "
                         f"to one of them, or drop the +{CONFIG_KEY}.* overrides (verl's own "
                         f"algorithm.rollout_correction works with {name})")
    return name


def engine_recipe(engine: str, cfg: CorrectionConfig, *, precision: Optional[str] = None) -> dict[str, Any]:
    """The engine's parity kwargs for these flags (the prefix cache off: verl keeps one per engine)."""
    if engine == "sglang":
        from rollout_parity.engines.sglang.recipe import sglang_parity_kwargs

        return sglang_parity_kwargs(fp32_lm_head=cfg.fp32_lm_head, precision=precision)
    from rollout_parity.engines.vllm.recipe import vllm_parity_kwargs

    return vllm_parity_kwargs(fp32_lm_head=cfg.fp32_lm_head, precision=precision)


def engine_reproduces_sampler(engine: str) -> bool:
    """Whether the engine's returned logprobs are the sampler's processed distribution (vLLM's recipe), so that a
    truncating sampler needs a sampler-aware pi_old; SGLang's are the tempered full-vocabulary logprobs."""
    return engine != "sglang"


def _verl_sglang_source() -> Optional[str]:
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "workers/rollout/sglang_rollout/async_sglang_server.py"
    return path.read_text() if path.is_file() else None


def refuse_engine(config: Any, cfg: CorrectionConfig) -> str:
    """The rollout engine, after refusing by name what verl's path to it cannot carry (before anything loads)."""
    engine = rollout_engine(config)
    if engine != "sglang":
        return engine
    from rollout_parity.engines.sglang.features import SGLANG_DISTRIBUTIONS, SUPPORTED_SGLANG, \
        installed_sglang_version, sglang_has
    from rollout_parity.engines.sglang.recipe import ORIGINAL_LOGPROB_ENV, refuse_original_logprobs
    from rollout_parity.framework_api import check_framework

    env_vars = _select(config, "ray_kwargs.ray_init.runtime_env.env_vars", {}) or {}
    env = {**os.environ, **{str(k): str(v) for k, v in dict(env_vars).items()}}  # the job's own over the driver's
    try:
        refuse_original_logprobs(_select(config, _ROLLOUT + "temperature", 1.0), env)
    except ValueError as exc:
        raise ValueError(f"{_ROLLOUT}name=sglang: {exc} (the server actors see the driver's environment and "
                         f"ray_kwargs.ray_init.runtime_env.env_vars.{ORIGINAL_LOGPROB_ENV})") from None
    if cfg.weight_sync_check_interval:
        raise ValueError(f"weight_sync_check_interval with {_ROLLOUT}name=sglang: the check probes the engine from "
                         "inside verl's vLLM weight sync; verl's SGLang sync is not hooked yet. Set "
                         "weight_sync_check_interval=0, or roll out with vLLM")
    version = installed_sglang_version()
    if version is not None:  # one warning outside the releases the recipe was read and run for
        check_framework("SGLang", distributions=SGLANG_DISTRIBUTIONS, tested=SUPPORTED_SGLANG, extra="sglang")
    source = _verl_sglang_source() or ""
    if version is not None and sglang_has("server_args_struct", version) and "dataclasses.fields(ServerArgs" \
            in source.replace(" ", ""):
        raise ValueError(f"{_ROLLOUT}name=sglang: verl {verl_version()}'s SGLang server reads ServerArgs with "
                         f"dataclasses.fields, which SGLang {version} refuses (a msgspec Struct since 0.5.20): "
                         "install the SGLang your verl pins (verl[sglang]), e.g. sglang==0.5.12")
    if version is not None and sglang_has("weight_update_session", version) and source \
            and "begin_weight_update" not in source:
        raise ValueError(f"{_ROLLOUT}name=sglang: SGLang {version} loads weights from tensors only between "
                         f"begin_weight_update() and end_weight_update() (since 0.5.21), which verl "
                         f"{verl_version()} never calls: its first weight sync would fail. Install the SGLang your "
                         "verl pins (verl[sglang])")
    return engine


def refuse_recipe_contradictions(config: Any, cfg: CorrectionConfig, explicit: set[str]) -> None:
    """A setting the user chose against the engine's parity recipe, by name (nothing is written yet).

    ``engine_kwargs.<engine>`` is refused whenever it contradicts. For vLLM, verl's own fields feed the same
    engine: ``logprobs_mode`` (verl's default is the recipe's) is refused whenever it differs;
    ``enable_prefix_caching`` (verl's default, True, is not the recipe's) when set on the command line
    (``explicit``), otherwise overwritten and printed.
    """
    engine = rollout_engine(config)
    recipe = engine_recipe(engine, cfg)
    where = f"{_ROLLOUT}engine_kwargs.{engine}"
    given = _select(config, where, {}) or {}
    given = OmegaConf.to_container(given, resolve=True) if isinstance(given, DictConfig) else dict(given)
    for key, value in recipe.items():
        current = given.get(key)
        pairs = [(f"{key}.{k}", (current or {}).get(k), v) for k, v in value.items()] if isinstance(value, dict) \
            else [(key, current, value)]
        for name, mine, theirs in pairs:
            if mine is not None and mine != theirs:
                raise ValueError(f"{where}.{name}={mine!r} contradicts the parity recipe "
                                 f"({name.rsplit('.', 1)[-1]}={theirs!r})")
    if engine == "sglang":
        from rollout_parity.engines.sglang.recipe import refuse_contradictions

        refuse_contradictions(recipe, given, where=where + ".")
    if engine != "vllm":
        return
    for key in _VLLM_OWN_FIELDS:
        current = _select(config, _ROLLOUT + key)
        if key in recipe and current is not None and current != recipe[key] \
                and (key == "logprobs_mode" or _ROLLOUT + key in explicit):
            raise ValueError(f"{_ROLLOUT}{key}={current!r} contradicts the parity recipe ({key}={recipe[key]!r}), "
                             f"the same setting as engine_kwargs.vllm.{key}: drop the override, or the "
                             f"+{CONFIG_KEY}.* overrides")


def merge_engine_recipe(config: DictConfig, cfg: CorrectionConfig) -> None:
    """Write the engine's recipe into ``engine_kwargs.<engine>`` beside the user's keys (a dict value merged)."""
    engine = rollout_engine(config)
    recipe = engine_recipe(engine, cfg, precision=cfg.precision)
    rollout = config.actor_rollout_ref.rollout
    if rollout.get("engine_kwargs", None) is None:
        rollout.engine_kwargs = {}
    if rollout.engine_kwargs.get(engine, None) is None:
        rollout.engine_kwargs[engine] = {}
    kwargs = rollout.engine_kwargs[engine]
    for key, value in recipe.items():
        current = kwargs.get(key, None)
        if isinstance(value, dict):
            merged = dict(OmegaConf.to_container(current, resolve=True)) if current is not None else {}
            kwargs[key] = {**merged, **value}
        else:
            kwargs[key] = value
    if engine == "vllm":
        for key in _VLLM_OWN_FIELDS:  # verl passes these from its own fields too
            if key in recipe and key in rollout:
                rollout[key] = recipe[key]
