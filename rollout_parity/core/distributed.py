"""Sums, counts and extrema over data-parallel ranks: the one all-reduce the core and the adapters share.

Every metric of rollout-parity is a global mean (or extremum) over the batch of all ranks, so each
rank reduces its local sums and counts before dividing (never a mean of means). With
``process_group=None`` nothing is reduced: the local batch is the batch.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

__all__ = ["all_reduce", "masked_mean", "MaskedSummary", "masked_summary"]


def all_reduce(tensor: torch.Tensor, process_group: Any, op: str = "sum") -> torch.Tensor:
    """``tensor`` reduced in place over ``process_group`` (``op``: ``sum`` or ``max``); returned."""
    if process_group is None:
        return tensor
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("process_group given but torch.distributed is not initialised")
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()), group=process_group)
    return tensor


def masked_mean(values: torch.Tensor, mask: torch.Tensor, process_group: Any = None) -> float:
    """Mean of ``values`` where ``mask`` is set, over every rank (0.0 when no entry is set)."""
    keep = mask.detach() != 0
    sums = torch.stack([torch.where(keep, values.detach().double(), 0.0).sum(), keep.sum().double()])
    total, count = all_reduce(sums, process_group).tolist()
    return total / count if count else 0.0


class MaskedSummary(NamedTuple):
    mean: float
    min: float
    max: float
    count: int


def masked_summary(values: torch.Tensor, mask: torch.Tensor, process_group: Any = None,
                   empty: float = 0.0) -> MaskedSummary:
    """Global mean, min and max of ``values`` where ``mask`` is set (``empty`` for each when none is)."""
    keep = mask.detach() != 0
    v = values.detach().double()
    sums = all_reduce(torch.stack([torch.where(keep, v, 0.0).sum(), keep.sum().double()]), process_group)
    tops = torch.stack([v, -v]).masked_fill(~keep, -math.inf).flatten(1).amax(1)
    tops = all_reduce(tops, process_group, "max")
    (total, count), (high, neg_low) = sums.tolist(), tops.tolist()
    if not count:
        return MaskedSummary(empty, empty, empty, 0)
    return MaskedSummary(total / count, -neg_low, high, int(count))
