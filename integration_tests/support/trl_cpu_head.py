"""Test support only: TRL 1.15's fused log-prob head on a CPU (never in the GPU path).

TRL 1.15 scores tokens with ``trl.kernels.ChunkedLogProbFunction``, whose tile statistics are a
Triton kernel with no CPU backend ("0 active drivers"); TRL 1.16 added a torch path for devices
without Triton. So that the adapter tests run on TRL 1.15 here, :func:`install` swaps the name
``trl.trainer.utils`` calls for a plain-torch function with the same signature, the same outputs
and the same compute dtype rule (the autocast dtype if autocast is on, else the hidden states'),
differentiated by autograd. On TRL 1.16+ nothing is installed: TRL's own CPU path runs.

It is the TRL counterpart of ``vllm_cpu_shim``: a device stand-in, not a copy of TRL's loss.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Optional

import torch

__all__ = ["needed", "install", "revert", "fused_head_logprobs"]

_MARK = "__rollout_parity_cpu_head__"


def needed() -> bool:
    """True for an installed TRL 1.15.x, whose fused head only runs on Triton devices."""
    try:
        major, minor = (int(part) for part in version("trl").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) == (1, 15)


class _TorchChunkedLogProb:
    """``ChunkedLogProbFunction.apply`` in plain torch: [N, V] logits at once (tests are tiny)."""

    @staticmethod
    def apply(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
              temperature: float, chunk_size: int, final_logit_softcapping: Optional[float] = None,
              logit_scale: float = 1.0, outputs: tuple = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
        return fused_head_logprobs(hidden, weight, bias, targets, temperature, final_logit_softcapping, logit_scale,
                                   outputs)


def fused_head_logprobs(hidden, weight, bias, targets, temperature, softcap=None, logit_scale=1.0, outputs=()):
    """(log p(target), entropy, log sum p^2, mean logit, target is the argmax); None for what is not asked."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    with torch.autocast(device, enabled=False):
        z = torch.nn.functional.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
        z = z.float() * logit_scale  # TRL folds each tile into fp32 statistics
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        logp = z.log_softmax(-1)
        target = logp.gather(-1, targets[:, None]).squeeze(-1)
        p = logp.exp()
        entropy = -(p * logp).sum(-1) if "entropy" in outputs else None
        log_sum_sq = torch.logsumexp(2 * logp, -1) if "log_sum_sq_probs" in outputs else None
        mean_logits = z.mean(-1) if "mean_logits" in outputs else None
        is_top1 = None
        if "is_top1" in outputs:  # strictly above every other logit, like TRL's running max before the target
            others = z.scatter(-1, targets[:, None], float("-inf"))
            is_top1 = z.gather(-1, targets[:, None]).squeeze(-1) > others.max(-1).values
    return target, entropy, log_sum_sq, mean_logits, is_top1


def install() -> bool:
    """Swap TRL 1.15's fused head function for the torch one; idempotent. False when not needed."""
    if not needed():
        return False
    import trl.trainer.utils as trl_utils

    current = trl_utils._ChunkedLogProbFunction
    if getattr(current, _MARK, None) is None:
        setattr(_TorchChunkedLogProb, _MARK, current)
        trl_utils._ChunkedLogProbFunction = _TorchChunkedLogProb
    return True


def revert() -> None:
    """Give TRL its own function back."""
    import trl.trainer.utils as trl_utils

    original = getattr(trl_utils._ChunkedLogProbFunction, _MARK, None)
    if original is not None:
        trl_utils._ChunkedLogProbFunction = original
        delattr(_TorchChunkedLogProb, _MARK)
