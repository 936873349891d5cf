"""Test support: one update of verl's own FSDP actor on CPU with our loss, vs the core.

Run as a script (its own process: verl picks its platform once, and the gloo group is
process-wide); prints one JSON line. What runs is verl 0.9.1's ``TrainingWorker``
(the actor worker's training half): ``train_mini_batch`` -> ``FSDPEngineWithLMHead``
(FSDP2, one gloo rank) -> ``verl.workers.utils.losses.ppo_loss`` -> our registered loss ->
verl's optimizer step (SGD, so the expected update is ``-lr * grad``). The expected
parameters come from an independent copy of the same HF model updated with the core's
``compute_correction`` + ``policy_loss`` on padded tensors.

    python -m integration_tests.support.verl_actor_step_cpu <preset> [--fp32-lm-head]
"""

from __future__ import annotations

import copy
import json
import os
import sys

LR = 0.5
PROMPT_LENS = [3, 5, 2, 4]
RESPONSE_LENS = [6, 2, 7, 4]


def main(preset: str, fp32_lm_head: bool) -> dict:
    from .verl_cpu_platform import ENV, install

    os.environ.update(ENV)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    install()

    from functools import partial

    import torch
    import transformers
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo import core_algos
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
    from verl.workers.utils.losses import ppo_loss

    from rollout_parity import CorrectionConfig, compute_correction, policy_loss
    from rollout_parity.adapters import verl as adapter
    from rollout_parity.core.fp32_head import is_fp32_lm_head
    from rollout_parity.testing.tiny_model import build_tiny_model

    torch.manual_seed(0)
    path = build_tiny_model()
    cfg = CorrectionConfig.preset(preset, fp32_lm_head=fp32_lm_head)
    if cfg.rollout_rejection is not None:
        cfg = cfg.replace(rollout_rejection_threshold=0.02)  # rejects some sequences of this batch
    adapter.set_active_config(cfg)

    config_dir = os.path.abspath(os.path.join(os.path.dirname(core_algos.__file__), "..", "config"))
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.model.use_remove_padding=false",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
            "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
            "actor_rollout_ref.actor.optim.optimizer=SGD", f"actor_rollout_ref.actor.optim.lr={LR}",
            "actor_rollout_ref.actor.optim.weight_decay=0.0", "actor_rollout_ref.actor.optim.clip_grad=1e9",
            "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.actor.policy_loss.loss_mode=rollout_parity",
        ])
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    actor_config.model_config = model_config
    engine_config = actor_config.engine  # as verl's ActorRolloutRefWorker fills it
    engine_config.use_dynamic_bsz = actor_config.use_dynamic_bsz
    engine_config.max_token_len_per_gpu = actor_config.ppo_max_token_len_per_gpu
    engine_config.micro_batch_size_per_gpu = actor_config.ppo_micro_batch_size_per_gpu
    engine_config.infer_micro_batch_size_per_gpu = actor_config.ppo_micro_batch_size_per_gpu
    engine_config.infer_max_token_len_per_gpu = actor_config.ppo_max_token_len_per_gpu
    worker = TrainingWorker(config=TrainingWorkerConfig(
        model_type="language_model", model_config=model_config, engine_config=engine_config,
        optimizer_config=actor_config.optim, checkpoint_config=actor_config.checkpoint))
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=actor_config))

    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    initial = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, reference.config.vocab_size, (p + r,), generator=g)
            for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]
    B, T = len(seqs), max(RESPONSE_LENS)
    mask = (torch.arange(T)[None] < torch.tensor(RESPONSE_LENS)[:, None]).float()

    def response_logprobs(model):
        rows = []
        for ids, p, r in zip(seqs, PROMPT_LENS, RESPONSE_LENS):
            logits = model(input_ids=ids.unsqueeze(0)).logits[0].float()
            lp = torch.log_softmax(logits[p - 1:p + r - 1], -1).gather(-1, ids[p:p + r].unsqueeze(-1)).squeeze(-1)
            rows.append(torch.nn.functional.pad(lp, (0, T - r)))
        return torch.stack(rows)

    with torch.no_grad():
        old = response_logprobs(reference)
    rollout = old + torch.randn(B, T, generator=g) * 0.1
    advantages = torch.tensor([1.0, -0.7, 0.4, -1.2])
    correction = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)

    def nested(rows):
        return tu.nested_tensor_from_tensor_list(list(rows))

    L = RESPONSE_LENS
    data = tu.get_tensordict({  # the layout verl's agent loop + driver put into the TransferQueue
        "input_ids": nested(seqs), "position_ids": nested(torch.arange(len(s)) for s in seqs),
        "attention_mask": nested(torch.ones(len(s), dtype=torch.long) for s in seqs),
        "prompts": nested(s[:p] for s, p in zip(seqs, PROMPT_LENS)),
        "responses": nested(s[p:] for s, p in zip(seqs, PROMPT_LENS)),
        "loss_mask": nested(mask[i, :L[i]].long() for i in range(B)),
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

    current = response_logprobs(reference)
    loss, _ = policy_loss(cfg, current_logprobs=current, old_logprobs=old, advantages=advantages,
                          correction=correction, clip_ratio=actor_config.clip_ratio,
                          clip_ratio_c=actor_config.clip_ratio_c, loss_agg_mode=actor_config.loss_agg_mode,
                          global_num_tokens=float(mask.sum()), global_num_seqs=float(B))
    loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= LR * p.grad

    trained = dict(worker.engine.module.named_parameters())
    max_diff = moved = 0.0
    for (name, expected), start in zip(reference.named_parameters(), initial.parameters()):
        got = trained[name]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        max_diff = max(max_diff, (got.detach() - expected.detach()).abs().max().item())
        moved = max(moved, (expected.detach() - start.detach()).abs().max().item())
    torch.distributed.destroy_process_group()
    return {
        "verl_loss": verl_metrics.get("actor/pg_loss"), "core_loss": loss.item(), "max_param_diff": max_diff,
        "moved": moved, "rejected_tokens": int(mask.sum().item() - correction.mask.sum().item()),
        "fp32_head_applied": bool(is_fp32_lm_head(worker.engine.module)),
        "engine": type(worker.engine).__name__, "metric_keys": sorted(verl_metrics),
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    result = main(args[0], "--fp32-lm-head" in args)
    print("RESULT_JSON " + json.dumps(result))
