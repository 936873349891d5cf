"""Sampling replay: the engine's exact kept set per sampled token.

vLLM 0.31 can return, with each sampled token, the set of vocabulary ids that survived its
min-p / top-k / top-p processing (``LLM(..., return_sampling_mask=True)``, Model Runner V2,
``logprobs_mode=processed_logprobs``): ``CompletionOutput.sampling_mask`` is a
``vllm.outputs.SamplingMask`` whose ``token_ids`` holds one list of kept ids per generated
token. With it the trainer renormalises its pi_old over *exactly* the engine's kept set
(DeepSeek-V3.2's "keep sampling mask", prime-rl's sampling replay) instead of recomputing the set
from its own logits, where a token at the nucleus edge may land on the other side by float noise.

:class:`KeptSets` holds those sets for a batch of token positions as CSR (flat ids, offsets),
built from one list of kept-id lists per completion (:meth:`KeptSets.from_lists`; an engine's outputs reach it
through the engine's package, ``engines/vllm/outputs.py`` for vLLM) or from a ``(..., K)`` integer tensor padded
with -1 (:meth:`KeptSets.from_padded`, the form that travels inside a framework's batch). A position
with no recorded set (padding, a completion shorter than the batch, a token the engine returned no
set for) is empty: the trainer's recomputed kept set, with the boundary rule of ``core/sampler.py``,
stands in there. ``sampler_logprobs`` and ``sampler_logprobs_from_hidden`` take ``kept_sets=``.

vLLM's own limits (``vllm/config/vllm.py``, ``v1/engine/input_processor.py``): replay needs Model
Runner V2 (which needs Triton: it does not start on CPU), ``processed_logprobs``, temperature > 0
and ``top_k > 0`` on every request (to bound the mask's size), and no speculative decoding or
custom logits processors. The bound: vLLM sizes its compact per-token buffer by the batch's largest
top_k, at most 2,048 ids (``MAX_COMPACT_SUPPORT``, ``v1/worker/gpu/sample/output.py``); a wider set
comes back through a vocabulary-size bitmask, as a list of every kept id. A top_k at the vocabulary
size therefore bounds nothing: with a wide top-p each token's set can be the whole vocabulary.
docs/fp32_and_sampler_replay.md, "Sampling replay".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

__all__ = ["KeptSets"]


@dataclass(frozen=True)
class KeptSets:
    """Kept-id sets for every position of a ``shape``-d block of token positions (row-major).

    ids:     (nnz,) long, the kept ids of position 0, then of position 1, ...
    offsets: (positions + 1,) long; position p's set is ``ids[offsets[p]:offsets[p + 1]]``,
             empty where no set was recorded.
    shape:   the token-id shape the positions flatten.
    """

    ids: torch.Tensor
    offsets: torch.Tensor
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        n = 1
        for s in self.shape:
            n *= int(s)
        if self.offsets.dim() != 1 or self.offsets.numel() != n + 1:
            raise ValueError(f"offsets must have {n + 1} entries for shape {tuple(self.shape)}, "
                             f"got {tuple(self.offsets.shape)}")
        if self.ids.dim() != 1 or int(self.offsets[-1]) != self.ids.numel() or int(self.offsets[0]) != 0:
            raise ValueError(f"offsets must run from 0 to len(ids)={self.ids.numel()}")

    @property
    def counts(self) -> torch.Tensor:
        """(shape) long: the size of each position's set (0: none recorded)."""
        return self.offsets.diff().reshape(self.shape)

    @property
    def recorded(self) -> torch.Tensor:
        """(shape) bool: positions with a recorded set."""
        return self.counts > 0

    @classmethod
    def from_lists(cls, lists: Sequence[Optional[Sequence[Sequence[int]]]],
                   width: Optional[int] = None) -> "KeptSets":
        """Sets for a ``(len(lists), width)`` batch from one list of kept-id lists per completion.

        ``lists[b]`` holds completion ``b``'s kept ids, one list per generated token, or is None (no sets:
        the recomputed ones stand in). Completion ``b``'s ``j``-th set goes to position ``(b, j)``,
        as completions are right-padded in a batch; ``width`` defaults to the longest.
        """
        lists = list(lists)
        longest = max((len(x) for x in lists if x is not None), default=0)
        width = longest if width is None else int(width)
        if longest > width:
            raise ValueError(f"a sampling mask has {longest} positions but the batch is {width} tokens wide")
        counts = torch.zeros(len(lists), width, dtype=torch.long)
        flat: list[int] = []
        for b, sets in enumerate(lists):
            for j, kept in enumerate(sets or ()):
                counts[b, j] = len(kept)
                flat.extend(kept)
        offsets = torch.zeros(counts.numel() + 1, dtype=torch.long)
        torch.cumsum(counts.reshape(-1), 0, out=offsets[1:])
        return cls(torch.tensor(flat, dtype=torch.long), offsets, (len(lists), width))

    @classmethod
    def from_padded(cls, padded: torch.Tensor) -> "KeptSets":
        """Sets from a ``(..., K)`` integer tensor, each position's ids followed by -1 (an all -1 row: none)."""
        if padded.dim() < 2 or padded.dtype.is_floating_point or padded.dtype == torch.bool:
            raise ValueError(f"padded kept sets must be an integer tensor (..., K), got {padded.dtype} "
                             f"{tuple(padded.shape)}")
        flat = padded.reshape(-1, padded.shape[-1]).to("cpu", torch.long)
        keep = flat >= 0
        offsets = torch.zeros(flat.shape[0] + 1, dtype=torch.long)
        torch.cumsum(keep.sum(-1), 0, out=offsets[1:])
        return cls(flat[keep], offsets, tuple(padded.shape[:-1]))

    def to_padded(self, width: Optional[int] = None) -> torch.Tensor:
        """``(shape..., K)`` long, each set's ids then -1; ``K`` defaults to the largest set."""
        counts = self.offsets.diff()
        k = int(counts.max()) if counts.numel() else 0
        width = max(k, 1) if width is None else int(width)
        if k > width:
            raise ValueError(f"a kept set has {k} ids, more than width={width}")
        out = torch.full((counts.numel(), width), -1, dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        cols = torch.arange(self.ids.numel()) - self.offsets[:-1].repeat_interleave(counts)
        out[rows, cols] = self.ids
        return out.reshape(*self.shape, width)

    def flat_rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``start:stop`` of the flattened block: (row index within the slice, id) per kept entry."""
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        counts = self.offsets[start + 1: stop + 1] - self.offsets[start:stop]
        rows = torch.repeat_interleave(torch.arange(stop - start), counts)
        return rows, self.ids[lo:hi]

    def rows(self, start: int, stop: int) -> "KeptSets":
        """The sets of rows ``start:stop`` of the first dimension (a micro-batch of a batch)."""
        per_row = 1
        for s in self.shape[1:]:
            per_row *= int(s)
        a, b = start * per_row, stop * per_row
        lo, hi = int(self.offsets[a]), int(self.offsets[b])
        return KeptSets(self.ids[lo:hi], self.offsets[a:b + 1] - lo, (stop - start, *self.shape[1:]))

    def reshape(self, *shape: int) -> "KeptSets":
        """The same positions under another shape with the same number of positions."""
        return KeptSets(self.ids, self.offsets, tuple(int(s) for s in shape))
