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
import os
import sys

LR = 0.5
PROMPT_LENS = [3, 5, 2, 4]
RESPONSE_LENS = [6, 2, 7, 4]


def main(preset: str) -> dict:
    from .spread import seed
    from .verl_actor_build import training_worker
    from .verl_cpu import ENV, install

    os.environ.update(ENV)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    install()

    import torch
    import transformers
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import response_from_nested

    from rollout_parity import CorrectionConfig, compute_correction, policy_loss
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

    config = compose_verl(
        f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
        "actor_rollout_ref.actor.optim.optimizer=SGD", f"actor_rollout_ref.actor.optim.lr={LR}",
        "actor_rollout_ref.actor.optim.weight_decay=0.0", "actor_rollout_ref.actor.optim.clip_grad=1e9",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.use_kl_loss=false",
        # one log-prob micro-batch: one hidden capture
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={len(PROMPT_LENS)}", base=False)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    actor_config, worker = training_worker(config)
    engine, module = worker.engine, worker.engine.module
    head = module.get_output_embeddings()

    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    initial = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(3 + seed())
    seqs = [torch.randint(0, reference.config.vocab_size, (p + r,), generator=g)
            for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]
    B, T = len(seqs), max(RESPONSE_LENS)
    L = RESPONSE_LENS
    mask = (torch.arange(T)[None] < torch.tensor(L)[:, None]).float()

    def nested(rows):
        return tu.nested_tensor_from_tensor_list(list(rows))

    def inputs():
        return {"input_ids": nested(seqs), "position_ids": nested(torch.arange(len(s)) for s in seqs),
                "attention_mask": nested(torch.ones(len(s), dtype=torch.long) for s in seqs),
                "prompts": nested(s[:p] for s, p in zip(seqs, PROMPT_LENS)),
                "responses": nested(s[p:] for s, p in zip(seqs, PROMPT_LENS)),
                "loss_mask": nested(mask[i, :L[i]].long() for i in range(B)),
                "response_mask": nested(mask[i, :L[i]].long() for i in range(B))}

    # 1. verl's own log-prob pass, fp32 head then bf16 head, against an fp64 head on the same hidden states
    seen: dict = {}

    def record(mod, args, out):
        seen["dtype"], seen["hidden"], seen["weight_dtype"] = out.dtype, args[0].detach(), mod.weight.dtype

    def log_prob_pass():
        data = tu.get_tensordict(inputs(), non_tensor_dict={
            "temperature": 1.0, "compute_loss": False, "calculate_entropy": False, "global_token_num": None})
        handle = head.register_forward_hook(record)
        try:
            out = worker.infer_batch(data)
        finally:
            handle.remove()
        lp = response_from_nested(out["log_probs"], inputs()["response_mask"])
        return torch.nested.to_padded_tensor(lp, 0.0, output_size=(B, T)), seen["dtype"], seen["hidden"]

    applied_at_build = is_fp32_lm_head(module)
    lp32, dtype32, hidden = log_prob_pass()
    revert_fp32_lm_head(module)
    lp16, dtype16, _ = log_prob_pass()
    apply_fp32_lm_head(module)
    weight = head.weight.full_tensor() if hasattr(head.weight, "full_tensor") else head.weight
    # the head in fp64 over the very hidden states verl's pass produced (bf16 weights, as FSDP computes)
    # (use_remove_padding=false: verl runs one padded row per sequence)
    flat = torch.cat([hidden[i, :len(s)] for i, s in enumerate(seqs)]).double()
    logits64 = flat @ weight.detach().to(torch.bfloat16).double().T
    ids = torch.cat([torch.roll(s, -1) for s in seqs])
    lp64_flat = torch.log_softmax(logits64, -1).gather(-1, ids[:, None]).squeeze(-1)
    starts = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    lp64 = torch.zeros(B, T, dtype=torch.float64)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        lp64[i, :r] = lp64_flat[starts[i] + p - 1: starts[i] + p - 1 + r]
    valid = mask.bool()

    # 2. one update through verl's ppo_loss and our wrapper, vs the core on an independent copy
    with torch.no_grad():
        old = lp32.clone()  # verl's pi_old (fp32 head), as its log-prob pass wrote it
    # sequences 0 and 2 far off (sum K3 ~0.03, rejected by the preset's 1e-3), 1 and 3 near parity (~1e-4, kept):
    # every batch seed both rejects and trains, where one mismatch for all let a seed reject the whole batch
    rollout = old + torch.randn(B, T, generator=g) * torch.tensor([0.1, 0.01, 0.1, 0.01])[:, None]
    advantages = torch.tensor([1.0, -0.7, 0.4, -1.2])
    correction = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
    data = tu.get_tensordict({  # the layout verl's agent loop + driver put into the TransferQueue
        **inputs(),
        "response_mask": nested(correction.mask[i, :L[i]].long() for i in range(B)),
        "old_log_probs": nested(old[i, :L[i]] for i in range(B)),
        "rollout_log_probs": nested(rollout[i, :L[i]] for i in range(B)),
        "advantages": nested(advantages[i] * mask[i, :L[i]] for i in range(B)),
        "rollout_is_weights": nested(correction.weights[i, :L[i]] for i in range(B)),
    }, non_tensor_dict={"temperature": 1.0, "mini_batch_size": B, "epochs": 1, "global_batch_size": B, "seed": 1,
                        "calculate_entropy": False, "dataloader_kwargs": {"shuffle": False}})
    output = worker.train_mini_batch(data)
    verl_metrics = {k: float(v[0]) if isinstance(v, list) else float(v)
                    for k, v in tu.get(output, "metrics").items() if not isinstance(v, dict)}

    apply_fp32_lm_head(reference)

    def response_logprobs(model):
        rows = []
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            for ids_, p, r in zip(seqs, PROMPT_LENS, RESPONSE_LENS):
                logits = model(input_ids=ids_.unsqueeze(0)).logits[0].float()
                lp = torch.log_softmax(logits[p - 1:p + r - 1], -1).gather(-1, ids_[p:p + r].unsqueeze(-1)).squeeze(-1)
                rows.append(torch.nn.functional.pad(lp, (0, T - r)))
        return torch.stack(rows)

    current = response_logprobs(reference)
    loss, _ = policy_loss(cfg, current_logprobs=current, old_logprobs=old, advantages=advantages,
                          correction=correction, clip_ratio=actor_config.clip_ratio,
                          clip_ratio_c=actor_config.clip_ratio_c, loss_agg_mode=actor_config.loss_agg_mode,
                          global_num_tokens=float(mask.sum()), global_num_seqs=float(B))
    loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= LR * p.grad

    trained = dict(module.named_parameters())
    ours, theirs = [], []
    for (name, expected), start in zip(reference.named_parameters(), initial.parameters()):
        got = trained[name]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        ours.append((got.detach().float() - start.detach()).flatten())
        theirs.append((expected.detach() - start.detach()).flatten())
    ours_v, theirs_v = torch.cat(ours), torch.cat(theirs)
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
