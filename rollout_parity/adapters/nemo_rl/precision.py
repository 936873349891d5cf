"""The ``precision`` flag in NeMo RL: ``policy.precision`` and the generation's dtype, set together.

``loss_fn.rollout_correction.precision`` names one dtype for the trainer and the vLLM engine
(``core/precision.py``). Where NeMo RL reads each (v0.7.0 and main alike):

* the trainer: ``policy.precision`` (``float32`` | ``bfloat16`` | ``float16``): the DTensor workers' autocast
  and FSDP ``param_dtype`` (``models/policy/workers/dtensor_policy_worker.py``, ``models/automodel/setup.py``),
  Megatron's ``model_cfg.fp16``/``bf16`` and ``params_dtype`` (``models/megatron/setup.py``,
  ``_apply_precision_config``);
* the engine: ``policy.generation.vllm_cfg.precision``, which ``vllm_worker.py`` passes to ``vllm.LLM`` as
  ``dtype`` (NeMo RL's recipes write ``${policy.precision}`` there; a recipe may break the link);
* Megatron's optimizer: with ``use_precision_aware_optimizer`` NeMo RL asserts
  ``policy.megatron_cfg.optimizer.fp16`` (or ``bf16``) matches ``policy.precision``
  (``models/megatron/setup.py``, ``_validate_dtype_config``), and only ``fp16=True`` gives Megatron's
  optimizer its loss scaler: so with ``policy.megatron_cfg.enabled`` the flag writes both optimizer keys.

NeMo RL's DTensor workers have no loss scaler (a plain ``loss.backward()``: ``models/automodel/train.py``,
``dtensor_policy_worker.py``): fp16 there trains unscaled, which the flag says once.

:func:`configure_precision` runs where ``grpo.setup()`` starts (``turn_on``), on the config NeMo RL has
composed, overridden and resolved, before any worker reads it. A value the user gave on NeMo RL's command
line (a Hydra override) that contradicts the flag is refused by name; a recipe value (NeMo RL's example
recipes all set ``policy.precision: bfloat16``) is overwritten and printed. Without the flag, a trainer and
an engine in different dtypes get one warning naming both.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping, Optional

from rollout_parity.engines.vllm.fp16_models import refuse_fp16_model
from rollout_parity.adapters.nemo_rl.translate import BLOCK_KEY, carries_block, split_loss_config
from rollout_parity.core.config import FlagError
from rollout_parity.core.precision import engine_dtype, precision_of_dtype

__all__ = ["POLICY_KEY", "GENERATION_KEY", "precision_writes", "configure_precision", "warn_one_sided_precision",
           "command_line_keys", "record_command_line"]

logger = logging.getLogger(__name__)

POLICY_KEY = "policy.precision"
GENERATION_KEY = "policy.generation.vllm_cfg.precision"
_OPTIMIZER = "policy.megatron_cfg.optimizer."
_FLAG = f"loss_fn.{BLOCK_KEY}.precision"
_warned: set[str] = set()
_command_line: set[str] = set()


def _get(node: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if node is None:
            return None
        node = node.get(part) if isinstance(node, Mapping) else getattr(node, part, None)
    return node


def _set(root: Any, dotted: str, value: Any) -> None:
    *parents, name = dotted.split(".")
    node = root
    for part in parents:
        child = node.get(part) if isinstance(node, Mapping) else getattr(node, part)
        if child is None:
            child = {}
            node[part] = child
        node = child
    node[name] = value


def precision_writes(config: Any, precision: Optional[str]) -> dict[str, Any]:
    """Every key (dotted from the recipe's root) the flag writes, and its value in NeMo RL's spelling."""
    if precision is None:
        return {}
    writes: dict[str, Any] = {POLICY_KEY: engine_dtype(precision)}
    if _get(config, "policy.generation.backend") in (None, "vllm"):
        writes[GENERATION_KEY] = engine_dtype(precision)
    if _get(config, "policy.megatron_cfg.enabled"):
        writes[_OPTIMIZER + "fp16"] = precision == "fp16"
        writes[_OPTIMIZER + "bf16"] = precision == "bf16"
    return writes


def record_command_line(original: Any, cfg: Any, overrides: list, *args: Any, **kwargs: Any) -> Any:
    """NeMo RL's ``parse_hydra_overrides``: the keys its command line sets, remembered (Hydra's own parser)."""
    result = original(cfg, overrides, *args, **kwargs)
    from hydra.core.override_parser.overrides_parser import OverridesParser

    _command_line.update(o.key_or_group for o in OverridesParser.create().parse_overrides(overrides=list(overrides)))
    return result


def command_line_keys() -> set[str]:
    """The keys NeMo RL's command line set in this process (``parse_hydra_overrides``), empty before it runs."""
    return set(_command_line)


def configure_precision(config: Any, explicit: Optional[Iterable[str]] = None) -> Optional[str]:
    """Apply ``loss_fn.rollout_correction.precision`` to a resolved NeMo RL config in place (NeMo RL's
    ``MasterConfig`` or a plain dict); warn once when it is unset and the two sides differ.

    ``explicit``: the keys the user set on the command line (default: what ``parse_hydra_overrides`` saw).
    Returns the flag's precision (None when unset). Raises ``ValueError`` naming the key and the fix.
    """
    loss = _get(config, "loss_fn")
    cfg = split_loss_config(loss)[0] if carries_block(loss) else None
    precision = None if cfg is None else cfg.precision
    if precision is None:
        warn_one_sided_precision(config)
        return None
    explicit = command_line_keys() if explicit is None else set(explicit)
    if precision == "fp16":  # vLLM's own refusal, named at setup instead of when the engine builds
        try:
            refuse_fp16_model(_get(config, "policy.model_name"), "policy.model_name")
        except FlagError as exc:
            raise ValueError(str(exc).replace("precision:", f"{_FLAG}:", 1)) from None
    backend = _get(config, "policy.generation.backend")
    if backend not in (None, "vllm", "megatron"):
        raise ValueError(f"{_FLAG}={precision!r} with policy.generation.backend={backend!r}: the flag writes "
                         f"{POLICY_KEY} and vLLM's {GENERATION_KEY}; set {backend}'s dtype to {POLICY_KEY} yourself "
                         f"and drop {_FLAG}")
    generation = _get(config, GENERATION_KEY)
    if backend in (None, "vllm") and generation is not None and precision_of_dtype(generation) is None:
        raise ValueError(f"{GENERATION_KEY}={generation!r} contradicts {_FLAG}={precision!r}: NeMo RL's {generation} "
                         f"rollout engine is not one dtype the trainer can compute in; drop {_FLAG}, or the "
                         f"{generation} rollout")
    writes = precision_writes(config, precision)
    changed = []
    for key, value in writes.items():
        current = _get(config, key)
        same = current == value if isinstance(value, bool) else precision_of_dtype(current) == precision
        if same:
            continue
        if key in explicit:
            raise ValueError(f"{key}={current!r} contradicts {_FLAG}={precision!r}, which sets the trainer's and the "
                             f"engine's dtype together ({', '.join(writes)}): drop the {key} override, or set "
                             f"{_FLAG} to the dtype you want on both sides")
        changed.append((key, current, value))
    for key, _, value in changed:
        _set(config, key, value)
    if changed:  # a recipe value replaced: said where it shows (NeMo RL's own logging setup hides INFO)
        print("[rollout-parity] NeMo RL settings overridden: "
              + "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed), flush=True)
    if precision == "fp16" and not _get(config, "policy.megatron_cfg.enabled"):
        _once(f"rollout-parity: {_FLAG}='fp16' on NeMo RL's DTensor policy worker, which has no loss scaler (a plain "
              "loss.backward()): gradients below fp16's smallest subnormal (6e-8) become zero. Its Megatron backend "
              "(policy.megatron_cfg.enabled) scales the loss")
    return precision


def _once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def warn_one_sided_precision(config: Any) -> Optional[str]:
    """Without the flag: one warning (once per process) when ``policy.precision`` and the vLLM engine's
    dtype differ; the message, or None. Never refuses."""
    policy, generation = _get(config, POLICY_KEY), _get(config, GENERATION_KEY)
    if _get(config, "policy.generation.backend") not in (None, "vllm"):
        return None
    trainer, engine = precision_of_dtype(policy), precision_of_dtype(generation)
    if trainer is None or engine is None or trainer == engine:
        return None
    message = (f"rollout-parity: the trainer computes in {trainer} ({POLICY_KEY}={policy!r}) but the vLLM engine in "
               f"{engine} ({GENERATION_KEY}={generation!r}): a precision set on one side only, so pi_rollout and "
               "pi_old differ by the two dtypes' rounding. `rollout-parity doctor` measures what it costs on your "
               f"model (its p/mixed row); {_FLAG}: <bf16|fp16|fp32> sets both sides together")
    _once(message)
    return message
