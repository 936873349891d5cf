"""Why ``fp32_lm_head`` is refused on NeMo RL, shown with NeMo RL's own code at v0.7.0 and main.

NeMo RL's DTensor policy worker shards the model with ``_parallelize_model(param_dtype=
policy.precision)`` and runs every forward under ``torch.autocast(dtype=policy.precision)``: the
trainer's lm_head projects in bf16, and no NeMo RL setting changes that for a causal LM. An fp32
head on vLLM's side alone would move pi_rollout away from that bf16 pi_old, so the flag is
refused by name (``RolloutParityLossFn``, ``nemo_rl_generation_config``), before grpo.setup()
starts a worker (``test_nemo_rl_turn_on.py``). The shard and forward run in a fresh process
(one gloo rank, ``integration_tests/support/nemo_head_dtype.py``); ``device_type="cpu"`` for the
worker's ``"cuda"`` autocast, whose rule for ``linear`` is the same.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from integration_tests.support.nemo_anchor import ANCHORS, VERSIONS, skip_unless_available
from rollout_parity.adapters.nemo_rl import NEMO_RL_FP32_HEAD_REFUSAL, RolloutParityLossFn, nemo_rl_generation_config

pytestmark = [pytest.mark.nemo_rl]
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", VERSIONS)
def test_nemos_policy_worker_projects_the_head_in_bf16(version):
    skip_unless_available((version,))
    run = subprocess.run([sys.executable, "-m", "integration_tests.support.nemo_head_dtype", version], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert (seen["weight"], seen["logits"]) == ("torch.bfloat16", "torch.bfloat16")
    # bf16 rounding of logits of size ~5 is ~2e-2 (measured 2.3e-2 on the tiny model); an fp32 head's
    # difference from itself would be 0. 1e-3 sits an order of magnitude below the former.
    assert seen["max_abs_diff_from_fp32_head"] > 1e-3


def test_the_flag_is_refused_by_name_with_the_reason():
    skip_unless_available(("v0.7.0",))
    with ANCHORS.activate("v0.7.0"):
        _refused()


def _refused():
    for build in (lambda: RolloutParityLossFn({"fp32_lm_head": True}),
                  lambda: nemo_rl_generation_config(fp32_lm_head=True)):
        with pytest.raises(ValueError, match="fp32_lm_head=True cannot be served on NeMo RL") as err:
            build()
        assert "autocast" in str(err.value) and "leave fp32_lm_head off" in str(err.value)
    assert "lm_head_precision covers its own MoE models only" in NEMO_RL_FP32_HEAD_REFUSAL
