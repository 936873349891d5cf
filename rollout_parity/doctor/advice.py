"""The doctor's advice: which recipe steps mattered, flags that do no harm at the user's length, the lines."""

from __future__ import annotations

from typing import Any, Mapping

from rollout_parity.doctor.lengths import BUDGET

__all__ = ["framework_lines", "NO_LINES", "recommend", "format_recommendation", "precision_verdict", "FP16_PAYS",
           "PRECISION_OPT_IN", "FP16_TRAINING"]

_MATTERS = 1.2  # a step "mattered" when it lowered mean |delta| by at least this factor
#: fp16 "pays" when p/fp16's mean |delta| is at least this factor below row c's (the same recipe in bf16, bf16
#: head) and fp16's range is comfortable on the model (``doctor/precision.py``, ``COMFORT_DIVISOR``).
FP16_PAYS = 2.0
#: The shared flag that sets both sides' dtype, per framework: an opt-in line, never in the default lines.
PRECISION_OPT_IN = {"verl": "+rollout_parity.precision=fp16", "trl": "--precision fp16",
                    "nemo_rl": "precision: fp16 (under loss_fn.rollout_correction)"}
#: What training in fp16 does about gradient underflow, per framework, as read in their sources: transformers'
#: TrainingArguments(fp16=True) sets accelerate's mixed_precision="fp16", whose Accelerator makes a GradScaler
#: (accelerate/accelerator.py); verl's FSDP engine makes a ShardedGradScaler when param_dtype is float16
#: (verl/workers/engine/fsdp/transformer_impl.py); NeMo RL v0.7.0 reads policy.precision "float16" in its DTensor
#: worker (fp32 master weights, no GradScaler in its source) and sets Megatron's model.fp16 (models/megatron/setup.py).
FP16_TRAINING = ("training in fp16 needs loss scaling: TRL (HF Trainer fp16: accelerate's GradScaler), verl (FSDP "
                 "engine, param_dtype fp16: ShardedGradScaler), NeMo RL (policy.precision float16: Megatron's "
                 "model.fp16; v0.7.0's DTensor worker has no GradScaler)")
#: The TRL script the launch line names: the repository's example (an unmodified TRL script runs the same way).
TRL_EXAMPLE = "examples/trl_grpo.py"


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


def _fmt_cli(value: Any) -> str:
    """One command-line value: lists comma-separated (one token, for TRL's parser and the launcher alike)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str("_".join(map(str, v)) if isinstance(v, (list, tuple)) else v) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


def _shared_flags(cfg: Any) -> dict[str, Any]:
    """The flags of ``cfg`` that differ from the defaults (what a user must add)."""
    from rollout_parity.core.config import CorrectionConfig

    default = CorrectionConfig().to_dict()
    return {k: v for k, v in cfg.to_dict().items() if v != default[k]}


#: Why a framework gets no lines when the run rolls out with an engine other than vLLM (None: it gets them).
NO_LINES = {"verl": None, "trl": "TRL generates with vLLM only",
            "nemo_rl": "rollout-parity's NeMo RL adapter writes vLLM's generation config only"}


def framework_lines(cfg: Any, engine: str = "vllm") -> dict[str, str]:
    """The copy-pasteable lines that turn ``cfg`` (a ``CorrectionConfig``) on in each framework.

    ``engine``: the rollout engine the run samples with. Under SGLang only verl's lines (with
    ``actor_rollout_ref.rollout.name=sglang``; the adapter writes SGLang's recipe into its engine kwargs): the
    other frameworks' keys are absent (:data:`NO_LINES` says why).

    ``verl``: Hydra overrides for ``python -m verl.trainer.main_ppo`` (the adapter merges the
    vLLM recipe into the rollout engine itself). ``trl``: command-line flags for a script that
    parses ``ParityGRPOConfig`` with ``TrlParser`` (lists comma-separated, one token each);
    ``launch``: the same flags before a TRL script under ``rollout-parity launch``. ``nemo_rl``: YAML to merge into a NeMo RL
    recipe run with ``rollout-parity launch``: the ``loss_fn`` keys the hook turns into
    ``RolloutParityLossFn`` (the shared flags and the guard line, configs/nemo_rl_loss.yaml) and
    the vLLM recipe where NeMo RL reads it (``nemo_rl_generation_config``); ``fp32_lm_head``,
    which NeMo RL cannot serve, is left out with a comment saying so.
    """
    import shlex

    import yaml

    from rollout_parity.adapters.nemo_rl import nemo_rl_generation_config

    flags = _shared_flags(cfg)
    # verl's rollout.name takes the registry's engine keys; vllm is its default
    verl_lines = [] if engine == "vllm" else [f"    actor_rollout_ref.rollout.name={engine}"]
    verl = " \\\n".join(verl_lines + [f"    +rollout_parity.{k}={_fmt_hydra(v)}" for k, v in flags.items()])
    if engine != "vllm":
        return {"verl": verl}
    trl = " ".join(f"--{k} {shlex.quote(_fmt_cli(v))}" for k, v in flags.items())

    def plain(v: Any) -> Any:
        return [plain(x) for x in v] if isinstance(v, (list, tuple)) else v

    # NeMo RL refuses fp32_lm_head (its trainer head stays in policy.precision): left out, with a comment.
    nemo = {"loss_fn": {"rollout_parity": "${rollout_parity:}",
                        "rollout_correction": {k: plain(v) for k, v in flags.items() if k != "fp32_lm_head"}},
            **nemo_rl_generation_config(fp32_lm_head=False)}
    nemo_text = yaml.safe_dump(nemo, sort_keys=False, default_flow_style=False).rstrip()
    if cfg.fp32_lm_head:
        nemo_text = ("# fp32_lm_head left out: NeMo RL's policy workers keep the head in policy.precision "
                     "(docs/nemo_rl.md)\n" + nemo_text)
    return {"verl": verl, "trl": trl, "launch": " ".join(x for x in ("rollout-parity launch", trl, TRL_EXAMPLE) if x),
            "nemo_rl": nemo_text}


def recommend(report: Mapping[str, Any]) -> dict[str, Any]:
    """What to change, derived from the measured rows: which recipe steps mattered on this
    model, the evaluated flags with their rejection fitted to the user's length
    (``report["lengths"]["advice"]``, :func:`rollout_parity.doctor.lengths.fit_rejection`), the share of
    tokens / sequences they act on, and the lines for each framework."""
    from rollout_parity.core.config import CorrectionConfig

    from rollout_parity.doctor.rows import engine_rows

    engine = report.get("engine", "vllm")
    rows = {r["row"]: r for r in report["rows"]}
    steps = []
    for what, before, after in engine_rows(engine).steps:
        if before in rows and after in rows:
            x, y = rows[before]["delta_abs_mean"], rows[after]["delta_abs_mean"]
            factor = x / y if y > 0 else float("inf")
            steps.append({"step": what, "rows": f"{before} -> {after}", "before": x, "after": y, "factor": factor,
                          "mattered": bool(factor >= _MATTERS)})
    fp32_step = next((s for s in steps if s["rows"] == "c -> d"), None)
    fp32 = True if fp32_step is None else fp32_step["mattered"]
    base = report.get("correction_config")
    cfg = (CorrectionConfig.from_dict(dict(base)) if base else CorrectionConfig.preset(report["correction_preset"]))
    cfg = cfg.replace(fp32_lm_head=fp32, log_rollout_offpolicy_metrics=False)
    advice = (report.get("lengths") or {}).get("advice") or {}
    rejection = None
    if advice.get("reason"):
        if advice.get("option") is None:
            cfg = cfg.replace(rollout_rejection=None, rollout_rejection_threshold=None)
        else:
            cfg = cfg.replace(rollout_rejection=[advice["option"]], rollout_rejection_threshold=advice["threshold"])
        rejection = {"option": advice.get("option"), "threshold": advice.get("threshold"), "reason": advice["reason"]}
    acting = {}
    for name in ("d", "a"):
        if name in rows:
            r = rows[name]
            acting[name] = {"clipped_token_frac": r["clipped_frac"], "rejected_token_frac": r["rejected_token_frac"],
                            "rejected_seq_frac": r["rejected_seq_frac"]}
            if "rejected_seq_frac_at_length" in r:
                acting[name]["rejected_seq_frac_at_length"] = r["rejected_seq_frac_at_length"]
    cache = None
    if "d" in rows and "d/salt" in rows:
        d, salt = rows["d"], rows["d/salt"]
        # Ratios of the per-version "vs a" medians: both measured against the same row a.
        cache = {"salt_vs_off_tokens_per_s": salt["vs_a"] / d["vs_a"] if d["vs_a"] and "a" in rows
                 else salt["tokens_per_s"] / d["tokens_per_s"],
                 "salt_delta_vs_off": salt["delta_abs_mean"] / d["delta_abs_mean"] if d["delta_abs_mean"] else None}
    return {"steps": steps, "fp32_lm_head": fp32, "preset": report["correction_preset"], "rejection": rejection,
            "rejection_shares": advice.get("shares", {}), "checked_at": advice.get("checked_at", []),
            "flags": _shared_flags(cfg), "acting": acting, "prefix_cache": cache,
            "precision": precision_verdict(report), "lines": framework_lines(cfg, engine)}


def _fp16_range(precision: Mapping[str, Any]) -> dict[str, Any]:
    """fp16's range on the model over the trainer's forwards (``report["precision"]["forwards"]``): the largest
    |activation| and |logit| of any forward, and the inf/NaN seen in float16 ones (a bf16 or fp32 forward
    holds what fp16 would overflow on as a finite number)."""
    from rollout_parity.core.precision import FP16_MAX
    from rollout_parity.doctor.precision import COMFORT_DIVISOR

    groups = list((precision.get("forwards") or {}).values())
    largest = max((max(g["max_abs_activation"], g["max_abs_logit"]) for g in groups), default=0.0)
    fp16 = [g for g in groups if g.get("dtype") == "float16"]
    nonfinite = sum(g["nonfinite_forwards"] + g.get("nonfinite_logit_calls", 0) for g in fp16)
    limit = FP16_MAX / COMFORT_DIVISOR
    return {"largest": largest, "limit": limit, "nonfinite_fp16": nonfinite,
            "comfortable": bool(nonfinite == 0 and largest < limit),
            "share_above": fp16[0]["share_above"] if fp16 else (groups[0]["share_above"] if groups else None)}


def precision_verdict(report: Mapping[str, Any]) -> dict[str, Any] | None:
    """Whether fp16 on both sides pays on this model (Qi et al. 2025), from the p/* rows and fp16's range.

    Pays when row c's mean |delta| is at least ``FP16_PAYS`` times p/fp16's (the same recipe, engine and
    trainer in fp16 instead of bf16) and the range is comfortable: no inf/NaN in an fp16 forward and every
    |activation| / |logit| below ``FP16_MAX / COMFORT_DIVISOR``. Also: p/fp16+head against row d (the fp32
    head on a bf16 body), and p/mixed's cost as a multiple of row c's mismatch. None when the rows did not run.
    """
    precision = report.get("precision")
    rows = {r["row"]: r for r in report["rows"]}
    if not precision:
        return None
    if precision.get("skipped"):
        return {"pays": False, "reasons": [precision["skipped"]], "factor_needed": FP16_PAYS}
    if "p/fp16" not in rows or "c" not in rows:
        return None
    c, p16 = rows["c"]["delta_abs_mean"], rows["p/fp16"]["delta_abs_mean"]
    ratio = c / p16 if p16 > 0 else float("inf")
    fp16_range = _fp16_range(precision)
    reasons = []
    if not ratio >= FP16_PAYS:
        reasons.append(f"no clear gain: p/fp16's mean |delta| is {ratio:.1f}x below row c's (needs {FP16_PAYS:g}x)")
    if fp16_range["nonfinite_fp16"]:
        reasons.append(f"overflow: {fp16_range['nonfinite_fp16']} fp16 forward(s) of the trainer held inf/NaN")
    elif not fp16_range["largest"] < fp16_range["limit"]:
        reasons.append(f"overflow risk: largest |activation or logit| {fp16_range['largest']:.3g} is not below "
                       f"FP16_MAX/8 = {fp16_range['limit']:,.0f}")
    out = {"pays": not reasons, "reasons": reasons, "factor_needed": FP16_PAYS, "c_vs_fp16": ratio,
           "c": c, "fp16": p16, "range": fp16_range}
    if "p/mixed" in rows and c > 0:
        out["mixed_vs_c"] = rows["p/mixed"]["delta_abs_mean"] / c
    if "p/fp16+head" in rows and "d" in rows:
        head = rows["p/fp16+head"]["delta_abs_mean"]
        out["d_vs_fp16_head"] = rows["d"]["delta_abs_mean"] / head if head > 0 else float("inf")
    if not reasons:
        out["opt_in"] = dict(PRECISION_OPT_IN)
    return out


def format_recommendation(report: Mapping[str, Any]) -> str:
    """The recommendation as text: the measured reasons, then the lines per framework."""
    rec = report["recommendation"]
    out = ["", "what mattered on this model (mean |delta|, before -> after):"]
    for s in rec["steps"]:
        verdict = "mattered" if s["mattered"] else "no measurable effect here"
        out.append(f"  {s['step']:<54s} {s['rows']:<24s} {s['before']:.2e} -> {s['after']:.2e}  "
                   f"({s['factor']:.1f}x, {verdict})")
    rows = {r["row"]: r for r in report["rows"]}
    from rollout_parity.doctor.rows import engine_rows

    if "s/full-vocab" in rows and "s/full-vocab" in engine_rows(report.get("engine", "vllm")).parity_rows:
        r = rows["s/full-vocab"]
        out.append(f"  with {report['sampling']['truncating']}, SGLang returns the full tempered distribution's logprobs "
                   f"and the trainer computes the same (s/full-vocab, mean |delta| {r['delta_abs_mean']:.2e}): no "
                   f"kept-mass bias between them (the kept mass, mean log S = {r['mean_log_kept_mass']:+.3f} per "
                   "token, is on neither side), so no sampler-aware pi_old under SGLang")
    elif "s/full-vocab" in rows:
        r = rows["s/full-vocab"]
        out.append(f"  with {report['sampling']['truncating']}, a full-vocabulary trainer is biased by mean log S = "
                   f"{r['mean_log_kept_mass']:+.3f} per token: the adapters recompute pi_old with the sampler's "
                   "processing (rollout_parity.sampler_logprobs), or sample without truncation")
    if rec["prefix_cache"] and rec["prefix_cache"]["salt_vs_off_tokens_per_s"]:
        c = rec["prefix_cache"]
        out.append(f"  prefix cache kept on with cache_salt (d/salt): {c['salt_vs_off_tokens_per_s']:.2f}x row d's "
                   f"tok/s at {c['salt_delta_vs_off']:.2f}x its |delta|; available where you stamp the requests "
                   "(rollout_parity.WeightVersion); the lines below keep the recipe's cache off")
    out += _precision_lines(report)
    overrides = report.get("correction_overrides") or {}
    evaluated = rec["preset"] + (" with " + ", ".join(f"{k}={v}" for k, v in overrides.items()) if overrides else "")
    length = (report.get("lengths") or {}).get("response_length")
    measured = report["sampling"].get("max_tokens")
    out.append(f"{evaluated} on these rollouts ({measured} tokens each):")
    for name, a in rec["acting"].items():
        what = "with the recipe (row d)" if name == "d" else "without parity (row a)"
        at_length = (f"; at {length:,} tokens (predicted) {a['rejected_seq_frac_at_length']:.2%} of sequences"
                     if "rejected_seq_frac_at_length" in a else "")
        out.append(f"  {what}: truncates {a['clipped_token_frac']:.2%} of tokens, rejects "
                   f"{a['rejected_token_frac']:.2%} of tokens / {a['rejected_seq_frac']:.2%} of sequences{at_length}")
    if rec.get("rejection"):
        out.append("  " + rec["rejection"]["reason"])
    if rec.get("rejection_shares"):
        unit = "tokens" if str((rec.get("rejection") or {}).get("option") or "").startswith("token") else "sequences"
        per_row = "; ".join(f"{row} " + ", ".join(f"{s:.1%} at {int(n):,}" for n, s in sorted(
            per.items(), key=lambda kv: int(kv[0]))) for row, per in rec["rejection_shares"].items())
        out.append(f"  the lines' rejection drops at most {BUDGET:.0%} of the parity rows' {unit}: {per_row}")
    flags = ", ".join(f"{k}={v}" for k, v in rec["flags"].items())
    out.append(f"flags to add: {flags}")
    lines = rec["lines"]
    if set(lines) == {"verl"}:  # an engine TRL and our NeMo RL adapter do not roll out with
        name = report.get("engine_name", report.get("engine"))
        out += ["", f"verl with {name} as the rollout (add to python -m verl.trainer.main_ppo ...):", lines["verl"]]
        out += [f"TRL, NeMo RL: no lines for {name} ({NO_LINES['trl']}; {NO_LINES['nemo_rl']}): run the doctor on "
                "vLLM for theirs"]
        return "\n".join(out)
    out += ["", "verl (add to python -m verl.trainer.main_ppo ...):", lines["verl"],
            "", "TRL (the flags of a script parsing ParityGRPOConfig with TrlParser, e.g. "
                f"python {TRL_EXAMPLE} <flags>):", "    " + lines["trl"],
            "", "TRL, an unmodified GRPO script (the same flags before the script):", "    " + lines["launch"],
            "", "NeMo RL (merge into your recipe YAML; run NeMo RL's own examples/run_grpo.py under the launcher:",
            "    rollout-parity launch examples/run_grpo.py --config my_recipe.yaml):"]
    out += ["    " + line for line in lines["nemo_rl"].splitlines()]
    return "\n".join(out)



def _precision_lines(report: Mapping[str, Any]) -> list[str]:
    """The fp16 verdict, the p/* rows beside the bf16 ones, and (when it pays) the opt-in line."""
    v = (report.get("recommendation") or {}).get("precision")
    if not v:
        return []
    rows = {r["row"]: r for r in report["rows"]}
    out = [f"fp16 on both sides (p/* rows; it pays at >= {v['factor_needed']:g}x below row c with fp16's range "
           "comfortable: no inf/NaN, every |activation| and |logit| below 65504/8):"]
    if "c_vs_fp16" not in v:
        return out + ["  " + r for r in v["reasons"]]
    r = v["range"]
    head = (f"p/fp16 mean |delta| {v['fp16']:.2e} vs row c's {v['c']:.2e} ({v['c_vs_fp16']:.1f}x); largest "
            f"|activation or logit| {r['largest']:.3g}, limit {r['limit']:,.0f}")
    if v["pays"]:
        out.append(f"  fp16 pays on this model: {head}")
    else:
        out.append(f"  fp16 does not pay here: {'; '.join(v['reasons'])} ({head})")
    if "d_vs_fp16_head" in v:
        out.append(f"  with the fp32 head too (p/fp16+head): {rows['p/fp16+head']['delta_abs_mean']:.2e} vs row d's "
                   f"{rows['d']['delta_abs_mean']:.2e} (bf16 body), {v['d_vs_fp16_head']:.1f}x lower")
    if "mixed_vs_c" in v:
        out.append(f"  a precision set on one side only costs {v['mixed_vs_c']:.1f}x row c's mismatch (p/mixed: "
                   "row c's bf16 rollouts scored by an fp16 trainer)")
    if v.get("opt_in"):
        o = v["opt_in"]
        out.append(f"  opt in (it changes your training dtype, so the lines below leave it out): verl {o['verl']} | "
                   f"TRL {o['trl']} | NeMo RL {o['nemo_rl']}")
        out.append(f"  {FP16_TRAINING}")
    return out
