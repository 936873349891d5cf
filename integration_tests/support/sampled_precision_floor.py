"""The precision floor of an engine-vs-trainer gap on tokens the checkpoint samples itself (``floors.py``).

For runs whose rollouts the test cannot read token by token (a subprocess's report, a framework's logged
metrics). A bound between vLLM's logprobs and a trainer's forward of the same tokens is a multiple of this floor: the
same checkpoint in the run's dtype (a bf16 body, the head in fp32 or in bf16 as the run has it) against the
checkpoint in float32, scoring the same tokens the way the trainer scores them
(:func:`rollout_parity.grpo_rounds.trainer_scores`: the processed view of the sampling parameters). The
tokens are completions the float32 model samples for the run's own prompts. Both sides move with the machine's
bf16 paths; a run whose trainer computes in float32 takes the dtype its engine runs in as ``dtype``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from integration_tests.support.floors import Floor, gaps, spacing

__all__ = ["sampled_precision_floor", "sample_completions"]


def sample_completions(model: Any, prompts: Sequence[Sequence[int]], *, samples: int, tokens: int,
                       temperature: float, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """``samples`` completions of ``tokens`` tokens per prompt, drawn at ``temperature`` (no truncation) from
    ``model`` with a generator seeded by ``seed``; returns (prompt per completion, completions)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_of, completions = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([list(p)] * samples)
            for _ in range(tokens):
                probs = (model(input_ids=ids).logits[:, -1].float() / temperature).softmax(-1)
                ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
            prompt_of += [list(p)] * samples
            completions += ids[:, len(p):].tolist()
    return prompt_of, completions


def sampled_precision_floor(model_path: str, prompts: Sequence[Sequence[int]],
                            views: Mapping[str, tuple[Mapping, bool]], *, samples: int, tokens: int,
                            temperature: float, seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, Floor]:
    """Per view ``name: (sampling, fp32_head)``, the mean and max |logprob| gap of ``model_path`` in ``dtype``
    (its head in fp32 when ``fp32_head``) against float32, on the float32 model's completions of ``prompts``.

    A token outside the kept set of either side (a truncating ``sampling``) is left out: the engine samples
    inside its own kept set. The floor is at least the float32 spacing of the scores.
    """
    from transformers import AutoModelForCausalLM

    from rollout_parity.grpo_rounds import trainer_scores

    run = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    fp32 = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompt_of, completions = sample_completions(fp32, prompts, samples=samples, tokens=tokens,
                                                temperature=temperature, seed=seed)
    floors = {}
    for name, (sampling, fp32_head) in views.items():
        a = trainer_scores(run, prompt_of, completions, fp32_head=fp32_head, sampling=sampling)
        b = trainer_scores(fp32, prompt_of, completions, fp32_head=True, sampling=sampling)
        kept = a.mask.bool() & ~a.outside & ~b.outside
        lp = [[s.processed[r][kept[r]].tolist() for r in range(len(completions))] for s in (a, b)]
        floors[name] = Floor.from_gaps(gaps(*lp), minimum=spacing([x for r in lp[1] for x in r]))
    return floors
