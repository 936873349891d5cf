"""verl's own Hydra config (``ppo_trainer.yaml``) composed the way the verl tests use it, and their flags.

One place for the composition the adapter, loss-mode, bad-input and data-parallel tests share:
an FSDP actor with micro-batches of 2 and vLLM as the rollout, plus each test's overrides.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import pytest

__all__ = ["BASE_OVERRIDES", "compose_verl", "actor_config", "flags"]

BASE_OVERRIDES = ["actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                  "actor_rollout_ref.rollout.name=vllm"]


def compose_verl(*overrides: str, base: bool = True) -> Any:
    """verl's ``ppo_trainer`` config with :data:`BASE_OVERRIDES` (unless ``base=False``) and ``overrides``."""
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo import core_algos

    config_dir = os.path.abspath(os.path.join(os.path.dirname(core_algos.__file__), "..", "config"))
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=[*(BASE_OVERRIDES if base else []), *overrides])


def actor_config(*overrides: str) -> Any:
    """A real verl ActorConfig (``FSDPActorConfig``) from verl's own defaults and ``overrides``."""
    from verl.utils.config import omega_conf_to_dataclass

    return omega_conf_to_dataclass(compose_verl(*overrides).actor_rollout_ref.actor)


@pytest.fixture
def flags() -> Iterator[Callable[[Any], Any]]:
    """Set the process's flags (what plugin load does in a real run) for a test; clear them after it."""
    from rollout_parity.adapters import verl as adapter

    def _set(cfg: Any) -> Any:
        adapter.set_active_config(cfg)
        return cfg
    yield _set
    adapter.set_active_config(None)
