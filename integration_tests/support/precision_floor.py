"""The precision floor of an engine-vs-trainer gap (``floors.py``): the trainer's logprobs in its run dtype
(bf16 body, fp32 head) against the same model in float32, on the same tokens and through the same processing.

Two implementations of one dtype (vLLM's kernels and the trainer's) are not expected closer than either is to
float32, and both move with the machine's bf16 paths.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from integration_tests.support.floors import Floor, gaps, spacing
from integration_tests.support.trainer_ref import completion_logits

__all__ = ["load_hf_fp32", "raw_logprobs", "precision_floor"]


def load_hf_fp32(path: str):
    """The checkpoint in float32 (the floor's reference side)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def raw_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log_softmax of the logits (in float32) at the given token ids: what vLLM's raw logprobs are."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.reshape(-1, 1).to(logits.device)).squeeze(-1)


def precision_floor(model: Any, fp32_model: Any, prompts: Sequence[Sequence[int]],
                    completions: Sequence[Sequence[int]], *,
                    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], fp32_head: bool = True) -> Floor:
    """``score(logits, ids)`` of the completions with ``model`` (its head in fp32 when ``fp32_head``) against
    the same with ``fp32_model``: the mean and max |gap| over the tokens finite on both sides, at least the
    float32 spacing of the scores."""
    run = completion_logits(model, prompts, completions, fp32_head=fp32_head)
    ref = completion_logits(fp32_model, prompts, completions, fp32_head=True)
    a = [score(lg, torch.tensor(list(c))).tolist() for lg, c in zip(run, completions)]
    b = [score(lg, torch.tensor(list(c))).tolist() for lg, c in zip(ref, completions)]
    return Floor.from_gaps(gaps(a, b), minimum=spacing([x for s in b for x in s]))
