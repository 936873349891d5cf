"""What vLLM's request outputs carry for the trainer: the kept sets of sampling replay.

vLLM 0.31 returns, with each sampled token, the vocabulary ids that survived its min-p / top-k / top-p
processing (``LLM(..., return_sampling_mask=True)``): ``CompletionOutput.sampling_mask`` is a
``vllm.outputs.SamplingMask`` whose ``token_ids`` holds one list of kept ids per generated token
(``core/replay.py`` for what the trainer does with them). Duck-typed: never imports vLLM.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from rollout_parity.core.replay import KeptSets

__all__ = ["kept_sets"]


def _mask_lists(mask: Any) -> Optional[Sequence[Sequence[int]]]:
    """One completion's sets: a ``vllm.outputs.SamplingMask`` (its ``token_ids``), a list of lists, or None."""
    if mask is None:
        return None
    return getattr(mask, "token_ids", mask)


def kept_sets(masks: Sequence[Any], width: Optional[int] = None) -> KeptSets:
    """Sets for a ``(len(masks), width)`` batch from one vLLM sampling mask per completion.

    ``masks[b]`` is completion ``b``'s ``CompletionOutput.sampling_mask`` (a ``SamplingMask``), its
    ``token_ids`` (one list of kept ids per generated token), or None; see :meth:`KeptSets.from_lists`.
    """
    return KeptSets.from_lists([_mask_lists(m) for m in masks], width)
