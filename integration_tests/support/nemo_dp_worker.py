"""One data-parallel rank of NeMo RL's training step with the rollout-parity loss (gloo, CPU).

``run(rank, world, port, out, cases)`` is started by ``torch.multiprocessing.spawn`` from
``integration_tests/test_nemo_rl_distributed.py``. Each rank builds the same global batch,
takes its share with NeMo RL's own ``BatchedDataDict.shard_by_batch_size`` (as
``lm_policy.py`` shards for its DP workers), gets the global valid counts from NeMo RL's own
``process_global_batch`` all-reduced over the gloo group, runs the microbatched loss and
backward (support/nemo_harness.py), then the ranks' results are combined as NeMo RL combines
them: losses summed (``aggregate_training_statistics`` all-reduces them), gradients summed
(NeMo RL's FSDP step undoes the DP mean so gradients add up), per-microbatch metrics gathered
into one list (``lm_policy.py`` extends them). Rank 0 writes the result to ``out``.
"""

from __future__ import annotations

import json
import os


def build(ns, case: dict):
    """The shared batch as NeMo RL data and the loss of ``case`` (see the test module)."""
    from rollout_parity.check.shared_batch import config_for, make_shared_batch
    from integration_tests.support.nemo_harness import nemo_data
    from rollout_parity.adapters.nemo_rl import RolloutParityLossFn

    b = make_shared_batch()
    current = b.fresh_current()
    data = nemo_data(ns, b.old_logprobs, b.rollout_logprobs, current, b.response_mask, b.advantages)
    if "nemo" in case:  # NeMo RL's own keys (its IS acts inside the wrapper), flags null
        loss_fn = RolloutParityLossFn.from_nemo_config(dict(case["nemo"], rollout_correction={}))
    else:
        loss_fn = RolloutParityLossFn(config_for(case["shared"]),
                                      dict(reference_policy_kl_penalty=0.0, **case.get("kwargs", {})))
    return data, current, loss_fn


def run(rank: int, world: int, port: int, out: str, cases: dict, version: str, mbs: int) -> None:
    import torch
    import torch.distributed as dist

    from integration_tests.support.nemo_anchor import ANCHORS
    from integration_tests.support.nemo_harness import load, train_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        with ANCHORS.activate(version) as ns:
            load(ns)
            for name, case in cases.items():
                data, current, loss_fn = build(ns, case)
                data["row"] = torch.arange(data.size)
                share = data.shard_by_batch_size(world, batch_size=data.size)[rank]
                # The rank's own leaf (a worker computes its logprobs from its own shard).
                share["next_token_logprobs"] = share["next_token_logprobs"].detach().requires_grad_(True)
                total, mb_metrics = train_step(ns, loss_fn, share, mbs, group=dist.group.WORLD)
                loss = torch.tensor([total], dtype=torch.float64)
                dist.all_reduce(loss)
                grad = torch.zeros_like(current)
                grad[share["row"]] = share["next_token_logprobs"].grad
                dist.all_reduce(grad)
                gathered = [None] * world
                dist.all_gather_object(gathered, mb_metrics)
                results[name] = {"loss": float(loss), "grad": grad.tolist(),
                                 "metrics": [m for rank_metrics in gathered for m in rank_metrics]}
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
