"""verl's vLLM rollout server: the parity recipe's ``hf_overrides`` merged into verl's own, never replacing them.

verl's ``vLLMHttpServer.launch_server`` builds vLLM's arguments as ``{..., "hf_overrides": <verl's>,
**engine_kwargs}``: verl's own dict (``_apply_quantization``: the ``quantization_config`` of an fp8 or QAT
rollout, a ``quantization_config_file``) is replaced whole by an ``hf_overrides`` in
``actor_rollout_ref.rollout.engine_kwargs.vllm``, which is where ``configure_verl`` writes the recipe's
(``head_dtype=float32`` with ``fp32_lm_head``, beside any of yours). In the server process the two wrappers
below take that dict out of the engine kwargs (verl's in-place hook on them, ``_preprocess_engine_kwargs``)
and merge it into the dict ``_apply_quantization`` returns, which verl passes to vLLM. Every key of both
sides is kept; a key both set to different values is a ``ValueError`` naming it. Both pass straight
through in a process without flags. docs/verl_plugin.md, "How the adapter plugs in".
"""

from __future__ import annotations

import json
from typing import Any, Callable

from rollout_parity.adapters.verl.flags import active_config

__all__ = ["merge_hf_overrides", "engine_kwargs_without_hf_overrides", "quantization_with_hf_overrides"]

_TAKEN = "_rollout_parity_hf_overrides"  # on verl's server: the engine kwargs' hf_overrides, until merged
_WHERE = "actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides"


def _as_dict(value: Any) -> dict:
    if isinstance(value, str):  # vLLM takes the JSON text of the dict too
        value = json.loads(value)
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(value, DictConfig):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        pass
    if not isinstance(value, dict):
        raise ValueError(f"{_WHERE}: expected a mapping, got {value!r}")
    return dict(value)


def merge_hf_overrides(verls: Any, ours: Any) -> dict:
    """verl's ``hf_overrides`` with the engine kwargs' added: every key of both; the same key set to two values
    is a ``ValueError`` naming it."""
    merged = _as_dict(verls or {})
    for key, value in _as_dict(ours or {}).items():
        if key in merged and merged[key] != value:
            raise ValueError(
                f"{_WHERE}.{key}={value!r} conflicts with verl's own hf_overrides.{key}={merged[key]!r} (set by its "
                "rollout quantization or QAT config, verl's _apply_quantization): vLLM takes one of them. Drop the "
                f"engine kwarg, or the rollout's quantization setting")
        merged[key] = value
    return merged


def engine_kwargs_without_hf_overrides(original: Callable, self: Any, engine_kwargs: dict) -> Any:
    """verl's ``_preprocess_engine_kwargs``; then the kwargs' ``hf_overrides`` set aside for the merge."""
    result = original(self, engine_kwargs)
    if active_config() is not None and engine_kwargs.get("hf_overrides") is not None:
        self.__dict__[_TAKEN] = engine_kwargs.pop("hf_overrides")
    return result


def quantization_with_hf_overrides(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """verl's ``_apply_quantization``: its quantization and its ``hf_overrides``, those of the engine kwargs merged in."""
    quantization, hf_overrides = original(self, *args, **kwargs)
    taken = self.__dict__.pop(_TAKEN, None)
    if taken is None:
        return quantization, hf_overrides
    return quantization, merge_hf_overrides(hf_overrides, taken)
