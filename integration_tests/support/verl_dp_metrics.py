"""Test support: verl's per-micro-batch loss and metric path on 2 gloo ranks vs 1 rank (issue 10).

The shared batch is corrected once by our driver hook (verl's helper), as verl's driver does.
Then verl's own ``ppo_loss`` (the engine's per-micro-batch loss, our wrappers around it and
around the user's policy loss) runs

* on 2 ranks (torch.distributed, gloo, 127.0.0.1), each with half of the rows split into two
  micro-batches, ``dp_size=2`` and verl's global normalisers; metrics then take verl's own path:
  ``postprocess_batch_func`` per rank, ``allgather_dict_into_dict`` over the ranks and
  ``Metric.aggregate_dp``, as ``TrainingWorker`` does;
* on 1 rank with the whole batch as one micro-batch.

The two must agree on the loss (verl averages gradients over ranks: the mean of the ranks'
summed micro-batch losses), the gradient (per row, divided by ``dp_size``) and every metric
the adapter adds (a loss with its own ``actor/ppo_kl`` gets no copy of it from us). Prints one JSON line.

    python -m integration_tests.support.verl_dp_metrics <shared-batch config> [loss_mode]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from .processes import free_port
from .verl_configs import actor_config

RANKS = 2


def _corrected(name: str):
    """The shared batch after our driver hook (verl's helper), and verl's normalisers for it."""
    from verl import DataProto
    from verl.trainer.ppo import rollout_corr_helper as helper

    from rollout_parity.check.shared_batch import config_for, make_shared_batch
    from rollout_parity.adapters import verl as adapter

    adapter.set_active_config(config_for(name))
    batch = make_shared_batch()
    proto = DataProto.from_dict(tensors={"old_log_probs": batch.old_logprobs, "rollout_log_probs": batch.rollout_logprobs,
                                         "response_mask": batch.response_mask})
    proto, _ = helper.compute_rollout_correction_and_add_to_batch(proto, {"rollout_is": None, "rollout_rs": None})
    weights = proto.batch["rollout_is_weights"] if "rollout_is_weights" in proto.batch.keys() else None
    B, T = batch.response_mask.shape
    advantages = batch.advantages[:, None] * batch.response_mask
    # verl's V1 normaliser: the rollout's loss-mask tokens of the mini-batch (before rejection)
    info = {"batch_num_tokens": int(batch.response_mask.sum()), "global_batch_size": B}
    return batch, proto.batch["response_mask"], weights, advantages, info


def _micro_batch(batch, mask, weights, advantages, rows, current, dp_size, info):
    """Rows of the batch in verl's nested micro-batch layout, and the model output ppo_loss reads."""
    import torch
    from verl.utils import tensordict_utils as tu

    T = mask.shape[1]

    def nested(t):
        return tu.nested_tensor_from_tensor_list([t[i] for i in rows])

    tensors = {"prompts": tu.nested_tensor_from_tensor_list([torch.zeros(1, dtype=torch.long) for _ in rows]),
               "responses": tu.nested_tensor_from_tensor_list([torch.zeros(T, dtype=torch.long) for _ in rows]),
               "response_mask": nested(mask.long()), "old_log_probs": nested(batch.old_logprobs),
               "advantages": nested(advantages)}
    if weights is not None:
        tensors["rollout_is_weights"] = nested(weights)
    data = tu.get_tensordict(tensors, non_tensor_dict={"dp_size": dp_size, **info})
    # the model's packed output: prompt (1 token) + response; logprob i predicts token i + 1
    values = torch.cat([torch.cat([current[i], current.new_zeros(1)]) for i in rows])
    offsets = torch.arange(len(rows) + 1) * (T + 1)
    return data, {"log_probs": torch.nested.nested_tensor_from_jagged(values, offsets)}


def _run(rank_rows, dp_size, name, mode, micro_rows, group=None):
    """One rank: verl's ppo_loss per micro-batch, backward, and verl's per-rank metric postprocessing."""
    from functools import partial

    import torch
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import postprocess_batch_func
    from verl.workers.utils.losses import ppo_loss

    batch, mask, weights, advantages, info = _corrected(name)
    config = actor_config(f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}")
    current = batch.fresh_current()
    outputs, total = [], 0.0
    loss_fn = partial(ppo_loss, config)
    for rows in micro_rows:
        data, model_output = _micro_batch(batch, mask, weights, advantages, rows, current, dp_size, info)
        loss, metrics = loss_fn(model_output, data)
        loss.backward()
        total += loss.item()
        outputs.append({"loss": loss.item(), "metrics": metrics})
    # verl's per-rank step: the micro-batches' metrics merged (a Metric keeps one value per micro-batch)
    rank_data = tu.get_tensordict({"rows": torch.tensor(rank_rows)}, non_tensor_dict={"use_dynamic_bsz": False})
    metrics = postprocess_batch_func(outputs, indices=None, data=rank_data)["metrics"]
    grad = current.grad[rank_rows].tolist()
    return total, grad, metrics


def _worker(rank, port, name, mode, out_dir):
    import torch.distributed as dist
    from verl.utils.metric import Metric
    from verl.utils.torch_functional import allgather_dict_into_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    rows = list(range(rank * 4, rank * 4 + 4))
    total, grad, metrics = _run(rows, RANKS, name, mode, [rows[:2], rows[2:]])
    gathered = allgather_dict_into_dict(metrics, group=dist.group.WORLD)  # what TrainingWorker does
    aggregated = {k: Metric.aggregate_dp(v) for k, v in gathered.items() if isinstance(v[0], Metric)}
    losses = [None] * RANKS
    dist.all_gather_object(losses, (total, grad))
    if rank == 0:
        with open(os.path.join(out_dir, "ranks.json"), "w") as f:
            json.dump({"metrics": {k: float(v) for k, v in aggregated.items()}, "losses": losses}, f)
    dist.destroy_process_group()


def main(name: str, mode: str = "vanilla") -> dict:
    import torch.multiprocessing as mp
    from verl.utils.metric import Metric

    from rollout_parity.adapters import verl as adapter

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(free_port(), name, mode, out_dir), nprocs=RANKS, join=True)
        with open(os.path.join(out_dir, "ranks.json")) as f:
            ranks = json.load(f)
    rows = list(range(8))
    total, grad, metrics = _run(rows, 1, name, mode, [rows])
    single = {k: float(v.aggregate()) for k, v in metrics.items() if isinstance(v, Metric)}
    ours = [k for k in single if k.startswith(("policy/", "rollout_correction/", "rollout_corr/"))]
    multi_loss = sum(loss for loss, _ in ranks["losses"]) / RANKS
    multi_grad = [row for _, g in ranks["losses"] for row in g]
    adapter.set_active_config(None)
    return {
        "our_keys": sorted(ours),
        "loss_single": total, "loss_ranks": multi_loss,
        "grad_max_diff": max(abs(a - b / RANKS) for ra, rb in zip(grad, multi_grad) for a, b in zip(ra, rb)),
        "grad_max": max(abs(a) for r in grad for a in r),
        "metric_max_diff": max((abs(single[k] - ranks["metrics"][k]) for k in ours), default=None),
        "repeats_verls_ppo_kl": any(k.startswith("policy/") or k.endswith("ppo_k1_mean") for k in ours),
        "metrics_single": {k: single[k] for k in ours}, "metrics_ranks": {k: ranks["metrics"][k] for k in ours},
        "verl_own_differ": sorted(k for k in single if k.startswith("actor/") and k in ranks["metrics"]
                                  and abs(single[k] - ranks["metrics"][k]) > 1e-6),
    }


if __name__ == "__main__":
    print("RESULT_JSON " + json.dumps(main(*sys.argv[1:])))
