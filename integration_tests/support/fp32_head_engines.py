"""vLLM engines whose model runs in processes of their own, for the fp32-head tests.

``python -m integration_tests.support.fp32_head_engines MODEL OUT.json`` (with
``VLLM_ENABLE_V1_MULTIPROCESSING=1``: the engine core, and on CPU its worker, are spawned) builds
two engines in turn from this fresh process, which imports nothing of vLLM beforehand:

* ``recipe``: ``vllm_parity_kwargs(fp32_lm_head=True)``; it samples the check's GRPO-shaped
  rollouts (:data:`PROMPTS` x :data:`SAMPLES`, ``MAX_TOKENS`` tokens, T=0.7) and reports
  ``verify_engine`` and the workers' head reports;
* ``patched_caller``: this process applies ``apply_vllm_fp32_logits_patch()``, then builds the
  recipe *without* the fp32 head: the caller holds the patch, the engine's processes do not.

:func:`vllm_serve` starts ``vllm serve``'s OpenAI server with the recipe's flags on 127.0.0.1.
The rollouts are re-scored in the test process, with the check's measure.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Sequence

from .processes import openai_server

__all__ = ["PROMPTS", "SAMPLES", "MAX_TOKENS", "TEMPERATURE", "prompts", "vllm_serve", "post", "main"]

# The check's probe (rollout_parity/check/vllm_probe.py): 4 prompts x 4 samples x 32 tokens, T=0.7.
PROMPTS, SAMPLES, MAX_TOKENS, TEMPERATURE = 4, 4, 32, 0.7
ENGINE = dict(enforce_eager=True, seed=0, max_model_len=512, gpu_memory_utilization=0.3)


def prompts(model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    from rollout_parity.grpo_rounds import grpo_prompt

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [grpo_prompt(tokenizer, 0, i, sentences=2) for i in range(PROMPTS)]


def _sample(llm: Any, ps: Sequence[list[int]]) -> dict[str, list]:
    from vllm import SamplingParams

    requests = [{"prompt_token_ids": p} for p in ps for _ in range(SAMPLES)]
    # No per-request seed: vLLM's CPU sampler refuses one ("CPU Generator does not use offset").
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMPERATURE, logprobs=0)
    outs = llm.generate(requests, params, use_tqdm=False)
    completions = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return {"prompts": [r["prompt_token_ids"] for r in requests], "completions": completions, "logprobs": logprobs}


def _engine(model: str, fp32_lm_head: bool) -> Any:
    import vllm

    from rollout_parity import vllm_parity_kwargs

    return vllm.LLM(model=model, **vllm_parity_kwargs(fp32_lm_head=fp32_lm_head), **ENGINE)


def main(model: str, out: str) -> None:
    from rollout_parity import verify_engine
    from rollout_parity.adapters.vllm import apply_vllm_fp32_logits_patch
    from rollout_parity.engines.vllm.head import head_reports
    from rollout_parity.grpo_rounds import shutdown

    result: dict[str, Any] = {"caller_pid": os.getpid(),
                              "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")}
    ps = prompts(model)
    llm = _engine(model, fp32_lm_head=True)
    try:
        result["recipe"] = {"reports": head_reports(llm)[0], "held": verify_engine(llm, fp32_lm_head=True),
                            **_sample(llm, ps)}
    finally:
        shutdown(llm)
    apply_vllm_fp32_logits_patch()
    llm = _engine(model, fp32_lm_head=False)
    try:
        result["patched_caller"] = {"reports": head_reports(llm)[0], "held": verify_engine(llm, fp32_lm_head=True)}
    finally:
        shutdown(llm)
    Path(out).write_text(json.dumps(result))


@contextlib.contextmanager
def vllm_serve(model: str, flags: Sequence[str], log: Path, timeout: float = 900.0) -> Iterator[tuple[str, int]]:
    """``vllm serve``'s server with ``FLAGS`` on 127.0.0.1, eager; yields ``(base URL, server pid)``. The test
    asks the engine's processes for their head through ``/collective_rpc``."""
    with openai_server(model, ["--max-model-len", "512", "--enforce-eager", *flags], log, timeout) as served:
        yield served


def post(url: str, body: dict, timeout: float = 600.0) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


if __name__ == "__main__":
    main(*sys.argv[1:3])
