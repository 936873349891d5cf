"""Test support: verl's own FSDP actor on CPU in the dtype ``+rollout_parity.precision`` wrote, one update.

Run as a script (its own process: verl picks its platform once, the gloo group is process-wide); prints one
JSON line. The config is verl's ``ppo_trainer`` composed with ``+rollout_parity.precision=<p>``,
``fp32_lm_head`` and the ``tis_srs_k3`` correction, rewritten by the adapter's own config path
(``configure_verl``); verl's ``TrainingWorker`` is then built from that rewritten config
(``verl_actor_build.training_worker``, after verl's ``validate_config``), so the dtype the actor computes in
is the one the flag's keys gave verl (its FSDP engine reads ``fsdp_config.mixed_precision.param_dtype``).

1. verl's own log-prob pass with the fp32 head: the forward's autocast and hidden dtype, the head's output
   dtype, the head against an fp64 head over the same hidden states, and verl's logprobs against the whole
   model in fp64 (the rounding the precision leaves).
2. One update (``train_mini_batch`` -> FSDP2 -> verl's ``ppo_loss`` -> verl's vanilla loss through our
   wrapper -> verl's optimizer step, through verl's grad scaler where it made one) against an independent
   copy of the HF model (fp32 master, autocast in the same dtype, fp32 head) with the core's
   ``compute_correction`` + ``policy_loss``.

    python -m integration_tests.support.verl_actor_step_precision <bf16|fp16> [--cpu-scaler] [--declared-only]

``--cpu-scaler``: verl makes its fp16 ``ShardedGradScaler`` for device "cuda", which torch disables without
CUDA (``torch/amp/grad_scaler.py``: "CUDA is not available. Disabling."); this option puts verl's same class,
with verl's own ``growth_interval``, on device "cpu" so the loss-scaled backward and the unscale before the
clip run here too. ``--declared-only``: also build verl's actor from a config without the flag that sets only
the keys verl's YAML names (``fsdp_config.dtype``, ``rollout.dtype``) to float16, and report the dtype verl's
engine computes in and the adapter's warning.
"""

from __future__ import annotations

import copy
import json
import sys


def main(precision: str, cpu_scaler: bool = False) -> dict:
    from .spread import seed
    from .verl_actor_batch import Batch, actor_overrides, start_process, update_vectors
    from .verl_actor_build import training_worker

    start_process("29534")

    import torch
    import transformers
    from verl.utils.config import omega_conf_to_dataclass

    from rollout_parity.adapters import verl as adapter
    from rollout_parity.check.verl_checks import compose_verl
    from rollout_parity.core.fp32_head import apply_fp32_lm_head, is_fp32_lm_head
    from rollout_parity.core.precision import torch_dtype
    from rollout_parity.testing.tiny_model import build_tiny_model

    torch.manual_seed(0)
    path = build_tiny_model()  # saved in bf16
    config = compose_verl(
        *actor_overrides(path),
        "+rollout_parity.preset=tis_srs_k3", "+rollout_parity.rollout_rejection_threshold=0.02",
        "+rollout_parity.fp32_lm_head=true", f"+rollout_parity.precision={precision}", base=False)
    cfg = adapter.configure_verl(config)  # the adapter's config path: the flag's keys written into verl's config
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    actor_config, worker = training_worker(config)
    engine, module = worker.engine, worker.engine.module
    if cpu_scaler and engine.scaler is not None:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        engine.scaler = ShardedGradScaler(device="cpu", growth_interval=400)  # transformer_impl.py:409's own
    scaler = engine.scaler
    scaler_state = {"scaler": type(scaler).__name__ if scaler is not None else None,
                    "scaler_enabled": bool(scaler is not None and scaler.is_enabled())}
    head = module.get_output_embeddings()
    dtype = torch_dtype(precision)

    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    initial = copy.deepcopy(reference)
    full64 = copy.deepcopy(reference).double()
    g = torch.Generator().manual_seed(3 + seed())
    batch = Batch(reference.config.vocab_size, g)
    valid, mask = batch.valid, batch.mask

    # 1. verl's own log-prob pass with the fp32 head
    seen: dict = {}

    def record(mod, args, out):
        seen["dtype"], seen["hidden"] = out.dtype, args[0].detach()

    handle = head.register_forward_hook(record)
    try:
        out = worker.infer_batch(batch.log_prob_data())
    finally:
        handle.remove()
    lp = batch.padded(out["log_probs"])
    hidden = seen["hidden"]
    weight = head.weight.full_tensor() if hasattr(head.weight, "full_tensor") else head.weight
    head64 = batch.head_fp64(hidden, weight.detach().to(dtype))  # the head's weights as FSDP hands them over
    with torch.no_grad():
        model64 = batch.response_logprobs(full64, None)

    # 2. one update through verl's ppo_loss and our wrapper, vs the core on an independent copy
    old = lp.clone()  # verl's pi_old, as its log-prob pass wrote it
    correction, advantages, verl_metrics = batch.train(worker, cfg, old, g)
    scale_after = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None

    apply_fp32_lm_head(reference)
    current = batch.response_logprobs(reference, dtype)
    loss = batch.core_update(reference, cfg, current, old, advantages, correction, actor_config)
    ours_v, theirs_v = update_vectors(module, reference, initial)
    declared = declared_only(training_worker, compose_verl, path) if "--declared-only" in sys.argv[2:] else None
    torch.distributed.destroy_process_group()
    fsdp = config.actor_rollout_ref.actor.fsdp_config
    return {
        "precision": cfg.precision, "engine": type(engine).__name__,
        "written": {"actor.fsdp_config.dtype": fsdp.dtype,
                    "actor.fsdp_config.mixed_precision.param_dtype": fsdp.mixed_precision.param_dtype,
                    "rollout.dtype": rollout.dtype,
                    "rollout.engine_kwargs.vllm.dtype": rollout.engine_kwargs["vllm"]["dtype"]},
        "autocast_dtype": str(getattr(engine, "_autocast_dtype", None)), "hidden_dtype": str(hidden.dtype),
        **scaler_state, "scale_after_step": scale_after,
        "fp32_head_applied_at_build": bool(is_fp32_lm_head(module)), "head_output_dtype": str(seen["dtype"]),
        "head_err_vs_fp64_head": (lp.double() - head64)[valid].abs().max().item(),
        "logprob_err_vs_fp64_model": (lp.double() - model64)[valid].abs().mean().item(),
        "verl_loss": verl_metrics.get("actor/pg_loss"), "core_loss": loss.item(),
        "update_cosine": torch.nn.functional.cosine_similarity(ours_v.double(), theirs_v.double(), dim=0).item(),
        "update_norm_ratio": (ours_v.double().norm() / theirs_v.double().norm()).item(),
        "update_rel_err": ((ours_v.double() - theirs_v.double()).norm() / theirs_v.double().norm()).item(),
        "moved": ours_v.abs().max().item(),
        "rejected_tokens": int(mask.sum().item() - correction.mask.sum().item()),
        "kept_tokens": int(correction.mask.sum().item()), "metric_keys": sorted(verl_metrics),
        "declared_only": declared,
    }


def declared_only(training_worker, compose_verl, path: str) -> dict:
    """Without the flag, ``fsdp_config.dtype=float16`` and ``rollout.dtype=float16`` (the keys verl's YAML
    names): the dtype verl's FSDP engine then computes in, and the adapter's warning from verl's own
    (patched) ``validate_config``."""
    import logging

    from rollout_parity.adapters import verl as adapter

    from .verl_actor_batch import PROMPT_LENS

    adapter.set_active_config(None)
    records: list = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("rollout_parity.adapters.verl.precision").addHandler(handler)
    config = compose_verl(
        f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={len(PROMPT_LENS)}",
        "actor_rollout_ref.actor.fsdp_config.dtype=float16", "actor_rollout_ref.rollout.dtype=float16", base=False)
    _, worker = training_worker(config)
    engine = worker.engine
    return {"autocast_dtype": str(engine._autocast_dtype), "scaler": type(engine.scaler).__name__
            if engine.scaler is not None else None, "warnings": [r.getMessage() for r in records]}


if __name__ == "__main__":
    print("RESULT_JSON " + json.dumps(main(sys.argv[1], cpu_scaler="--cpu-scaler" in sys.argv[2:])))
