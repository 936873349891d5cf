"""Floors: this machine's noise for one computation, measured in the same run as the bound that uses it.

A bound between two engines (vLLM and a trainer, two vLLM engines, a run and its rerun) is written as a multiple
of a floor, never as an absolute number measured on one CPU: oneDNN's AMX / AVX512 paths and batch-dependent
blocking move every gap between engines by the same factor, and a floor measured beside the gap moves with it.

- :func:`engine_batch_floor`: one engine scoring the same tokens in two batch arrangements (all together, then
  each sequence alone). CPU kernels block by the batch's shape; what differs is the engine's own noise.
- the precision floor (built in each test from its own trainer model): the trainer's logprobs in its run dtype
  (bf16 body, fp32 head) against the same model in float32 on the same tokens. Two implementations of one
  dtype (vLLM's kernels and the trainer's) are not expected closer than either is to float32, and both move
  with the machine's bf16 paths; it is the floor for engine-vs-trainer gaps where the engine's batch floor is
  ~0 (kernels that ignore the batch).
- :func:`spacing`: the floor's lower end, the rounding of the dtype the values are held in (a machine whose
  kernels ignore the batch still rounds), so a floor is never 0.
- :class:`Floor`: the mean and max of a floor, combined from several measurements by their largest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

__all__ = ["Floor", "spacing", "engine_batch_floor", "gaps"]


@dataclass(frozen=True)
class Floor:
    """A floor's mean and max |gap| (the same computation done twice on this machine)."""

    mean: float
    max: float

    @staticmethod
    def of(*floors: "Floor") -> "Floor":
        """The largest of several floors, field by field."""
        return Floor(mean=max(f.mean for f in floors), max=max(f.max for f in floors))

    @staticmethod
    def from_gaps(values: Iterable[float], minimum: float = 0.0) -> "Floor":
        """A floor from per-token |gaps|, at least ``minimum`` (the spacing) in mean and max."""
        xs = [abs(float(v)) for v in values]
        if not xs:
            raise ValueError("a floor needs at least one gap; the two arrangements scored no token")
        return Floor(mean=max(sum(xs) / len(xs), minimum), max=max(max(xs), minimum))


def spacing(values: Any, dtype: torch.dtype = torch.float32) -> float:
    """The dtype's relative spacing (``eps``) times the mean |value|: the rounding of numbers held in ``dtype``."""
    t = torch.as_tensor(values, dtype=torch.float64).flatten()
    t = t[torch.isfinite(t)]
    if t.numel() == 0:
        return 0.0
    return float(torch.finfo(dtype).eps * t.abs().mean())


def gaps(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> list[float]:
    """|a - b| per token over matching sequences (both finite)."""
    out = []
    for xs, ys in zip(a, b, strict=True):
        out.extend(abs(x - y) for x, y in zip(xs, ys, strict=True) if abs(x) != float("inf") and abs(y) != float("inf"))
    return out


def engine_batch_floor(llm: Any, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], *, alone: int = 4,
                       dtype: torch.dtype = torch.float32) -> Floor:
    """The engine's own noise on these tokens: each (prompt ids, completion ids) scored batched, then alone.

    Scores are vLLM's prompt logprobs of the completion tokens (one prefill, T=1: raw = processed), which is
    what a rollout's logprobs are compared with when the engine scores tokens it did not sample. ``alone``
    sequences (the first ones) are scored again one per batch.
    """
    from vllm import SamplingParams

    if not sequences:
        raise ValueError("engine_batch_floor needs at least one (prompt, completion) sequence")
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)

    def score(batch):
        outs = llm.generate([{"prompt_token_ids": list(p) + list(c)} for p, c in batch], scoring, use_tqdm=False)
        return [[o.prompt_logprobs[len(p) + i][t].logprob for i, t in enumerate(c)] for o, (p, c) in zip(outs, batch)]

    batched = score(list(sequences))[:alone]
    single = [score([s])[0] for s in list(sequences)[:alone]]
    return Floor.from_gaps(gaps(batched, single), minimum=spacing([x for s in batched for x in s], dtype))
