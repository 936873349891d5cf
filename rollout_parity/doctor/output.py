"""The doctor's output: the ablation table and the plot of the per-token |delta| distributions."""

from __future__ import annotations

import math
import os
from typing import Any

__all__ = ["format_table", "plot", "fp16_range_line"]


def plot(deltas: dict[str, list[float]], path: str, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from rollout_parity.doctor.rows import engine_rows

    labels = {name: spec.label for name, spec in engine_rows(report.get("engine", "vllm")).rows.items()}
    engine = report.get("engine_name", "vLLM")
    fig, (ax, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    bins = np.logspace(-7, 1, 57)
    for name, vals in deltas.items():
        v = np.clip(np.asarray(vals, dtype=float), 1e-7, 10.0)  # exact matches land at 1e-7
        if not v.size:
            continue
        label = f"{name}: {labels[name]} (mean {np.mean(vals):.2e})"
        style = "--" if name.startswith("s/") else "-"
        ax.hist(v, bins=bins, histtype="step", linewidth=1.5, linestyle=style,
                weights=np.full(v.size, 1.0 / v.size), label=label)
        xs = np.sort(v)
        cdf.plot(xs, np.arange(1, xs.size + 1) / xs.size, linewidth=1.5, linestyle=style, label=name)
    for a in (ax, cdf):
        a.set_xscale("log")
        a.set_xlabel(f"|log pi_trainer - log pi_{engine}| per token (clipped to [1e-7, 10])")
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
        ("k1_mean", "k1_mean", "{:+.1e}"), ("k3_kl", "k3_kl", "{:.1e}"), ("ess", "ess", "{:.4f}"),
        ("clipped", "clipped_frac", "{:.4f}"), ("rej seq", "rejected_seq_frac", "{:.3f}"),
        ("tok/s", "tokens_per_s", "{:.0f}"), ("vs a", "vs_a", "{:.2f}"),
    ]
    length = (report.get("lengths") or {}).get("response_length")
    if length is not None:  # the evaluated flags at the user's length, predicted from the measured completions
        cols.insert(10, (f"rej@{length}", "rejected_seq_frac_at_length", "{:.3f}"))
    advised = any("rejected_seq_frac_advised" in r for r in report["rows"])
    if advised:  # what the recommended flags drop, on the same tokens
        cols.insert(10, ("rej adv", "rejected_seq_frac_advised", "{:.3f}"))
    cells = [[h for h, _, _ in cols]]
    for r in report["rows"]:
        cells.append([("-" if k not in r or (isinstance(r[k], float) and math.isnan(r[k])) else fmt.format(r[k]))
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
    engine = f"{report.get('engine_name', 'vLLM')} {report.get('engine_version', report.get('vllm_version'))}"
    lines.append(
        f"model {report['model']} | {engine} | T={s['temperature']}, s/* rows "
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
        lines.append("sampled tokens the trainer's recomputed kept set missed (boundary rule: the set with the "
                     "token added; in every column): " + ", ".join(outside))
    if length is not None:
        lines.append(f"rej seq: measured at {s['max_tokens']} tokens; rej@{length}: predicted for {length}-token "
                     "answers from whole measured completions concatenated (block bootstrap)"
                     + (f", assuming {ex['assumes']}" if (ex := report["lengths"].get("extrapolation")) else ""))
    if advised:
        lines.append(f"clipped, rej seq: the preset {report['correction_preset']} as measured; rej adv: the "
                     "sequences the recommended flags (below) take out of the loss, on the same tokens")
    lines.append("tok/s: median over versions (interleaved); vs a: median of per-version ratios to row a")
    line = fp16_range_line(report.get("precision"))
    if line:
        lines.append(line)
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


def fp16_range_line(precision: dict[str, Any] | None) -> str | None:
    """One line on fp16's range over the trainer's forwards (``report["precision"]``, ``doctor/precision.py``)."""
    if not precision or not precision.get("forwards"):
        return None
    parts = []
    for g in precision["forwards"].values():
        bad = g["nonfinite_forwards"] + g.get("nonfinite_logit_calls", 0)
        parts.append(f"{g['dtype']} forwards: largest |activation| {g['max_abs_activation']:.3g}, |logit| "
                     f"{g['max_abs_logit']:.3g}, {g['share_above']:.2%} of tokens above {g['share_threshold']:,.0f}"
                     + (f", {bad} with inf/NaN" if bad else ", no inf/NaN"))
    return f"fp16 range (largest finite {precision['fp16_max']:,.0f}) in the trainer's " + "; ".join(parts)
