"""The doctor's measurement: engines, rounds with real weight updates, the trainer's scores, the rows."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping, Optional

from rollout_parity import quiet
from rollout_parity.doctor.advice import recommend
from rollout_parity.doctor.lengths import dropped_share, extrapolation, fit_rejection, length_scan, resample, \
    tokens_to_json
from rollout_parity.doctor.output import plot
from rollout_parity.doctor.rows import (DoctorOptions, EngineRows, RowSpec, check_requirements, correction_config,
                                        engine_driver, sampler_setting, selected_rows, validate)

__all__ = ["run_doctor"]

def run_doctor(opts: DoctorOptions) -> dict[str, Any]:
    """Run the ablation; return the report (also written to ``opts.json_path`` if set)."""
    notes = validate(opts)
    check_requirements(opts.engine, plot=bool(opts.plot_path))
    driver = engine_driver(opts.engine)

    with driver.environment(opts.threads) as threads, quiet.phase("the measurement"):  # the engine's output held
        report = _run(opts, notes, threads, driver)
    if opts.plot_path:
        plot(report.pop("_deltas"), opts.plot_path, report)
        report["plot"] = opts.plot_path
    report.pop("_deltas", None)
    if opts.json_path:
        os.makedirs(os.path.dirname(os.path.abspath(opts.json_path)), exist_ok=True)
        with open(opts.json_path, "w") as fh:
            json.dump(report, fh, indent=2, default=str)
        report["json"] = opts.json_path
    return report


def engine_sizing(opts: DoctorOptions, max_len: int) -> dict[str, Any]:
    """The sizing kwargs of every doctor engine on ``opts.engine`` (that engine's ``sizing``)."""
    return engine_driver(opts.engine).sizing(opts, max_len)


def _run(opts: DoctorOptions, notes: list[str], threads: int | None, driver: Any) -> dict[str, Any]:
    import torch

    from rollout_parity.grpo_rounds import grpo_prompt, trainer_threads, weight_versions

    t_start = time.perf_counter()
    cfg = correction_config(opts)
    timings: dict[str, Any] = {}
    say = (lambda msg: print(f"[doctor] {msg}", file=quiet.console)) if opts.progress else (lambda msg: None)

    t0 = time.perf_counter()
    model_path, built = opts.model, opts.model is None
    if built:
        from rollout_parity.testing.tiny_model import build_trained_tiny_model

        model_path = build_trained_tiny_model(log=say)
    timings["model_build_s"] = time.perf_counter() - t0

    engine_version = driver.version()  # imports the engine: fails early, before the trainer model loads
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to(device).eval()

    table: EngineRows = driver.TABLE
    specs = _precision_rows(selected_rows(opts), model_path, notes, driver)
    trainers = _trainers(trainer, specs, model_path, device)
    real_updates = opts.update_scale > 0 and opts.steps > 1 and driver.supports_updates()
    if opts.update_scale > 0 and opts.steps > 1 and not real_updates:
        notes.append(driver.NO_UPDATES_NOTE)
    versions = weight_versions(trainer.state_dict(), opts.steps, scale=opts.update_scale if real_updates else 0.0,
                               seed=opts.seed)
    prompts = [[grpo_prompt(tokenizer, v, i, sentences=opts.sentences, seed=opts.seed) for i in range(opts.num_prompts)]
               for v in range(opts.steps)]
    warm = [grpo_prompt(tokenizer, opts.steps + 1, i, sentences=opts.sentences, seed=opts.seed)
            for i in range(opts.num_prompts)]
    longest = max(len(p) for ps in prompts + [warm] for p in ps)
    need = longest + opts.max_tokens + 1
    max_len = int(2 ** math.ceil(math.log2(need)))
    positions = getattr(trainer.config, "max_position_embeddings", None)
    if positions and need <= positions < max_len:
        max_len = int(positions)  # the power of two would exceed what the model allows
    sizing = driver.sizing(opts, max_len)
    sampling = {
        "temperature": {"temperature": opts.temperature},
        "truncating": {"temperature": opts.temperature, "top_k": opts.top_k, "top_p": opts.top_p, "min_p": opts.min_p},
    }

    sampled = _sample(driver, model_path, specs, sizing, sampling, prompts, warm, versions if real_updates else None,
                      opts, timings)
    say("scoring the rollouts with the trainer, version by version")
    t0 = time.perf_counter()
    with trainer_threads() as timings["trainer_threads"]:
        scores, stale, probes = _score_versions(trainers, specs, sampled["batches"], versions, sampling, opts,
                                                real_updates, table)
    timings["trainer_s"] = time.perf_counter() - t0
    rows, deltas, tensors = _rows_report(specs, cfg, scores, sampled, table)
    for row in rows:  # the dtype of the trainer that scored the row, read back from its parameters
        row["trainer_dtype"] = _dtype_name(trainers[table.rows[row["row"]].trainer_precision])
    t0 = time.perf_counter()
    lengths = _lengths(cfg, rows, tensors, opts, table)
    lengths["extrapolation"] = extrapolation(opts.max_tokens, opts.response_length, longest,
                                             _trained_window(model_path) if built else None)
    if (lengths["extrapolation"] or {}).get("beyond_training"):
        notes.append(_beyond_training_note(lengths["extrapolation"], opts.max_tokens, opts.response_length))
    timings["lengths_s"] = time.perf_counter() - t0

    entropy_row = "d" if _view(table.rows["d"]) in scores else specs[0].name
    entropy_parts = scores[_view(table.rows[entropy_row])]
    entropy = torch.cat([p.entropy[p.mask.bool()] for p in entropy_parts])
    timings["total_s"] = time.perf_counter() - t_start
    report: dict[str, Any] = {
        "model": model_path,
        "tiny_model_built": built,
        "engine": opts.engine,
        "engine_name": driver.NAME,
        "engine_version": engine_version,
        f"{opts.engine}_version": engine_version,
        "options": {k: v for k, v in asdict(opts).items() if k not in ("progress",)},
        "sampling": {"temperature": opts.temperature, "truncating": sampler_setting(opts), "top_k": opts.top_k,
                     "top_p": opts.top_p, "min_p": opts.min_p, "max_tokens": opts.max_tokens,
                     "response_length": opts.response_length},
        "workload": {"versions": opts.steps, "prompts_per_version": opts.num_prompts, "samples": opts.samples,
                     "prompt_tokens": [min(len(p) for ps in prompts for p in ps), longest],
                     "sequences_per_row": opts.steps * opts.num_prompts * opts.samples},
        "weight_updates": {"real": real_updates, "scale": opts.update_scale if real_updates else 0.0,
                           "stale_delta_abs_mean": statistics.fmean(stale) if stale else None},
        "mean_entropy": float(entropy.mean()) if entropy.numel() else float("nan"),
        "mean_entropy_row": entropy_row,
        "correction_preset": opts.preset,
        "correction_overrides": dict(opts.overrides),
        "correction_config": cfg.to_dict(),
        "sizing_kwargs": sizing,
        "cpu_threads": threads,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "rows": rows,
        "lengths": lengths,
        "precision": _precision_report(specs, trainers, probes, notes, table),
        "notes": notes,
        "timings": timings,
    }
    recipe = next((r for r in rows if r["row"] == "d"), None)
    report["recipe_delta_abs_mean"] = recipe["delta_abs_mean"] if recipe else None
    report["recommendation"] = recommend(report)
    advised_shares(rows, report["recommendation"], tensors)
    report["_deltas"] = deltas
    return report


def advised_shares(rows: list[dict[str, Any]], recommendation: Mapping[str, Any], tensors: Mapping[str, tuple]) -> None:
    """Each row's share of sequences the *recommended* flags take out of the loss (``rejected_seq_frac_advised``),
    beside the measured preset's ``rejected_seq_frac``: the table shows what the run the advice is for would drop."""
    from rollout_parity.core.config import CorrectionConfig

    flags = recommendation.get("flags")
    if not flags:
        return
    advised = CorrectionConfig(**flags)
    for row in rows:
        if row["row"] in tensors:
            row["rejected_seq_frac_advised"] = dropped_share(advised, tensors[row["row"]])


def _sample(driver: Any, model_path: str, specs: list[RowSpec], sizing: Mapping[str, Any],
            sampling: Mapping[str, Mapping[str, Any]], prompts: list[list[list[int]]], warm: list[list[int]],
            weights: list[Mapping[str, Any]] | None, opts: DoctorOptions, timings: dict[str, Any]) -> dict[str, Any]:
    """Build every engine the rows need, warm them up, run the interleaved rounds, shut them down.

    Returns the batches per configuration, each engine's resolved settings and each row's
    ``verify_engine`` result.
    """
    from tqdm.auto import tqdm

    from rollout_parity.grpo_rounds import Config, run_rounds, warm_up

    configs_of = driver.TABLE.configs
    ops = driver.ops()
    config_names = list(dict.fromkeys(s.config for s in specs))
    engine_keys = list(dict.fromkeys(configs_of[c][0] for c in config_names))
    bar = tqdm(total=len(engine_keys) + len(config_names) * (opts.steps + 1), desc="doctor",
               disable=not opts.progress, file=quiet.console)
    engines: dict[str, Any] = {}
    engine_seconds: dict[str, float] = {}
    try:
        for key in engine_keys:
            bar.set_postfix_str(f"engine {key}")
            t0 = time.perf_counter()
            engines[key] = driver.start(model_path, key, dict(sizing))
            engine_seconds[key] = time.perf_counter() - t0
            bar.update(1)
        configs = [Config(name, engines[configs_of[name][0]], configs_of[name][1], sampling[configs_of[name][2]])
                   for name in config_names]
        bar.set_postfix_str("warm-up")
        t0 = time.perf_counter()
        warm_up(configs, warm, samples=opts.samples, max_tokens=opts.max_tokens, ops=ops)
        bar.update(len(configs))
        timings["warm_up_s"] = time.perf_counter() - t0
        bar.set_postfix_str("rounds")
        t0 = time.perf_counter()
        batches = run_rounds(configs, prompts, samples=opts.samples, max_tokens=opts.max_tokens, weights=weights,
                             tick=lambda name: bar.update(1), ops=ops)
        timings["rounds_s"] = time.perf_counter() - t0
        resolved = {key: driver.describe(llm) for key, llm in engines.items()}
        held = {s.name: driver.verify(engines[configs_of[s.config][0]], fp32_lm_head=s.trainer_fp32_head,
                                      prefix_cache_policy=configs_of[s.config][1]) for s in specs}
    finally:
        bar.close()
        for llm in engines.values():
            driver.shutdown(llm)
        engines.clear()
    timings["engines_s"] = engine_seconds
    return {"batches": batches, "resolved": resolved, "held": held}


def _view(spec: RowSpec) -> tuple[str, bool, str]:
    """What a row's trainer scores: (configuration, fp32 head, trainer precision); rows may share one."""
    return spec.config, spec.trainer_fp32_head, spec.trainer_precision


def _score_versions(trainers: Mapping[str, Any], specs: list[RowSpec], batches: Mapping[str, list[Any]],
                    versions: list[Any], sampling: Mapping[str, Mapping[str, Any]], opts: DoctorOptions,
                    real_updates: bool, table: EngineRows):
    """Score each version's rollouts with the trainer (per precision) holding that version.

    Returns the scores per :func:`_view`, one per version, row d's per-token |delta| with the trainer
    one version behind (what an engine that missed an update shows), and per trainer precision the
    :class:`~rollout_parity.doctor.precision.ActivationProbe` of its forwards. The bf16 trainer holds
    ``versions[v]``; another one its own load of the checkpoint at version 0 (what its engine loaded)
    and ``versions[v]`` after, as the engines do.
    """
    from contextlib import ExitStack

    from rollout_parity.doctor.precision import ActivationProbe

    views = sorted({_view(s) for s in specs})
    scores: dict[tuple[str, bool, str], list[Any]] = {k: [] for k in views}
    stale: list[float] = []
    trainer = trainers["bf16"]
    probes = {p: ActivationProbe(m) for p, m in trainers.items()}
    try:
        with ExitStack() as stack:
            for probe in probes.values():
                stack.enter_context(probe)
            for v in range(opts.steps):
                for p, m in trainers.items():
                    if p == "bf16" or v > 0:
                        m.load_state_dict(versions[v])
                for config, fp32, precision in views:
                    t0 = time.perf_counter()
                    scores[(config, fp32, precision)].append(
                        _score(trainers[precision], batches[config][v], fp32, sampling[table.configs[config][2]],
                               opts))
                    probes[precision].seconds += time.perf_counter() - t0
                if real_updates and "d" in batches and v + 1 < opts.steps:
                    ahead = batches["d"][v + 1]
                    s = _score(trainer, ahead, True, sampling["temperature"], opts)
                    stale += _abs_deltas(s.processed, s.mask, ahead.logprobs)
    finally:
        trainer.load_state_dict(versions[0])
    return scores, stale, probes


def _precision_rows(specs: list[RowSpec], model_path: str, notes: list[str], driver: Any) -> list[RowSpec]:
    """The rows without the p/* ones when the engine refuses this model in float16 (a note says why)."""
    precision_rows = driver.TABLE.precision_rows
    if not any(s.name in precision_rows for s in specs):
        return specs
    note = driver.float16_refusal(model_path)
    if note is None:
        return specs
    kept = [s for s in specs if s.name not in precision_rows]
    if not kept:
        raise ValueError(f"--rows: {note.split(': ', 1)[1]}; choose other rows")
    notes.append(note)
    return kept


def _trainers(trainer: Any, specs: list[RowSpec], model_path: str, device: str) -> dict[str, Any]:
    """The trainer model per precision the rows need: the bf16 one given, and a float16 load of the
    checkpoint only when a row scores with one (the p/* rows)."""
    from transformers import AutoModelForCausalLM

    from rollout_parity.core.precision import torch_dtype

    trainers = {"bf16": trainer}
    for precision in dict.fromkeys(s.trainer_precision for s in specs):
        if precision not in trainers:
            trainers[precision] = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=torch_dtype(precision)).to(device).eval()
    return trainers


def _dtype_name(model: Any) -> str:
    """The dtype of a model's floating parameters (``float16``, ``bfloat16``; ``mixed: ...`` if several)."""
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if p.is_floating_point()})
    return dtypes[0] if len(dtypes) == 1 else "mixed: " + ", ".join(dtypes)


def _precision_report(specs: list[RowSpec], trainers: Mapping[str, Any], probes: Mapping[str, Any],
                      notes: list[str], table: EngineRows) -> dict[str, Any]:
    """The report's ``precision`` section: the p/* rows run, each trainer's dtype, and fp16's range on the
    model over every trainer forward, per trainer precision (``doctor/precision.py``)."""
    from rollout_parity.doctor.precision import COMFORT_DIVISOR, FP16_MAX, SHARE_DIVISOR

    forwards = {p: dict(probe.summary(_dtype_name(trainers[p])), scoring_s=probe.seconds)
                for p, probe in probes.items()}
    skipped = next((n for n in notes if n.startswith("p/* rows skipped")), None)
    return {"rows": [s.name for s in specs if s.name in table.precision_rows], "skipped": skipped,
            "fp16_max": FP16_MAX, "share_threshold": FP16_MAX / SHARE_DIVISOR,
            "comfortable_below": FP16_MAX / COMFORT_DIVISOR,
            "trainer_dtypes": {p: _dtype_name(m) for p, m in trainers.items()}, "forwards": forwards}


def _rows_report(specs: list[RowSpec], cfg: Any, scores: Mapping[tuple[str, bool], list[Any]],
                 sampled: Mapping[str, Any], table: EngineRows) -> tuple[list[dict[str, Any]], dict[str, list[float]], dict[str, tuple]]:
    """Each row's metrics, its per-token |delta| (for the plot), and its (pi_old, pi_rollout, mask) tensors."""
    import torch

    from rollout_parity.grpo_rounds import padded_logprobs, throughput_summary

    batches = sampled["batches"]
    summary = throughput_summary(batches, baseline="a" if "a" in batches else None)
    rows: list[dict[str, Any]] = []
    deltas: dict[str, list[float]] = {}
    tensors: dict[str, tuple] = {}
    for spec in specs:
        parts = scores[_view(spec)]
        trainer_lp = _stack([getattr(p, spec.trainer_view) for p in parts])
        mask = _stack([p.mask for p in parts])
        rollout_lp = _stack([padded_logprobs(b.logprobs, p.mask.shape[1]) for b, p in zip(batches[spec.config], parts)])
        outside = _stack([p.outside.float() for p in parts]) if spec.trainer_view == "processed" else None
        rows.append(_row(spec, cfg, trainer_lp, rollout_lp, mask, parts, batches[spec.config], summary[spec.config],
                         sampled["resolved"][table.configs[spec.config][0]], sampled["held"][spec.name], outside,
                         table))
        d = (trainer_lp - rollout_lp)[mask.bool()]
        deltas[spec.name] = d.abs()[torch.isfinite(d)].tolist()
        tensors[spec.name] = (trainer_lp, rollout_lp, mask)
    return rows, deltas, tensors


def _lengths(cfg: Any, rows: list[dict[str, Any]], tensors: Mapping[str, tuple], opts: DoctorOptions,
             table: EngineRows) -> dict[str, Any]:
    """The rejection advice at the user's length, every row's predicted dropped share there, and the scan."""
    measured = opts.max_tokens
    parity = {name: tensors[name] for name in table.parity_rows if name in tensors}
    advice = fit_rejection(cfg, parity, measured, opts.response_length, seed=opts.seed, group=opts.samples)
    if opts.response_length is not None:
        for row in rows:  # the evaluated flags at the user's length, by the full correction on pseudo-answers
            t = tensors[row["row"]]
            at = t if opts.response_length == measured else resample(t, opts.response_length, seed=opts.seed,
                                                                      group=opts.samples)
            row["rejected_seq_frac_at_length"] = dropped_share(cfg, at)
    options = []
    rule = cfg.rejection_rules[0] if len(cfg.rejection_rules) == 1 else None
    if rule is not None and rule.estimator != "k1":
        options = [f"seq_sum_{rule.estimator}", f"seq_mean_{rule.estimator}"]
    lengths = sorted({measured, *([opts.response_length] if opts.response_length else [])})
    scan = length_scan(options, parity, measured, lengths, seed=opts.seed, group=opts.samples) if options else []
    return {"measured": measured, "response_length": opts.response_length, "parity_rows": sorted(parity),
            "advice": advice, "scan": scan,
            # the parity rows' tokens: a saved run predicts other flags at other lengths (lengths.predict_dropped)
            "tokens": {name: tokens_to_json(t) for name, t in parity.items()}}


def _trained_window(model_path: str) -> Optional[int]:
    """The built-in model's training sequence length, from the key file it is cached with."""
    from rollout_parity.testing.tiny_model import _KEY_FILE

    try:
        return int(json.loads((Path(model_path) / _KEY_FILE).read_text())["params"]["seq_len"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def _beyond_training_note(ex: Mapping[str, Any], measured: int, length: int) -> str:
    return (f"rej@{length} extrapolates past the built-in model's training: it was trained on "
            f"{ex['trained_window']}-token windows and {length}-token answers reach position {ex['last_position']:,}; "
            f"the prediction assumes {ex['assumes']}, and past its training this model's engine and trainer part more per "
            f"token than in its first {measured} (docs/thresholds.md): the predicted shares are likely too low "
            f"there (the advice fits to half its budget at a length it did not measure; --max_tokens {length} "
            f"measures it)")


def _score(trainer: Any, batch: Any, fp32: bool, sampling: Mapping[str, Any], opts: DoctorOptions) -> Any:
    from rollout_parity.grpo_rounds import trainer_scores

    return trainer_scores(trainer, batch.prompts, batch.completions, fp32_head=fp32, sampling=sampling,
                          batch_size=opts.trainer_batch)


def _stack(parts: list[Any]):
    """Concatenate (B_i, T_i) tensors along B, right-padding T with zeros."""
    import torch

    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


def _abs_deltas(trainer_lp: Any, mask: Any, logprobs: list[list[float]]) -> list[float]:
    import torch

    from rollout_parity.grpo_rounds import padded_logprobs

    rollout = padded_logprobs(logprobs, trainer_lp.shape[1])
    d = (trainer_lp - rollout)[mask.bool()]
    return d.abs()[torch.isfinite(d)].tolist()


def _row(spec: RowSpec, cfg: Any, trainer_lp: Any, rollout_lp: Any, mask: Any, parts: list[Any], batches: list[Any],
         throughput: Mapping[str, Any], resolved: Mapping[str, Any], held: Mapping[str, bool],
         outside: Any, table: EngineRows) -> dict[str, Any]:
    import torch

    from rollout_parity.core.correction import compute_correction
    from rollout_parity.grpo_rounds import padded_logprobs

    out = compute_correction(cfg, old_logprobs=trainer_lp, rollout_logprobs=rollout_lp, response_mask=mask,
                             with_metrics=True)
    m = {k.split("/", 1)[1]: float(v) for k, v in out.metrics.items()}
    valid = mask.bool()
    d = (trainer_lp - rollout_lp)[valid]
    finite = torch.isfinite(d)
    n_tokens = int(valid.sum())
    engine_key, policy, _ = table.configs[spec.config]
    row = {
        "row": spec.name,
        "label": spec.label,
        "how": spec.how,
        "config": spec.config,
        "engine": engine_key,
        "engine_kwargs": table.kwargs(engine_key),
        "engine_resolved": dict(resolved),
        "recipe_held": dict(held),
        "trainer_head": "fp32" if spec.trainer_fp32_head else spec.trainer_precision,
        "trainer_view": spec.trainer_view,
        "prefix_cache_policy": policy,
        # Over every token with finite logprobs on both sides: a token the trainer's recomputed kept set
        # missed has the boundary rule's logprob (core/sampler.py), counted in outside_frac.
        "delta_abs_mean": float(d[finite].abs().mean()) if finite.any() else float("nan"),
        "delta_abs_max": float(d[finite].abs().max()) if finite.any() else float("nan"),
        "delta_mean": float(d[finite].mean()) if finite.any() else float("nan"),
        "outside_frac": float(outside[valid].mean()) if outside is not None and n_tokens else 0.0,
        # sequences holding such a token: each one a strict -inf (log-ratio -20, K3 ~19) would have rejected
        "outside_sequences": int((outside * mask).sum(-1).gt(0).sum()) if outside is not None else 0,
        "nonfinite_tokens": int((~finite).sum()),
        # From compute_correction under the evaluated flags (--preset, --set).
        **{k: m.get(k, float("nan")) for k in ("k1_mean", "k3_kl", "ess", "clipped_frac", "rejected_token_frac",
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
        dv = (lp - padded_logprobs(b.logprobs, lp.shape[1]))[part.mask.bool()]
        dv = dv[torch.isfinite(dv)].abs()
        per_version.append(float(dv.mean()) if dv.numel() else float("nan"))
    row["delta_abs_mean_versions"] = per_version  # a stale cache shows as growth after version 0
    if spec.trainer_view == "full":  # the log-kept-mass bias: mean log S over the tokens
        full = torch.cat([p.full[p.mask.bool()] for p in parts])
        proc = torch.cat([p.processed[p.mask.bool()] for p in parts])
        ok = torch.isfinite(proc)
        row["mean_log_kept_mass"] = float((full[ok] - proc[ok]).mean()) if ok.any() else float("nan")
    return row

