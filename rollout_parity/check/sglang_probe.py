"""The live parity probe for SGLang: this SGLang, on this hardware, against the trainer's logprobs.

A tiny causal LM built locally (``testing.tiny_model``; ``--model`` for your own) is served by an in-process
``sglang.Engine`` built with the recipe (``sglang_parity_kwargs(fp32_lm_head=True)``):

* ``sglang/recipe``: the engine, as this SGLang resolved its server arguments, holds every setting of the recipe
  (``engines.sglang.recipe.verify_engine``: the fp32 head, the radix cache off, the overlap scheduler off,
  logprobs after the temperature);
* ``sglang/logprobs``: GRPO-shaped rollouts sampled at temperature 0.7 are re-scored by a transformers trainer
  (bf16 body, ``apply_fp32_lm_head``; on the GPU when there is one) as ``log_softmax(logits / T)``, the form SGLang
  returns: mean |trainer - engine| must stay at the recipe's level (:data:`MAX_DELTA`);
* ``sglang/sampler``: the same under a truncating sampler (top-k 40, top-p 0.9). SGLang's logprobs stay those of
  the full tempered distribution there, so the trainer scores them the same way, never renormalised.

On a CPU machine the engine runs SGLang's CPU path (``device="cpu"``, ``attention_backend="torch_native"``,
``SGLANG_USE_CPU_ENGINE=1``); on a GPU, SGLang's defaults for it. Nothing here patches SGLang.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

from rollout_parity.check.report import ENGINE_PROBE_MAX_DELTA, Check, FrameworkReport, extra_range

__all__ = ["SGLANG_CHECKS", "MAX_DELTA", "SAMPLING", "run_sglang_probe", "run", "probe_engine_kwargs"]

SGLANG_CHECKS = {
    "sglang/recipe": "server arguments of the recipe honoured",
    "sglang/logprobs": "mean |trainer - engine| logprob, T=0.7",
    "sglang/sampler": "same, top-k/top-p sampling, tempered logprobs",
}
#: Mean |delta| per token the probe accepts (the engine probes' shared bound).
MAX_DELTA = ENGINE_PROBE_MAX_DELTA
SAMPLING = {"sglang/logprobs": {"temperature": 0.7}, "sglang/sampler": {"temperature": 0.7, "top_k": 40, "top_p": 0.9}}


def probe_engine_kwargs(model: str, gpu_memory_utilization: float, *, cuda: bool) -> dict:
    """The probe engine's ``sglang.Engine`` kwargs: the recipe with the fp32 head, seed 0, and the platform's
    execution path (on CPU: SGLang's CPU device with its torch-native attention and a 4,096-token KV pool)."""
    from rollout_parity.engines.sglang.recipe import sglang_parity_kwargs

    platform = dict(mem_fraction_static=gpu_memory_utilization) if cuda else \
        dict(device="cpu", attention_backend="torch_native", max_total_tokens=4096)
    return dict(model_path=model, **sglang_parity_kwargs(fp32_lm_head=True), **platform, random_seed=0,
                log_level="error")


def run_sglang_probe(report: FrameworkReport, *, model: Optional[str] = None, max_delta: float = MAX_DELTA,
                     prompts: int = 4, samples: int = 4, max_tokens: int = 32, gpu_memory_utilization: float = 0.3,
                     tick: Callable[[], None] = lambda: None) -> None:
    import torch

    report.tested = extra_range("sglang")
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # read when SGLang's modules import
        report.notes.append("CPU: SGLang's CPU engine (torch-native attention); CUDA kernels not exercised here")
    _probe(report, model, max_delta, prompts, samples, max_tokens, gpu_memory_utilization, cuda, tick)


def _generate(engine: Any, prompts: list[list[int]], samples: int, sampling: dict, max_tokens: int):
    """``samples`` completions per prompt: (prompts, completions, logprobs), one row per completion."""
    ids = [p for p in prompts for _ in range(samples)]
    outs = engine.generate(input_ids=ids, sampling_params=dict(sampling, max_new_tokens=max_tokens),
                           return_logprob=True)
    completions = [list(o["output_ids"]) for o in outs]
    logprobs = [[float(x[0]) for x in o["meta_info"]["output_token_logprobs"]] for o in outs]
    return ids, completions, logprobs


def _probe(report, model, max_delta, n_prompts, samples, max_tokens, gpu_memory_utilization, cuda, tick) -> None:
    import sglang
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_parity.engines.sglang.recipe import describe_engine, verify_engine
    from rollout_parity.grpo_rounds import grpo_prompt, padded_logprobs, trainer_scores

    if model is None:
        from rollout_parity.testing.tiny_model import build_tiny_model

        model = build_tiny_model()
        report.notes.append("model: a tiny Qwen2 built locally (no download); --model for your own")
    else:
        report.notes.append(f"model: {model}")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [grpo_prompt(tokenizer, 0, i, sentences=2) for i in range(n_prompts)]
    t0 = time.perf_counter()
    engine = sglang.Engine(**probe_engine_kwargs(model, gpu_memory_utilization, cuda=cuda))
    report.notes.append(f"engine built in {time.perf_counter() - t0:.0f} s")
    tick()
    try:
        recipe = Check("sglang/recipe", SGLANG_CHECKS["sglang/recipe"], tolerance=None)
        held, resolved = verify_engine(engine, fp32_lm_head=True), describe_engine(engine)
        for setting, ok in held.items():
            recipe.expect(setting, ok, f"not held by this SGLang (resolved: {resolved})")
        rollouts = {name: _generate(engine, prompts, samples, sampling, max_tokens)
                    for name, sampling in SAMPLING.items()}
        tick()
    finally:
        engine.shutdown()
    device = "cuda" if cuda else "cpu"
    trainer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(device).eval()
    report.checks.append(recipe.result())
    for name, sampling in SAMPLING.items():
        ids, completions, logprobs = rollouts[name]
        tempered = {"temperature": sampling["temperature"]}  # what SGLang's logprobs are, whatever its sampler
        scores = trainer_scores(trainer, ids, completions, fp32_head=True, sampling=tempered)
        delta = (scores.processed - padded_logprobs(logprobs, scores.processed.shape[1]))[scores.mask.bool()].abs()
        check = Check(name, SGLANG_CHECKS[name], tolerance=max_delta)
        check.close("mean |delta|", "mean |trainer - engine|", float(delta.mean()), 0.0, atol=max_delta)
        report.notes.append(f"{name}: {delta.numel()} tokens, mean |delta| {float(delta.mean()):.2e}, "
                            f"max {float(delta.max()):.2e}")
        report.checks.append(check.result())
        tick()


def run(report: FrameworkReport, opts: Any, tick: Callable[[], None]) -> None:
    """``rollout-parity check``'s entry for SGLang (``registry.py``): the live probe with the options' model."""
    run_sglang_probe(report, model=opts.model, max_delta=opts.max_delta or MAX_DELTA,
                     gpu_memory_utilization=opts.gpu_memory_utilization, tick=tick)
