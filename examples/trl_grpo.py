"""GRPO with TRL and rollout-parity: an existing TRL run plus one flag.

Runs on a laptop CPU with a tiny locally built model (no download), 2 steps, vLLM colocated::

    python examples/trl_grpo.py --rollout_importance_sampling_mode token_truncate

Every GRPOConfig flag still works, and so does every shared rollout-parity flag (docs/flags.md), on
the command line or in a TRL YAML file (``--config grpo.yaml``), e.g.::

    python examples/trl_grpo.py --rollout_importance_sampling_mode token_truncate --fp32_lm_head true

Both reweight or change precision and never reject, so they do no harm at any answer length. Add
rejection only with the thresholds ``rollout-parity doctor --response_length <max_completion_length>``
fits to your model and length (docs/thresholds.md).

With a real model: ``--model Qwen/Qwen3-0.6B --use_cpu false --bf16 true ...``.
Environment on CPU: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set below if unset).

This script imports ``ParityGRPOConfig`` / ``ParityGRPOTrainer`` (the import swap). A script that
imports ``GRPOConfig`` / ``GRPOTrainer`` from ``trl`` runs unmodified under the launcher instead::

    rollout-parity launch --rollout_importance_sampling_mode token_truncate train_grpo.py [its args]
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CPU_DEFAULTS = dict(
    output_dir="outputs/trl-grpo-parity", use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.2,
    vllm_max_model_length=256, per_device_train_batch_size=4, num_generations=4, max_completion_length=16,
    max_steps=2, logging_steps=1, learning_rate=1e-3, report_to="none", save_strategy="no", use_cpu=True,
    bf16=False, model_init_kwargs={"dtype": "float32"},
)


@dataclass
class ScriptArguments:
    model: Optional[str] = field(default=None, metadata={"help": "model path or id; default: a tiny local model"})


def reward_distinct_words(completions, **kwargs):
    """A toy reward: more distinct words is better."""
    return [float(len(set(c[0]["content"].split()))) for c in completions]


def main() -> None:
    from datasets import Dataset
    from trl import TrlParser

    from rollout_parity.adapters.trl import ParityGRPOConfig, ParityGRPOTrainer

    parser = TrlParser((ScriptArguments, ParityGRPOConfig))
    parser.set_defaults(**CPU_DEFAULTS)
    script_args, training_args = parser.parse_args_and_config()

    model = script_args.model
    if model is None:
        from rollout_parity.testing.tiny_model import build_tiny_model

        model = build_tiny_model()
    prompts = [[{"role": "user", "content": f"say something about {w}"}] for w in
               ("cats", "rivers", "numbers", "trees", "roads", "birds", "stones", "cities")]

    shim = _cpu_weight_sync_shim(training_args)
    with shim:
        trainer = ParityGRPOTrainer(model=model, reward_funcs=reward_distinct_words, args=training_args,
                                    train_dataset=Dataset.from_dict({"prompt": prompts}))
    print("rollout-parity correction:", trainer.rollout_correction)
    print("vLLM engine built with:", {k: v for k, v in (trainer.rollout_parity_engine_kwargs or {}).items()
                                      if k in ("logprobs_mode", "enable_prefix_caching", "async_scheduling",
                                               "hf_overrides")})
    trainer.train()
    for log in trainer.state.log_history:
        shown = {k: round(v, 4) for k, v in log.items()
                 if k in ("loss", "reward") or k.startswith("rollout_correction/") and
                 k.split("/")[1] in ("kl", "k3_kl", "is_weight_mean", "clipped_frac", "ess", "delta_abs_mean")}
        if shown:
            print(shown)


def _cpu_weight_sync_shim(args):
    """On CPU, vLLM repacks linear weights so TRL's in-place weight sync fails; the test shim keeps them.

    Only for this CPU demo (run from a checkout): GPU runs never need it.
    """
    import contextlib

    import torch

    if not args.use_vllm or torch.cuda.is_available():
        return contextlib.nullcontext()
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from integration_tests.support.vllm_cpu_shim import cpu_weight_sync_shim

    return cpu_weight_sync_shim()


if __name__ == "__main__":
    main()
