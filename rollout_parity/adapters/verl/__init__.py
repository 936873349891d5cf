"""verl adapter: the shared flags inside an unmodified ``python -m verl.trainer.main_ppo``.

Add the flags as Hydra overrides (``+rollout_parity.rollout_importance_sampling_mode=token_truncate``,
or ``+rollout_parity.preset=tis_srs_k3``); verl's own policy loss, whatever ``loss_mode`` names,
runs unchanged and reads our weights and mask through ``rollout_is_weights`` and ``response_mask``.
verl >= 0.9 imports this package in every process through its ``verl.plugins`` entry point; verl
0.8 needs ``VERL_USE_EXTERNAL_MODULES=rollout_parity.adapters.verl``. Importing it applies the
patches (:func:`apply`; :func:`revert` undoes them); a failed import is loud (``flags.loud_import_failure``),
and every Ray process that carries the flags prints one ``verl adapter active`` line.

The rooms, in the order a run meets them:

* ``flags``   the active flags and how they reach every Ray process (the job's environment);
* ``config``  translate: the ``rollout_parity`` block validated, refused by name, or written into
  verl's config (the rollout engine's parity recipe, the transport) by :func:`configure_verl`;
* ``engine``  the rollout engine (``rollout.name``: vLLM or SGLang): its recipe through verl's ``engine_kwargs``,
  what verl's path to it cannot carry refused by name;
* ``precision`` the ``precision`` flag on verl's actor, ref and rollout dtype keys, and the warning when
  the two sides differ without it;
* ``driver``  hand over: the correction once per batch in verl's rollout-correction helper;
* ``verl_keys`` verl's own correction keys and helper entry points answered by the core, and every metric
  verl's own correction logs, under verl's names;
* ``loss``    hand over: verl's own loss wrapped, and the metrics only it can see;
* ``actor``   the fp32 head and the sampler-aware pi_old pass in verl's FSDP engine;
* ``sync``    verl's weight sync: fused-MoE layers completed in vLLM, the optional sync check;
* ``rollout`` verl's vLLM server: the recipe's ``hf_overrides`` merged into verl's own (fp8, QAT);
* ``compat``  the tested verl range, the names the adapter needs, TRL side by side;
* ``patches`` where each behaviour is attached, through ``adapters/_patching.py``: apply, revert.

Math: docs/flags.md and ``rollout_parity.core``. Everything else: docs/verl.md.
"""

from __future__ import annotations

try:
    import verl  # noqa: F401
    from omegaconf import DictConfig  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised without verl installed
    raise ImportError("rollout_parity.adapters.verl needs verl: pip install rollout-parity[verl]") from exc

from rollout_parity.adapters.verl.flags import CONFIG_KEY, ENV_CONFIG, ENV_SAMPLER, MODULE, active_config, \
    active_sampler, announce, loud_import_failure, set_active_config

with loud_import_failure():  # verl's plugin loader logs a failure only at DEBUG
    from rollout_parity.adapters.verl.compat import REQUIRED_VERL_NAMES, TESTED_VERL
    from rollout_parity.adapters.verl.config import check_no_double_correction, configure_verl, \
        correction_config_from_verl, sampler_from_verl
    from rollout_parity.adapters.verl.driver import OUTSIDE_FIELD, PROCESSED_FIELD, driver_correction
    from rollout_parity.adapters.verl.loss import with_rollout_parity
    from rollout_parity.adapters.verl.patches import patcher
    from rollout_parity.core.sampler import SamplerSettings

__all__ = [
    "TESTED_VERL", "REQUIRED_VERL_NAMES", "PROCESSED_FIELD", "OUTSIDE_FIELD", "CONFIG_KEY", "ENV_CONFIG", "ENV_SAMPLER", "MODULE",
    "SamplerSettings", "configure_verl", "correction_config_from_verl", "check_no_double_correction",
    "sampler_from_verl", "set_active_config", "active_config", "active_sampler", "driver_correction",
    "with_rollout_parity", "apply", "revert", "is_applied",
]


def apply() -> None:
    """Wrap verl's names (``patches.PATCH_POINTS``); idempotent, all or nothing.

    Checks the installed verl version first (one warning outside :data:`TESTED_VERL`). Modules
    already imported are patched now (a missing name raises ``FrameworkAPIError`` and undoes what
    this call did); the others are patched when verl imports them.
    """
    patcher.apply()


def revert() -> None:
    """Put every wrapped verl name back (newest first) and stop patching on import."""
    patcher.revert()
    from rollout_parity.adapters.verl.loss import _wrapped_loss

    _wrapped_loss.cache_clear()


def is_applied() -> bool:
    """True while the eager patch points carry rollout-parity's wrappers."""
    return patcher.is_applied()


with loud_import_failure():
    apply()
announce()
