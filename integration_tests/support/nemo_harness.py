"""Drive a loss the way NeMo RL's training loop does, with NeMo RL's own pieces where they run.

Real NeMo RL code (imported from the anchors through ``nemo_anchor.ANCHORS``; ``load`` and
``nemo_data`` are ``rollout_parity.check.nemo_checks``'s, which ``rollout-parity check`` uses too):
``BatchedDataDict`` (``get_batch``, ``shard_by_batch_size``, ``make_microbatch_iterator``,
which asserts on sizes a list slice would accept) and ``process_global_batch``
(``nemo_rl/models/automodel/data.py``: the global valid sequence and token counts, all-reduced
over the data-parallel group; its ``.cuda()`` is the identity on this CPU machine).

Written here from NeMo RL's source, because it lives inside GPU worker methods or inside
``grpo_train`` (cited per function): the per-microbatch backward, the worker's metric scaling
and the driver's aggregation of the metrics.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import numpy as np
import torch

# NeMo RL's names and its (B, S) loss-data layout: the package's, shared with `rollout-parity check`.
from rollout_parity.check.nemo_checks import load, nemo_data  # noqa: F401 (the NeMo RL tests import them here)


@contextlib.contextmanager
def cpu_cuda():
    """``Tensor.cuda`` as the identity (NeMo RL's helpers move their counts to the GPU)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def global_counts(ns, data, loss_fn, group=None) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """NeMo RL's own ``process_global_batch`` on the whole local batch (one global batch).

    Without a group a single-process gloo group stands in (NeMo RL all-reduces over its DP
    group); it is torn down again.
    """
    import torch.distributed as dist

    own_group = group is None and not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with cpu_cuda():
            out = ns.process_global_batch(data, loss_fn, group or dist.group.WORLD,
                                          batch_idx=0, batch_size=data.size)
    finally:
        if own_group:
            dist.destroy_process_group()
    return out["batch"], out["global_valid_seqs"], out["global_valid_toks"]


def train_step(ns, loss_fn, data, microbatch_size: int, group=None,
               num_global_batches: int = 1) -> tuple[float, list[dict]]:
    """One optimizer step's loss calls on this rank, as NeMo RL's DTensor worker makes them.

    ``dtensor_policy_worker_v2.py`` ``train``: global counts from ``process_global_batch``;
    ``automodel/train.py`` ``automodel_forward_backward``: per microbatch, the loss called by
    keyword (``LossPostProcessor``), backward per microbatch, every metric except ``*_min``/
    ``*_max`` divided by the number of global batches; microbatches without a valid sample
    are left out of the metrics and the summed loss. Returns (summed loss, metric dicts).
    """
    batch, gvs, gvt = global_counts(ns, data, loss_fn, group)
    total = 0.0
    all_metrics: list[dict] = []
    for mb in batch.make_microbatch_iterator(microbatch_size):
        current = mb["next_token_logprobs"]
        loss, metrics = loss_fn(next_token_logprobs=current, data=mb, global_valid_seqs=gvs,
                                global_valid_toks=gvt)
        assert loss.dim() == 0
        if current.requires_grad:
            loss.backward()
        metrics = dict(metrics)
        for key in metrics:
            if "_min" in key or "_max" in key:
                continue
            metrics[key] /= num_global_batches
        metrics["global_valid_seqs"] = float(gvs)
        metrics["global_valid_toks"] = float(gvt)
        if metrics["num_valid_samples"] > 0:
            total += float(loss.detach())
            all_metrics.append(metrics)
    return total, all_metrics


def aggregate(mb_metrics: list[dict]) -> dict[str, float]:
    """``lm_policy.py`` gathers every rank's per-microbatch metrics into lists;
    ``grpo.py`` (``grpo_train``) then takes the min/max of ``probs_ratio*_min``/``_max``
    (infinite values dropped, -1 if none is left), the mean of the global counts, and sums
    everything else."""
    gathered: dict[str, list] = {}
    for metrics in mb_metrics:
        for key, value in metrics.items():
            gathered.setdefault(key, []).append(value)
    out: dict[str, float] = {}
    for key, values in gathered.items():
        if key in {"probs_ratio_min", "probs_ratio_clamped_min"}:
            finite = [x for x in values if not np.isinf(x)]
            out[key] = float(np.min(finite)) if finite else -1.0
        elif key in {"probs_ratio_max", "probs_ratio_clamped_max"}:
            finite = [x for x in values if not np.isinf(x)]
            out[key] = float(np.max(finite)) if finite else -1.0
        elif key in {"lr", "wd", "global_valid_seqs", "global_valid_toks"}:
            out[key] = float(np.mean(values))
        else:
            out[key] = float(np.sum(values))
    return out


#: The loss metrics grpo_train reads by key on every step (v0.7.0 and main grpo.py):
#: ``metrics['loss']`` and ``metrics['gen_kl_error']`` in the printed summary and
#: ``metrics["token_mult_prob_error"]`` for the plot check.
GRPO_READS = ("loss", "gen_kl_error", "token_mult_prob_error", "global_valid_toks")


def finite_or_sentinel(metrics: dict) -> list[str]:
    """Keys whose value is not finite (NeMo RL's ±inf extrema of an empty microbatch aside)."""
    bad = []
    for key, value in metrics.items():
        if key in {"probs_ratio_min", "probs_ratio_clamped_min"} and value == math.inf:
            continue
        if key in {"probs_ratio_max", "probs_ratio_clamped_max"} and value == -math.inf:
            continue
        if not math.isfinite(value):
            bad.append(key)
    return bad


def split_step_rescale(ns, loss_fn, mb_metrics: list[dict], gvs: float, gvt: float,
                       grad_denominator: Optional[float] = None) -> list[dict]:
    """Main's Megatron split step (``megatron_policy_worker.py``, ``_split_step_finish``):
    each microbatch ran with placeholder global counts 1; every metric is then multiplied by
    1/tokens, 1/sequences or nothing, as ``loss_fn.metric_normalizations`` says (not
    advertised: the gradient's denominator); ``*_min``/``*_max`` stay as they are."""
    norms = getattr(loss_fn, "metric_normalizations", None) or {}
    inv_toks = 1.0 / (gvt if gvt > 0 else 1.0)
    inv_seqs = 1.0 / (gvs if gvs > 0 else 1.0)
    if grad_denominator is None:
        grad_denominator = gvt if loss_fn.loss_type == ns.LossType.TOKEN_LEVEL else gvs
    inv_n = 1.0 / grad_denominator
    out = []
    for metrics in mb_metrics:
        scaled = {}
        for key, value in metrics.items():
            if "_min" in key or "_max" in key:
                scaled[key] = value
                continue
            kind = norms.get(key)
            if kind is ns.MetricNormalizer.NONE:
                scale = 1.0
            elif kind is ns.MetricNormalizer.TOKENS:
                scale = inv_toks
            elif kind is ns.MetricNormalizer.SEQUENCES:
                scale = inv_seqs
            else:
                scale = inv_n
            scaled[key] = value * scale
        out.append(scaled)
    return out
