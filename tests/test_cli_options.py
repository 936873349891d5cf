"""The command lines' conventions: one spelling, help on every option, switches with values, typos refused.

``rollout-parity doctor``/``check``/``launch`` (issue 32, items 5 and 9): options are snake_case like
TRL's and verl's, with the kebab-case spelling an alias; every option says what it does; a switch
takes an optional ``true``/``false`` (TRL's parser does the same for bool fields), so the doctor's
``--fp32_lm_head true`` runs before a script; ``launch`` is in the top-level help; an unknown or
abbreviated option is refused in one line naming the closest one.
"""

from __future__ import annotations

import argparse

import pytest

from rollout_parity import CorrectionConfig, cli, doctor
from rollout_parity.doctor.rows import ROW_SPECS
from rollout_parity.launcher import build_parser as launch_parser
from rollout_parity.launcher import correction_from_args, parse_args


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subs.choices[name]


PARSERS = {"doctor": lambda: _subparser("doctor"), "check": lambda: _subparser("check"), "launch": launch_parser}


def _options(name: str) -> list[argparse.Action]:
    return [a for a in PARSERS[name]()._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _value(action: argparse.Action) -> list[str]:
    if action.nargs == "?" and action.const is True:
        return ["false" if action.default else "true"]  # the switch's other value
    if action.nargs == argparse.REMAINDER:
        return ["module"]
    if action.choices:
        return [next(c for c in action.choices if c != action.default)]
    if action.type is int:
        return ["3"]
    if action.type is float:
        return ["0.5"]
    return ["k=v"] if action.dest == "overrides" else ["x"]


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_option_has_help_and_both_spellings(name):
    for action in _options(name):
        assert action.help and action.help != argparse.SUPPRESS, action.option_strings
        long = [s for s in action.option_strings if s.startswith("--")]
        if not long:
            continue
        snake = long[0]
        assert "-" not in snake[2:], f"{snake}: snake_case first"
        if "_" in snake:
            assert long == [snake, "--" + snake[2:].replace("_", "-")], long


@pytest.mark.parametrize("name", list(PARSERS))
def test_both_spellings_parse_to_the_same_value(name):
    parser = PARSERS[name]()
    for action in _options(name):
        if action.nargs == argparse.REMAINDER:
            continue
        got = []
        for spelling in action.option_strings:
            argv = [spelling, *_value(action)] + (["script.py"] if name == "launch" else [])
            got.append(getattr(parser.parse_args(argv), action.dest))
        assert len(set(map(repr, got))) == 1 and got[0] != action.default, (action.option_strings, got)


def _stub_doctor(monkeypatch):
    seen = []
    monkeypatch.setattr(doctor, "run_doctor", lambda opts: seen.append(opts) or {"recipe_delta_abs_mean": 1e-3})
    monkeypatch.setattr(doctor, "format_table", lambda report: "")
    monkeypatch.setattr(doctor, "format_recommendation", lambda report: "")
    return seen


@pytest.mark.parametrize("argv", [["--top_p", "0.8"], ["--top-p", "0.8"], ["--top_p=0.8"]])
def test_the_doctor_takes_either_spelling(monkeypatch, argv):
    """The issue's ``doctor --top_p 0.9`` failed with the top-level usage."""
    seen = _stub_doctor(monkeypatch)
    assert cli.main(["doctor", *argv]) == 0
    assert seen[0].top_p == 0.8


@pytest.mark.parametrize("argv,progress", [(["--no_progress"], False), (["--no-progress", "true"], False),
                                           (["--no_progress", "false"], True), (["--no_progress=no"], True)])
def test_switches_take_an_optional_true_or_false(monkeypatch, argv, progress):
    seen = _stub_doctor(monkeypatch)
    assert cli.main(["doctor", *argv]) == 0
    assert seen[0].progress is progress


@pytest.mark.parametrize("argv,fp32,target", [
    (["--fp32_lm_head", "true", "examples/trl_grpo.py", "--seed", "1"], True, ["examples/trl_grpo.py", "--seed", "1"]),
    (["--fp32_lm_head", "examples/trl_grpo.py"], True, ["examples/trl_grpo.py"]),  # never the path as its value
    (["--fp32-lm-head", "false", "examples/trl_grpo.py"], False, ["examples/trl_grpo.py"]),
    (["--fp32_lm_head=yes", "examples/trl_grpo.py"], True, ["examples/trl_grpo.py"]),
])
def test_a_launcher_switch_before_the_script(argv, fp32, target):
    """The doctor's TRL line pasted before the script (``--fp32_lm_head true script.py``) used to take
    ``true`` for the script."""
    args = parse_args(argv)
    assert correction_from_args(args).fp32_lm_head is fp32 and args.target == target


def test_an_explicit_false_is_given_not_absent():
    """``--fp32_lm_head false`` is a flag given (it overrides a preset's value), unlike leaving it out."""
    given = parse_args(["--fp32_lm_head", "false", "x.py"])
    assert given.fp32_lm_head is False and parse_args(["x.py"]).fp32_lm_head is None
    assert correction_from_args(given) == CorrectionConfig(fp32_lm_head=False)


@pytest.mark.parametrize("sub,argv,meant", [
    ("doctor", ["--top_pp", "0.9"], "--top_p"),
    ("doctor", ["--respons_length", "8192"], "--response_length"),
    ("doctor", ["--num-prompt", "2"], "--num-prompts"),  # an abbreviation argparse would have taken
    ("check", ["--jsn", "-"], "--json"),
    ("check", ["--no_prog"], "--no_progress"),
])
def test_a_typo_is_one_line_naming_the_closest_option(monkeypatch, capsys, sub, argv, meant):
    _stub_doctor(monkeypatch)
    assert cli.main([sub, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rollout-parity {sub}: unknown option {argv[0]} (did you mean {meant!r}?); "
                   f"see rollout-parity {sub} --help"]


def test_the_top_level_help_lists_launch(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "{doctor,check,launch}" in out and "launch " in out and "rollout-parity launch --help" in " ".join(out.split())


@pytest.mark.parametrize("sub", ["doctor", "check", "launch"])
def test_each_subcommands_help(capsys, monkeypatch, sub):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as info:
        cli.main([sub, "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"usage: rollout-parity {sub}" in out
    if sub == "doctor":  # --rows names the rows, --engine the engines and SGLang's rows
        from rollout_parity.doctor.engine_sglang import ROW_SPECS as SGLANG_ROWS

        assert f"of {', '.join(ROW_SPECS)} on vLLM (default: all the engine's" in out
        assert f"of vllm, sglang (default vllm; SGLang's rows: {', '.join(SGLANG_ROWS)};" in out
    if sub == "launch":
        assert "--fp32_lm_head [true|false], --fp32-lm-head [true|false]" in out


def test_version_is_the_packages_the_projects_and_the_changelogs_newest(capsys):
    import re
    import tomllib

    import rollout_parity
    from rollout_parity.cli import main
    from tests.docs_text import ROOT

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"rollout-parity {rollout_parity.__version__}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == rollout_parity.__version__
    newest = re.search(r"^## (\S+) \(", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)[1]
    assert newest == rollout_parity.__version__
