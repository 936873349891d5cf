"""Every example does no harm at its own answer length, and the README's Python runs as written.

The flags of every example are collected from the files themselves (nothing copied by hand):
examples/*.sh and examples/*.py (the command, its commented alternatives, the docstring's commands),
and every code block of the README and docs/ that sets flags (verl's ``+rollout_parity.<flag>=...``,
TRL's and the launcher's ``--<flag> ...``, NeMo RL's ``rollout_correction:`` YAML, Python's
``CorrectionConfig(...)``). Each set is run through the doctor's own prediction of the share of
sequences it drops (``rollout_parity.doctor.lengths.predict_dropped``, the doctor's ``rej@L``) on the
parity rows of the saved default doctor run (docs/data/doctor.json: the built-in model's measured
tokens; no engine here), at the example's own length (``max_response_length``, ``max_completion_length``)
or, where the example names none, at the doctor's measured length and its reference lengths (1,024 and
8,192 tokens). Each must drop at most 5 % (the doctor's own budget, ``lengths.BUDGET``). A block preceded
by ``<!-- not-an-example: <why> -->`` is a record of what ran, not a setting to copy, and is skipped.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache

import pytest
import yaml

from rollout_parity.core.config import CorrectionConfig, flag_from_text
from rollout_parity.doctor.lengths import BUDGET, REFERENCE_LENGTHS, predict_dropped
from tests.docs_text import ROOT, blocks, commands, pages, rel

FIELDS = set(CorrectionConfig.__dataclass_fields__)
SAVED_RUN = ROOT / "docs" / "data" / "doctor.json"
#: A page about another engine's run judges its examples on that engine's saved run (its own parity rows).
PAGE_RUNS = {"docs/doctor_sglang.md": ROOT / "docs" / "data" / "doctor_sglang.json"}


def _run_of(example: "Example"):
    return PAGE_RUNS.get(example.where.split(":")[0].split(" ")[0], SAVED_RUN)


@dataclass
class Example:
    where: str
    flags: dict = field(default_factory=dict)
    preset: str | None = None
    length: int | None = None

    def config(self) -> CorrectionConfig:
        flags = {k: flag_from_text(k, v) if isinstance(v, str) else v for k, v in self.flags.items()}
        return CorrectionConfig.preset(self.preset, **flags) if self.preset else CorrectionConfig(**flags)


_LENGTH = re.compile(r"(?:max_response_length|max_completion_length|response[-_]length)\s*[=: ]\s*(\d+)")


def _length(text: str) -> int | None:
    found = {int(x) for x in _LENGTH.findall(text)}
    assert len(found) <= 1, f"several lengths in one example: {sorted(found)}"
    return found.pop() if found else None


def _hydra(command: str) -> tuple[dict, str | None]:
    flags, preset = {}, None
    for key, value in re.findall(r"\+?rollout_parity\.(\w+)=(\S+)", command):
        value = value.strip("'\"")
        if key == "preset":
            preset = value
        elif key in FIELDS:
            flags[key] = value.strip("[]") if key == "rollout_rejection" else value
    return flags, preset


def _cli(command: str) -> tuple[dict, str | None]:
    """``--<flag> value`` (a bare switch means true); stops at nothing: flags after a script are the script's
    own TrlParser flags, which mean the same."""
    import shlex

    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    flags, preset = {}, None
    for i, word in enumerate(words):
        if not word.startswith("--"):
            continue
        name, eq, value = word[2:].partition("=")
        if name not in FIELDS and name != "preset":
            continue
        if not eq:
            nxt = words[i + 1] if i + 1 < len(words) else ""
            value = nxt if nxt and not nxt.startswith("-") and not nxt.endswith(".py") else "true"
        if name == "preset":
            preset = value
        else:
            flags[name] = value
    return flags, preset


def _yaml(text: str) -> list[dict]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return []
    found = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "rollout_correction" and isinstance(value, dict):
                    found.append({k: v for k, v in value.items()})
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(data)
    return found


def _python(text: str) -> list[tuple[dict, str | None]]:
    """``CorrectionConfig(...)``, ``CorrectionConfig.preset(name, ...)``, ``ParityGRPOConfig(...)`` calls."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name not in ("CorrectionConfig", "CorrectionConfig.preset", "ParityGRPOConfig", "GRPOConfig"):
            continue
        flags = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg in FIELDS}
        preset = ast.literal_eval(node.args[0]) if name.endswith(".preset") and node.args else None
        if flags or preset or name.startswith("CorrectionConfig"):
            out.append((flags, preset))
    return out


def _from_text(where: str, text: str, lang: str, length: int | None) -> list[Example]:
    out = []
    if lang in ("yaml", "yml"):
        out += [Example(where, flags, None, length) for flags in _yaml(text)]
    elif lang in ("python", "py"):
        out += [Example(where, flags, preset, length) for flags, preset in _python(text)]
    else:
        for command in commands(text):
            if "rollout-parity doctor" in command or "run.sh doctor" in command:
                continue  # the doctor evaluates flags (--set), it does not train with them
            for parse in (_hydra, _cli):
                flags, preset = parse(command)
                if flags or preset:
                    out.append(Example(where, flags, preset, _length(command) or length))
    return out


def collect() -> list[Example]:
    """Every example's flags, with where they are and the length they are for."""
    found: list[Example] = []
    for script in sorted((ROOT / "examples").glob("*.sh")):
        text = script.read_text()
        length = _length(text)
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        found += _from_text(rel(script), code, "bash", length)
        for n, line in enumerate(text.splitlines(), 1):  # the commented alternatives, each on its own
            if line.lstrip().startswith("#") and "rollout_parity." in line:
                flags, preset = _hydra(line)
                if flags or preset:
                    found.append(Example(f"{rel(script)}:{n}", flags, preset, length))
    for script in sorted((ROOT / "examples").glob("*.py")):
        text = script.read_text()
        length = _length(text)
        doc = ast.get_docstring(ast.parse(text)) or ""
        for command in commands(doc):
            flags, preset = _cli(command)
            if flags or preset:  # the file's own default length only where the command runs this file
                own = length if script.name in command else None
                found.append(Example(f"{rel(script)} (docstring)", flags, preset, _length(command) or own))
        found += [Example(rel(script), f, p, length) for f, p in _python(text)]
    for page in pages():
        for b in blocks(page):
            if b.exempt:
                continue
            found += _from_text(b.where, b.text, b.lang, _length(b.text))
    return found


@lru_cache(maxsize=None)
def _saved_run(path=SAVED_RUN) -> dict:
    return json.loads(path.read_text())


@lru_cache(maxsize=None)
def _dropped(cfg_json: str, length: int, path=SAVED_RUN) -> dict:
    return predict_dropped(CorrectionConfig.from_dict(json.loads(cfg_json)), _saved_run(path), length)


def _worst(example: Example) -> tuple[float, int, str]:
    cfg = example.config()
    run = _run_of(example)
    measured = int(_saved_run(run)["lengths"]["measured"])
    lengths = [example.length] if example.length else sorted({measured, *REFERENCE_LENGTHS})
    worst = (0.0, lengths[0], "")
    for n in lengths:
        for row, share in _dropped(json.dumps(cfg.to_dict(), sort_keys=True), n, run).items():
            if share > worst[0]:
                worst = (share, n, row)
    return worst


EXAMPLES = collect()


def test_the_collector_finds_every_example_we_ship():
    where = {e.where.split(":")[0].split(" ")[0] for e in EXAMPLES}
    assert {"examples/verl_ppo.sh", "examples/trl_grpo.py", "README.md"} <= where, sorted(where)
    readme = [e for e in EXAMPLES if e.where.startswith("README.md")]
    # the quick start (Python), TRL's launcher line, verl's override, NeMo RL's YAML
    assert len(readme) >= 4, readme
    verl = next(e for e in EXAMPLES if e.where == "examples/verl_ppo.sh")
    assert verl.length == 512 and verl.flags


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.where for e in EXAMPLES])
def test_every_example_drops_at_most_five_percent_at_parity_at_its_length(example):
    share, length, row = _worst(example)
    assert share <= BUDGET, (f"{example.where}: {example.preset or ''} {example.flags} drops {share:.1%} of row {row}'s "
                             f"healthy sequences at {length:,} tokens (predicted from {rel(_run_of(example))}): "
                             "use the "
                             "doctor's fitted flags or correction without rejection")


def test_the_papers_preset_would_fail_it_at_the_verl_examples_length():
    """The check has teeth: `tis_srs_k3`, the example's old setting, drops more than the budget at 512 tokens."""
    preset = Example("tis_srs_k3 at 512", {}, "tis_srs_k3", 512)
    share, _, _ = _worst(preset)
    assert share > BUDGET


def test_the_readmes_python_runs_as_written():
    """Every Python block of the README runs in a fresh namespace (the quick start defines what it uses)."""
    ran = 0
    for b in blocks(ROOT / "README.md"):
        if b.lang == "python":
            exec(compile(b.text, b.where, "exec"), {"__name__": "__readme__"})
            ran += 1
    assert ran >= 1


def test_the_saved_tokens_give_back_the_doctors_own_prediction():
    """predict_dropped on a saved run's tokens is the doctor's own rej@L for the parity rows (same draws, same
    correction): what this file asserts about the examples is what the doctor would have printed for them."""
    report = json.loads((ROOT / "docs" / "data" / "doctor_8192.json").read_text())
    cfg = CorrectionConfig.from_dict(report["correction_config"])
    length = report["lengths"]["response_length"]
    got = predict_dropped(cfg, report, length)
    rows = {r["row"]: r for r in report["rows"]}
    assert set(got) == set(report["lengths"]["parity_rows"]) and got
    for name, share in got.items():
        assert share == rows[name]["rejected_seq_frac_at_length"], name


def test_the_saved_tokens_round_trip_exactly():
    import torch

    from rollout_parity.doctor.lengths import tokens_from_report, tokens_to_json

    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=gen)
    rollout = old + 1e-3 * torch.randn(6, 9, generator=gen)
    mask = torch.ones(6, 9)
    mask[2, 4:] = 0  # one completion ended early (EOS): right padding
    old, rollout = old * mask, rollout * mask
    report = json.loads(json.dumps({"lengths": {"tokens": {"d": tokens_to_json((old, rollout, mask))}}}))
    back = tokens_from_report(report)["d"]
    assert all(torch.equal(a, b) for a, b in zip(back, (old, rollout, mask)))
    mask[3, 1] = 0  # a hole inside a completion is not a doctor row's mask
    with pytest.raises(ValueError, match="prefix"):
        tokens_to_json((old, rollout, mask))
