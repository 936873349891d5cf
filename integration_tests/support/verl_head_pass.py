"""Test support: verl's own FSDP2 actor on CPU/gloo running the sampler-aware pi_old pass (issue 31).

What runs is verl's own actor: the ``ppo_trainer`` config composed with the test's overrides (verl 0.9's
keys: ``actor.fsdp_config.ulysses_sequence_parallel_size``, ``fsdp_config.param_offload``,
``fsdp_config.offload_policy``), validated by the adapter's ``configure_verl`` (the driver's path), turned into
verl's dataclasses (``FSDPActorConfig`` resolves the deprecated Ulysses key into ``fsdp_config``) and built
into a ``TrainingWorker`` as verl's ``ActorRolloutRefWorker`` builds its actor: FSDP2 (``fully_shard``, the
lm_head sharded on its own) with verl's mixed precision (fp32 master, ``param_dtype`` bf16, bf16 autocast).
On 1 or 2 gloo ranks (``torch.multiprocessing``), each rank:

1. runs verl's pi_old pass (``infer_batch`` with entropy, the rollout's ``top_p``/``top_k`` active) and
   records, beside it, the head's input hidden states (an observer hook; under Ulysses gathered over the
   ranks afterwards) and the collectives of the pass (``CommDebugMode``), then the same pass without the
   sampler for the collective count it adds;
2. recomputes the expected pi_old independently: fp32 logits of the gathered hidden states against
   ``bf16(W)`` (the master weight cast as FSDP's mixed precision casts it) and against the fp32 master,
   each through the core's full-logits ``sampler_logprobs``;
3. with ``probe``: scores the sync check's probe (the actor side of ``weight_sync_check_interval``) after
   the actor was put back where verl's ``update_weights`` leaves it, recording verl's ``FSDPEngine.to``
   calls around that forward.

Rank 0 writes one JSON line.

    python -m integration_tests.support.verl_head_pass '<options as JSON>'
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from .processes import free_port

PROMPT_LENS = [3, 5, 2, 4]
RESPONSE_LENS = [6, 2, 7, 5]
TEMPERATURE = 0.7
DEFAULTS = {"ranks": 1, "sp": 1, "sp_key": "fsdp_config", "remove_padding": True, "param_offload": False,
            "offload_policy": False, "fp32_head": True, "top_p": 0.9, "top_k": -1, "probe": False, "extra": []}


def _overrides(opts: dict, path: str) -> list[str]:
    actor = "actor_rollout_ref.actor."
    out = [f"actor_rollout_ref.model.path={path}", f"{actor}strategy=fsdp2", "actor_rollout_ref.rollout.name=vllm",
           f"actor_rollout_ref.model.use_remove_padding={str(opts['remove_padding']).lower()}",
           "actor_rollout_ref.model.enable_gradient_checkpointing=false",
           "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
           f"{actor}fsdp_config.use_torch_compile=false", f"{actor}ppo_micro_batch_size_per_gpu=2",
           f"{actor}fsdp_config.param_offload={str(opts['param_offload']).lower()}",
           f"{actor}fsdp_config.offload_policy={str(opts['offload_policy']).lower()}",
           f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", f"actor_rollout_ref.rollout.top_p={opts['top_p']}",
           f"actor_rollout_ref.rollout.top_k={opts['top_k']}",
           f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={len(PROMPT_LENS)}",
           "+rollout_parity.preset=tis_srs_k3", f"+rollout_parity.fp32_lm_head={str(opts['fp32_head']).lower()}"]
    out += opts["extra"]
    if opts["sp"] > 1:
        key = "ulysses_sequence_parallel_size"
        out.append(f"{actor}fsdp_config.{key}={opts['sp']}" if opts["sp_key"] == "fsdp_config"
                   else f"{actor}{key}={opts['sp']}")
    return out


def _build(opts: dict, path: str):
    """verl's config, validated by the adapter, and verl's actor built from it as ActorRolloutRefWorker does."""
    from rollout_parity.adapters import verl as adapter
    from rollout_parity.check.verl_checks import compose_verl

    from .verl_actor_build import training_worker

    config = compose_verl(*_overrides(opts, path), base=False)
    adapter.configure_verl(config)  # the driver's validation and flags (refusals raise here)
    return config, training_worker(config)[1]


def _worker(rank: int, port: int, opts: dict, path: str, out_dir: str) -> None:
    from .verl_cpu import ENV, install

    os.environ.update(ENV)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(opts["ranks"]), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    install()
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=opts["ranks"])
    try:
        result = _run(opts, path)
    except Exception as exc:  # noqa: BLE001 - reported to the test, with the rank that saw it
        import traceback

        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()


def _inputs(vocab: int):
    import torch
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, vocab, (p + r,), generator=g) for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]

    def nested(rows):
        return tu.nested_tensor_from_tensor_list(list(rows))

    def batch():
        mask = [torch.ones(r, dtype=torch.long) for r in RESPONSE_LENS]
        data = {"input_ids": nested(seqs), "position_ids": nested(torch.arange(len(s)) for s in seqs),
                "attention_mask": nested(torch.ones(len(s), dtype=torch.long) for s in seqs),
                "prompts": nested(s[:p] for s, p in zip(seqs, PROMPT_LENS)),
                "responses": nested(s[p:] for s, p in zip(seqs, PROMPT_LENS)),
                "loss_mask": nested(mask), "response_mask": nested(mask)}
        return tu.get_tensordict(data, non_tensor_dict={
            "temperature": TEMPERATURE, "compute_loss": False, "calculate_entropy": True, "global_token_num": None})
    return seqs, batch


def _run(opts: dict, path: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from rollout_parity.adapters import verl as adapter
    from rollout_parity.core.sampler import sampler_logprobs

    config, worker = _build(opts, path)
    engine, module = worker.engine, worker.engine.module
    head = module.get_output_embeddings()
    cfg, sampler = adapter.active_config(), adapter.active_sampler()
    seqs, batch = _inputs(module.config.vocab_size)
    seen: list = []
    handle = head.register_forward_hook(lambda mod, args, out: seen.append(args[0].detach()))

    def pass_(with_sampler: bool):
        adapter.set_active_config(cfg, sampler if with_sampler else None)
        seen.clear()
        with CommDebugMode() as comm:
            out = worker.infer_batch(batch())
        return out, comm.get_total_counts(), seen[-1]

    try:
        plain_out, plain_comms, _ = pass_(False)
        out, comms, hidden = pass_(True)
    finally:
        handle.remove()
        adapter.set_active_config(cfg, sampler)

    # the hidden states of every packed position (this rank's Ulysses slice, gathered), in verl's order
    total = sum(len(s) for s in seqs)
    if opts["remove_padding"]:
        hidden = hidden.reshape(-1, hidden.shape[-1])
        if engine.use_ulysses_sp:
            parts = [torch.empty_like(hidden) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, hidden.contiguous())
            hidden = torch.cat(parts)
        hidden = hidden[:total]
    else:
        hidden = torch.cat([hidden[i, :len(s)] for i, s in enumerate(seqs)])
    labels = torch.roll(torch.cat(seqs), -1)  # verl's labels: the packed ids rolled by one
    master = head.weight.full_tensor() if hasattr(head.weight, "full_tensor") else head.weight
    master = master.detach()

    def expected(weight):
        logits = hidden.float() @ weight.float().T  # fp32 compute, the fp32 head's semantics
        ref = sampler_logprobs(logits, labels, TEMPERATURE, sampler.top_k, sampler.top_p, return_outside=True)
        full = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, labels[:, None])[:, 0]
        return ref.logprobs, full

    result = {"error": None, "engine": type(engine).__name__, "use_ulysses_sp": bool(engine.use_ulysses_sp),
              "sp_size": int(engine.ulysses_sequence_parallel_size), "master_dtype": str(master.dtype),
              "autocast_dtype": str(engine._autocast_dtype), "comms_plain": plain_comms, "comms_sampler": comms}
    if out is not None:  # the sequence-parallel group's rank 0 collects verl's outputs
        processed = out[adapter.PROCESSED_FIELD].values()
        verl_full = out["log_probs"].values()
        ref16, full16 = expected(master.to(engine._autocast_dtype))
        ref32, _ = expected(master)
        valid = torch.isfinite(ref16)
        result.update(
            positions=int(processed.shape[0]), tokens=total,
            processed_vs_bf16_head=(processed - ref16)[valid].abs().max().item(),
            processed_vs_fp32_master=(processed - ref32)[valid].abs().max().item(),
            verl_full_vs_bf16_head=(verl_full - full16).abs().max().item(),
            plain_full_equal=bool(torch.equal(plain_out["log_probs"].values(), verl_full)),
            kept_mass_removed=(processed - verl_full)[valid].abs().max().item(),
            outside=int(out[adapter.OUTSIDE_FIELD].values().sum().item()))
    if opts["probe"]:
        result.update(_probe(worker, seqs, out))
    return result


def _probe(worker, seqs, out) -> dict:
    """The sync check's actor side after verl's update_weights has put the actor back (offloaded or not)."""
    import torch
    from verl.utils.device import get_device_id, get_device_name

    from rollout_parity.adapters.verl import sync

    engine = worker.engine
    calls: list = []
    cls = type(engine)
    original_to = cls.to

    def to(self, device, *args, **kwargs):
        calls.append(("to", device, kwargs.get("model", True)))
        return original_to(self, device, *args, **kwargs)

    handle = engine.module.register_forward_pre_hook(
        lambda mod, args, kwargs: calls.append(("forward", str(kwargs["input_ids"].device))), with_kwargs=True)
    # where verl's ActorRolloutRefWorker.update_weights leaves the actor ("3. offload model to cpu")
    if engine.is_param_offload_enabled:
        engine.to("cpu", model=True, optimizer=False, grad=False)
    cls.to = to
    try:
        prompts = [s[:p].tolist() for s, p in zip(seqs, PROMPT_LENS)]
        completions = [s[p:].tolist() for s, p in zip(seqs, PROMPT_LENS)]
        probe = sync.trainer_logprobs_where_verl_computes(engine, prompts, completions, TEMPERATURE)
    finally:
        cls.to = original_to
        handle.remove()
    # The floor of probe_vs_verl (support/floors.py): the same probe with each sequence in a batch of its own
    # (every rank runs the same forwards: FSDP gathers the parameters for each), at least the float32 spacing.
    from .floors import Floor, gaps, spacing

    alone = [sync.trainer_logprobs_where_verl_computes(engine, [p], [c], TEMPERATURE)[0, :len(c)].tolist()
             for p, c in zip(prompts, completions)]
    batched = [row[:len(c)].tolist() for row, c in zip(probe, completions)]
    floor = Floor.from_gaps(gaps(batched, alone), minimum=spacing([x for row in batched for x in row]))
    result = {"probe_calls": calls, "device_name": get_device_name(), "device_id": str(get_device_id()),
              "param_offload_enabled": bool(engine.is_param_offload_enabled), "probe_floor_max": floor.max}
    if out is not None:  # verl's own pi_old of the same tokens (full vocabulary, same temperature)
        from verl.workers.utils.padding import response_from_nested

        verl_lp = response_from_nested(out["log_probs"], batch_response_mask(seqs))
        verl_lp = torch.nested.to_padded_tensor(verl_lp, float("nan"), output_size=probe.shape)
        result["probe_vs_verl_max"] = (probe - verl_lp).abs().nan_to_num(0.0).max().item()
    return result


def batch_response_mask(seqs):
    import torch
    from verl.utils import tensordict_utils as tu

    return tu.nested_tensor_from_tensor_list([torch.ones(r, dtype=torch.long) for r in RESPONSE_LENS])


def main(raw: str) -> dict:
    import torch.multiprocessing as mp

    from rollout_parity.testing.tiny_model import build_tiny_model

    opts = {**DEFAULTS, **json.loads(raw)}
    # fp32 on disk (as the master is after any optimizer step: not bf16-representable); an untied head,
    # which FSDP2 shards on its own (verl's _select_fsdp2_wrap_targets)
    path = build_tiny_model(dtype="float32")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(free_port(), opts, path, out_dir), nprocs=opts["ranks"], join=True)
        ranks = []
        for rank in range(opts["ranks"]):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    return {**ranks[0], "ranks": ranks}


if __name__ == "__main__":
    print("RESULT_JSON " + json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "{}")))
