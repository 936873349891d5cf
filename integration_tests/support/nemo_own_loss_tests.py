"""NeMo RL's own loss tests (``tests/unit/algorithms/test_loss_functions.py``), found, made CPU-only, and run.

Their file is never stored here (our rule: no copy of a framework's code). It is looked for

1. under ``$ROLLOUT_PARITY_NEMO_RL_TESTS``: ``<dir>/<version>/test_loss_functions.py`` (or the repository layout
   ``<dir>/<version>/tests/unit/algorithms/test_loss_functions.py``), then
2. beside the anchors: ``<anchors>/nemo-rl/<version>/tests/unit/algorithms/test_loss_functions.py``,

and fetched from the commit each anchor is pinned to (:data:`PINNED`, :func:`how_to_get`). At test time
:func:`cpu_copy` writes a copy with only the device changed (``"cuda"`` -> ``"cpu"``, ``torch.cuda.is_available()``
-> ``True``, ``torch.cuda.manual_seed_all`` -> ``torch.manual_seed``) into a temporary folder, and :func:`run`
runs it in a fresh pytest process with ``nemo_own_plugin`` (NeMo RL's own class, ours with the flags off, or
ours carrying NeMo RL's IS keys), returning each test's outcome.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional

from integration_tests.support.nemo_anchor import COMMITS, REPO_ROOT, anchor_root

ENV = "ROLLOUT_PARITY_NEMO_RL_TESTS"
REPOSITORY = "https://github.com/NVIDIA-NeMo/RL"
TEST_PATH = "tests/unit/algorithms/test_loss_functions.py"
#: Where each anchor's test file comes from: NeMo RL's repository at the anchor's own commit.
PINNED = {version: (REPOSITORY, commit) for version, commit in COMMITS.items()}
MODES = ("theirs", "off", "ours")


def locate(version: str) -> Optional[Path]:
    """NeMo RL's test file for ``version``, or None (see the module doc for where it is looked for)."""
    candidates = []
    base = os.environ.get(ENV)
    if base:
        candidates += [Path(base) / version / "test_loss_functions.py", Path(base) / version / TEST_PATH]
    candidates.append(anchor_root() / version / TEST_PATH)
    return next((p for p in candidates if p.is_file()), None)


def how_to_get(version: str) -> str:
    """One message: what cannot run, and how to get the file for ``version``."""
    repo, commit = PINNED[version]
    raw = f"https://raw.githubusercontent.com/NVIDIA-NeMo/RL/{commit}/{TEST_PATH}"
    return (f"NeMo RL's own loss tests ({TEST_PATH}) at {version} are not here, so they cannot be run with "
            f"RolloutParityLossFn in ClippedPGLossFn's place. Get them from {repo} at commit {commit}: "
            f"`mkdir -p $DIR/{version} && curl -fL {raw} -o $DIR/{version}/test_loss_functions.py` "
            f"(or `git -C <NeMo RL clone> show {commit}:{TEST_PATH}`), then set {ENV}=$DIR; or place it at "
            f"{anchor_root() / version / TEST_PATH}. The file stays outside this repository.")


_CPU = ((re.compile(r"torch\.cuda\.is_available\(\)"), "True"),
        (re.compile(r"torch\.cuda\.manual_seed_all\("), "torch.manual_seed("),
        (re.compile(r"([\"'])cuda\1"), r"\1cpu\1"))


def cpu_copy(source: Path, folder: Path) -> Path:
    """A copy of NeMo RL's test file with only the device changed, in ``folder`` (with an empty pytest.ini, so
    neither this repository's configuration nor NeMo RL's applies)."""
    text = source.read_text()
    for pattern, replacement in _CPU:
        text = pattern.sub(replacement, text)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pytest.ini").write_text("[pytest]\n")
    target = folder / "test_loss_functions.py"
    target.write_text(text)
    return target


def run(version: str, mode: str, source: Path, folder: Path, timeout: float = 900) -> dict[str, str]:
    """``{test id: passed | failed | error | skipped}`` of NeMo RL's test file run under ``mode``."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    target = cpu_copy(source, folder / f"{version}-{mode}")
    report = target.parent / "report.xml"
    env = dict(os.environ, ROLLOUT_PARITY_NEMO_OWN_TREE=str(anchor_root() / version),
               ROLLOUT_PARITY_NEMO_OWN_MODE=mode, PYTHONPATH=os.pathsep.join(
                   [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "pytest", str(target), "-q", "-p", "no:cacheprovider", "-p",
           "integration_tests.support.nemo_own_plugin", "--rootdir", str(target.parent), "-c",
           str(target.parent / "pytest.ini"), f"--junitxml={report}", "-o", "junit_family=xunit1"]
    proc = subprocess.run(cmd, cwd=target.parent, env=env, capture_output=True, text=True, timeout=timeout)
    if not report.is_file():
        raise RuntimeError(f"NeMo RL's tests did not run ({version}, {mode}):\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return outcomes(report)


def outcomes(report: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name")
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            out[name] = "failed"
        elif "error" in kinds:
            out[name] = "error"
        elif "skipped" in kinds:
            out[name] = "skipped"
        else:
            out[name] = "passed"
    return out


def passing(results: dict[str, str]) -> set[str]:
    return {name for name, outcome in results.items() if outcome == "passed"}
