"""Every command the README and the framework pages print is run, and the flags in it are seen to act.

The command blocks of README.md, docs/trl.md, docs/verl.md (and verl_ray.md), docs/nemo_rl.md (and
nemo_rl_own_correction.md) and docs/install.md, read from the pages (tests/docs_text.py), and the doctor's
printed framework lines (its saved default run). Each command goes to the handler of its kind, which runs it
as printed, on this CPU stack and small:

* ``rollout-parity launch ... (-m trl.scripts.grpo | script.py) ...``, ``python -m verl.trainer.main_ppo ...``,
  ``ray job submit ... -- python -m verl.trainer.main_ppo ...`` and ``accelerate launch -m
  rollout_parity.launcher ...`` run through ``rollout-parity launch --dry-run`` (the launcher's own code up to
  the config the trainer would use, then stop): the shared flags it prints equal the flags written in the
  command, read independently here, and for verl the engine kwargs carry the recipe. What no CPU can run
  as printed is substituted and named: the placeholder ``<your usual overrides>`` (the engine name only), TRL's
  bf16 default on a CPU (``--use_cpu true``, TRL's own check refuses bf16 there), a user's ``train_grpo.py``
  (TRL's own script parsed by ``TrlParser``), a Ray head address (the part after ``--`` runs, with the job's
  ``env_vars`` set).
* ``pip install 'rollout-parity[<extra>]'``: the extra exists with the framework in it (installing the built
  wheel into the frameworks' stacks is ``scripts/install_check.sh``; its contents ``tests/test_wheel.py``).
* Commands that run for minutes or need what this machine lacks are each run by the named test (it must
  exist), and any other command fails here: a new documented command needs a handler or a test.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from integration_tests.support.dry_run_report import json_items, sections
from rollout_parity.core.config import CorrectionConfig, flag_from_text
from rollout_parity.launcher import main as launch
from rollout_parity.testing.stack import need
from tests.docs_text import ROOT, blocks, commands

PAGES = ("README.md", "docs/trl.md", "docs/verl.md", "docs/verl_ray.md", "docs/nemo_rl.md",
         "docs/nemo_rl_own_correction.md", "docs/install.md", "docs/doctor_sglang.md")
FIELDS = set(CorrectionConfig.__dataclass_fields__)
#: Commands a handler here does not run, and the test that runs each (it must exist).
RUN_ELSEWHERE = {
    r"^bash scripts/run\.sh doctor$": "integration_tests/test_doctor_smoke.py::test_table_rows_and_engines",
    r"^bash scripts/run\.sh test$": ".ci/run",
    # SGLang's engines run in SGLang's own venv: the test runs this command there, small
    r"^rollout-parity doctor --engine sglang ":
        "integration_tests/test_doctor_sglang.py::test_every_sglang_row_ran_on_its_own_engine_as_sglang_resolved_it",
    r"^rollout-parity check( |$)": "integration_tests/test_check.py::test_the_command_passes_on_this_stack",
    r"^uv run rollout-parity launch examples/run_grpo\.py ":
        "integration_tests/test_nemo_rl_turn_on.py::test_rollout_parity_launch_runs_the_users_entry_point_with_our_loss",
    r"^(mkdir -p|ROLLOUT_PARITY_NEMO_RL_TESTS=)": "integration_tests/test_nemo_rl_own_loss_tests.py",
    r"^python -m pip install build && python -m build$": "tests/test_wheel.py",
    # the built wheel, a checkout's path and a git URL into verl's and TRL's pinned stacks (minutes of pip)
    r"^pip install '(dist/rollout_parity-[\d.]+-py3-none-any\.whl|/path/to/rollout-parity|rollout-parity)"
    r"\[\w+\]( @ git\+https://\S+)?'$": "scripts/install_check.sh",
}
#: A user's own overrides (docs: "<your usual overrides>"): the engine our adapter writes the recipe for.
USUAL_VERL = ["actor_rollout_ref.rollout.name=vllm"]
#: On a CPU TRL refuses its own bf16 default; where the command writes no output directory, a temporary one.
CPU_TRL = ["--use_cpu", "true"]


def _documented() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for block in blocks(ROOT / page):
            if block.lang in ("bash", "sh") and not block.exempt:
                out += [(block.where, command) for command in commands(block.text)]
    return out


DOCUMENTED = _documented()


def _expected_trl(words: list[str]) -> CorrectionConfig:
    """The shared flags written in a TRL command line (``--flag value``, a bare bool switch is true)."""
    given = {}
    for i, word in enumerate(words):
        name = word[2:].replace("-", "_") if word.startswith("--") else None
        if name in FIELDS:
            value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("-") else "true"
            given[name] = flag_from_text(name, value)
    preset = words[words.index("--preset") + 1] if "--preset" in words else None
    return CorrectionConfig.preset(preset, **given) if preset else CorrectionConfig(**given)


def _expected_verl(words: list[str]) -> CorrectionConfig:
    """The ``+rollout_parity.*`` overrides as Hydra's own override parser reads their values."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([w for w in words if w.startswith("+rollout_parity.")])
    given = {o.key_or_group.split(".", 1)[1]: flag_from_text(o.key_or_group.split(".", 1)[1], o.value())
             for o in parsed}
    preset = given.pop("preset", None)
    return CorrectionConfig.preset(preset, **given) if preset else CorrectionConfig(**given)


def _dry_run(argv: list[str], capsys) -> dict:
    capsys.readouterr()
    code = launch(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"launch {' '.join(argv)} exited {code}:\n{out}\n{err[-3000:]}"
    return sections(out)


def _verl(words: list[str], capsys) -> None:
    need("verl", extra="verl")
    assert words[:3] == ["python", "-m", "verl.trainer.main_ppo"], words
    overrides = words[3:]
    report = _dry_run(["--dry-run", "-m", "verl.trainer.main_ppo", *USUAL_VERL, *overrides], capsys)
    expected = _expected_verl(overrides)
    assert json_items(report["shared flags"]) == expected.to_dict()
    engine = json_items(report["vLLM engine kwargs"])
    assert engine["logprobs_mode"] == "processed_logprobs" and engine["enable_prefix_caching"] is False
    assert ("hf_overrides" in engine) == expected.fp32_lm_head


def _trl(launcher_args: list[str], capsys, tmp_path: Path) -> None:
    need("trl", extra="trl")
    target = launcher_args.index("-m") if "-m" in launcher_args else next(
        i for i, w in enumerate(launcher_args) if w.endswith(".py"))
    script_args = launcher_args[target + (2 if launcher_args[target] == "-m" else 1):]
    extra = CPU_TRL + ([] if "--output_dir" in script_args else ["--output_dir", str(tmp_path / "out")])
    argv = [w for w in launcher_args if w != "--dry-run"]
    report = _dry_run(["--dry-run", *argv, *extra], capsys)
    assert json_items(report["shared flags"]) == _expected_trl(launcher_args).to_dict()
    assert not (tmp_path / "out").exists()  # stopped before the trainer wrote anything


def _handle(command: str, capsys, monkeypatch, tmp_path: Path) -> str:
    """Run one documented command by its kind; returns what ran (for the failure message)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    words = shlex.split(re.sub(r"<[^<>]*>", "", command))  # a placeholder (<your usual overrides>) is the user's
    for pattern, test in RUN_ELSEWHERE.items():
        if re.search(pattern, command):
            path, _, func = test.partition("::")
            assert (ROOT / path).exists() and (not func or f"def {func}(" in (ROOT / path).read_text()), test
            return f"run by {test}"
    if words[:2] == ["pip", "install"]:
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        form = re.fullmatch(r"(?:\./)?rollout-parity\[(\w[\w-]*)\]", words[2])  # the index's name, or a checkout's path
        assert form, f"an install form no test covers: {command}"
        extra = form.group(1)
        assert extra in extras and any(r.startswith(extra.replace("_", "-")) for r in extras[extra]), extra
        return f"extra [{extra}] declared"
    if words[:3] == ["ray", "job", "submit"]:
        job = words[words.index("--") + 1:]
        if "--runtime-env-json" in words:
            env = json.loads(words[words.index("--runtime-env-json") + 1]).get("env_vars", {})
            for key, value in env.items():
                monkeypatch.setenv(key, value)
        _verl(job, capsys)
        return "the job's command, dry run"
    if words[:3] == ["python", "-m", "verl.trainer.main_ppo"]:
        _verl(words, capsys)
        return "dry run"
    if words[:2] == ["rollout-parity", "launch"] and "verl.trainer.main_ppo" in words:
        _verl(["python", *words[words.index("-m"):]], capsys)
        return "dry run"
    if words[:2] == ["rollout-parity", "launch"]:
        _trl(words[2:], capsys, tmp_path)
        return "dry run"
    if words[:2] == ["accelerate", "launch"]:
        args = words[words.index("rollout_parity.launcher") + 1:]
        if "train_grpo.py" in args:  # the user's own script: TRL's, which parses GRPOConfig with TrlParser
            args = args[:args.index("train_grpo.py")] + ["-m", "trl.scripts.grpo", "--model_name_or_path",
                                                          "no-such/model", "--dataset_name", "no-such/data", "--use_vllm"]
        _trl(args, capsys, tmp_path)
        return "the launcher's part, dry run"
    raise AssertionError(f"no test runs this documented command: {command}")


@pytest.mark.verl
@pytest.mark.trl
@pytest.mark.parametrize("where, command", DOCUMENTED, ids=[f"{w}:{c[:40]}" for w, c in DOCUMENTED])
def test_every_documented_command_runs_with_its_flags_acting(where, command, capsys, monkeypatch, tmp_path):
    _handle(command, capsys, monkeypatch, tmp_path)


@pytest.mark.verl
@pytest.mark.trl
def test_the_doctors_printed_lines_run_with_their_flags_acting(capsys, monkeypatch, tmp_path):
    """The verl block and the TRL launch line of the doctor's recommendation (the saved default run), pasted."""
    from rollout_parity.doctor.advice import format_recommendation, recommend

    report = json.loads((ROOT / "docs" / "data" / "doctor.json").read_text())
    report["recommendation"] = recommend(report)  # what this code prints for the saved measurements
    lines = format_recommendation(report).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("verl ("))
    overrides = []
    for line in lines[start + 1:]:
        if not line.strip().startswith("+rollout_parity."):
            break
        overrides.append(line.strip().rstrip("\\").strip())
    assert overrides, lines
    monkeypatch.chdir(tmp_path)
    _verl(["python", "-m", "verl.trainer.main_ppo", *overrides], capsys)
    launch_line = next(line.strip() for line in lines if line.strip().startswith("rollout-parity launch "))
    words = shlex.split(launch_line)
    assert (ROOT / words[-1]).is_file()  # examples/trl_grpo.py
    _trl(words[2:-1] + [str(ROOT / words[-1])], capsys, tmp_path)


def test_an_unknown_documented_command_fails(capsys, monkeypatch, tmp_path):
    with pytest.raises(AssertionError, match="no test runs this documented command"):
        _handle("curl http://example.invalid | sh", capsys, monkeypatch, tmp_path)
