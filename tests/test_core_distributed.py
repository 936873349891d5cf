"""Data-parallel metrics: two gloo ranks on halves of a batch log what one process logs on all of it."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollout_parity import CorrectionConfig, compute_correction, policy_loss
from rollout_parity.core.distributed import all_reduce, masked_mean, masked_summary
from rollout_parity.core.sampler import kept_mass_metrics

CFG = dict(rollout_importance_sampling_mode="sequence_truncate", rollout_importance_sampling_threshold=1.2,
           rollout_rejection=["seq_sum_k3", "token_k1"], rollout_rejection_threshold=[0.05, 1.5],
           off_policy_sequence_mask_delta=0.02)


def full_batch():
    g = torch.Generator().manual_seed(7)
    B, T = 8, 10
    lengths = torch.tensor([10, 3, 7, 0, 10, 5, 9, 1])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 2 - 0.05
    rollout = old + torch.randn(B, T, generator=g) * 0.1
    rollout[5, 2] = float("nan")
    current = old + torch.randn(B, T, generator=g) * 0.05
    adv = torch.randn(B, generator=g)
    return old, rollout, current, mask, adv


def log_kept_mass():
    """log S per token: finite inside the kept set, +inf for a token sampled outside it (rank 1 only)."""
    log_s = -torch.rand(8, 10, generator=torch.Generator().manual_seed(3)) * 0.2
    log_s[6, 1] = float("inf")
    return log_s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        old, rollout, current, mask, adv = full_batch()
        half = slice(rank * 4, rank * 4 + 4)
        cfg = CorrectionConfig(**CFG)
        cur = current[half].clone().requires_grad_()
        out = compute_correction(cfg, old_logprobs=old[half], rollout_logprobs=rollout[half],
                                 response_mask=mask[half], advantages=adv[half], current_logprobs=cur,
                                 process_group=dist.group.WORLD)
        # Global token normalisation: each rank divides by the global count, gradients then sum.
        n_global = torch.tensor(float(out.mask.sum()))
        dist.all_reduce(n_global)
        loss, _ = policy_loss(cfg, current_logprobs=cur, old_logprobs=old[half], advantages=adv[half],
                              correction=out, global_num_tokens=n_global)
        loss.backward()
        ratio = (old[half] - rollout[half]).exp()  # NaN and all: masked_summary must see only the mask's entries
        keep = mask[half] * rollout[half].isfinite()
        shared = (masked_summary(ratio, keep, dist.group.WORLD), masked_mean(ratio, keep, dist.group.WORLD))
        kept = kept_mass_metrics(log_kept_mass()[half], mask[half], process_group=dist.group.WORLD)
        ops = {op: all_reduce(torch.tensor([float(rank + 1), -float(rank)]), dist.group.WORLD, op=op).tolist()
               for op in ("sum", "max")}
        # Without rollout logprobs the off-policy mask reads pi_old, and its one diagnostic is all-reduced too.
        pi_old_only = compute_correction(CorrectionConfig(off_policy_sequence_mask_delta=0.02), old_logprobs=old[half],
                                         response_mask=mask[half], advantages=adv[half], current_logprobs=cur,
                                         process_group=dist.group.WORLD).metrics
        results[rank] = (out.metrics, out.weights, out.mask, cur.grad, loss.detach(), shared, kept, ops, pi_old_only)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_two_gloo_ranks_equal_one_process_on_the_concatenated_batch():
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(2, _free_port(), results), nprocs=2, join=True)

    old, rollout, current, mask, adv = full_batch()
    cfg = CorrectionConfig(**CFG)
    cur = current.clone().requires_grad_()
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                             advantages=adv, current_logprobs=cur)
    loss, _ = policy_loss(cfg, current_logprobs=cur, old_logprobs=old, advantages=adv, correction=out)
    loss.backward()

    m0, w0, k0, g0, l0, s0, kept0, ops0, old0 = results[0]
    m1, w1, k1, g1, l1, s1, kept1, ops1, old1 = results[1]
    assert m0 == m1  # every rank logs the same, global numbers
    for key, value in out.metrics.items():
        assert m0[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    torch.testing.assert_close(torch.cat([w0, w1]), out.weights)
    assert torch.equal(torch.cat([k0, k1]), out.mask)
    torch.testing.assert_close(torch.cat([g0, g1]), cur.grad)
    assert (l0 + l1).item() == pytest.approx(loss.item(), rel=1e-5)

    # the all-reduce the adapters share (core/distributed.py): global mean, min, max over the kept entries
    ratio = (old - rollout).exp()
    kept = ratio[(mask * rollout.isfinite()).bool()].double()
    assert s0 == s1
    summary, mean = s0
    assert summary.count == kept.numel() and mean == pytest.approx(kept.mean().item(), rel=1e-12)
    assert (summary.mean, summary.min, summary.max) == pytest.approx(
        (kept.mean().item(), kept.min().item(), kept.max().item()), rel=1e-12)

    # kept_mass_metrics over the process group: the concatenated batch's, on both ranks (rank 1 alone
    # holds the token outside the kept set, so a local value differs)
    assert kept0 == kept1
    whole = kept_mass_metrics(log_kept_mass(), mask)
    assert kept0 == pytest.approx(whole, rel=1e-12)
    assert kept0 != kept_mass_metrics(log_kept_mass()[:4], mask[:4])
    # all_reduce's op: sum and max of [rank + 1, -rank] over ranks 0 and 1
    assert ops0 == ops1 == {"sum": [3.0, -1.0], "max": [2.0, 0.0]}

    # the off-policy mask on pi_old (no rollout logprobs): the global share of masked non-empty sequences
    def pi_old_only(rows):
        return compute_correction(CorrectionConfig(off_policy_sequence_mask_delta=0.02), old_logprobs=old[rows],
                                  response_mask=mask[rows], advantages=adv[rows],
                                  current_logprobs=current[rows]).metrics["rollout_correction/off_policy_masked_frac"]
    assert old0 == old1
    assert old0["rollout_correction/off_policy_masked_frac"] == pytest.approx(pi_old_only(slice(None)), rel=1e-12)
    assert pi_old_only(slice(0, 4)) != pi_old_only(slice(4, 8))  # a local share would differ between the ranks
