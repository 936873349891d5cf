"""The doctor figures the README and docs quote are produced, not typed.

Each one sits between ``<!-- doctor:... -->`` markers and is re-rendered here, in memory, from the saved
doctor run it names (docs/data/*.json, written by the command in ``scripts/render_docs.py``'s ``RUNS``)
with today's ``format_table`` / ``recommend`` / ``format_recommendation``; any difference fails. Doctor
output quoted outside the markers fails too, and so does a saved run whose options are not the ones its
command gives. Fix a failure with ``python scripts/render_docs.py`` (or re-run the doctor command and then
that).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil

import pytest

from rollout_parity.doctor.rows import DoctorOptions
from tests.docs_text import ROOT, pages, rel
from tests.script_loader import load_script

render_docs = load_script(ROOT / "scripts" / "render_docs.py", "render_docs")

#: What only doctor output contains: its table header, its recommendation's headings.
DOCTOR_OUTPUT = ("mean|d|", "what mattered on this model", "flags to add:", "on these rollouts (")


def test_every_quoted_doctor_figure_matches_its_saved_run():
    assert render_docs.drifted() == []


def test_the_docs_quote_something_from_every_saved_run():
    used = {m["spec"].split(":")[0] for page in pages() for m in render_docs.MARKER.finditer(page.read_text())}
    assert set(render_docs.RUNS) <= used, f"saved runs nothing quotes: {set(render_docs.RUNS) - used}"


def test_doctor_output_is_quoted_only_between_markers():
    stray = []
    for page in pages():
        text = render_docs.MARKER.sub("", page.read_text())
        for needle in DOCTOR_OUTPUT:
            if needle in text:
                line = text[: text.index(needle)].count("\n") + 1
                stray.append(f"{rel(page)} (near line {line} of the unmarked text): {needle!r}")
    assert not stray, "doctor output typed by hand (quote it through scripts/render_docs.py):\n" + "\n".join(stray)


def test_a_drifted_figure_is_caught(tmp_path):
    """Copy the pages and the saved runs, change one digit of a quoted figure: the check names it."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    readme = (ROOT / "README.md").read_text()
    m = next(m for m in render_docs.MARKER.finditer(readme) if m["spec"] == "default:table")
    body = m["body"]
    digit = re.search(r"\d\.\d\de-0\d", body)
    changed = body[: digit.start()] + ("9" if body[digit.start()] != "9" else "8") + body[digit.start() + 1:]
    (tmp_path / "README.md").write_text(readme[: m.start("body")] + changed + readme[m.end("body"):])
    drift = render_docs.drifted(tmp_path)
    assert len(drift) == 1 and drift[0].startswith("README.md:") and "default:table" in drift[0]
    assert "quotes" in drift[0] and "the saved run gives" in drift[0]
    # rendering puts the saved run's figure back, and nothing else moves
    assert render_docs.render_text((tmp_path / "README.md").read_text(), tmp_path) == readme


def _doctor_options(command: str) -> dict:
    """The DoctorOptions fields a command line sets, through the CLI's own parser (either spelling)."""
    from rollout_parity.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices["doctor"]
    known = {s for a in sub._actions for s in a.option_strings}
    words = []
    for word in shlex.split(command)[1:]:  # drop the program
        if word.startswith("--") and word not in known:
            for alt in (word.replace("_", "-"), word.replace("-", "_")):
                if alt in known:
                    word = alt
        words.append(word)
    args = parser.parse_args(words)
    return {"max_tokens": args.max_tokens, "steps": args.steps, "num_prompts": args.num_prompts,
            "sentences": args.sentences, "samples": args.samples, "response_length": args.response_length,
            "preset": args.preset, "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed,
            "engine": args.engine,
            "rows": DoctorOptions(engine=args.engine, rows=None if args.rows is None else tuple(
                r.strip() for r in args.rows.split(","))).rows}


@pytest.mark.parametrize("name", sorted(render_docs.RUNS))
def test_each_saved_run_is_what_its_command_says(name):
    path, command = render_docs.RUNS[name]
    assert command.startswith("rollout-parity doctor ") and f"--json {path}" in command
    report = json.loads((ROOT / path).read_text())
    saved = {"engine": "vllm", **report["options"]}  # runs saved before --engine measured vLLM
    for key, want in _doctor_options(command).items():
        got = tuple(saved[key]) if isinstance(saved[key], list) else saved[key]
        assert got == want, f"{path}: {key} is {got!r}, its command gives {want!r}"
    assert report["lengths"]["tokens"], f"{path} holds no measured tokens (run the doctor of this checkout)"


# --- saved logs of runs on a GPU (docs/data/gpu/) ---------------------------------------------------------------

def test_every_saved_log_is_quoted_and_every_log_under_docs_data_is_listed():
    quoted = {m["file"] for page in pages() for m in render_docs.LOG_MARKER.finditer(page.read_text())}
    assert set(render_docs.LOGS) <= quoted, f"saved logs nothing quotes: {set(render_docs.LOGS) - quoted}"
    on_disk = {str(p.relative_to(ROOT / "docs" / "data")) for p in (ROOT / "docs" / "data").glob("*/*.log")}
    assert on_disk == set(render_docs.LOGS), "a log under docs/data/*/ without its command in LOGS, or the reverse"


def test_a_log_selection_renders_what_the_log_holds():
    log = (ROOT / "docs" / "data" / "gpu" / "gpu_check_h200.log").read_text().splitlines()
    bench = next(line for line in log if line.startswith("GPU_CHECK bench"))
    want = re.search(r" plain_vs_matmul=(\S+)", bench)[1]
    assert render_docs.render_log("gpu/gpu_check_h200.log", "value=GPU_CHECK bench:plain_vs_matmul") == want
    assert render_docs.render_log("gpu/gpu_check_h200.log", "lines=1-1") == f"\n```text\n{log[0]}\n```\n"
    assert render_docs.render_log("gpu/gpu_check_h200.log", "line=1") == f"`{log[0]}`"
    assert render_docs.render_log("gpu/gpu_check_h200.log", "GPU_CHECK done").count("\n") == 4  # one line, fenced
    with pytest.raises(KeyError, match="not a saved log"):
        render_docs.render_log("gpu/typo.log", "GPU_CHECK")


def test_values_quotes_every_run_of_a_log_in_order():
    log = (ROOT / "docs" / "data" / "cpu" / "correction_overhead.log").read_text().splitlines()
    runs = [re.search(r" compiled_overhead_ratio=(\S+)", line)[1] for line in log if line.startswith("RESULT")]
    assert len(runs) == 3
    assert render_docs.render_log("cpu/correction_overhead.log", "values=RESULT:compiled_overhead_ratio") == (
        " / ".join(runs))
    assert render_docs.render_log("cpu/correction_overhead.log", "value=RESULT:compiled_overhead_ratio") == runs[0]
    with pytest.raises(KeyError, match="no line starting"):
        render_docs.render_log("cpu/correction_overhead.log", "values=RESULT:no_such_key")


def test_the_docs_call_the_cpu_correction_goal_met_only_where_every_run_meets_it():
    """The goal: the correction with its metrics plus the loss within 1.5x the loss alone (B=64, T=4096)."""
    log = (ROOT / "docs" / "data" / "cpu" / "correction_overhead.log").read_text().splitlines()
    ratios = {key: [float(re.search(rf" {key}=(\S+)", line)[1]) for line in log if line.startswith("RESULT")]
              for key in ("overhead_ratio", "compiled_overhead_ratio")}
    row = next(line for line in (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
               if line.startswith("| `correction_overhead.py`"))
    target = row.rstrip(" |").rsplit("|", 1)[1]
    assert ("met on CPU with `compile_correction`" in target) == (max(ratios["compiled_overhead_ratio"]) <= 1.5)
    assert ("eager **not met**" in target) == (max(ratios["overhead_ratio"]) > 1.5)


def test_a_drifted_log_figure_is_caught(tmp_path):
    """Copy the pages and the logs, change one digit of a quoted log line: the check names it."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "README.md").write_text((ROOT / "README.md").read_text())
    page = tmp_path / "docs" / "fp32_and_sampler_gpu.md"
    text = page.read_text()
    m = next(m for m in render_docs.LOG_MARKER.finditer(text) if m["select"] == "GPU_CHECK")
    digit = re.search(r"\d\.\d\de-0\d", m["body"])
    body = m["body"][: digit.start()] + ("9" if m["body"][digit.start()] != "9" else "8") + m["body"][digit.start() + 1:]
    page.write_text(text[: m.start("body")] + body + text[m.end("body"):])
    drift = render_docs.drifted(tmp_path)
    assert len(drift) == 1 and drift[0].startswith("docs/fp32_and_sampler_gpu.md:")
    assert "log:gpu/gpu_check_h200.log" in drift[0]
    assert "the saved log gives" in drift[0]
    assert render_docs.render_text(page.read_text(), tmp_path) == text  # the log's line put back


def test_the_docs_call_the_gpu_speed_goal_met_only_where_the_log_meets_it():
    """The goal: plain and sampler-aware passes within 1.3x the bf16 GEMM with fp32 output, on the GPU."""
    log = (ROOT / "docs" / "data" / "gpu" / "gpu_check_h200.log").read_text()
    bench = next(line for line in log.splitlines() if line.startswith("GPU_CHECK bench"))
    ratios = {k: float(re.search(rf" {k}=(\S+)", bench)[1]) for k in ("plain_vs_matmul", "sampler_vs_matmul")}
    met = max(ratios.values()) <= 1.3
    page = (ROOT / "docs" / "fp32_and_sampler_gpu.md").read_text()
    said = page[page.index("**On an NVIDIA H200**"):]
    assert ("the goal of 1.3x the GEMM is **not met**" in said) == (not met), ratios


# --- evidence 2 with the precision flag (docs/evidence_fp16.md, from docs/data/cpu/tim_truncated_precision.log) -------

def _precision_section() -> str:
    page = (ROOT / "docs" / "evidence_fp16.md").read_text()
    return page[page.index("### The same with fp16 on both sides"):]


def _precision_rows() -> dict:
    """``{(precision, condition): {key: value}}`` of the log's CONDITION lines."""
    rows = {}
    for line in (ROOT / "docs" / "data" / "cpu" / "tim_truncated_precision.log").read_text().splitlines():
        if line.startswith("CONDITION "):
            head, _, rest = line.partition(": ")
            precision, condition = head.split()[1].split("/")
            rows[precision, condition] = dict(word.split("=", 1) for word in rest.split())
    return rows


def test_the_fp16_evidence_types_no_measured_number_by_hand():
    """Every measured figure of the section is a log marker (or inside a quoted block of the log)."""
    text = render_docs.LOG_MARKER.sub("", _precision_section())
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    typed = re.findall(r"\d\.\d{2,}|\d+(?:\.\d+)?e-\d+|\d+(?:\.\d+)? ?%", text)
    assert not typed, f"numbers typed by hand in the fp16 section (quote them from the log): {typed}"


def test_the_fp16_evidence_says_what_the_log_shows():
    rows = _precision_rows()
    pairs = [(rows["fp16", c], rows["bf16", c]) for p, c in rows if p == "fp16" and ("bf16", c) in rows]
    assert pairs, "the log holds no condition run in both precisions"
    shrinks = all(float(f["delta_start"]) < float(b["delta_start"]) for f, b in pairs)
    diverged = [f["nonfinite_step"] for f, _ in pairs if f.get("nonfinite_step", "none") != "none"]
    worse = all(float(f["final"]) < float(b["final"]) for f, b in pairs)
    text = _precision_section()
    assert ("**fp16 shrinks the mismatch the correction sees.**" in text) == shrinks
    assert ("fp16 training failed on this CPU" in text) == (bool(diverged) and worse)
    for (precision, _), row in rows.items():  # both sides computed in the precision the flag asked for
        assert row["trainer_precision"] == precision
        assert row["engine"] == {"bf16": "bfloat16", "fp16": "float16"}[precision]
