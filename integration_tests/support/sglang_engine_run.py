"""A live SGLang engine against the trainer, run with the SGLang venv's Python (scripts/sglang_venv.sh).

    SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=<repo> python -m integration_tests.support.sglang_engine_run MODEL NEW OUT.json

One engine built with the recipe (``sglang_parity_kwargs(fp32_lm_head=True)`` on SGLang's CPU path) samples
GRPO-shaped prompts at T = 0.7 under top-k 40 / top-p 0.9, and writes, per token, the engine's logprob beside the
trainer's (bf16 body, fp32 head) scored three ways: tempered over the full vocabulary (what SGLang returns),
renormalised over the kept set of vLLM's rule (core's sampler-aware pi_old), and with a bf16 head. The floor: the
trainer against the same checkpoint in float32 on the same tokens (the trainer's precision floor). Then
``update_weights_from_disk`` loads ``NEW`` (a checkpoint of the same shapes) and the next tokens are scored by
both trainers. (Engines with and without the fp32 head read back live: the doctor's rows c and d/sglang-only,
integration_tests/test_doctor_sglang.py.)
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SAMPLING = {"temperature": 0.7, "top_k": 40, "top_p": 0.9}
PROMPTS, SAMPLES, TOKENS = 3, 2, 16


def _engine(model: str, **recipe):
    import sglang

    from rollout_parity.check.sglang_probe import probe_engine_kwargs

    kwargs = probe_engine_kwargs(model, 0.3, cuda=False)
    kwargs.update(recipe)
    return sglang.Engine(**kwargs)


def _rollouts(engine, prompts):
    ids = [p for p in prompts for _ in range(SAMPLES)]
    outs = engine.generate(input_ids=ids, sampling_params=dict(SAMPLING, max_new_tokens=TOKENS), return_logprob=True)
    return ids, [list(o["output_ids"]) for o in outs], [[x[0] for x in o["meta_info"]["output_token_logprobs"]]
                                                       for o in outs]


def _scores(model_path, ids, completions, sampling, fp32_head=True, dtype="bfloat16"):
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_parity.grpo_rounds import trainer_scores

    trainer = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    scores = trainer_scores(trainer, ids, completions, fp32_head=fp32_head, sampling=sampling)
    return [[float(v) for v in row[: len(c)]] for row, c in zip(scores.processed, completions)]


def main(model: str, new: str, out_path: str) -> None:
    from transformers import AutoTokenizer

    from rollout_parity.engines.sglang.recipe import describe_engine, verify_engine
    from rollout_parity.grpo_rounds import grpo_prompt

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [grpo_prompt(tokenizer, 0, i, sentences=1) for i in range(PROMPTS)]
    result: dict = {}
    t0 = time.perf_counter()
    engine = _engine(model)
    result["start_s"] = time.perf_counter() - t0
    try:
        result["verify"] = verify_engine(engine, fp32_lm_head=True)
        result["described"] = {k: str(v) for k, v in describe_engine(engine).items()}
        ids, completions, engine_lp = _rollouts(engine, prompts)
        result.update(completions=completions, engine=engine_lp)
        engine.flush_cache()
        answer = engine.update_weights_from_disk(new)  # (success, message, ...): its length varies by release
        result["update"] = [bool(answer[0]), str(answer[1])]
        ids2, completions2, engine_lp2 = _rollouts(engine, prompts)
        result.update(completions_new=completions2, engine_new=engine_lp2)
    finally:
        engine.shutdown()
    tempered = {"temperature": SAMPLING["temperature"]}
    result["trainer_tempered"] = _scores(model, ids, completions, tempered)
    result["float32"] = _scores(model, ids, completions, tempered, dtype="float32")
    result["trainer_sampler_aware"] = _scores(model, ids, completions, SAMPLING)
    result["trainer_bf16_head"] = _scores(model, ids, completions, tempered, fp32_head=False)
    result["trainer_new"] = _scores(new, ids2, completions2, tempered)
    result["trainer_old_on_new_tokens"] = _scores(model, ids2, completions2, tempered)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
