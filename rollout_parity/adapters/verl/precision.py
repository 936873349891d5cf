"""The ``precision`` flag in verl: one compute dtype written to the trainer's keys and the engine's together.

Where verl 0.9.1 reads each side's dtype (``core/precision.py`` has the flag and why fp16):

* **the FSDP actor and ref** (``strategy`` fsdp/fsdp2): ``FSDPEngine._build_fsdp_module``
  (``verl/workers/engine/fsdp/transformer_impl.py:391-411``) takes FSDP's ``param_dtype`` from
  ``fsdp_config.mixed_precision.param_dtype``, and **bf16 whenever ``mixed_precision`` is unset**; the
  forward's autocast follows it (``:1555-1559``, skipped for fp32), and an fp16 ``param_dtype`` makes a
  ``ShardedGradScaler(growth_interval=400)`` that scales the loss before backward and unscales before the
  gradient clip (``:404-411``, ``:763-765``, ``:798-820``). The engine never reads ``fsdp_config.dtype``
  (``verl/workers/config/engine.py:98``, "model dtype"). verl's older FSDP workers (verl < 0.9 unless
  ``trainer.use_legacy_worker_impl=disable``) read it instead: ``dp_actor.py`` for the autocast and the
  grad scaler, always; ``fsdp_workers.py`` for FSDP's ``param_dtype`` while ``mixed_precision`` is unset.
  So the flag writes both, ``fsdp_config.dtype`` and ``fsdp_config.mixed_precision.param_dtype`` (reduce
  and buffer dtypes stay verl's fp32).
  fp16 training on FSDP needs nothing more: the grad scaler comes with the ``param_dtype``; the master
  weights stay in ``fsdp_config.model_dtype`` (fp32).
* **the Megatron actor and ref** (``strategy`` megatron): ``megatron.dtype``
  (``verl/workers/engine/megatron/transformer_impl.py:292``), which also sets Megatron's optimizer to fp16
  with dynamic loss scaling (``:545``; ``verl/utils/megatron/optimizer.py:159-169``, initial scale 32768).
  ``McoreEngineConfig`` takes bf16 or fp16 only (``verl/workers/config/engine.py:218``): fp32 is refused.
* **the rollout engine**: ``rollout.dtype`` (``verl/workers/rollout/vllm_rollout/vllm_async_server.py:326``;
  SGLang's ``sglang_rollout/async_sglang_server.py:316``), which ``rollout.engine_kwargs.<engine>.dtype``
  overrides (the engine kwargs come last, ``:349`` and ``:340``); the parity recipe writes the same value there.

With the flag, a key verl's own YAML sets (``fsdp_config.dtype``, ``megatron.dtype``, ``rollout.dtype``:
bfloat16) is overwritten and printed unless the user set it on the command line; a key only a user sets
(``mixed_precision.param_dtype``, ``engine_kwargs.<engine>.dtype``) that contradicts is refused, as is one
set on the command line. Without the flag, an actor and an engine that compute in different dtypes (a
precision set on one side only) get one warning naming both.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from rollout_parity import registry
from rollout_parity.engines.vllm.fp16_models import refuse_fp16_model
from rollout_parity.adapters.verl.flags import CONFIG_KEY
from rollout_parity.core.config import CorrectionConfig, FlagError
from rollout_parity.core.precision import engine_dtype, precision_of_dtype

__all__ = ["precision_writes", "refuse_precision_contradictions", "write_precision", "trainer_dtype",
           "engine_dtype_of", "warn_one_sided_precision"]

logger = logging.getLogger(__name__)

_AR = "actor_rollout_ref."
_FSDP = ("fsdp", "fsdp2")
_warned: set[str] = set()


def _select(config: Any, key: str) -> Any:
    from rollout_parity.adapters.verl.config import select

    return select(config, key)


def _engine(config: Any) -> str:
    """The rollout engine's name (verl's default: vLLM)."""
    return str(_select(config, _AR + "rollout.name") or "vllm")


def _engine_dtype_key(config: Any) -> str:
    """The engine kwargs' dtype, which verl passes after ``rollout.dtype`` (the engine's own ``dtype`` wins)."""
    return f"{_AR}rollout.engine_kwargs.{_engine(config)}.dtype"


def _strategy(config: Any) -> Optional[str]:
    return _select(config, _AR + "actor.strategy")


def _roles(config: Any) -> list[str]:
    """The actor, and the ref where the config has one."""
    return ["actor"] + (["ref"] if _select(config, _AR + "ref") is not None else [])


def precision_writes(config: Any, cfg: CorrectionConfig) -> dict[str, Any]:
    """Every key the flag writes (dotted, from the root) and its value, for this config's strategy.

    The value is verl's own spelling: ``bfloat16``/``float16``/``float32`` for the ``dtype`` keys (verl's
    YAML), ``bf16``/``fp16``/``fp32`` for FSDP's ``mixed_precision.param_dtype`` (``PrecisionType``'s).
    """
    precision = cfg.precision
    if precision is None:
        return {}
    strategy = _strategy(config)
    writes: dict[str, Any] = {}
    for role in _roles(config):
        if strategy in (None, *_FSDP):
            writes[f"{_AR}{role}.fsdp_config.dtype"] = engine_dtype(precision)
            writes[f"{_AR}{role}.fsdp_config.mixed_precision.param_dtype"] = precision
        elif strategy == "megatron":
            writes[f"{_AR}{role}.megatron.dtype"] = engine_dtype(precision)
    writes[_AR + "rollout.dtype"] = engine_dtype(precision)
    writes[_engine_dtype_key(config)] = engine_dtype(precision)
    return writes


def _set_by_user_only(key: str) -> bool:
    """Keys verl's own YAML never sets: any value there is the user's."""
    return key.endswith(".mixed_precision.param_dtype") or (".engine_kwargs." in key and key.endswith(".dtype"))


def refuse_precision_contradictions(config: Any, cfg: CorrectionConfig, explicit: set[str]) -> None:
    """Raise ``ValueError`` naming the key when the flag cannot be written as it says (nothing written yet).

    ``explicit`` are the keys the user set on the command line."""
    precision = cfg.precision
    if precision is None:
        return
    if precision == "fp16" and _engine(config) == "vllm":  # vLLM's refusal, before Ray instead of at engine build
        try:
            refuse_fp16_model(_select(config, "actor_rollout_ref.model.path"), "actor_rollout_ref.model.path")
        except FlagError as exc:
            raise ValueError(str(exc).replace("precision:", f"{CONFIG_KEY}.precision:", 1)) from None
    strategy = _strategy(config)
    if strategy not in (None, *_FSDP, "megatron"):
        raise ValueError(f"{CONFIG_KEY}.precision={precision!r} with actor_rollout_ref.actor.strategy={strategy!r}: "
                         "the flag writes the dtype keys of verl's FSDP (fsdp, fsdp2) and Megatron actors; set "
                         f"{strategy}'s dtype and actor_rollout_ref.rollout.dtype to one value yourself instead")
    if strategy == "megatron" and precision == "fp32":
        raise ValueError(f"{CONFIG_KEY}.precision='fp32' with actor_rollout_ref.actor.strategy='megatron': verl's "
                         "Megatron engine computes in bfloat16 or float16 only (McoreEngineConfig.dtype); use "
                         f"{CONFIG_KEY}.precision=bf16 or fp16")
    for key in precision_writes(config, cfg):
        current = _select(config, key)
        if current is None or precision_of_dtype(current) == precision:
            continue
        if _set_by_user_only(key) or key in explicit:
            raise ValueError(
                f"{key}={current!r} contradicts {CONFIG_KEY}.precision={precision!r}, which sets the trainer's and "
                f"the engine's dtype together ({', '.join(precision_writes(config, cfg))}): drop the {key} "
                f"override, or set {CONFIG_KEY}.precision to the dtype you want on both sides")


def write_precision(config: DictConfig, cfg: CorrectionConfig) -> None:
    """Write :func:`precision_writes` into ``config`` (struct mode lifted by the caller)."""
    for key, value in precision_writes(config, cfg).items():
        if ".engine_kwargs." in key:
            continue  # the parity recipe's (config._merge_vllm_recipe), the same value
        parent, name = key.rsplit(".", 1)
        node = config
        for part in parent.split("."):
            if node.get(part, None) is None:
                node[part] = {}
            node = node[part]
        node[name] = value


def _fsdp_reads_dtype(config: Any) -> bool:
    """Whether this verl's FSDP actor computes in ``fsdp_config.dtype``: its older workers do (verl < 0.9, unless
    ``trainer.use_legacy_worker_impl=disable``; ``dp_actor.py``'s autocast), its engine does not."""
    if importlib.util.find_spec("verl.workers.fsdp_workers") is None:
        return False
    return _select(config, "trainer.use_legacy_worker_impl") != "disable"


def trainer_dtype(config: Any) -> tuple[str, Optional[str], str]:
    """``(key, precision, described)``: the actor's compute dtype as this verl reads it, the key it comes from,
    and ``key=value`` for a message (what the engine makes of an unset key, where it is unset)."""
    strategy = _strategy(config)
    if strategy == "megatron":
        key = _AR + "actor.megatron.dtype"
        return key, precision_of_dtype(_select(config, key)), f"{key}={_select(config, key)!r}"
    if strategy not in (None, *_FSDP):
        return "", None, ""
    dtype_key = _AR + "actor.fsdp_config.dtype"
    declared = _select(config, dtype_key)
    if _fsdp_reads_dtype(config):  # the older dp_actor's autocast: fsdp_config.dtype
        return dtype_key, precision_of_dtype(declared), f"{dtype_key}={declared!r}"
    mixed = _AR + "actor.fsdp_config.mixed_precision.param_dtype"
    if _select(config, mixed) is not None:
        return mixed, precision_of_dtype(_select(config, mixed)), f"{mixed}={_select(config, mixed)!r}"
    return mixed, "bf16", (f"{mixed} unset: verl's FSDP engine then computes in bf16, whatever "
                           f"{dtype_key}={declared!r} says")


def engine_dtype_of(config: Any) -> tuple[str, Optional[str]]:
    """``(key, precision)``: the engine's dtype (``engine_kwargs.<engine>.dtype`` over ``rollout.dtype``);
    None for ``auto`` (the checkpoint's dtype, unknown here)."""
    kwargs = _engine_dtype_key(config)
    if _select(config, kwargs) is not None:
        return kwargs, precision_of_dtype(_select(config, kwargs))
    key = _AR + "rollout.dtype"
    return key, precision_of_dtype(_select(config, key))


def warn_one_sided_precision(config: Any) -> Optional[str]:
    """Without the flag: one warning (once per process) when the actor and the vLLM engine compute in
    different dtypes; the message, or None. Never refuses, never raises on a config of another shape."""
    if isinstance(config, DictConfig) and OmegaConf.select(config, "actor_rollout_ref", default=None) is None:
        return None
    try:
        _, t_precision, trainer = trainer_dtype(config)
        e_key, e_precision = engine_dtype_of(config)
        e_value = _select(config, e_key)
    except Exception:  # noqa: BLE001 - a config of another trainer: nothing to compare
        return None
    if t_precision is None or e_precision is None or t_precision == e_precision:
        return None
    engine = _engine(config)
    engine = next((u.name for u in registry.ENGINES if u.key == engine), engine)
    message = (f"rollout-parity: the actor computes in {t_precision} ({trainer}) but the {engine} engine in "
               f"{e_precision} ({e_key}={e_value!r}): a precision set on one side only, so pi_rollout and pi_old "
               f"differ by the two dtypes' rounding. `rollout-parity doctor` measures what it costs on your model "
               f"(its p/mixed row); +{CONFIG_KEY}.precision=<bf16|fp16|fp32> sets both sides together")
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
    return message
