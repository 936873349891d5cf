"""The registry (``rollout_parity/registry.py``) is the one list of frameworks and engines.

A second list, in the package or the suite's setup, is what lets a new framework or engine be half added: a test
here fails naming the file and line of any literal that lists two or more units, and every package under
``adapters/`` and ``engines/`` must be a unit's (and every unit must have its package).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from rollout_parity import registry

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rollout_parity"
KEYS = set(registry.keys())
FRAMEWORK_KEYS = set(registry.keys("framework"))
#: Literals that hold two unit keys without being a list of units, each with why.
NOT_LISTS = {
    ("rollout_parity/engines/vllm/recipe.py", ("trl", "vllm")):
        "the two dialects of vLLM's server flags (`vllm serve`, `trl vllm-serve`), not a list of units",
}


def _scanned() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "registry.py"] + [ROOT / "conftest.py"]


def _keys_listed(node: ast.AST) -> tuple[str, set[str]]:
    """What kind of literal ``node`` is and the unit keys it lists."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return "list", {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in KEYS}
    if isinstance(node, ast.Dict):
        return "table", {k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in KEYS}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        words = [w for w in re.split(r"[\s,/|]+", node.value) if w]
        listed = set(words) & KEYS  # prose naming two units ("trl, verl" log a metric) says who, not which exist
        if len(listed) >= 3 and all(w in KEYS | {"core", "and", "or"} for w in words):
            return "list", listed
    return "", set()


def _findings() -> list[str]:
    found = []
    for path in _scanned():
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            kind, listed = _keys_listed(node)
            if len(listed) < 2:
                continue
            if kind == "table":  # a per-framework table of content: complete, so a new framework cannot skip it
                if not FRAMEWORK_KEYS <= listed:
                    found.append(f"{rel}:{node.lineno}: a table for {sorted(listed)} lacks "
                                 f"{sorted(FRAMEWORK_KEYS - listed)}")
            elif (rel, tuple(sorted(listed))) not in NOT_LISTS:
                found.append(f"{rel}:{node.lineno}: lists {sorted(listed)}; read registry.py instead")
    return found


def test_no_second_list_of_frameworks_or_engines():
    assert _findings() == []


def test_the_scan_finds_a_second_list(tmp_path, monkeypatch):
    """The scan is not blind: a hand-kept tuple, a comma string and an incomplete table are each found."""
    fake = tmp_path / "rollout_parity"
    fake.mkdir()
    (fake / "m.py").write_text('A = ("trl", "verl")\nB = "core, trl, verl, vllm"\nC = {"trl": 1, "verl": 2}\n'
                               'D = {"trl": 1, "verl": 2, "nemo_rl": 3}\nE = "trl, verl"\n')
    (tmp_path / "conftest.py").write_text("")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    found = _findings()
    assert [f.split(":")[1] for f in found] == ["1", "2", "3"], found


def test_every_adapter_and_engine_package_is_a_unit_and_back():
    adapters = {p.name for p in (PACKAGE / "adapters").iterdir() if (p / "__init__.py").exists()}
    engines = {p.name for p in (PACKAGE / "engines").iterdir() if (p / "__init__.py").exists()}
    # an adapters/<engine> package is that engine's plugin, run inside the engine's own processes
    assert adapters == FRAMEWORK_KEYS | {"vllm"} and engines == set(registry.keys("engine"))
    for u in registry.UNITS:
        assert (ROOT / Path(*u.package.split("."))).is_dir(), u.package
        assert u.package.startswith("rollout_parity.adapters." if u.kind == "framework" else "rollout_parity.engines.")


@pytest.mark.parametrize("u", registry.UNITS, ids=lambda u: u.key)
def test_each_units_check_resolves_and_its_extra_exists(u):
    module, function = u.check.split(":")
    assert callable(getattr(importlib.import_module(module), function))
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf'^{re.escape(u.extra)} = \[', text, re.M), f"pyproject.toml has no extra {u.extra!r}"


def test_the_check_the_cli_and_the_markers_read_the_registry():
    from rollout_parity.check import FRAMEWORKS
    from rollout_parity.cli import build_parser
    from rollout_parity.testing.stack import FRAMEWORK_MARKERS

    assert [s.key for s in FRAMEWORKS] == ["core", *registry.keys()]
    assert set(registry.keys()) <= set(FRAMEWORK_MARKERS)
    check = build_parser()._subparsers._group_actions[0].choices["check"]
    assert ", ".join(("core", *registry.keys())) in re.sub(r"\s+", " ", check.format_help())


def test_metric_names_carry_one_field_per_framework():
    from dataclasses import fields

    from rollout_parity.core.metric_names import Metric

    per_framework = {f.name for f in fields(Metric) if f.name not in ("name", "definition", "note", "source")}
    assert per_framework == FRAMEWORK_KEYS


def test_unit_reads_user_spellings_and_names_the_known():
    assert registry.unit("NeMo-RL").key == "nemo_rl" and registry.unit(" vllm ").kind == "engine"
    with pytest.raises(KeyError, match="unknown framework or engine 'openrlhf': rollout-parity knows trl, verl"):
        registry.unit("openrlhf")
    with pytest.raises(ValueError, match="kind must be 'framework' or 'engine'"):
        registry.Unit("x", "X", "library", "x", ("x",), "x", "p", "m", "c:f", 1)
