"""The README and docs/ point only at things that exist, and stay readable.

Every repository path they name exists (globs and ``<name>`` placeholders match something), every
markdown link and anchor resolves, every ``rollout_parity.x.y`` name is defined, every
``rollout-parity <command>`` (and ``bash scripts/run.sh <command>``) with its options is one the CLI
accepts (either spelling, ``--top_p`` or ``--top-p``), prose lines are at most 120 characters, the
README is a short entry (at most 200 lines, the two set-up commands, one example per framework) and
docs/README.md lists every page. Nothing in the repository cites the design contract that lives
outside it.
"""

from __future__ import annotations

import os
import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest

from tests.docs_text import ROOT, anchors, blocks, commands, inline_code, pages, prose_lines, rel

#: First path components that are this repository's (a path starting with one must exist).
TOP = ("rollout_parity", "tests", "integration_tests", "docs", "scripts", "examples", "benchmarks", "configs",
       "constraints")
TOP_FILES = ("README.md", "pyproject.toml", "conftest.py", "compat-results.txt")
#: Paths that look like ours but are another project's: allowed where the text names the owner nearby.
FOREIGN = {"examples/run_grpo.py": "NeMo RL", "examples/run_grpo*.py": "NeMo RL",
           "examples/data_preprocess/gsm8k.py": "verl", "docs/design-docs/dependency-management.md": "NeMo RL"}
#: Outside the repository, named on purpose: where the suite finds NeMo RL's source trees.
OUTSIDE = ("../shared/anchors",)
PATH = re.compile(r"(?<![\w./~$-])((?:%s)/[\w./*<>{},-]*|(?:%s)\b)" % ("|".join(TOP), "|".join(
    re.escape(f) for f in TOP_FILES)))
DOTTED = re.compile(r"(?<![\w./+-])((?:rollout_parity|integration_tests|tests|benchmarks)(?:\.\w+)+)(?![\w=-])")
MAX_PROSE = 120
FILE_SUFFIXES = {"md", "py", "sh", "yaml", "yml", "json", "txt", "toml", "png"}


def _texts():
    """(page, line number, text, is_code) of every line of every page."""
    for page in pages():
        code_lines = {}
        for b in blocks(page):
            for k, line in enumerate(b.text.splitlines(), b.line + 1):
                code_lines[k] = line
        for n, line in enumerate(page.read_text().splitlines(), 1):
            yield page, n, line, n in code_lines


def _exists(path: str) -> bool:
    path = path.rstrip(".,:;)")
    path = path.split("::")[0]
    pattern = re.sub(r"<[^>]+>", "*", path)
    if "{" in pattern:
        head, alts, tail = re.match(r"(.*)\{([^}]*)\}(.*)", pattern).groups()
        return all(_exists(head + a + tail) for a in alts.split(","))
    if any(c in pattern for c in "*?["):
        return any(ROOT.glob(pattern))
    return (ROOT / pattern).exists()


def test_every_repository_path_named_in_the_docs_exists():
    missing = []
    lines = {}
    for page, n, line, _ in _texts():
        lines[(page, n)] = line
    for (page, n), line in lines.items():
        for m in PATH.finditer(line):
            path = m.group(1).rstrip(".,:;)")
            owner = FOREIGN.get(path)
            if owner:
                near = " ".join(lines.get((page, k), "") for k in range(n - 3, n + 1))
                if owner in near:
                    continue
                missing.append(f"{rel(page)}:{n}: {path} is {owner}'s, and the text does not say so")
                continue
            if not _exists(path):
                missing.append(f"{rel(page)}:{n}: {path}")
        for m in re.finditer(r"(?<![\w/])\.\./[\w./-]+", line):
            if not m.group(0).startswith(OUTSIDE) and not (page.parent / m.group(0)).exists():
                missing.append(f"{rel(page)}:{n}: {m.group(0)} (outside the repository)")
    assert not missing, "paths the repository lacks:\n" + "\n".join(missing)


def test_every_markdown_link_and_anchor_resolves():
    bad = []
    for page in pages():
        for n, line in prose_lines(page):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
                    continue
                file, _, anchor = target.partition("#")
                dest = page if not file else (page.parent / file).resolve()
                if not dest.exists():
                    bad.append(f"{rel(page)}:{n}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    bad.append(f"{rel(page)}:{n}: {target} (no heading #{anchor} in {rel(dest)})")
    assert not bad, "links to nothing:\n" + "\n".join(bad)


def _defined(module_file: Path, name: str) -> bool:
    text = module_file.read_text()
    return re.search(r"(^|\W)%s(\W|$)" % re.escape(name), text) is not None


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    here = ROOT
    for i, part in enumerate(parts):
        if (here / part).is_dir():
            here = here / part
            continue
        if (here / f"{part}.py").exists():
            module = here / f"{part}.py"
            return all(_defined(module, attr) for attr in parts[i + 1:])
        init = here / "__init__.py"
        return init.exists() and all(_defined(init, attr) for attr in parts[i:])
    return True


def test_every_dotted_name_of_ours_is_defined():
    from rollout_parity.core.config import CorrectionConfig

    hydra_keys = {f for f in CorrectionConfig.__dataclass_fields__} | {"preset"}
    bad = []
    for page, n, line, _ in _texts():
        if "did you mean" in line:  # a refusal quoted with its deliberate typo
            continue
        for m in DOTTED.finditer(line):
            name = m.group(1)
            if name.rsplit(".", 1)[1] in FILE_SUFFIXES:  # a file name (benchmarks.md), not a module
                continue
            if name.split(".")[1] in hydra_keys:  # a Hydra key (+rollout_parity.<flag>=...), not a module
                continue
            if not _resolves(name):
                bad.append(f"{rel(page)}:{n}: {name}")
    assert not bad, "names the package does not define:\n" + "\n".join(bad)


@lru_cache(maxsize=None)
def _cli_options() -> dict[str, set[str]]:
    """The CLI's commands and each one's option strings, from its own parsers."""
    import argparse

    from rollout_parity.cli import build_parser
    from rollout_parity.launcher import build_parser as launch_parser

    out = {}
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = {s for a in sub._actions for s in a.option_strings}
    # `launch` parses its own options (rollout_parity/launcher.py), whether or not the CLI lists it
    out["launch"] = out.get("launch", set()) | {s for a in launch_parser()._actions for s in a.option_strings}
    return out


def _run_sh_commands() -> set[str]:
    text = (ROOT / "scripts" / "run.sh").read_text()
    arms = re.findall(r"^\s*([a-z|-]+)\)", text, flags=re.M)
    return {name for arm in arms for name in arm.split("|")} - {"*"}


def _known(option: str, known: set[str]) -> bool:
    option = option.split("=", 1)[0]
    return option in known or option.replace("_", "-") in known or option.replace("-", "_") in known


def _check_command(words: list[str]) -> list[str]:
    """Problems with one ``rollout-parity <command> ...`` (words after ``rollout-parity``)."""
    parsers = _cli_options()
    if not words or words[0].startswith(("<", "[", ".")):  # a placeholder: `rollout-parity <command>`, `...`
        return []
    if words[0].startswith("-"):  # an option of the program itself (its help)
        return []
    command = words[0]
    if command not in parsers:
        return [f"no command {command!r} (the CLI has {sorted(parsers)})"]
    problems = []
    for word in words[1:]:
        if command == "launch" and (word.endswith(".py") or word == "-m" or not word.startswith("-")
                                    and word.endswith(("...", "]"))):
            break  # everything after the script belongs to the script
        if word.startswith("--") and not _known(word, parsers[command]):
            problems.append(f"`rollout-parity {command}` has no option {word.split('=', 1)[0]}")
    return problems


def _split(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:
        return text.split()


def _command_texts():
    """(where, words after the program) of every rollout-parity / run.sh / launcher command the docs name."""
    for page in pages():
        for b in blocks(page):
            if b.lang not in ("", "bash", "sh", "shell", "console", "text"):
                continue
            for cmd in commands(b.text):
                yield b.where, cmd
        for n, line in prose_lines(page):
            for code in inline_code(line):
                yield f"{rel(page)}:{n}", code


def test_every_command_and_option_named_in_the_docs_exists():
    run_sh = _run_sh_commands()
    bad = []
    for where, text in _command_texts():
        words = _split(text)
        for i, word in enumerate(words):
            if word == "rollout-parity" or word.endswith("/rollout-parity"):
                bad += [f"{where}: {p}" for p in _check_command(words[i + 1:])]
            elif word == "-m" and i + 1 < len(words) and words[i + 1] in ("rollout_parity.launcher",
                                                                          "rollout_parity.cli"):
                rest = words[i + 2:] if words[i + 1] == "rollout_parity.cli" else ["launch", *words[i + 2:]]
                bad += [f"{where}: {p}" for p in _check_command(rest)]
            elif word == "scripts/run.sh" and i + 1 < len(words):
                sub = words[i + 1]
                if sub not in run_sh:
                    bad.append(f"{where}: scripts/run.sh has no command {sub!r} (it has {sorted(run_sh)})")
                elif sub in _cli_options():
                    bad += [f"{where}: {p}" for p in _check_command(words[i + 1:])]
    assert not bad, "commands the CLI does not have:\n" + "\n".join(bad)


#: Pages that document one command's options: every `--option` in their prose must be that command's.
OPTION_PAGES = {"docs/doctor.md": "doctor", "docs/thresholds.md": "doctor", "docs/check.md": "check",
                **{f"docs/doctor_{task}.md": "doctor"
                   for task in ("rows", "output", "recommendation", "length", "fp16", "options")}}


def test_every_option_a_command_page_names_exists():
    bad = []
    for page_name, command in OPTION_PAGES.items():
        page = ROOT / page_name
        for n, line in prose_lines(page):
            if "did you mean" in line:  # a refusal quoted with its deliberate typo
                continue
            for code in inline_code(line):
                for word in re.split(r"[\s/,]+", code):
                    if re.match(r"--[a-z]", word) and not _known(word, _cli_options()[command]):
                        bad.append(f"{page_name}:{n}: {word} (`rollout-parity {command}` has no such option)")
    assert not bad, "\n".join(bad)


def test_the_command_checker_catches_a_wrong_option_and_command():
    assert _check_command(["doctor", "--response_length", "8192", "--top-p", "0.9"]) == []
    assert _check_command(["doctor", "--response-lenght", "8192"])
    assert _check_command(["docter"])
    assert _check_command(["launch", "--preset", "icepop", "train.py", "--not-ours"]) == []
    assert _check_command(["launch", "--rollout_rejecton", "x", "train.py"])


def test_prose_lines_are_at_most_120_characters():
    """Outside code blocks and table rows, with marker comments removed (what a reader reads)."""
    long = []
    for page in pages():
        for n, line in prose_lines(page):
            shown = re.sub(r"<!--.*?-->", "", line)
            if shown.lstrip().startswith("|"):
                continue
            if len(shown) > MAX_PROSE:
                long.append(f"{rel(page)}:{n}: {len(shown)} characters")
    assert not long, f"prose lines over {MAX_PROSE} characters:\n" + "\n".join(long)


def test_the_readme_is_a_short_entry_with_the_two_commands_and_one_example_per_framework():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    setup = text.split("## Set up", 1)[1]
    first = next(b for b in blocks(ROOT / "README.md") if "scripts/run.sh" in b.text)
    assert [c.split("#")[0].strip() for c in commands(first.text)] == ["bash scripts/run.sh doctor",
                                                                       "bash scripts/run.sh test"]
    assert setup.index("scripts/run.sh doctor") < setup.index("##")
    sections = re.split(r"^## ", text, flags=re.M)
    for framework in ("TRL", "verl", "NeMo RL"):
        section = next((s for s in sections if s.startswith(framework)), None)
        assert section is not None and "```" in section, f"no example section for {framework}"
    assert "docs/README.md" in text


def test_the_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [rel(p) for p in sorted((ROOT / "docs").rglob("*.md"))
               if p.name != "README.md" and f"]({p.relative_to(ROOT / 'docs')})" not in index]
    assert not missing, "docs/README.md does not list: " + ", ".join(missing)


def test_long_pages_open_with_a_contents_list():
    """A page over 300 lines links its own sections within its first 25 lines."""
    bad = []
    for page in pages():
        lines = page.read_text().splitlines()
        if len(lines) > 300 and not any(re.search(r"\]\(#[\w-]+\)", line) for line in lines[:25]):
            bad.append(f"{rel(page)} ({len(lines)} lines)")
    assert not bad, "long pages without a contents list at the top: " + ", ".join(bad)


def _repository_files():
    skip_dirs = {".git", "__pycache__", ".venv", "venv", "node_modules", "data"}
    for top in [*TOP, "."]:
        base = ROOT / top
        if top == ".":
            yield from (p for p in ROOT.iterdir() if p.is_file())
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.endswith(".egg-info")]
            for f in filenames:
                if f.endswith((".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".json")):
                    yield Path(dirpath) / f


def test_nothing_cites_the_design_contract_that_is_not_in_the_repository():
    word = "DES" + "IGN"  # written split, so this file does not cite it either
    name = word + ".md"
    hits = []
    for path in _repository_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if name in line or re.search(r"\b%s'?s?\b" % word, line):
                hits.append(f"{rel(path)}:{n}")
    assert not hits, f"{name} is not in the repository; cite the docs page or the source instead:\n" + "\n".join(hits)


@pytest.mark.parametrize("bad, caught", [
    ("see `rollout_parity/core/no_such_module.py`", "rollout_parity/core/no_such_module.py"),
    ("see `docs/nowhere.md`", "docs/nowhere.md"),
])
def test_the_path_checker_catches_a_missing_file(bad, caught):
    found = [m.group(1) for m in PATH.finditer(bad)]
    assert found == [caught] and not _exists(caught)


#: Another project's tracker or pull-request number (``verl#6240``, ``verl #4036``, ``EasyR1 #583``) may be cited.
_FOREIGN_NUMBER = re.compile(r"(verl|vLLM|vllm|trl|TRL|RL|EasyR1|PR|sglang|SGLang|transformers|accelerate)\s*$")


def _internal_references(text: str) -> list[str]:
    """Our own issue numbers (``issue 31``, a bare ``#31``) and this machine's paths (``/work/...``) in a text."""
    found = [m.group(0) for m in re.finditer(r"\b[Ii]ssues? \d+", text)]
    found += [m.group(0) for m in re.finditer(r"(?<![\w&])#\d+\b", text)
              if not _FOREIGN_NUMBER.search(text[max(0, m.start() - 14):m.start()])]
    return found + re.findall(r"(?<![\w.])/work/\S*", text)


def test_user_pages_name_no_issue_numbers_or_machine_paths():
    """A reader has neither our tracker nor our machines: a number or a path of ours tells them nothing."""
    hits = [f"{rel(page)}:{n}: {ref}" for page in pages()
            for n, line in enumerate(page.read_text().splitlines(), 1) for ref in _internal_references(line)]
    assert not hits, "internal references in user pages:\n" + "\n".join(hits)


@pytest.mark.parametrize("text, found", [
    ("as issue 31 measured", ["issue 31"]), ("see #12 for why", ["#12"]), ("in /work/main/x", ["/work/main/x"]),
    ("verl#6240 and verl #4036, EasyR1 #583", []), ("&#8212;", [])])
def test_the_internal_reference_checker_catches_ours_and_keeps_theirs(text, found):
    assert _internal_references(text) == found


def _our_tests() -> dict[str, set[str]]:
    """``{file name: its test functions}`` of this repository's test files."""
    out: dict[str, set[str]] = {}
    for folder in ("tests", "integration_tests"):
        for path in (ROOT / folder).rglob("test_*.py"):
            out[path.name] = set(re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), flags=re.M))
    return out


def test_every_test_a_page_names_exists():
    """``test_x.py::test_y`` in a page is ours: the file and the function exist (a renamed test is no citation)."""
    tests = _our_tests()
    missing = []
    for page in pages():
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for file, func in re.findall(r"(test_\w+\.py)::(test_\w+)", line):
                if file in tests and func not in tests[file] or file not in tests:
                    missing.append(f"{rel(page)}:{n}: {file}::{func}")
    assert not missing, "tests named in the docs that do not exist:\n" + "\n".join(missing)
