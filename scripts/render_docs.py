"""Regenerate every doctor figure and GPU log line that README.md and docs/ quote, from the runs in docs/data/.

    python scripts/render_docs.py          # rewrite the marked parts of README.md and docs/*.md in place
    python scripts/render_docs.py --check  # exit 1, naming each block, when a quoted figure differs

A quoted figure sits between two marker comments; the renderer replaces what is between them:

    <!-- doctor:SOURCE:VIEW -->...<!-- /doctor -->          a block (a fenced text block) or an inline value
    <!-- doctor:SOURCE:PATH:FORMAT -->...<!-- /doctor -->   one value of the report, formatted

SOURCE names a saved run (:data:`RUNS`: the JSON ``rollout-parity doctor --json`` wrote, and the command
that wrote it). VIEW is one of :data:`VIEWS` (``table``: the ablation table as the doctor prints it;
``recommendation``: what the doctor prints after it; ``flags``: its "flags to add" line; ``advice``: its part on
rejection; ``precision``: its fp16 verdict; ``fp16_range``: the table's line on fp16's range; ``lines.verl`` /
``lines.trl`` / ``lines.nemo_rl``:
one framework's lines; ``command``: the command that made the run, as inline code; ``command.block``: as a code block), or PATH is a dotted path into the
report (``rows.d.delta_abs_mean``: a row by its name; ``rec.``: the recommendation, recomputed with
today's code from the saved measurements) with a format (:func:`_format`: a Python format spec such as ``.2e`` or ``.1%``, or ``text``, ``block`` (a text
block), ``flags``, ``pct``; a leading backquote makes it inline code).
``<!-- doctor:runs:thresholds -->`` is the rejection-threshold table of docs/thresholds.md, from the
saved runs' threshold scans.

Saved logs of runs on other machines (a GPU's: :data:`LOGS`, under docs/data/) are quoted the same way:

    <!-- log:FILE:PREFIX -->...<!-- /log -->              every line of FILE that starts with PREFIX, a text block
    <!-- log:FILE:lines=A-B -->...<!-- /log -->           lines A to B (from 1), a text block
    <!-- log:FILE:line=N -->...<!-- /log -->              line N, as inline code (a table cell)
    <!-- log:FILE:value=PREFIX:KEY -->...<!-- /log -->    KEY's value in the first ``PREFIX ... KEY=value ...`` line
    <!-- log:FILE:values=PREFIX:KEY -->...<!-- /log -->   its value in every such line (runs in a row), "a / b / c"
    <!-- log:FILE:command -->...<!-- /log -->            the command that wrote FILE, as inline code
    <!-- log:FILE:command.block -->...<!-- /log -->      the same as a code block

The table and the recommendation are re-derived with today's ``format_table`` / ``recommend`` /
``format_recommendation`` from the saved measurements, so a change of the doctor's wording or lines
shows up here without re-running an engine. tests/test_docs_render.py fails when a quoted figure
differs from what this renders.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

ROOT = Path(__file__).resolve().parents[1]

#: The saved runs: name -> (JSON under the repository root, the command that wrote it, run from the root).
RUNS: dict[str, tuple[str, str]] = {
    "default": ("docs/data/doctor.json", "rollout-parity doctor --json docs/data/doctor.json"),
    "8192": ("docs/data/doctor_8192.json",
             "rollout-parity doctor --response_length 8192 --json docs/data/doctor_8192.json"),
    "832": ("docs/data/doctor_832.json",
            "rollout-parity doctor --rows d,s/sampler --max_tokens 832 --sentences 1 --steps 2 --num_prompts 4 "
            "--json docs/data/doctor_832.json"),
    # in SGLang's venv (scripts/sglang_venv.sh: sglang 0.5.23 on the CPU torch, no matplotlib, so no plot)
    "sglang": ("docs/data/doctor_sglang.json",
               "rollout-parity doctor --engine sglang --json docs/data/doctor_sglang.json"),
}

MARKER = re.compile(r"<!-- doctor:(?P<spec>[^ ]+) -->(?P<body>.*?)<!-- /doctor -->", re.DOTALL)

#: Saved logs of runs made elsewhere (docs/data/FILE) -> the command that wrote them, run from the root there.
LOGS: dict[str, str] = {
    "gpu/gpu_check_h200.log": "python scripts/gpu_check.py --bench-timeout 120",
    # the same at a5c1057, before the forward's row kernel (torch's division and log-softmax over each chunk)
    "gpu/gpu_check_h200_torch_rows.log": "python scripts/gpu_check.py --bench-timeout 120",
    "gpu/correction_overhead_h200.log": "python benchmarks/correction_overhead.py --device cuda; "
                                        "python benchmarks/correction_overhead.py --device cuda --batch 256 "
                                        "--tokens 8192 --repeats 20",
    "gpu/head_pass_profile_h200.log": "python scripts/gpu_head_pass_profile.py",
    # three runs back to back on the 2-core CPU machine, nothing else running (2026-11-27)
    "cpu/correction_overhead.log": "for i in 1 2 3; do python benchmarks/correction_overhead.py --repeats 100; done",
    # the CUDA kernels compiled for GPU targets by five Triton releases, each first on PYTHONPATH (no GPU needed)
    "cpu/kernel_compile.log": "python scripts/compile_kernels.py --sweep <triton==3.3.1> <triton==3.4.0> "
                              "<triton==3.5.1> <triton==3.6.0> --log docs/data/cpu/kernel_compile.log",
    # evidence 2's truncated-sampling experiment, seed 0, with the precision flag at bf16 and at fp16 (stdout, in a row)
    "cpu/tim_truncated_precision.log": "python benchmarks/tim_truncated.py --precision bf16 --seeds 0 \\\n"
                                       "  --conditions ref_trunc calibrated preset_full_vocab --out <dir>\n"
                                       "python benchmarks/tim_truncated.py --precision fp16 --seeds 0 \\\n"
                                       "  --conditions ref_trunc calibrated --out <dir>",
}

LOG_MARKER = re.compile(r"<!-- log:(?P<file>[^: ]+):(?P<select>[^>]*?) -->(?P<body>.*?)<!-- /log -->", re.DOTALL)

#: Thresholds of the rejection table (docs/thresholds.md): (option, threshold) in the saved scans.
THRESHOLD_ROWS = (("seq_sum_k3", 1e-3), ("seq_sum_k3", 1e-2), ("seq_sum_k3", 5e-2), ("seq_sum_k3", 1e-1),
                  ("seq_sum_k3", 2e-1), ("seq_sum_k3", 5e-1), ("seq_mean_k3", 3e-5), ("seq_mean_k3", 1e-4),
                  ("seq_mean_k3", 2e-4), ("seq_mean_k3", 3e-4), ("seq_mean_k3", 5e-4))
#: Its columns: (run, row).
THRESHOLD_COLUMNS = (("default", "d"), ("default", "s/sampler"), ("832", "d"), ("832", "s/sampler"))


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def load_run(name: str, root: Path = ROOT, cache: dict[str, Any] | None = None) -> dict[str, Any]:
    """A saved run, with its recommendation recomputed by today's code from its measurements."""
    if cache is not None and name in cache:
        return cache[name]
    if name not in RUNS:
        raise KeyError(f"unknown doctor run {name!r}: one of {sorted(RUNS)} (scripts/render_docs.py RUNS)")
    from rollout_parity.doctor import recommend

    report = json.loads((root / RUNS[name][0]).read_text())
    report["recommendation"] = recommend(report)
    if cache is not None:
        cache[name] = report
    return report


def _fence(text: str) -> str:
    return "\n```text\n" + text.rstrip("\n") + "\n```\n"


def _table(report: Mapping[str, Any]) -> str:
    from rollout_parity.doctor import format_table

    lines = format_table(report).splitlines()
    return "\n".join(lines[: 2 + len(report["rows"])])


def _recommendation(report: Mapping[str, Any]) -> str:
    from rollout_parity.doctor import format_recommendation

    return format_recommendation(report).strip("\n")


def _advice(report: Mapping[str, Any]) -> str:
    """The recommendation's part on rejection: from "<preset> on these rollouts" to "flags to add"."""
    lines = _recommendation(report).splitlines()
    start = next(i for i, line in enumerate(lines) if " on these rollouts (" in line)
    end = next(i for i, line in enumerate(lines) if line.startswith("flags to add:"))
    return "\n".join(lines[start: end + 1])


def _precision(report: Mapping[str, Any]) -> str:
    """The recommendation's fp16 verdict: its heading line and the indented lines under it."""
    lines = _recommendation(report).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("fp16 on both sides ("))
    end = start + 1
    while end < len(lines) and lines[end].startswith("  "):
        end += 1
    return "\n".join(lines[start:end])


def _fp16_range(report: Mapping[str, Any]) -> str:
    from rollout_parity.doctor.output import fp16_range_line

    line = fp16_range_line(report.get("precision"))
    if line is None:
        raise KeyError("this run has no precision section (a run from before the p/* rows)")
    return line


def _watch(report: Mapping[str, Any]) -> str:
    """What to chart and its alarm values, as the doctor prints them at its end (docs/watch.md)."""
    from rollout_parity.doctor.watch import markdown_watch

    return markdown_watch(report)


def _command(name: str) -> str:
    return RUNS[name][1]


VIEWS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "table": lambda r: _fence(_table(r)),
    "recommendation": lambda r: _fence(_recommendation(r)),
    "flags": lambda r: _fence(next(line for line in _recommendation(r).splitlines()
                                   if line.startswith("flags to add:"))),
    "advice": lambda r: _fence(_advice(r)),
    "precision": lambda r: _fence(_precision(r)),
    "fp16_range": lambda r: _fence(_fp16_range(r)),
    "watch": lambda r: "\n" + _watch(r) + "\n",
    "lines.verl": lambda r: _fence(r["recommendation"]["lines"]["verl"]),
    "lines.trl": lambda r: _fence(r["recommendation"]["lines"]["trl"]),
    "lines.nemo_rl": lambda r: "\n```yaml\n" + r["recommendation"]["lines"]["nemo_rl"] + "\n```\n",
}


def lookup(report: Mapping[str, Any], path: str) -> Any:
    """``rows.d.x``: field x of the row named d (row names may hold a '/'); ``rec.x``: the recommendation's."""
    parts = path.split(".")
    value: Any = report
    i = 0
    if parts[0] == "rec":
        value, i = report["recommendation"], 1
    while i < len(parts):
        key = parts[i]
        if key == "rows" and isinstance(value, Mapping) and "rows" in value:
            rows = {r["row"]: r for r in value["rows"]}
            name = parts[i + 1]
            if name not in rows:
                raise KeyError(f"no row {name!r} in this run (rows: {sorted(rows)})")
            value, i = rows[name], i + 2
            continue
        if isinstance(value, (list, tuple)):
            value = value[int(key)]
        else:
            if key not in value:
                raise KeyError(f"{path}: no {key!r} (keys: {sorted(value)})")
            value = value[key]
        i += 1
    return value


def _format(value: Any, fmt: str) -> str:
    """``value`` as ``fmt`` says: a format spec, ``text``, ``block``, ``list``, ``flags`` (``k=v, ...`` as the doctor
    prints its flags), ``pct`` (a share with one decimal and a space before %); a leading backquote wraps
    the result in one (inline code)."""
    if fmt.startswith("`"):
        return f"`{_format(value, fmt[1:])}`"
    if fmt == "block":
        return _fence(str(value))
    if fmt == "flags":
        return ", ".join(f"{k}={v}" for k, v in value.items())
    if fmt == "pct":
        return f"{100 * value:.1f} %"
    if fmt == "g" and isinstance(value, float):
        return f"{value:g}"
    if fmt == "text":
        return str(value)
    if fmt == "list":
        return ", ".join(map(str, value))
    return format(value, fmt)


def thresholds_table(root: Path = ROOT, cache: dict[str, Any] | None = None) -> str:
    """Shares of sequences above each threshold, per parity row, at each saved run's measured length."""
    heads, columns = [], []
    for run, row in THRESHOLD_COLUMNS:
        report = load_run(run, root, cache)
        measured = report["lengths"]["measured"]
        heads.append(f"{row}, {measured} tokens")
        columns.append((report, row, str(measured)))
    out = ["| threshold | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for option, tau in THRESHOLD_ROWS:
        cells = []
        for report, row, measured in columns:
            hit = [s for s in report["lengths"]["scan"] if s["option"] == option and math_close(s["threshold"], tau)]
            cells.append(f"{hit[0]['rows'][row][measured]:.1%}" if hit and row in hit[0]["rows"] else "—")
        label = f"`{option}` {tau:g}" + (" (the preset)" if (option, tau) == ("seq_sum_k3", 1e-3) else "")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n" + "\n".join(out) + "\n"


def math_close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def render_spec(spec: str, root: Path = ROOT, cache: dict[str, Any] | None = None) -> str:
    """What belongs between ``<!-- doctor:SPEC -->`` and ``<!-- /doctor -->``."""
    source, _, rest = spec.partition(":")
    if source == "runs" and rest == "thresholds":
        return thresholds_table(root, cache)
    if rest in ("command", "command.block"):
        if source not in RUNS:
            raise KeyError(f"unknown doctor run {source!r}")
        return f"`{_command(source)}`" if rest == "command" else "\n```bash\n" + _command(source) + "\n```\n"
    report = load_run(source, root, cache)
    if rest in VIEWS:
        return VIEWS[rest](report)
    path, sep, fmt = rest.rpartition(":")
    if not sep:
        raise ValueError(f"doctor:{spec}: a view ({', '.join(VIEWS)}) or PATH:FORMAT")
    return _format(lookup(report, path), fmt)


def render_log(file: str, select: str, root: Path = ROOT) -> str:
    """What belongs between ``<!-- log:FILE:SELECT -->`` and ``<!-- /log -->`` (see the module docstring)."""
    if file not in LOGS:
        raise KeyError(f"log:{file}: not a saved log (LOGS: {sorted(LOGS)})")
    if select == "command":
        return f"`{LOGS[file]}`"
    if select == "command.block":
        return "\n```bash\n" + LOGS[file] + "\n```\n"
    lines = (root / "docs" / "data" / file).read_text().splitlines()
    if select.startswith("lines="):
        first, _, last = select[len("lines="):].partition("-")
        return _fence("\n".join(lines[int(first) - 1: int(last)]))
    if select.startswith("line="):
        return f"`{lines[int(select[len('line='):]) - 1].strip()}`"
    if select.startswith(("value=", "values=")):
        every = select.startswith("values=")
        prefix, _, key = select.partition("=")[2].rpartition(":")
        hits = [hit[1] for line in lines if line.startswith(prefix)
                for hit in [re.search(rf"(?:^|\s){re.escape(key)}=(\S+)", line)] if hit]
        if not hits:
            raise KeyError(f"log:{file}: no line starting {prefix!r} with {key}=")
        return " / ".join(hits) if every else hits[0]
    picked = [line for line in lines if line.startswith(select)]
    if not picked:
        raise KeyError(f"log:{file}: no line starts with {select!r}")
    return _fence("\n".join(picked))


def _kinds(root: Path, cache: dict[str, Any]) -> tuple:
    """Per kind of marked part: its marker, its opening comment's spec, what it renders, where that comes from."""
    return ((MARKER, lambda m: f"doctor:{m['spec']}", lambda m: render_spec(m["spec"], root, cache), "the saved run"),
            (LOG_MARKER, lambda m: f"log:{m['file']}:{m['select']}",
             lambda m: render_log(m["file"], m["select"], root), "the saved log"))


def render_text(text: str, root: Path = ROOT, cache: dict[str, Any] | None = None) -> str:
    """``text`` with every marked part re-rendered."""
    cache = {} if cache is None else cache
    for marker, spec, render, _ in _kinds(root, cache):
        text = marker.sub(lambda m: f"<!-- {spec(m)} -->{render(m)}<!-- /{spec(m).split(':')[0]} -->", text)
    return text


def drifted(root: Path = ROOT) -> list[str]:
    """One line per marked part whose text differs from what the saved runs render."""
    cache: dict[str, Any] = {}
    out = []
    for path in doc_files(root):
        text = path.read_text()
        for marker, spec, render, source in _kinds(root, cache):
            for m in marker.finditer(text):
                want = render(m)
                if m["body"] != want:
                    line = text.count("\n", 0, m.start()) + 1
                    out.append(f"{path.relative_to(root)}:{line}: {spec(m)} quotes {m['body'].strip()[:60]!r}, "
                               f"{source} gives {want.strip()[:60]!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report drifted figures (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        bad = drifted()
        print("\n".join(bad) if bad else "every quoted doctor figure matches its saved run")
        return 1 if bad else 0
    cache: dict[str, Any] = {}
    for path in doc_files():
        text = path.read_text()
        new = render_text(text, cache=cache)
        if new != text:
            path.write_text(new)
            print(f"rendered {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
