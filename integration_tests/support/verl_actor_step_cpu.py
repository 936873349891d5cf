"""Test support: verl's own FSDP actor on CPU, a bf16 model, the fp32 head, one update; vs the core.

Run as a script (its own process: verl picks its platform once, and the gloo group is
process-wide); prints one JSON line. What runs is verl's ``TrainingWorker`` (the actor
worker's training half) with verl's default precision: fp32 master weights, FSDP2 mixed
precision with bf16 parameters and a bf16 autocast forward. The CPU platform comes from
``integration_tests/support/verl_cpu``; TRL 1.16 is importable here, so building the actor also
exercises the adapter's TRL switch.

1. verl's own log-prob pass (``infer_batch``) with ``fp32_lm_head`` (our hook on
   ``FSDPEngine._build_module``): the head's output dtype, and verl's logprobs against an fp64
   head over the same hidden states; then the same pass with the head reverted to bf16.
2. One update, ``train_mini_batch`` -> FSDP2 -> verl's ``ppo_loss`` -> verl's vanilla loss
   through our wrapper -> verl's SGD step; the expected update comes from an independent copy of
   the HF model (fp32 master, bf16 autocast, fp32 head) with the core's ``compute_correction`` +
   ``policy_loss`` on padded tensors.

    python -m integration_tests.support.verl_actor_step_cpu <preset>

The batch (token ids) and the rollout's mismatch are drawn from seed ``3 + spread.seed()``: the suite's 3, or
one moved by the seed ``scripts/measure_spread.py`` varies (``ROLLOUT_PARITY_SEED``, inherited by this process).
"""

from __future__ import annotations

import copy
import json
import sys


def main(preset: str) -> dict:
    from .spread import seed
    from .verl_actor_batch import Batch, actor_overrides, start_process, update_vectors
    from .verl_actor_build import training_worker

    start_process("29533")

    import torch
    import transformers

    from rollout_parity import CorrectionConfig
    from rollout_parity.adapters import verl as adapter
    from rollout_parity.check.verl_checks import compose_verl
    from rollout_parity.core.fp32_head import apply_fp32_lm_head, is_fp32_lm_head, revert_fp32_lm_head
    from rollout_parity.testing.tiny_model import build_tiny_model

    torch.manual_seed(0)
    path = build_tiny_model()  # saved in bf16
    cfg = CorrectionConfig.preset(preset, fp32_lm_head=True)
    if cfg.rollout_rejection is not None:
        cfg = cfg.replace(rollout_rejection_threshold=0.02)  # rejects some sequences of this batch
    adapter.set_active_config(cfg)

    config = compose_verl(*actor_overrides(path), base=False)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    actor_config, worker = training_worker(config)
    engine, module = worker.engine, worker.engine.module
    head = module.get_output_embeddings()

    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    initial = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(3 + seed())
    batch = Batch(reference.config.vocab_size, g)
    valid, mask = batch.valid, batch.mask

    # 1. verl's own log-prob pass, fp32 head then bf16 head, against an fp64 head on the same hidden states
    seen: dict = {}

    def record(mod, args, out):
        seen["dtype"], seen["hidden"], seen["weight_dtype"] = out.dtype, args[0].detach(), mod.weight.dtype

    def log_prob_pass():
        handle = head.register_forward_hook(record)
        try:
            out = worker.infer_batch(batch.log_prob_data())
        finally:
            handle.remove()
        return batch.padded(out["log_probs"]), seen["dtype"], seen["hidden"]

    applied_at_build = is_fp32_lm_head(module)
    lp32, dtype32, hidden = log_prob_pass()
    revert_fp32_lm_head(module)
    lp16, dtype16, _ = log_prob_pass()
    apply_fp32_lm_head(module)
    weight = head.weight.full_tensor() if hasattr(head.weight, "full_tensor") else head.weight
    lp64 = batch.head_fp64(hidden, weight.detach().to(torch.bfloat16))  # bf16 weights, as FSDP computes

    # 2. one update through verl's ppo_loss and our wrapper, vs the core on an independent copy
    with torch.no_grad():
        old = lp32.clone()  # verl's pi_old (fp32 head), as its log-prob pass wrote it
    correction, advantages, verl_metrics = batch.train(worker, cfg, old, g)

    apply_fp32_lm_head(reference)
    current = batch.response_logprobs(reference, torch.bfloat16)
    loss = batch.core_update(reference, cfg, current, old, advantages, correction, actor_config)
    ours_v, theirs_v = update_vectors(module, reference, initial)
    cosine = torch.nn.functional.cosine_similarity(ours_v, theirs_v, dim=0).item()
    torch.distributed.destroy_process_group()
    return {
        "engine": type(engine).__name__,
        "autocast_dtype": str(getattr(engine, "_autocast_dtype", None)),
        "hidden_dtype": str(hidden.dtype), "head_weight_dtype_in_forward": str(seen["weight_dtype"]),
        "fp32_head_applied_at_build": bool(applied_at_build),
        "head_output_dtype_fp32_head": str(dtype32), "head_output_dtype_bf16_head": str(dtype16),
        "fp32_head_err_vs_fp64": (lp32.double() - lp64)[valid].abs().max().item(),
        "bf16_head_err_vs_fp64": (lp16.double() - lp64)[valid].abs().max().item(),
        "fp32_vs_bf16_head_mean_abs": (lp32 - lp16)[valid].abs().mean().item(),
        "verl_loss": verl_metrics.get("actor/pg_loss"), "core_loss": loss.item(),
        "update_cosine": cosine, "update_norm_ratio": (ours_v.norm() / theirs_v.norm()).item(),
        "moved": ours_v.abs().max().item(),
        "rejected_tokens": int(mask.sum().item() - correction.mask.sum().item()),
        "kept_tokens": int(correction.mask.sum().item()),
        "metric_keys": sorted(verl_metrics),
    }


if __name__ == "__main__":
    print("RESULT_JSON " + json.dumps(main(sys.argv[1])))
