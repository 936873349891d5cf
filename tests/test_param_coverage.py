"""``scripts/param_coverage.py``: every public parameter has a test that sets it to a non-default value.

CI runs the whole suite, so the listing runs in CI here: a parameter added without such a test fails
this test with the script's list of what is missing. The scanner's rules are checked on small sources.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "param_coverage.py"


def _script():
    return load_script(SCRIPT, "param_coverage")  # imports nothing of the package: main() does


@pytest.mark.timeout(600)
def test_every_public_parameter_is_set_by_a_test():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--missing"], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    summary = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "MISSING" not in proc.stdout and "ERROR" not in proc.stdout
    assert " 0 missing" in summary[-1], summary[-1]


def _found(pc, source: str, param) -> list[str]:
    path = ROOT / "tests" / "test_synthetic.py"
    scan = pc.Scan(path, ast.parse(source))
    pc.attribute([param], [scan])
    return param.found


def _param(pc, **kw):
    base = dict(key="f x", name="x", default=1.0, kind="kw", call_names=frozenset({"f"}), position=1,
                siblings=frozenset({"a", "x", "y"}))
    base.update(kw)
    return pc.Param(**base)


@pytest.mark.parametrize("source,counted", [
    ("f(a, x=2.0)", True),
    ("f(a, x=1.0)", False),  # the default, written out
    ("f(a, x=1)", False),
    ("f(a, 3.0)", True),  # by position
    ("f(a, x=value)", True),  # not a literal: counts
    ("g(a, x=2.0)", False),  # another function's x
    ("f(**{'x': 2.0})", True),
    ("S = [dict(x=2.0, y=1)]\nf(a, **s)", True),  # a dict of f's parameters, splatted
    ("S = [dict(x=2.0, z=1)]\nf(a, **s)", False),  # z is not f's: that dict is for something else
    ("functools.partial(f, x=2.0)", True),
])
def test_keyword_positional_and_splatted_arguments(source, counted):
    pc = _script()
    assert bool(_found(pc, source, _param(pc))) is counted


@pytest.mark.parametrize("source,counted", [
    ("def test_a():\n    main(['doctor', '--top-k', '20'])", True),
    ("def test_a():\n    main(['doctor', '--top-k', '-1'])", False),  # the default
    ("def test_a():\n    main(['check', '--top-k', '20'])", False),  # another subcommand's
    ("def test_a():\n    run(['--top-k', '20'])", False),  # no subcommand anywhere: TRL's command line
    ("def test_a():\n    cmd = 'rollout-parity doctor --top-k 20 --rows a'", True),
    ("def test_a():\n    assert lines == 'rollout-parity doctor --top-k 20'", False),  # an expected output
    ("@pytest.mark.parametrize('argv', [['--top-k', '5']])\ndef test_a(argv):\n    main(['doctor', *argv])", True),
])
def test_command_line_options_need_their_subcommand(source, counted):
    pc = _script()
    param = _param(pc, key="cli doctor --top-k", name="top_k", default=-1, kind="cli", call_names=frozenset(),
                   options=("--top-k",), parser="doctor", position=None)
    assert bool(_found(pc, source, param)) is counted


@pytest.mark.parametrize("source,counted", [
    ("compose('+rollout_parity.fp32_lm_head=true')", True),
    ("compose('+rollout_parity.fp32_lm_head=false')", False),
    ("cfg = {'rollout_parity': {'fp32_lm_head': True}}", True),
    ("cfg = {'other': {'fp32_lm_head': True}}", False),
])
def test_the_verl_block(source, counted):
    pc = _script()
    param = _param(pc, key="verl +rollout_parity.fp32_lm_head", name="fp32_lm_head", default=False, kind="verl",
                   call_names=frozenset(), position=None)
    assert bool(_found(pc, source, param)) is counted


def test_mapping_keys_count_only_for_classes_built_from_a_mapping():
    pc = _script()
    source = "flags = {'x': 2.0}\ntext = '''\nloss_fn:\n  x: 3.0\n'''"
    assert _found(pc, source, _param(pc, mapping=True))
    assert not _found(pc, source, _param(pc, mapping=False))
    assert len(_found(pc, source, _param(pc, mapping=True))) == 2  # the dict and the YAML


def test_a_parameter_without_a_test_fails_the_listing(monkeypatch, capsys, tmp_path):
    """With an empty test tree every parameter is MISSING and the script exits 1, naming them."""
    pc = _script()
    monkeypatch.setattr(pc, "TEST_DIRS", ())
    monkeypatch.setattr(pc, "python_params", lambda errors, required: (
        [_param(pc, key="core.loss.policy_loss loss_scale_factor", name="loss_scale_factor", default=None)], {}))
    monkeypatch.setattr(pc, "verl_params", lambda: [])
    monkeypatch.setattr(pc, "cli_params", lambda: [])
    monkeypatch.setattr(pc, "ALLOWED", {})
    monkeypatch.setattr(pc, "PENDING", {})
    assert pc.main(["--missing"]) == 1
    out = capsys.readouterr().out
    assert "MISSING  core.loss.policy_loss loss_scale_factor" in out and "1 missing" in out
