"""One host sync per step: an adapter's own scalars and the correction's pending diagnostics, read back together.

``compute_correction(..., defer_metrics=True)`` leaves its diagnostics on the device as one vector
(``CorrectionOutput.pending_metrics``). Each adapter has scalars of its own to read at the same point (verl's
"is any token kept", NeMo RL's loss and global counts, TRL's PPO drift sums); :func:`read_back` stacks them with
the pending vector and makes the step's one device-to-host transfer (docs/metrics.md, "One host sync").
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

__all__ = ["read_back"]


def read_back(parts: Mapping[str, torch.Tensor],
              out: Optional[Any] = None) -> tuple[dict[str, float], dict[str, float]]:
    """``parts`` (named one-element tensors, any dtype) and ``out``'s pending diagnostics in one transfer.

    Returns the parts as floats by name, and ``out``'s diagnostics named (``out.finish_metrics``; ``{}`` when
    ``out`` is None or has none pending). The values are stacked in float64 on the first part's device (the
    others and the pending vector are moved there). Reads no gradient.
    """
    if not parts:
        raise ValueError("read_back needs at least one part: an adapter reads its own scalars with the diagnostics")
    with torch.no_grad():
        device = next(iter(parts.values())).device
        vector = torch.stack([p.detach().to(device=device, dtype=torch.float64).reshape(()) for p in parts.values()])
        pending = None if out is None else out.pending_metrics
        if pending is not None:
            vector = torch.cat([vector, pending.to(device)])
        values = vector.tolist()  # the one host sync
    named = dict(zip(parts, values))
    return named, (out.finish_metrics(values[len(parts):]) if pending is not None else {})
