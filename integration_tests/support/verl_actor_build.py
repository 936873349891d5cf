"""verl's FSDP actor as verl's own worker builds it, from a composed ``ppo_trainer`` config (test support).

verl's ``ActorRolloutRefWorker.__init__`` needs a Ray actor, so the CPU tests build its actor half, a
``TrainingWorker``, the way that worker does (verl 0.9.1, ``verl/workers/engine_workers.py``): the engine's
batch settings from ``actor`` and ``rollout`` (``log_prob_micro_batch_size_per_gpu``,
``log_prob_max_token_len_per_gpu``), verl's own assertions on them, and the config first through
``verl.utils.config.validate_config``, the check ``main_ppo`` runs before any worker starts. A config verl
would refuse is refused here too; nothing is filled in that verl would not fill.
"""

from __future__ import annotations

from typing import Any

__all__ = ["training_worker"]


def training_worker(config: Any) -> tuple[Any, Any]:
    """(actor config dataclass, a reset ``TrainingWorker`` with verl's ``ppo_loss``) from ``config``."""
    from functools import partial

    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
    from verl.workers.utils.losses import ppo_loss

    validate_config(config, use_reference_policy=False, use_critic=False)
    model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    actor_config.model_config = model_config
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    assert actor.use_dynamic_bsz == rollout.log_prob_use_dynamic_bsz  # verl's own assertions, in its order
    engine_config = actor_config.engine
    engine_config.use_dynamic_bsz = actor.use_dynamic_bsz
    engine_config.infer_max_token_len_per_gpu = rollout.log_prob_max_token_len_per_gpu
    engine_config.infer_micro_batch_size_per_gpu = rollout.log_prob_micro_batch_size_per_gpu
    engine_config.max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
    engine_config.micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
    engine_config.use_remove_padding = model_config.get("use_remove_padding", False)
    if actor.use_dynamic_bsz:
        assert rollout.log_prob_max_token_len_per_gpu is not None
        assert actor.ppo_max_token_len_per_gpu is not None
    else:
        assert rollout.log_prob_micro_batch_size_per_gpu is not None
        assert actor.ppo_micro_batch_size_per_gpu is not None
    worker = TrainingWorker(config=TrainingWorkerConfig(
        model_type=actor_config.model_config.get("model_type", "language_model"), model_config=model_config,
        engine_config=engine_config, optimizer_config=actor_config.optim, checkpoint_config=actor_config.checkpoint))
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=actor_config))
    return actor_config, worker
