"""NeMo RL's OWN loss tests, run with our adapter in ``ClippedPGLossFn``'s place: drop-in means a superset.

NeMo RL's ``tests/unit/algorithms/test_loss_functions.py`` at each anchor's commit (never stored here: see
``support/nemo_own_loss_tests.py`` for where it is looked for, ``$ROLLOUT_PARITY_NEMO_RL_TESTS`` or beside the anchors,
and how to get it) runs three times per version in a fresh pytest process, on a CPU copy made at test time (only the
device changed):

* ``theirs``: NeMo RL's own ``ClippedPGLossFn``;
* ``off``: ``RolloutParityLossFn`` with the shared flags all null: every test must end as with theirs;
* ``ours``: NeMo RL's own importance-sampling keys carried out by our correction
  (``RolloutParityLossFn.from_nemo_is_config``): every test that passes with theirs must pass, except the
  differences on purpose listed in :data:`ON_PURPOSE` (docs/nemo_rl_own_correction.md, "What differs on purpose").

Tests that fail with NeMo RL's own class on this CPU machine (its distillation tests compare against values drawn from
the CUDA generator) are no evidence either way and only reported.
"""

from __future__ import annotations

from collections import Counter

import pytest

from integration_tests.support import nemo_own_loss_tests as own
from integration_tests.support.nemo_anchor import VERSIONS, skip_unless_available

pytestmark = [pytest.mark.nemo_rl, pytest.mark.slow]

#: NeMo RL tests that pass with its own class and, on purpose, not with our correction in place: {version: {test: why}}.
ON_PURPOSE: dict[str, dict[str, str]] = {"v0.7.0": {}, "head": {}}


@pytest.fixture(scope="module", params=VERSIONS)
def results(request, tmp_path_factory):
    version = request.param
    skip_unless_available([version])
    source = own.locate(version)
    if source is None:
        pytest.skip(own.how_to_get(version))
    folder = tmp_path_factory.mktemp(f"nemo-rl-own-{version}")
    out = {mode: own.run(version, mode, source, folder) for mode in own.MODES}
    counts = {mode: Counter(r.values()) for mode, r in out.items()}
    print(f"\nNeMo RL {version} own loss tests ({source}): " + "; ".join(
        f"{mode}: {len(own.passing(out[mode]))}/{len(out[mode])} pass" for mode in own.MODES) + f" ({counts})")
    return version, out


def test_their_file_ran(results):
    version, out = results
    theirs = out["theirs"]
    assert len(own.passing(theirs)) >= 50, \
        f"NeMo RL's own tests barely ran with its own class: {Counter(theirs.values())}"
    assert any("clipped_pg" in name for name in own.passing(theirs))


def test_flags_off_every_test_ends_as_with_theirs(results):
    version, out = results
    differ = {name: (outcome, out["off"].get(name)) for name, outcome in out["theirs"].items()
              if out["off"].get(name) != outcome}
    assert not differ, f"NeMo RL {version}: with our flags off these end otherwise (theirs, ours): {differ}"


def test_ours_in_place_passes_every_test_theirs_passes(results):
    version, out = results
    lost = own.passing(out["theirs"]) - own.passing(out["ours"])
    unexplained = sorted(lost - set(ON_PURPOSE[version]))
    assert not unexplained, \
        f"NeMo RL {version}: pass with NeMo RL's loss, not with our correction in place: {unexplained}"
    stale = sorted(set(ON_PURPOSE[version]) - lost)
    assert not stale, f"listed as differing on purpose but passing now (remove from ON_PURPOSE): {stale}"
