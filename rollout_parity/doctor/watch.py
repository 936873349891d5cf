"""What to chart during a run, under each framework's own metric name, and the value that should alarm.

The alarm values are fitted to the user's model: each is a multiple of what the doctor measured at parity
(row ``d``: the recipe engine, fp32 heads, the same tokens scored by the trainer), so a run that stays at the
floor its model and kernels allow stays quiet and one that leaves it (a stale weight sync, a prefix cache hit
across an update, a precision set on one side, a sampler the trainer does not mirror) is named. The names come
from the one metric table (``rollout_parity.core.metric_names``): the name the adapter logs in verl, TRL and
NeMo RL for the flags the doctor recommends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

__all__ = ["WATCH", "Watch", "watch_rows", "format_watch", "markdown_watch"]

#: The doctor's row whose numbers are the floor: parity on the user's model.
FLOOR_ROW = "d"


@dataclass(frozen=True)
class Watch:
    """One quantity to chart: our metric leaf (``rollout_correction/<leaf>``), the doctor row's key holding its
    value at parity, and the alarm as a function of that floor (``alarm(floor) -> (threshold, direction)``)."""

    leaf: str
    row_key: str
    what: str
    rule: str
    alarm: Callable[[float], float]
    above: bool = True  # alarm when the value rises above the threshold (False: falls below it)
    digits: int = 3  # significant digits shown (ess sits a hair below 1)


def _times(factor: float, minimum: float = 0.0) -> Callable[[float], float]:
    return lambda floor: max(factor * floor, minimum)


#: Mismatch metrics alarm at a multiple of the floor: k3 is quadratic in the log-ratio, so 10x the floor's
#: k3 is about 3x its mean |delta|; shares of tokens or sequences alarm where the recommended rejection's
#: budget (at most 5 % of the parity rows' sequences, ``doctor.lengths.BUDGET``) is doubled.
WATCH = (
    Watch("delta_abs_mean", "delta_abs_mean", "mean |log pi_trainer - log pi_engine| per token",
          "3x the floor", _times(3.0)),
    Watch("k3_kl", "k3_kl", "k3 estimate of KL(pi_rollout || pi_old), >= 0", "10x the floor", _times(10.0)),
    Watch("ess", "ess", "effective sample size of the IS weights per token (1: on-policy)",
          "1 - 10x the floor's deficit (1 - ess)", lambda floor: 1.0 - 10.0 * (1.0 - floor), above=False, digits=6),
    Watch("rejected_seq_frac", "rejected_seq_frac", "share of sequences the recommended rejection removes",
          "2x the 5 % budget the rejection was fitted to, or 2x the floor", lambda floor: max(0.10, 2.0 * floor)),
    Watch("nonfinite_frac", "nonfinite_frac", "share of tokens with a NaN or inf logprob", "any", _times(0.0)),
)


def _names(leaf: str, cfg: Any) -> dict[str, str]:
    """The name under which each framework shows ``rollout_correction/<leaf>`` for ``cfg``: the adapter's
    rename (verl, TRL), or NeMo RL's own metric where its loss logs the same quantity and ours is left out."""
    from rollout_parity.core.metric_names import NemoRLLoss, PREFIX, metric_for, trl_names, verl_names

    key = PREFIX + leaf
    nemo = NemoRLLoss(kl_type="k3", own_truncation=False, sequence_level=False)  # NeMo RL's defaults
    metric, _ = metric_for(key)
    return {"verl": next(iter(verl_names({key: 0.0}, cfg))), "TRL": next(iter(trl_names({key: 0.0}, cfg))),
            "NeMo RL": (metric.key_for("nemo_rl", cfg, nemo) if metric else None) or key}


def _acting(report: Mapping[str, Any]) -> Any:
    """The configuration the doctor recommends (its flags over the measured preset), else the measured one."""
    from rollout_parity.core.config import CorrectionConfig

    flags = (report.get("recommendation") or {}).get("flags")
    if flags:
        return CorrectionConfig(**{k: v for k, v in flags.items() if k in CorrectionConfig.__dataclass_fields__})
    return CorrectionConfig(**report.get("correction_config", {}))


def _floor(w: Watch, report: Mapping[str, Any], row: Optional[Mapping[str, Any]]) -> Optional[float]:
    """The quantity at parity on this model. The rejection's share is the recommended flags' (the doctor's
    ``rejection_shares`` at the measured length), not the measured preset's: that is what the run will log."""
    if row is None:
        return None
    if w.leaf == "rejected_seq_frac":
        rec = report.get("recommendation") or {}
        if not (rec.get("flags") or {}).get("rollout_rejection"):
            return 0.0
        if "rejected_seq_frac_advised" in row:  # measured on row d's tokens with the recommended flags
            return float(row["rejected_seq_frac_advised"])
        shares = (rec.get("rejection_shares") or {}).get(FLOOR_ROW) or {}
        measured = str((report.get("lengths") or {}).get("measured", ""))
        if measured in shares:
            return float(shares[measured])
    value = row.get(w.row_key)
    return None if value is None else float(value)


def watch_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One entry per quantity: the names per framework, the floor on this model and the alarm threshold.

    Quantities the recommended flags do not produce (``rejected_seq_frac`` without a rejection, ``ess`` without
    an IS mode in verl) keep our name; a row the doctor did not run leaves the floor and the alarm None.
    """
    cfg = _acting(report)
    floor_row: Optional[Mapping[str, Any]] = next((r for r in report.get("rows", []) if r["row"] == FLOOR_ROW), None)
    out = []
    for w in WATCH:
        floor = _floor(w, report, floor_row)
        out.append(dict(leaf=w.leaf, what=w.what, rule=w.rule, names=_names(w.leaf, cfg), floor=floor,
                        alarm=None if floor is None else w.alarm(floor), above=w.above, digits=w.digits))
    return out


def _fmt(value: Optional[float], digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _frameworks_with_lines(report: Mapping[str, Any]) -> Optional[set[str]]:
    """The frameworks the recommendation printed lines for, by their names (under SGLang: verl alone); None when
    the report carries no lines (every framework's names are shown)."""
    from rollout_parity import registry

    lines = (report.get("recommendation") or {}).get("lines") or {}
    names = {registry.unit(key).name for key in lines if key in registry.keys("framework")}
    return names or None


def format_watch(report: Mapping[str, Any]) -> str:
    """The doctor's closing block: what to chart and when to worry, for this model."""
    lines = [f"what to watch during the run (alarm values: multiples of row {FLOOR_ROW}, parity on this model):"]
    shown = _frameworks_with_lines(report)
    for r in watch_rows(report):
        sign = ">" if r["above"] else "<"
        names = ", ".join(f"{fw} {name}" for fw, name in r["names"].items() if shown is None or fw in shown)
        lines.append(f"  {r['leaf']:<18} floor {_fmt(r['floor'], r['digits']):>9}  alarm {sign} {_fmt(r['alarm'], r['digits']):<9} ({names})")
    return "\n".join(lines)


def markdown_watch(report: Mapping[str, Any]) -> str:
    """The same as a markdown table (docs/watch.md, rendered from a saved doctor run)."""
    rows = ["| quantity | verl | TRL | NeMo RL | floor (row d) | alarm | rule |", "|---|---|---|---|---|---|---|"]
    cell = lambda text: text.replace("|", "\\|")  # noqa: E731 - a pipe inside a markdown cell
    for r in watch_rows(report):
        n = r["names"]
        sign = "above" if r["above"] else "below"
        rows.append(f"| {cell(r['what'])} | `{n['verl']}` | `{n['TRL']}` | `{n['NeMo RL']}` | {_fmt(r['floor'], r['digits'])} | "
                    f"{sign} {_fmt(r['alarm'], r['digits'])} | {r['rule']} |")
    return "\n".join(rows)
