"""Floors for the TRL tests: a live trainer's precision floor on the tokens of its own run.

``support/floors.py`` names the floors. A live TRL trainer's model carries TRL's fused log-prob head, its fp32
head cast and the adapter's hooks (routing replay on a MoE), so the precision floor is measured on two copies
built from its weights alone (its config and state dict): one in the dtype the lower-precision side runs in (the
trainer's bf16 body with its fp32 head, or a float32 trainer's weights in the bf16 that TRL's engine loads them
in), one in float32, scoring the same tokens. The live model is not touched. ``recording_probes`` keeps the
weight-sync check's probe tokens (its prompts and the engine's continuations), so a probe's gap can be put over
the floor on its own tokens.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Sequence

import torch

from integration_tests.support.floors import Floor
from integration_tests.support.precision_floor import precision_floor, raw_logprobs

__all__ = ["batch_sequences", "weights_precision_floor", "recording_probes"]

Sequences = Sequence[tuple[Sequence[int], Sequence[int]]]


def batch_sequences(batches: Iterable[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) of every row of TRL's batches (``prompt_ids`` left-padded, ``completion_ids``
    right-padded, each with its mask), without the padding."""
    out = []
    for batch in batches:
        for p, pm, c, cm in zip(batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                batch["completion_mask"]):
            out.append((p[pm.bool()].tolist(), c[cm.bool()].tolist()))
    return out


def weights_precision_floor(model: Any, sequences: Sequences, *, dtype: torch.dtype, fp32_head: bool) -> Floor:
    """|run dtype - float32| per completion token, on a copy of ``model``'s weights.

    The run side holds the body in ``dtype`` and the head in float32 (``fp32_head``: TRL's cast, vLLM's
    ``head_dtype``) or in ``dtype``; the reference holds the same weights in float32 (a bf16 trainer's weights
    upcast: the same numbers held wider). The logit head is a plain linear map (the tiny Qwen2 and Qwen3-MoE).
    """
    from transformers import AutoModelForCausalLM

    if not sequences:
        raise ValueError("weights_precision_floor needs at least one (prompt, completion) sequence")
    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    ref = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    ref.load_state_dict(state)
    run = copy.deepcopy(ref).to(dtype).eval()
    prompts, completions = [p for p, _ in sequences], [c for _, c in sequences]
    return precision_floor(run, ref, prompts, completions, score=raw_logprobs, fp32_head=fp32_head)


def recording_probes(patch: Any) -> list[list[tuple[list[int], list[int]]]]:
    """Record every weight-sync probe the TRL adapter scores from now on (``patch``: a ``pytest.MonkeyPatch``):
    per checked sync, its (prompt ids, the engine's continuation) pairs, appended before the check judges."""
    import rollout_parity.adapters.trl.sync as sync

    probes: list = []
    real = sync.probe_engine

    def recorded(generation, probe, temperature):
        completions, logprobs = real(generation, probe, temperature)
        probes.append([(list(p), list(c)) for p, c in zip(probe.prompts, completions)])
        return completions, logprobs

    patch.setattr(sync, "probe_engine", recorded)
    return probes
