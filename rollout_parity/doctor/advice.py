"""The doctor's advice: which recipe steps mattered, flags that do no harm at the user's length, the lines."""

from __future__ import annotations

from typing import Any, Mapping

from rollout_parity.doctor.lengths import BUDGET

__all__ = ["framework_lines", "recommend", "format_recommendation"]

# The recipe steps the recommendation judges: (what, row before, row after).
_STEPS = (
    ("processed logprobs (logprobs_mode=processed_logprobs)", "a", "b"),
    ("prefix cache and async scheduling off", "b", "c"),
    ("fp32 lm_head on both sides", "c", "d"),
    ("sampler-aware trainer logprobs (sampler_logprobs)", "s/full-vocab", "s/sampler"),
)
_MATTERS = 1.2  # a step "mattered" when it lowered mean |delta| by at least this factor


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
    the vLLM recipe where NeMo RL reads it (``nemo_rl_generation_config``); ``fp32_lm_head``,
    which NeMo RL cannot serve, is left out with a comment saying so.
    """
    import shlex

    import yaml

    from rollout_parity.adapters.nemo_rl import nemo_rl_generation_config

    flags = _shared_flags(cfg)
    verl = " \\\n".join(f"    +rollout_parity.{k}={_fmt_hydra(v)}" for k, v in flags.items())
    trl = " ".join(f"--{k} " + " ".join(shlex.quote(x) for x in _fmt_cli(v)) for k, v in flags.items())

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
    return {"verl": verl, "trl": trl, "nemo_rl": nemo_text}


def recommend(report: Mapping[str, Any]) -> dict[str, Any]:
    """What to change, derived from the measured rows: which recipe steps mattered on this
    model, the evaluated flags with their rejection fitted to the user's length
    (``report["lengths"]["advice"]``, :func:`rollout_parity.doctor.lengths.fit_rejection`), the share of
    tokens / sequences they act on, and the lines for each framework."""
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
            "flags": _shared_flags(cfg), "acting": acting, "prefix_cache": cache, "lines": framework_lines(cfg)}


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
                   f"{r['mean_log_kept_mass']:+.3f} per token: the adapters recompute pi_old with the sampler's "
                   "processing (rollout_parity.sampler_logprobs), or sample without truncation")
    if rec["prefix_cache"] and rec["prefix_cache"]["salt_vs_off_tokens_per_s"]:
        c = rec["prefix_cache"]
        out.append(f"  prefix cache kept on with cache_salt (d/salt): {c['salt_vs_off_tokens_per_s']:.2f}x row d's "
                   f"tok/s at {c['salt_delta_vs_off']:.2f}x its |delta|; available where you stamp the requests "
                   "(rollout_parity.WeightVersion); the lines below keep the recipe's cache off")
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
    out += ["", "verl (add to python -m verl.trainer.main_ppo ...):", lines["verl"],
            "", "TRL (ParityGRPOConfig through TrlParser):", "    " + lines["trl"],
            "", "NeMo RL (merge into your recipe YAML; run NeMo RL's own examples/run_grpo.py under the launcher:",
            "    rollout-parity launch examples/run_grpo.py --config my_recipe.yaml):"]
    out += ["    " + line for line in lines["nemo_rl"].splitlines()]
    return "\n".join(out)

