"""Trainer-side reference for the vLLM tests: transformers logits of sampled completions."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from rollout_parity.core.fp32_head import apply_fp32_lm_head, revert_fp32_lm_head


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def completion_logits(
    model: Any, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *, fp32_head: bool
) -> list[torch.Tensor]:
    """Per sequence, the (len(completion), V) logits that predicted each completion token.

    One unpadded forward per sequence (no padding effects); the head runs in fp32 through
    ``apply_fp32_lm_head`` when asked, else in the model dtype (bf16 logits).
    """
    (apply_fp32_lm_head if fp32_head else revert_fp32_lm_head)(model)
    out = []
    try:
        with torch.no_grad():
            for p, c in zip(prompts, completions):
                ids = torch.tensor([list(p) + list(c)])
                logits = model(ids).logits[0]
                out.append(logits[len(p) - 1 : len(p) - 1 + len(c)])
    finally:
        revert_fp32_lm_head(model)
    return out


def vllm_token_logprobs(output: Any) -> tuple[list[int], torch.Tensor]:
    """(token_ids, logprobs of those tokens) of a ``RequestOutput``'s first completion."""
    comp = output.outputs[0]
    ids = list(comp.token_ids)
    return ids, torch.tensor([d[t].logprob for d, t in zip(comp.logprobs, ids)], dtype=torch.float32)
