"""verl's own Hydra config (``ppo_trainer.yaml``) composed the way the verl tests use it, and their flags.

The composition (an FSDP actor with micro-batches of 2 and vLLM as the rollout, plus each test's
overrides) is the package's, ``rollout_parity.check.verl_checks``, which ``rollout-parity check``
runs too; the adapter, loss-mode, bad-input and data-parallel tests import it from here with the
``flags`` fixture.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from rollout_parity.check.verl_checks import BASE_OVERRIDES, actor_config, compose_verl

__all__ = ["BASE_OVERRIDES", "compose_verl", "actor_config", "flags"]


@pytest.fixture
def flags() -> Iterator[Callable[[Any], Any]]:
    """Set the process's flags (what plugin load does in a real run) for a test; clear them after it."""
    from rollout_parity.adapters import verl as adapter

    def _set(cfg: Any) -> Any:
        adapter.set_active_config(cfg)
        return cfg
    yield _set
    adapter.set_active_config(None)
