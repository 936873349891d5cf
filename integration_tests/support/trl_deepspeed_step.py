"""One TRL GRPO step under DeepSpeed ZeRO-3 on CPU, through accelerate, with the flags and ``fp32_lm_head``.

Run as a script (one process, its own gloo group: ``DS_ACCELERATOR=cpu``), it writes a JSON report
to ``argv[1]``. The model is bf16; ``ParityGRPOTrainer`` turns TRL's ``cast_lm_head_to_fp32`` on.
The projection TRL's fused head runs is watched at ``trl.trainer.utils._ChunkedLogProbFunction.apply``:
the dtype it computes in, the gathered (not partitioned) head weight it gets, and its log-probs
against an fp32 and a bf16 projection of the same hidden states with the same weight.

The sampler is TRL's ``rollout_func`` hook drawing from the policy itself at temperature 1
(``use_vllm=True`` is set after construction, as for a ``rollout_func`` user with vLLM: TRL keeps
sampler logprobs and applies ``importance_sampling_ratio`` only then); the engine-side parity of
the head is covered by the colocated and server runs.
"""

from __future__ import annotations

import json
import math
import sys

import torch


def main(report_path: str) -> None:
    import trl.trainer.utils as trl_utils
    from datasets import Dataset

    from integration_tests.support.trl_runs import Recorder, naive_channels, reward_distinct_chars
    from rollout_parity import CorrectionConfig
    from rollout_parity.adapters.trl import ParityGRPOConfig, ParityGRPOTrainer, apply
    from rollout_parity.testing.tiny_model import build_tiny_model

    projections: list[dict] = []
    real_apply = trl_utils._ChunkedLogProbFunction.apply

    def watched_apply(hidden, weight, bias, labels, temperature, *rest):
        out = real_apply(hidden, weight, bias, labels, temperature, *rest)
        with torch.no_grad():
            logits32 = hidden.float() @ weight.float().T / temperature
            logits16 = (hidden.bfloat16() @ weight.bfloat16().T).float() / temperature
            pick = labels.clamp(min=0).unsqueeze(-1)
            ref32 = logits32.log_softmax(-1).gather(-1, pick).squeeze(-1)
            ref16 = logits16.log_softmax(-1).gather(-1, pick).squeeze(-1)
            valid = labels >= 0
            logps = out[0].detach()
            projections.append({
                "hidden_dtype": str(hidden.dtype), "weight_dtype": str(weight.dtype),
                "weight_shape": list(weight.shape), "autocast": torch.is_autocast_enabled(hidden.device.type),
                "vs_fp32": (logps - ref32)[valid].abs().max().item(),
                "vs_bf16": (logps - ref16)[valid].abs().max().item()})
        return out

    trl_utils._ChunkedLogProbFunction.apply = watched_apply
    ds_config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                 "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
                 "gradient_accumulation_steps": "auto", "zero_allow_untested_optimizer": True}
    args = ParityGRPOConfig(
        output_dir=report_path + ".out", use_cpu=True, bf16=True, deepspeed=ds_config, report_to="none",
        save_strategy="no", seed=0, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=1, logging_steps=1, learning_rate=1e-4, model_init_kwargs={"dtype": "bfloat16"}, fp32_lm_head=True)
    prompts = [[{"role": "user", "content": f"what is {i} plus {i}?"}] for i in range(4)]
    trainer = ParityGRPOTrainer(model=build_tiny_model(), reward_funcs=reward_distinct_chars, args=args,
                                train_dataset=Dataset.from_dict({"prompt": prompts}))
    model = trainer.model

    def sample_from_the_policy(batch, tr):  # inside TRL's own ZeRO-3 gather for generation, as TRL samples
        from trl.models.utils import unwrap_model_for_generation

        ids = torch.tensor([[7, 11, 13]] * len(batch))
        with torch.no_grad(), unwrap_model_for_generation(tr.model_wrapped, tr.accelerator) as unwrapped:
            out = unwrapped.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=8,
                                     min_new_tokens=8, top_k=0, top_p=1.0, temperature=1.0, output_logits=True,
                                     return_dict_in_generate=True)
        new = out.sequences[:, 3:]
        logps = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        shift = torch.tensor([0.2, -0.4, -0.15] * 3)[: new.shape[1]]  # the deliberate mismatch of the other tests
        return {"prompt_ids": ids.tolist(), "completion_ids": new.tolist(), "logprobs": (logps + shift).tolist()}

    trainer.rollout_func, trainer.use_vllm, trainer._last_loaded_step = sample_from_the_policy, True, 0
    apply(trainer, CorrectionConfig(rollout_importance_sampling_mode="token_truncate",
                                    rollout_importance_sampling_threshold=1.5, rollout_rejection=["token_k3"],
                                    rollout_rejection_threshold=0.05, fp32_lm_head=True))
    recorder = Recorder(trainer)
    trainer.train()
    log = [h for h in trainer.state.log_history if "loss" in h][-1]
    inputs = recorder.inputs[0]
    w, keep = naive_channels(inputs, 1.5, 0.05)
    grads = recorder.token_grads(0)
    rejected = inputs["completion_mask"].bool() & ~keep
    head = model.get_output_embeddings().weight
    report = {
        "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage,
        "engine": type(trainer.model_wrapped).__name__,
        "body_dtype": str(model.get_input_embeddings().weight.dtype),
        "head_partitioned": head.numel() == 0 and list(getattr(head, "ds_shape", [])) != [],
        "projections": projections,
        "log": {k: v for k, v in log.items() if isinstance(v, (int, float))},
        "finite": all(v is None or math.isfinite(v) for v in log.values() if isinstance(v, float)),
        "ratio_matches_naive": bool((inputs["importance_sampling_ratio"] - w).abs().max() < 1e-6),
        "rejected": int(rejected.sum()), "rejected_grad_zero": bool((grads[rejected] == 0).all()),
        "kept_grad_nonzero": bool((grads[keep] != 0).any()), "grads_finite": bool(torch.isfinite(grads).all()),
    }
    with open(report_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
