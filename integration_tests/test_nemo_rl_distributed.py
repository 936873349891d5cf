"""The NeMo RL adapter on two data-parallel ranks (gloo) equals one rank with the whole batch.

Two ranks with two microbatches of two samples each against one rank with one microbatch of
all eight: every loss term and metric must add up over ranks and microbatches.

Each rank is a real process (support/nemo_dp_worker.py) running NeMo RL's own sharding
(``shard_by_batch_size``) and global counts (``process_global_batch`` all-reduced over the gloo
group) at v0.7.0; the loss adds up over ranks and microbatches through the global counts, the
gradients are summed, the metrics of all ranks' microbatches are aggregated as ``grpo_train``
does. The shared batch keeps its NaN and −inf engine logprobs and its empty sample (on rank 1).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from integration_tests.support.nemo_anchor import ANCHORS, skip_unless_available
from integration_tests.support.nemo_dp_worker import build
from integration_tests.support.processes import free_port
from integration_tests.support.nemo_harness import aggregate, load, train_step

pytestmark = [pytest.mark.nemo_rl]

VERSION = "v0.7.0"
MICROBATCH = 2
CASES = {
    "tis_srs_k3": {"shared": "tis_srs_k3"},
    "sequence_mask_seq_level_dual_clip": {"shared": "sequence_mask_token",
                                          "kwargs": dict(token_level_loss=False, ratio_clip_c=3.0)},
    "off_policy_mask": {"shared": "off_policy_mask"},
    "nemo_seq_mask_tis": {"nemo": dict(reference_policy_kl_penalty=0.0, use_importance_sampling_correction=True,
                                       truncated_importance_sampling_type="seq-mask-tis",
                                       truncated_importance_sampling_ratio=1.02,
                                       truncated_importance_sampling_ratio_min=0.98)},
    "nemo_plain_is_kl": {"nemo": dict(reference_policy_kl_penalty=0.01, use_importance_sampling_correction=True)},
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    skip_unless_available([VERSION])
    import torch.multiprocessing as mp

    from integration_tests.support import nemo_dp_worker

    out = tmp_path_factory.mktemp("nemo_dp") / "ranks.json"
    mp.spawn(nemo_dp_worker.run, args=(2, free_port(), str(out), CASES, VERSION, MICROBATCH),
             nprocs=2, join=True)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def one_rank():
    skip_unless_available([VERSION])
    results = {}
    with ANCHORS.activate(VERSION) as ns:
        load(ns)
        for name, case in CASES.items():
            data, current, loss_fn = build(ns, case)
            total, mb_metrics = train_step(ns, loss_fn, data, data.size)
            results[name] = {"loss": total, "grad": current.grad, "metrics": mb_metrics}
    return results


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_gloo_ranks_equal_one_rank_with_the_whole_batch(two_ranks, one_rank, name):
    dp, single = two_ranks[name], one_rank[name]
    assert math.isfinite(dp["loss"])
    assert dp["loss"] == pytest.approx(single["loss"], rel=1e-6, abs=1e-8)
    torch.testing.assert_close(torch.tensor(dp["grad"]), single["grad"], rtol=1e-6, atol=1e-8)
    assert bool(single["grad"].abs().sum() > 0)
    assert len(dp["metrics"]) == 4 and len(single["metrics"]) == 1
    ours, reference = aggregate(dp["metrics"]), aggregate(single["metrics"])
    assert set(ours) == set(reference)
    for key, value in reference.items():
        assert ours[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert all(math.isfinite(v) for v in reference.values())
    if "shared" in CASES[name]:
        assert reference["rollout_correction/nonfinite_frac"] > 0  # the NaN and −inf were counted
    else:  # NeMo RL's own keys, flags null: NeMo RL's metrics only, finite despite the NaN and −inf
        assert not any(key.startswith("rollout_correction/") for key in reference)
