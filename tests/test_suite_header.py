"""The suite says once, at the top, where NeMo RL's source is, or which tests cannot run without it and how to get
each pinned version (a clone without ../shared/anchors beside it otherwise showed only skip lines)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.docs_text import ROOT


def _header(env_anchors: str) -> str:
    env = dict(os.environ, ROLLOUT_PARITY_ANCHORS=env_anchors)
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/test_suite_header.py"], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout


def test_without_the_source_the_run_says_which_tests_and_how_to_get_it(tmp_path):
    out = _header(str(tmp_path))
    assert out.count("NeMo RL source: v0.7.0, head not found under") == 1
    assert "test_nemo_rl_*.py" in out
    for version, commit in (("v0.7.0", "81aa43dda4765b0429cf31dab44441e4e4383911"),
                            ("head", "7ea279abfbeb698b092856d0dab61e7cf39bc909")):
        tree = tmp_path / "nemo-rl" / version
        assert f"git clone https://github.com/NVIDIA-NeMo/RL.git {tree} && git -C {tree} checkout {commit}" in out


def test_with_the_source_the_run_names_where_it_is():
    from integration_tests.support.nemo_anchor import anchor_root, available_versions

    anchors = anchor_root().parent
    if len(available_versions()) < 2:
        import pytest

        pytest.skip("NeMo RL's source is not beside this checkout")
    out = _header(str(anchors))
    assert f"NeMo RL source: {anchors / 'nemo-rl'} (v0.7.0 81aa43d, head 7ea279a)" in out
