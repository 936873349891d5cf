"""Where the verl adapter meets verl: the names it wraps, through the shared patch layer.

Each point names a verl function or method, where verl looks it up by value, and the behaviour
the wrapper adds (in the rooms ``config``, ``driver``, ``loss``, ``actor``, ``compat``). Every
wrapper passes straight through while a process has no flags. ``adapters/_patching.py`` does the
wrapping, the bookkeeping, the import hook and the revert; docs/verl.md has the table in prose.
"""

from __future__ import annotations

from typing import Any, Callable

from rollout_parity.adapters._patching import ModulePatcher, PatchPoint
from rollout_parity.adapters.verl.actor import forward_step_with_sampler_pass, fp32_head_after_build, \
    inputs_for_sampler_pass
from rollout_parity.adapters.verl.compat import TESTED_VERL, trl_lacking_value_head
from rollout_parity.adapters.verl.config import configure_verl
from rollout_parity.adapters.verl.driver import batch_in_flight, rollout_correction_helper
from rollout_parity.adapters.verl.loss import policy_loss_fn, ppo_loss_with_global_metrics
from rollout_parity.adapters.verl.rollout import engine_kwargs_without_hf_overrides, quantization_with_hf_overrides
from rollout_parity.adapters.verl.sync import checked_update_weights, moe_after_ipc_update
from rollout_parity.adapters.verl.verl_keys import bypass_loss_correction

__all__ = ["PATCH_POINTS", "patcher", "ConfigRefusal"]


try:
    from hydra.errors import CompactHydraException as _Compact
except ImportError:  # pragma: no cover - verl depends on Hydra
    _Compact = Exception


class ConfigRefusal(_Compact, ValueError):
    """A refusal of the ``rollout_parity`` block (a typo, a bad value, what verl cannot express).

    Still a ``ValueError``; Hydra's ``main`` prints a ``CompactHydraException`` as its message alone,
    so the user reads one line naming the flag and the fix, not a traceback.
    """


def _configure(config: Any) -> None:
    try:
        configure_verl(config)
    except ConfigRefusal:
        raise
    except ValueError as exc:
        raise ConfigRefusal(f"rollout-parity: {exc}") from exc


def _configure_then(original: Callable, config: Any, *args: Any, **kwargs: Any) -> Any:
    """verl's ``validate_config``, after :func:`configure_verl` (idempotent)."""
    _configure(config)
    return original(config, *args, **kwargs)


def _configure_after(original: Callable, config: Any, *args: Any, **kwargs: Any) -> Any:
    """verl's ``auto_set_device``: the first call of every verl ``main`` with the composed config,
    in the driver, before Ray starts (verl 0.8's ``main_ppo`` validates only after ``ray.init``)."""
    result = original(config, *args, **kwargs)
    _configure(config)
    return result


PATCH_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint("verl.utils.device", "auto_set_device", _configure_after,
               callers=("verl.trainer.main_ppo", "verl.trainer.main_ppo_sync"), eager=True),
    PatchPoint("verl.utils.config", "validate_config", _configure_then,
               callers=("verl.trainer.main_ppo", "verl.trainer.main_ppo_v0", "verl.trainer.main_ppo_sync"), eager=True),
    PatchPoint("verl.trainer.ppo.rollout_corr_helper", "compute_rollout_correction_and_add_to_batch",
               rollout_correction_helper, callers=("verl.trainer.ppo.v1.trainer_base", "verl.trainer.main_ppo_sync"),
               eager=True),
    # verl's bypass_mode loss looks this up in the module at call time (verl_keys.py): the flags' weights there
    PatchPoint("verl.trainer.ppo.rollout_corr_helper", "compute_rollout_correction_and_rejection_mask",
               bypass_loss_correction, eager=True),
    PatchPoint("verl.trainer.ppo.core_algos", "get_policy_loss_fn", policy_loss_fn,
               callers=("verl.workers.utils.losses", "verl.trainer.distillation.losses"), eager=True),
    PatchPoint("verl.workers.utils.losses", "ppo_loss", ppo_loss_with_global_metrics,
               callers=("verl.workers.engine_workers", "verl.trainer.distillation.losses")),
    PatchPoint("verl.workers.engine.fsdp.transformer_impl", "FSDPEngine._build_module", fp32_head_after_build),
    PatchPoint("verl.workers.engine.fsdp.transformer_impl", "FSDPEngineWithLMHead.forward_step",
               forward_step_with_sampler_pass),
    PatchPoint("verl.workers.engine.fsdp.transformer_impl", "FSDPEngineWithLMHead.prepare_model_inputs",
               inputs_for_sampler_pass),
    PatchPoint("verl.models.transformers.monkey_patch", "is_trl_available", trl_lacking_value_head),
    # the weight sync (sync.py): the fused-MoE layers completed in the vLLM worker (a module only verl's vLLM
    # rollout imports), the optional check in the actor (required at start when the check is on: config.py)
    PatchPoint("verl.workers.rollout.vllm_rollout.utils", "vLLMColocateWorkerExtension.update_weights_from_ipc",
               moe_after_ipc_update, optional=True),
    PatchPoint("verl.workers.engine_workers", "ActorRolloutRefWorker.update_weights", checked_update_weights,
               optional=True),
    # verl's vLLM server (rollout.py): the engine kwargs' hf_overrides merged into verl's own (quantization). Only
    # its process imports the module (and vLLM): not checked at start, a missing name fails loudly there.
    PatchPoint("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer._preprocess_engine_kwargs",
               engine_kwargs_without_hf_overrides, optional=True),
    PatchPoint("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer._apply_quantization",
               quantization_with_hf_overrides, optional=True),
    # verl 0.9's V1 trainer. verl 0.8's main_ppo_sync has the same method, but ``python -m`` runs
    # that module as __main__ and Ray pickles its PPOTrainer by value: no import to patch on, so
    # what needs this hook is refused there at start (config.py).
    PatchPoint("verl.trainer.ppo.v1.trainer_base", "PPOTrainer._compute_advantage", batch_in_flight, optional=True),
)

patcher = ModulePatcher("verl", PATCH_POINTS, distributions=("verl",), tested=TESTED_VERL, extra="verl")
