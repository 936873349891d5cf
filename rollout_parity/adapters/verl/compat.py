"""Which verl the adapter runs against: the tested range, the names it needs, and TRL side by side.

Every private verl name the adapter wraps or calls is checked once, by ``configure_verl``, before a
run starts (``framework_api.check_framework``); a version outside :data:`TESTED_VERL` gets one warning.
verl 0.8 has no V1 trainer: what needs its driver step is refused there (``config.py``); its sequence fractions
of the IS weights are another formula (:func:`seq_fractions_of_raw_weights`, ``verl_keys.py``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import warnings
from typing import Callable

import verl

__all__ = ["TESTED_VERL", "REQUIRED_VERL_NAMES", "verl_version", "has_v1_trainer", "seq_fractions_of_raw_weights",
           "trl_lacking_value_head"]

logger = logging.getLogger(__name__)

#: verl releases this adapter is tested with (the ``verl`` extra declares the same range).
TESTED_VERL = ">=0.8.0,<0.10"
#: Every verl name the adapter wraps or calls.
REQUIRED_VERL_NAMES = (
    "verl.utils.device.auto_set_device",
    "verl.utils.config.validate_config",
    "verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_add_to_batch",
    "verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_rejection_mask",
    "verl.trainer.ppo.core_algos.get_policy_loss_fn",
    "verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY",
    "verl.workers.utils.losses.ppo_loss",
    "verl.workers.utils.padding.response_from_nested",
    "verl.workers.utils.padding.response_to_nested",
    "verl.workers.engine.fsdp.transformer_impl.FSDPEngine._build_module",
    "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.forward_step",
    "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.prepare_model_inputs",
    "verl.models.transformers.monkey_patch.is_trl_available",
    "verl.utils.ulysses.gather_outputs_and_unpad",
    "verl.utils.metric.Metric",
    "verl.utils.metric.AggregationType",
)


def verl_version() -> str:
    return getattr(verl, "__version__", "?")


def has_v1_trainer() -> bool:
    """verl >= 0.9's TransferQueue trainer (``verl.trainer.ppo.v1``), whose driver step we can reach."""
    return importlib.util.find_spec("verl.trainer.ppo.v1") is not None


@functools.lru_cache(maxsize=None)
def seq_fractions_of_raw_weights() -> bool:
    """Whether verl's ``rollout_is_seq_fraction_high``/``_low`` are shares of sequences by their mean RAW weight.

    verl >= 0.9.0 (``compute_is_metrics``, and its ``test_seq_fraction_high_uses_raw_weights``): the raw mean,
    before truncation or masking. verl 0.8's: the mean applied weight, so its ``_high`` is 0 under every bound
    it applies. An unreadable version counts as the newer convention.
    """
    from packaging.version import InvalidVersion, Version

    try:
        return Version(Version(verl_version()).base_version) >= Version("0.9.0")
    except InvalidVersion:
        return True


_seen: dict[str, bool] = {}


def _trl_has_value_head() -> bool:
    """Whether the installed TRL still ships ``AutoModelForCausalLMWithValueHead`` (TRL < 1.16)."""
    if "value_head" not in _seen:
        found = False
        for module in ("trl.experimental.ppo", "trl"):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    found = hasattr(importlib.import_module(module), "AutoModelForCausalLMWithValueHead")
            except ImportError:
                continue
            if found:
                break
        _seen["value_head"] = found
    return _seen["value_head"]


def trl_lacking_value_head(original: Callable[[], bool]) -> bool:
    """verl's ``is_trl_available``, False when TRL lacks the value-head class verl's patch imports.

    verl's ``apply_monkey_patch`` imports TRL's ``AutoModelForCausalLMWithValueHead`` whenever TRL is
    importable; TRL 1.16 removed it, so with both installed verl's FSDP actor fails to build. Only in
    ``verl.models.transformers.monkey_patch`` (that one use) TRL then counts as unavailable.
    """
    if not original():
        return False
    if _trl_has_value_head():
        return True
    if not _seen.get("logged"):
        _seen["logged"] = True
        logger.warning("rollout-parity: TRL has no AutoModelForCausalLMWithValueHead; verl's TRL value-head "
                       "patch is skipped (verl.models.transformers.monkey_patch.is_trl_available -> False)")
    return False
