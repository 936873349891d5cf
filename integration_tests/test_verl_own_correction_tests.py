"""verl's OWN tests of its rollout correction, unmodified, run twice: with verl's correction, and with ours in its place.

The drop-in promise is a superset: a verl user who turns rollout-parity on keeps every number, metric and option
verl's own correction gave them. So verl 0.9's own ``tests/trainer/ppo/test_rollout_corr.py`` and
``test_rollout_corr_integration.py`` (installed with verl as the top-level ``tests`` package, run from there,
never copied) run in a pytest subprocess once plain and once with ``integration_tests/support/verl_own_plugin.py``,
which replaces the entry points those tests call with the adapter's (``rollout_parity.adapters.verl.verl_keys``)
and runs verl's own beside each call on the same inputs. Every test passing with verl's must pass with ours,
except :data:`DELIBERATE_REFUSALS` (the list docs/verl_own_correction.md, "What differs on purpose", gives with
the reasons), and on every call verl made ours returned verl's weights, its mask exactly and every metric verl
logs, by name and value (the plugin's record), so verl's tests that only print a metric check it too. An older
verl release runs its own copy of the two files; a test of verl's that the release predates (:data:`ADDED_IN`) is
skipped, by name, with the release.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from packaging.version import Version

from rollout_parity.testing.stack import need

need("verl", extra="verl")

import verl  # noqa: E402

pytestmark = [pytest.mark.verl]

REPO = Path(__file__).resolve().parents[1]
VERL_TESTS = Path(verl.__file__).resolve().parent.parent / "tests" / "trainer" / "ppo"
FILES = ("test_rollout_corr.py", "test_rollout_corr_integration.py")
PLUGIN = "integration_tests.support.verl_own_plugin"
#: verl's own test (node id without the file) -> why ours refuses what it tests on purpose. Empty: every option and
#: metric these tests exercise is expressed. docs/verl_own_correction.md, "What differs on purpose", lists the
#: refusals elsewhere in verl's correction (none of them is reached by these two files).
DELIBERATE_REFUSALS: dict[str, str] = {}
#: verl 0.9.1's tests in these files, all passing with verl's correction; an older release has fewer.
PASSING_ON_0_9_1 = 30
#: verl's own test (node id without the file) -> the first verl release whose files have it.
ADDED_IN: dict[str, str] = {"test_rollout_corr::test_seq_fraction_high_uses_raw_weights": "0.9.0"}
#: verl's entry points the plugin must have answered, and the own test that is the one to call each directly
#: (None: several do); one whose only caller the release predates is not called there.
CALLED_BY: dict[str, str | None] = {
    "compute_rollout_correction_and_rejection_mask": None,
    "compute_offpolicy_metrics": None,
    "compute_is_metrics": "test_rollout_corr::test_seq_fraction_high_uses_raw_weights",
}
VERL_VERSION = Version(Version(verl.__version__).base_version)


def _lacking() -> dict[str, str]:
    """:data:`ADDED_IN`'s tests the installed verl predates."""
    return {test: since for test, since in ADDED_IN.items() if VERL_VERSION < Version(since)}


def _run(tmp_path: Path, label: str, plugin: bool) -> tuple[dict[str, str], dict]:
    """One pytest run of verl's two files: ``{test id: passed|failed|skipped}`` and the plugin's record."""
    xml, record = tmp_path / f"{label}.xml", tmp_path / f"{label}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VERL_OWN_CALLS": str(record),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           *(["-p", PLUGIN] if plugin else []), *(str(VERL_TESTS / f) for f in FILES)]
    # run outside the checkout: this repository's own ``tests`` package must not shadow verl's
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert xml.exists(), f"pytest ({label}) wrote no report:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        test = f"{Path(case.get('classname', '').replace('.', '/')).name}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[test] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return outcomes, json.loads(record.read_text()) if record.exists() else {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not all((VERL_TESTS / f).is_file() for f in FILES):
        pytest.skip(f"verl's own tests are not installed beside verl ({VERL_TESTS})")
    tmp = tmp_path_factory.mktemp("verl_own")
    return _run(tmp, "theirs", plugin=False), _run(tmp, "ours", plugin=True)


def test_every_test_passing_with_verls_correction_passes_with_ours(runs):
    (theirs, _), (ours, _) = runs
    passing = {t for t, o in theirs.items() if o == "passed"}
    # fewer means the files changed or failed to collect
    assert len(passing) >= PASSING_ON_0_9_1 - len(_lacking()), theirs
    assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))
    lost = {t: ours[t] for t in passing if ours[t] != "passed" and t not in DELIBERATE_REFUSALS}
    assert not lost, lost
    assert not set(DELIBERATE_REFUSALS) - set(theirs), "a listed refusal names no test of verl's"


def test_ours_answered_and_matched_verls_own_on_every_call(runs):
    """The plugin ran verl's own function beside ours on each call: nothing of verl's is missing or different."""
    _, (_, record) = runs
    calls = record.get("calls", {})
    for name, caller in CALLED_BY.items():
        if caller in _lacking():
            assert calls.get(name, 0) == 0, (name, calls)  # else another test calls it: CALLED_BY is wrong
        else:
            assert calls.get(name, 0) > 0, (name, calls)
    assert record["differences"] == [], record["differences"]


@pytest.mark.parametrize("test", sorted(ADDED_IN))
def test_verls_newer_own_tests_pass_with_ours_where_the_release_has_them(runs, test):
    (theirs, _), (ours, _) = runs
    if test in _lacking():
        assert test not in theirs, f"verl {verl.__version__} has {test}: ADDED_IN is wrong"
        pytest.skip(f"verl {verl.__version__} predates verl's own {test} (added in verl {ADDED_IN[test]})")
    assert theirs.get(test) == "passed" and ours.get(test) == "passed", (theirs.get(test), ours.get(test))
