"""The weight-sync check's probe request, in vLLM's terms (``core/sync_check.py`` for the check itself).

The engine continues the probe's fixed prompts at the trainer's temperature with nothing else processing the
distribution, so its processed logprobs are ``log_softmax(logits / T)``, what the trainer scores.
"""

from __future__ import annotations

from typing import Any, Optional

from rollout_parity.core.sync_check import SyncProbe

__all__ = ["probe_sampling_params", "engine_probe_params"]


def probe_sampling_params(probe: SyncProbe, temperature: float, *, vocab_size: Optional[int] = None) -> dict:
    """vLLM ``SamplingParams`` kwargs for the probe: ``temperature``, ``max_tokens`` = ``probe.new_tokens``, the
    probe's seed, ``ignore_eos``, and the sampled token's logprob (``logprobs=0``); no top-p, min-p or top-k.

    ``vocab_size`` (the engine's, ``model_config.get_vocab_size()``): for an engine built with
    ``return_sampling_mask`` (``rollout_sampling_replay``), which refuses every request with ``top_k <= 0``
    (``vllm/v1/engine/input_processor.py``, "sampling distribution replay requires top_k > 0"). ``top_k`` is
    then the vocabulary size: vLLM keeps every token there (Model Runner V2 stores a top-k at the vocabulary
    size as "off", ``v1/worker/gpu/sample/states.py``), so the processed logprobs stay ``log_softmax(logits /
    T)``; each probe token's kept set comes back as the whole vocabulary (vLLM's packed bitmask path, wider
    than its 2,048-id compact buffer), one per probe token, once per checked sync.
    """
    params = {"temperature": float(temperature), "max_tokens": probe.new_tokens, "seed": probe.seed,
              "ignore_eos": True, "logprobs": 0}
    if vocab_size is not None:
        if int(vocab_size) < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        params["top_k"] = int(vocab_size)
    return params


def engine_probe_params(model_config: Any, probe: SyncProbe, temperature: float) -> dict:
    """:func:`probe_sampling_params` for the engine whose resolved ``model_config`` (vLLM's ``ModelConfig``) is
    given: with ``top_k`` = its vocabulary size when it returns sampling masks, else without ``top_k``."""
    masks = bool(getattr(model_config, "return_sampling_mask", False))
    return probe_sampling_params(probe, temperature, vocab_size=model_config.get_vocab_size() if masks else None)
