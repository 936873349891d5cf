"""The spread log and the margins ``scripts/measure_spread.py`` prints and saves (the suite's bounds cite them)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from integration_tests.support import spread
from tests.docs_text import ROOT
from tests.script_loader import load_script

measure_spread = load_script(ROOT / "scripts" / "measure_spread.py", "measure_spread")


def test_bound_is_the_plain_comparison_without_the_log(monkeypatch):
    monkeypatch.delenv(spread.LOG_ENV, raising=False)
    assert spread.bound("x", 0.5, "<", 1.0) and not spread.bound("x", 1.0, "<", 1.0)
    assert spread.bound("x", torch.tensor(1.0), "<=", 1.0) and not spread.bound("x", torch.tensor(0.5), ">", 1.0)
    assert spread.bound("x", 2, ">=", 2) and not spread.bound("x", 1, ">=", 2)
    with pytest.raises(ValueError, match="op must be one of"):
        spread.bound("x", 1.0, "==", 1.0)


def test_with_the_log_a_missed_bound_is_recorded_and_the_test_goes_on(tmp_path, monkeypatch):
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv(spread.LOG_ENV, str(log))
    monkeypatch.setenv(spread.SEED_ENV, "3")
    assert spread.bound("a", torch.tensor(0.2), "<", 0.1)  # missed, yet True: the bounds after it get measured
    assert spread.bound("b", float("inf"), ">", 1.0)
    a, b = [json.loads(line) for line in log.read_text().splitlines()]
    assert (a["name"], a["value"], a["op"], a["limit"], a["held"], a["seed"]) == ("a", pytest.approx(0.2), "<", 0.1,
                                                                                 False, 3)
    assert b["value"] == "inf" and b["held"] is True
    assert spread.seed() == 3


def test_seed_is_the_suites_zero_unless_the_script_sets_it(monkeypatch):
    monkeypatch.delenv(spread.SEED_ENV, raising=False)
    assert spread.seed() == 0
    monkeypatch.setenv(spread.SEED_ENV, "7")
    assert spread.seed() == 7


@pytest.mark.parametrize("op, limit, values, worst, factor", [
    ("<", 1e-3, [1e-4, 2e-4], 2e-4, 5.0),  # upper bound: limit / worst
    (">", 10.0, [40.0, 25.0], 25.0, 2.5),  # lower bound: worst / limit
    ("<", 0.1, [0.05, 0.2], 0.2, 0.5),  # crossed: below 1
    ("<=", 1e-6, [-0.2, -0.08], -0.08, math.inf),  # a sign bound held on the far side of zero
    (">", -0.05, [-0.01, -0.02], -0.02, 2.5),  # negative limits: still "held by that factor"
])
def test_margin_is_how_many_times_over_the_bound_held(op, limit, values, worst, factor):
    got_worst, got = measure_spread.margin(op, limit, values)
    assert got_worst == worst and got == pytest.approx(factor)


def test_every_saved_spread_held_and_names_its_command():
    """Measurements of the limits in force; ``data/spread/former/`` keeps those that moved a limit (not checked)."""
    saved = sorted((ROOT / "integration_tests" / "data" / "spread").glob("*.json"))
    assert saved, "no saved spread measurement"
    for path in saved:
        data = json.loads(path.read_text())
        assert data["command"].startswith("wt-run python scripts/measure_spread.py "), path
        assert all(run["exit"] == 0 for run in data["runs"]), (path, data["runs"])
        for b in data["bounds"]:
            held = [spread._OPS[b["op"]](v, b["limit"]) for v in b["values"].values()]
            assert all(held), (path.name, b["test"], b["name"], b["values"])


def test_the_report_and_the_saved_summary_take_an_infinite_gap(capsys):
    records = [{"test": "t", "name": "gap", "value": v, "op": ">", "limit": 2e-2, "held": True, "condition": c}
               for v, c in ((float("inf"), "seed 0"), (0.5, "seed 1"))]
    runs = [{"label": "seeds", "returncode": 0, "records": records, "seconds": 1.0}]
    measure_spread.report(runs)
    assert "margin 25.00x" in capsys.readouterr().out  # the worst is the finite 0.5
    saved = measure_spread.summary(runs, "wt-run python scripts/measure_spread.py t")
    assert saved["bounds"][0]["values"] == {"seed 0": float("inf"), "seed 1": 0.5}


@pytest.mark.parametrize("argv, extra", [
    (["t.py"], []),
    (["t.py", "-k", "prefix"], ["-k", "prefix"]),
    (["t.py", "-m", "extended"], ["-m", "extended"]),  # the suite's addopts leave extended tests out otherwise
    (["t.py", "-k", "prefix", "-m", "extended"], ["-k", "prefix", "-m", "extended"]),
])
def test_the_keyword_and_marker_options_reach_pytest(monkeypatch, argv, extra):
    seen = []

    def fake_run(targets, extra_args, env, log, label, verbose):
        seen.append(list(extra_args))
        return {"label": label, "returncode": 0, "records": [], "seconds": 0.0}

    monkeypatch.setattr(measure_spread, "run_condition", fake_run)
    measure_spread.main(argv)
    assert seen == [extra]


@pytest.mark.parametrize("returncode", [0, 1])
def test_a_failed_condition_prints_the_end_of_pytests_output(monkeypatch, tmp_path, capsys, returncode):
    output = "\n".join(f"line {i}" for i in range(100)) + "\nE   AssertionError: the reason"

    def fake_subprocess_run(cmd, capture_output, text, env, cwd):
        return measure_spread.subprocess.CompletedProcess(cmd, returncode, stdout=output, stderr="")

    monkeypatch.setattr(measure_spread.subprocess, "run", fake_subprocess_run)
    measure_spread.run_condition(["t.py"], [], {}, tmp_path / "log.jsonl", "seed 2", verbose=False)
    out = capsys.readouterr().out
    assert ("| E   AssertionError: the reason" in out) == bool(returncode)
    assert "| line 0\n" not in out  # only the end
