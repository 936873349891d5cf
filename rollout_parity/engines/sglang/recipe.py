"""The SGLang parity recipe: server arguments, the logprobs it returns, and a check of a live engine.

SGLang's choices, each made explicit (``ServerArgs`` field names; the release table is ``engines/sglang/features.py``):

    enable_fp32_lm_head=True     (only with fp32_lm_head=True: the head in float32, as the trainer's)
    disable_radix_cache=True     (prefix_cache_policy=off: a cache hit may reuse KV computed before a weight update;
                                  reset: the cache stays on and is flushed after every weight load)
    disable_overlap_schedule=True (one fixed execution path: SGLang's analogue of vLLM's async_scheduling=False)
    dtype                        (only with precision: the engine's dtype, the trainer's)

What SGLang's logprobs are, in every release the recipe admits: ``log_softmax(logits / T)`` over the full
vocabulary, the distribution *before* top-k / top-p / min-p (``sglang/srt/layers/sampler.py``); greedy requests
get ``log_softmax(logits)``. There is no server setting for vLLM's "processed" logprobs. So the trainer's pi_old for
an SGLang rollout is the temperature-scaled full-vocabulary logprob (``SGLANG_LOGPROBS``), never renormalised over
the sampler's kept set; ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (logprobs before the temperature) is refused at T != 1.
A per-request cache salt does not exist in SGLang: ``prefix_cache_policy=salt`` is refused by name.

Torch-free and never imports SGLang: versions from metadata, engines duck-typed (``sglang.Engine.server_args``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from rollout_parity.core.precision import engine_dtype
from rollout_parity.engines.spec import EngineParityError, normalize_prefix_cache_policy

from .features import installed_sglang_version, require_sglang_feature

__all__ = ["SGLANG_LOGPROBS", "ORIGINAL_LOGPROB_ENV", "RECIPE_SERVER_ARGS", "NEEDS_RADIX_CACHE", "sglang_parity_kwargs",
           "refuse_contradictions", "refuse_original_logprobs", "describe_engine", "verify_engine"]

#: What the trainer computes to match SGLang's returned logprobs: the temperature, nothing of top-k/top-p/min-p.
SGLANG_LOGPROBS = "temperature"
#: SGLang's switch to logprobs before the temperature (read in its scheduler process at import).
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
#: The server arguments the recipe always pins.
RECIPE_SERVER_ARGS: dict[str, Any] = {"disable_overlap_schedule": True}
#: Server arguments that extend the radix cache, so they contradict the recipe's ``disable_radix_cache=True``
#: (SGLang itself refuses the pair at launch: "enable-hierarchical-cache and disable-radix-cache are mutually
#: exclusive", read in 0.5.23's ``server_args.py``).
NEEDS_RADIX_CACHE = ("enable_hierarchical_cache",)


def sglang_parity_kwargs(fp32_lm_head: bool = False, prefix_cache_policy: str = "off", *,
                         sglang_version: Optional[str] = None, precision: Optional[str] = None,
                         **overrides: Any) -> dict[str, Any]:
    """``ServerArgs`` / ``sglang.Engine(...)`` keyword arguments that hold the recipe.

    ``sglang_version``: the engine's SGLang (default: the installed one; none here: the newest). An option the
    release cannot carry is refused by name (:class:`~.features.SglangFeatureMissingError`). ``overrides`` are
    yours (model_path, mem_fraction_static, ...); one that contradicts the recipe is a ``ValueError`` naming it.
    """
    policy = normalize_prefix_cache_policy(prefix_cache_policy)
    if policy == "salt":
        raise ValueError("prefix_cache_policy='salt': SGLang has no per-request cache salt; use 'off' (the radix "
                         "cache off) or 'reset' (the cache flushed after every weight load)")
    version = installed_sglang_version() if sglang_version is None else sglang_version
    kwargs: dict[str, Any] = dict(RECIPE_SERVER_ARGS, disable_radix_cache=policy == "off")
    if fp32_lm_head:
        require_sglang_feature("enable_fp32_lm_head", version, option="fp32_lm_head=True")
        kwargs["enable_fp32_lm_head"] = True
    if precision is not None:
        kwargs["dtype"] = engine_dtype(precision)
    for key, value in overrides.items():
        if key in kwargs and value != kwargs[key]:
            raise ValueError(f"{key}={value!r} contradicts the SGLang parity recipe ({key}={kwargs[key]!r}): drop it, "
                             "or turn off the option that asks for it")
    refuse_contradictions(kwargs, overrides)
    return {**kwargs, **overrides}


def refuse_contradictions(recipe: Mapping[str, Any], given: Mapping[str, Any], where: str = "") -> None:
    """A server argument in ``given`` that cannot run beside the ``recipe``'s, by name (``where``: the path the
    user wrote it under, e.g. verl's ``actor_rollout_ref.rollout.engine_kwargs.sglang.``)."""
    if recipe.get("disable_radix_cache"):
        for key in NEEDS_RADIX_CACHE:
            if given.get(key):
                raise ValueError(f"{where}{key}={given[key]!r} needs SGLang's radix cache, which the parity recipe "
                                 "turns off (disable_radix_cache=True: a cache hit may reuse KV computed before a "
                                 f"weight update; SGLang refuses the pair at launch): drop {key}")


def refuse_original_logprobs(temperature: Optional[float], env: Optional[Mapping[str, str]] = None) -> None:
    """``SGLANG_RETURN_ORIGINAL_LOGPROB`` set (in ``env``, default this process's, which SGLang's scheduler inherits)
    with a temperature other than 1: the engine then returns logprobs before the temperature, the trainer's are
    after it; refused by name."""
    env = os.environ if env is None else env
    if str(env.get(ORIGINAL_LOGPROB_ENV, "")).strip().lower() in ("1", "true", "yes", "on") \
            and temperature is not None and float(temperature) != 1.0:
        raise ValueError(f"{ORIGINAL_LOGPROB_ENV}=1 with temperature {temperature}: SGLang then returns logprobs of "
                         "the logits before the temperature, and the trainer scores them after it; unset it")


def _server_args(engine: Any) -> Any:
    args = getattr(engine, "server_args", None)
    if args is None:
        raise TypeError(f"{type(engine).__name__} has no server_args: pass an sglang.Engine (or its ServerArgs)")
    return args


def describe_engine(engine: Any) -> dict[str, Any]:
    """The recipe's settings as the live engine resolved them (``engine.server_args``), plus the logprobs switch."""
    args = _server_args(engine)
    return {"enable_fp32_lm_head": getattr(args, "enable_fp32_lm_head", None),
            "disable_radix_cache": getattr(args, "disable_radix_cache", None),
            "disable_overlap_schedule": getattr(args, "disable_overlap_schedule", None),
            "dtype": getattr(args, "dtype", None),
            ORIGINAL_LOGPROB_ENV: os.environ.get(ORIGINAL_LOGPROB_ENV)}


def verify_engine(engine: Any, *, fp32_lm_head: Optional[bool] = None, prefix_cache_policy: str = "off",
                  strict: bool = False) -> dict[str, bool]:
    """Each recipe setting -> whether the live engine holds it.

    ``fp32_lm_head``: None checks nothing about the head; True/False asks for that head. ``prefix_cache_policy``:
    ``off`` wants the radix cache off (``reset`` leaves it on: flushing after each load is the caller's).
    ``strict``: raise :class:`EngineParityError` naming every setting not held.
    """
    described = describe_engine(engine)
    held = {"disable_overlap_schedule": described["disable_overlap_schedule"] is True,
            "logprobs after the temperature": described[ORIGINAL_LOGPROB_ENV] in (None, "", "0", "false")}
    if normalize_prefix_cache_policy(prefix_cache_policy) == "off":
        held["disable_radix_cache"] = described["disable_radix_cache"] is True
    if fp32_lm_head is not None:
        held["enable_fp32_lm_head"] = bool(described["enable_fp32_lm_head"]) is bool(fp32_lm_head)
    missing = [k for k, ok in held.items() if not ok]
    if strict and missing:
        raise EngineParityError(f"this SGLang engine breaks parity: {', '.join(missing)} not held "
                                f"(resolved: {described})")
    return held
