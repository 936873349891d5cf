"""The weight-sync and MoE flags at verl's start (issue 26): accepted, carried, or refused by name.

verl's own Hydra config, composed as the other verl tests compose it. The sync check needs verl's colocated
("naive") sync; routing replay has no FSDP path in verl. ``test_verl_moe.py`` runs the accepted flags for real.
"""

from __future__ import annotations

import json

import pytest

from rollout_parity.testing.stack import need

need("verl", extra="verl")

from integration_tests.support.verl_configs import compose_verl  # noqa: E402
from rollout_parity.adapters import verl as adapter  # noqa: E402
from rollout_parity.adapters.verl import patches  # noqa: E402
from rollout_parity.adapters.verl.sync import SYNC_CHECK_VERL_NAMES  # noqa: E402

pytestmark = [pytest.mark.verl]


@pytest.mark.parametrize("overrides, named", [
    (["+rollout_parity.moe_routing_replay=true"], r"moe_routing_replay=true: verl replays routes only in its "
                                                   r"Megatron and VeOmni engines"),
    (["+rollout_parity.weight_sync_check_interval=1", "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"],
     r"weight_sync_check_interval with actor_rollout_ref\.rollout\.checkpoint_engine\.backend='nccl'"),
    (["+rollout_parity.weight_sync_check_interval=-2"], "weight_sync_check_interval"),
])
def test_what_verl_cannot_do_of_the_sync_flags_is_refused_at_start(overrides, named):
    with pytest.raises(ValueError, match=named):
        adapter.configure_verl(compose_verl(*overrides))
    assert adapter.active_config() is None


def test_the_sync_check_is_carried_to_every_ray_process():
    config = compose_verl("+rollout_parity.weight_sync_check_interval=2",
                          "+rollout_parity.weight_sync_check_threshold=0.1")
    try:
        cfg = adapter.configure_verl(config)
        assert cfg.weight_sync_check_interval == 2 and cfg.weight_sync_check_threshold == 0.1
        carried = json.loads(config.ray_kwargs.ray_init.runtime_env.env_vars[adapter.ENV_CONFIG])
        assert carried["weight_sync_check_interval"] == 2 and adapter.active_config() == cfg
    finally:
        adapter.set_active_config(None)


def test_the_sync_points_are_patched_where_verl_defines_them():
    """The check's verl name is required when the check is on; both sync points wrap verl's own methods."""
    import inspect

    import verl.workers.engine_workers as workers

    from rollout_parity.framework_api import missing_names

    points = {p.dotted: p for p in patches.PATCH_POINTS}
    # what the check wraps is a patch point; what it calls (to bring an offloaded actor back) exists in this verl
    assert "verl.workers.engine_workers.ActorRolloutRefWorker.update_weights" in set(SYNC_CHECK_VERL_NAMES) & set(points)
    assert "verl.workers.engine.fsdp.transformer_impl.FSDPEngine.to" in SYNC_CHECK_VERL_NAMES
    assert not missing_names(SYNC_CHECK_VERL_NAMES)
    assert "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension.update_weights_from_ipc" in points
    method = workers.ActorRolloutRefWorker.update_weights
    assert getattr(method, "__rollout_parity_patch__", False) and inspect.iscoroutinefunction(method)
    from verl.single_controller.base.decorator import MAGIC_ATTR

    assert getattr(method, MAGIC_ATTR)["blocking"] is False  # verl's @register metadata reads through
