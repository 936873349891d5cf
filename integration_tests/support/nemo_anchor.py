"""NeMo RL's own source trees in ``../shared/anchors/nemo-rl``, by version, for the tests.

NeMo RL does not install here (Python >= 3.13.13, git-sourced dependencies, CUDA torch), but
its source trees at v0.7.0 and at a newer snapshot ("head") lie in ``../shared/anchors/nemo-rl``
(see that folder's README). Importing them (a stub finder for the heavy modules NeMo RL imports
but never calls on our paths, everything put back on exit) is the package's
``rollout_parity.check.nemo_source``, which ``rollout-parity check --nemo_rl_source`` uses too;
this module only knows where the anchors lie:

* ``ANCHORS.activate(version)`` activates ``<anchors>/nemo-rl/<version>`` and yields a
  namespace with ``version``, ``tree``, ``commit`` and ``load`` (``importlib.import_module``);
  the imports are kept aside per tree, so a second activation is instant and the two versions
  can take turns in one pytest process.
* ``skip_unless_available()`` skips, or fails in CI (``missing(..., anchor=True)``), when the
  trees are absent.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rollout_parity.check.nemo_source import SOURCES, is_source_tree

REPO_ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ("v0.7.0", "head")
COMMITS = {"v0.7.0": "81aa43dda4765b0429cf31dab44441e4e4383911",
           "head": "7ea279abfbeb698b092856d0dab61e7cf39bc909"}


def anchor_root() -> Path:
    """``../shared/anchors/nemo-rl`` beside the checkout (``ROLLOUT_PARITY_ANCHORS`` overrides
    the ``anchors`` folder)."""
    base = os.environ.get("ROLLOUT_PARITY_ANCHORS")
    root = Path(base) if base else REPO_ROOT.parent / "shared" / "anchors"
    return root / "nemo-rl"


def available_versions() -> list[str]:
    return [v for v in VERSIONS if is_source_tree(anchor_root() / v)]


def skip_unless_available(versions=VERSIONS) -> None:
    """Skip (fail in CI) unless every version in ``versions`` is present."""
    from rollout_parity.testing.stack import missing

    absent = [v for v in versions if v not in available_versions()]
    if absent:
        missing(f"NeMo RL anchor source {absent}",
                f"{anchor_root()} holds no nemo_rl/ tree for {absent} (the anchors sit in "
                "../shared/anchors beside the checkout; see its README)", anchor=True)


UPSTREAM = "https://github.com/NVIDIA-NeMo/RL.git"


def source_report() -> list[str]:
    """The suite's header about NeMo RL's source: where it was found, or, once, which tests cannot run without it
    and the commands that fetch each pinned version."""
    found = available_versions()
    if len(found) == len(VERSIONS):
        return [f"NeMo RL source: {anchor_root()} ({', '.join(f'{v} {COMMITS[v][:7]}' for v in VERSIONS)})"]
    absent = [v for v in VERSIONS if v not in found]
    lines = [f"NeMo RL source: {', '.join(absent)} not found under {anchor_root()} (ROLLOUT_PARITY_ANCHORS names the "
             "folder holding nemo-rl/<version>/): the tests marked nemo_rl that need it skip (CI=true: fail), "
             "integration_tests/test_nemo_rl_*.py and the NeMo RL cases of test_check.py and "
             "test_doctor_recommendation.py. To run them:"]
    for v in absent:
        tree = anchor_root() / v
        lines.append(f"  git clone {UPSTREAM} {tree} && git -C {tree} checkout {COMMITS[v]}")
    return lines


class NemoRLAnchors:
    """The anchor versions by name, activated through the package's :data:`SOURCES`."""

    @contextmanager
    def activate(self, version: str) -> Iterator:
        if version not in VERSIONS:
            raise ValueError(f"unknown NeMo RL anchor version {version!r}; expected one of {VERSIONS}")
        with SOURCES.activate(anchor_root() / version) as ns:
            ns.version, ns.commit = version, COMMITS[version]
            yield ns


#: One per process (the activations themselves are kept in the package's ``SOURCES``).
ANCHORS = NemoRLAnchors()
