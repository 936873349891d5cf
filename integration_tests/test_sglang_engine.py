"""A live SGLang engine on this CPU: `rollout-parity check --engine sglang` as a user runs it, and the engine's
logprobs against the trainer's in the form SGLang returns them.

SGLang runs in its own venv (scripts/sglang_venv.sh: sglang 0.5.23 on the CPU torch). The only stand-in there is
``sgl_kernel``'s few ops in plain PyTorch (integration_tests/support/sglang_cpu/; SGLang's kernels ship for CUDA
only): every SGLang argument goes through SGLang's own validation unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from integration_tests.support.venvs import venv_python

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.sglang

# Engine vs trainer (bf16 body, fp32 head, log_softmax(z / T)), mean |d| per token, in multiples of the trainer's
# precision floor (the same trainer against the checkpoint in float32, same tokens): 0.27 measured here, before and
# after the weight load (the engine's seed is fixed, so one run is every run of this file on one machine).
TEMPERED = 3.0
# The other forms of pi_old on the same tokens, in multiples of the tempered form's gap: renormalised over the
# kept set (vLLM's processed form) 175 measured, the head in bf16 7.4. Each must be visibly worse.
WORSE = 3.0


@pytest.fixture(scope="module")
def sglang_python() -> str:
    return venv_python("sglang_venv.sh", "SGLang venv (sglang 0.5.23 on the CPU torch)")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "SGLANG_USE_CPU_ENGINE": "1"}


def test_check_engine_sglang_passes_as_a_user_runs_it(sglang_python, tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sglang_python, "-m", "rollout_parity.cli", "check", "--engine", "sglang", "--only",
                           "core", "--json", str(out), "--no_progress"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    by_key = {f["key"]: f for f in report["frameworks"]}
    assert set(by_key) == {"core", "sglang"}, "--engine sglang probes SGLang beside what --only selects"
    sglang = by_key["sglang"]
    assert sglang["status"] == "ran" and report["ok"], sglang
    checks = {c["name"]: c for c in sglang["checks"]}
    assert set(checks) == {"sglang/recipe", "sglang/logprobs", "sglang/sampler"}
    assert checks["sglang/recipe"]["cases"] == 4  # overlap off, logprobs after T, radix off, fp32 head: all held
    assert all(c["status"] == "pass" for c in checks.values())


@pytest.fixture(scope="module")
def run(sglang_python, tmp_path_factory) -> dict:
    from rollout_parity.testing.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("sglang")
    model = build_tiny_model()
    new = build_tiny_model(root / "new", seed=1)
    out = root / "run.json"
    proc = subprocess.run([sglang_python, "-m", "integration_tests.support.sglang_engine_run", str(model), str(new),
                           str(out)], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _mean_gap(a: list, b: list) -> float:
    gaps = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(gaps) / len(gaps)


def test_the_engine_returns_tempered_full_vocabulary_logprobs(run):
    floor = _mean_gap(run["trainer_tempered"], run["float32"])
    tempered = _mean_gap(run["engine"], run["trainer_tempered"])
    assert tempered < TEMPERED * floor, (tempered, floor)
    assert _mean_gap(run["engine"], run["trainer_sampler_aware"]) > WORSE * tempered  # not vLLM's processed form
    assert _mean_gap(run["engine"], run["trainer_bf16_head"]) > WORSE * tempered  # the engine's head is fp32


def test_the_live_engine_holds_the_recipe(run):
    # an engine without the fp32 head told apart: the doctor's rows c and d/sglang-only (test_doctor_sglang.py)
    assert all(run["verify"].values()) and set(run["verify"]) == {
        "disable_overlap_schedule", "logprobs after the temperature", "disable_radix_cache", "enable_fp32_lm_head"}


def test_a_weight_load_from_disk_reaches_the_next_rollouts(run):
    assert run["update"][0] is True, run["update"]
    floor = _mean_gap(run["trainer_tempered"], run["float32"])
    to_new = _mean_gap(run["engine_new"], run["trainer_new"])
    assert to_new < TEMPERED * floor
    assert _mean_gap(run["engine_new"], run["trainer_old_on_new_tokens"]) > 50 * to_new  # old weights: 6,300x
