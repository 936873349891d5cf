"""A TRL GRPO step with the flags and ``fp32_lm_head`` under DeepSpeed ZeRO-3 on CPU, through accelerate.

The step runs in its own process (``support/trl_deepspeed_step.py``: one rank, gloo,
``DS_ACCELERATOR=cpu``) on a bf16 model. Checked: ZeRO-3 really partitions the head; the projection
TRL's fused head runs gets the gathered weight and computes in fp32 (fp32 activations, no
autocast), equal to an fp32 projection of the same hidden states to 1e-5 and away from a bf16 one;
our weights and rejection reach TRL's channels (a naive re-implementation), rejected tokens get
zero gradient, loss and metrics are finite.

DeepSpeed's bf16 mode stores every parameter in bf16, the head included, so what "fp32 head" means
under ZeRO-3 is an fp32 projection of bf16-stored weights with fp32 accumulation: the same numbers
as vLLM's ``head_dtype=float32`` on the weights synced to it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rollout_parity.testing.stack import need

need("trl", extra="trl")
need("deepspeed", extra="deepspeed")

from integration_tests.support.processes import free_port  # noqa: E402
from integration_tests.support.trl_runs import subprocess_env  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.deepspeed, pytest.mark.slow]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("trl-ds") / "report.json"
    env = subprocess_env(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                         LOCAL_RANK="0", WORLD_SIZE="1", PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-m", "integration_tests.support.trl_deepspeed_step", str(path)],
                          capture_output=True, text=True, env=env, timeout=900, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(path.read_text())


def test_zero3_partitions_a_bf16_model(report):
    assert report["zero_stage"] == 3 and report["engine"] == "DeepSpeedEngine"
    assert report["body_dtype"] == "torch.bfloat16" and report["head_partitioned"]


def test_head_computes_in_fp32_and_that_changes_the_logprobs(report):
    projections = report["projections"]
    assert len(projections) >= 2  # pi_old at generation, pi_theta in the loss
    for p in projections:
        assert p["hidden_dtype"] == "torch.float32" and not p["autocast"]  # the matmul's dtype
        assert p["weight_shape"][0] > 0  # the gathered head, not the empty ZeRO-3 partition
        assert p["vs_fp32"] < 1e-5 and p["vs_bf16"] > 1e-3


def test_grpo_step_with_the_flags(report):
    log = report["log"]
    assert report["finite"] and report["ratio_matches_naive"]
    assert report["rejected"] > 0 and report["rejected_grad_zero"] and report["kept_grad_nonzero"]
    assert report["grads_finite"] and log["grad_norm"] > 0
    assert log["sampling/importance_sampling_ratio/max"] <= 1.5
    assert {"rollout_correction/k1_mean", "rollout_correction/loss_contrib_pos", "rollout_correction/ppo_k1_mean"} <= set(log)
