#!/usr/bin/env bash
# verl GRPO on GSM8K with rollout-parity: the stock verl quick-start command line, plus ONE
# flag (marked below). Needs a GPU machine with `pip install rollout-parity[verl]` and the
# GSM8K parquet files from verl's examples/data_preprocess/gsm8k.py.
#
# What the flag does (docs/verl.md): at start, verl's config validation also validates the
# rollout_parity block into a CorrectionConfig, loads the adapter in every worker
# (model.external_lib), merges the vLLM parity recipe into
# actor_rollout_ref.rollout.engine_kwargs.vllm and turns on rollout logprobs. Your policy loss
# (actor_rollout_ref.actor.policy_loss.loss_mode: vanilla, gspo, cispo, ...) stays as it is: it
# receives the correction through verl's own rollout_is_weights and response_mask.
#
# The flag is token-level truncated importance sampling (TIS at 2): it reweights, never rejects, so
# it does no harm at any answer length. Every shared flag (docs/flags.md) works the same way, e.g.
#   +rollout_parity.fp32_lm_head=true          (fp32 head on the FSDP actor and in vLLM)
#   +rollout_parity.old_logprob_source=bypass  (rollout logprobs are pi_old)
# Rejection only with thresholds fitted to this run's length and model: `rollout-parity doctor
# --model <your model> --response_length 512` prints the lines to add (docs/thresholds.md).
set -euo pipefail

# The adapter is found through its `verl.plugins` entry point; this line makes the script
# work also where the package is on PYTHONPATH only (harmless otherwise).
export VERL_USE_EXTERNAL_MODULES="${VERL_USE_EXTERNAL_MODULES:+$VERL_USE_EXTERNAL_MODULES,}rollout_parity.adapters.verl"

DATA="${DATA:-$HOME/data/gsm8k}"
MODEL="${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.max_response_length=512 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.strategy=fsdp \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=true \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    trainer.logger='["console"]' \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.total_epochs=1 \
    +rollout_parity.rollout_importance_sampling_mode=token_truncate \
    "$@"
#   ^^^ the one-flag change: everything above it is verl's stock GRPO command
