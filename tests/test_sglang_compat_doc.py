"""docs/compat_sglang.md's feature table is ``SGLANG_FEATURES``, row for row: the same names, each with its first
release, what it is and the options that need it, and no other row (a row added to the code without the doc, or
to the doc without the code, fails here)."""

from __future__ import annotations

import re
from dataclasses import replace

from rollout_parity.engines.sglang.features import SGLANG_FEATURES, SglangFeature
from tests.docs_text import ROOT

DOC = ROOT / "docs" / "compat_sglang.md"
HEADER = ("feature", "first release", "what", "flags that need it")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def _plain(cell: str) -> str:
    """A cell as text: markdown's code and bold marks dropped (the code's ``what`` strings carry backticks too)."""
    return cell.replace("`", "").replace("**", "").strip()


def feature_table(text: str) -> list[dict[str, str]]:
    """The rows of the markdown table whose header starts with :data:`HEADER`, as ``{column: cell}``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines)
                  if line.lstrip().startswith("|") and tuple(c.lower() for c in _cells(line))[:len(HEADER)] == HEADER),
                 None)
    assert start is not None, f"no table with the columns {HEADER} in {DOC.name}"
    header = [c.lower() for c in _cells(lines[start])]
    rows = []
    for line in lines[start + 2:]:  # past the header and its |---| line
        if not line.lstrip().startswith("|"):
            break
        rows.append(dict(zip(header, _cells(line))))
    return rows


def problems(text: str, features: dict[str, SglangFeature]) -> list[str]:
    """Where the doc's table and ``features`` differ, one line each."""
    rows = feature_table(text)
    doc = {_plain(r["feature"]): r for r in rows}
    out = [f"{name}: a row twice" for name in doc if sum(_plain(r["feature"]) == name for r in rows) > 1]
    out += [f"{name}: in SGLANG_FEATURES, not in the doc" for name in features if name not in doc]
    out += [f"{name}: in the doc, not in SGLANG_FEATURES" for name in doc if name not in features]
    for name, f in features.items():
        row = doc.get(name)
        if row is None:
            continue
        for column, want in (("first release", f.since), ("what", f.what),
                             ("flags that need it", ", ".join(f.flags) or "-")):
            if _plain(row[column]) != _plain(want):
                out.append(f"{name}: {column} is {_plain(row[column])!r} in the doc, {_plain(want)!r} in the code")
    return out


def test_the_doc_table_is_the_feature_table():
    assert problems(DOC.read_text(), SGLANG_FEATURES) == []
    assert len(feature_table(DOC.read_text())) == len(SGLANG_FEATURES)


def test_a_row_added_to_the_code_or_the_doc_alone_fails():
    text = DOC.read_text()
    added = dict(SGLANG_FEATURES, sampling_logprobs_mode=SglangFeature("sampling_logprobs_mode", "0.5.21", "x"))
    assert problems(text, added) == ["sampling_logprobs_mode: in SGLANG_FEATURES, not in the doc"]
    fewer = {k: v for k, v in SGLANG_FEATURES.items() if k != "resolve_once"}
    assert problems(text, fewer) == ["resolve_once: in the doc, not in SGLANG_FEATURES"]


def test_a_changed_release_or_flag_fails():
    moved = dict(SGLANG_FEATURES, enable_fp32_lm_head=replace(SGLANG_FEATURES["enable_fp32_lm_head"], since="0.5.4"))
    assert problems(DOC.read_text(), moved) == [
        "enable_fp32_lm_head: first release is '0.5.3' in the doc, '0.5.4' in the code"]
    flagged = dict(SGLANG_FEATURES, resolve_once=replace(SGLANG_FEATURES["resolve_once"], flags=("precision=fp16",)))
    assert problems(DOC.read_text(), flagged) == [
        "resolve_once: flags that need it is '-' in the doc, 'precision=fp16' in the code"]
