"""The doctor on SGLang (``--engine sglang``): its rows, the engines they build, how the rounds drive them.

SGLang's rows are vLLM's where SGLang has the same knob, and none where it has not:

    a             SGLang defaults: radix cache on (its weight update flushes it), overlap scheduler on
    c             + radix cache and overlap scheduler off: ``sglang_parity_kwargs()``
    d             + fp32 lm_head on both sides: the full recipe
    d/sglang-only row d's rollouts scored by a bf16 trainer head: fp32 on one side only
    s/full-vocab  row d's engine under the truncating sampler, scored by the trainer's log_softmax(z/T) over the full
                  vocabulary: SGLang returns that form whatever its sampler truncates (``engines/sglang/recipe.py``),
                  so this is SGLang's parity row under truncation (vLLM's s/sampler has no SGLang counterpart)
    d/reset       the recipe with the radix cache kept on and flushed after every weight load (shared engine)

No b (SGLang has no logprobs mode to switch), no d/salt (no per-request cache salt), no p/* (not measured on
SGLang yet). Engines are in-process ``sglang.Engine`` objects (the scheduler runs in SGLang's own subprocess);
weights travel as tensors through ``update_weights_from_tensor``, inside ``begin_weight_update()`` /
``end_weight_update()`` on the releases that require it (0.5.21+).
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from typing import Any, Iterator, Mapping, Optional, Sequence

from rollout_parity.doctor.rowspec import EngineRows, RowSpec

__all__ = ["NAME", "TABLE", "ROW_SPECS", "CONFIGS", "DEFAULT_ROWS", "PARITY_ROWS", "engine_kwargs",
           "check_requirements", "refuse", "environment", "version", "sizing", "supports_updates", "NO_UPDATES_NOTE", "start", "ops",
           "load", "generate", "describe", "verify", "shutdown", "float16_refusal"]

NAME = "SGLang"

DEFAULT_ROWS = ("a", "c", "d", "d/sglang-only", "s/full-vocab", "d/reset")

#: Measured configurations: (engine key, prefix-cache policy across updates, sampling kind).
CONFIGS: dict[str, tuple[str, str, str]] = {
    "a": ("defaults", "off", "temperature"),
    "c": ("recipe_bf16", "off", "temperature"),
    "d": ("recipe_fp32", "off", "temperature"),
    "s": ("recipe_fp32", "off", "truncating"),
    "reset": ("recipe_fp32_cached", "reset", "temperature"),
}


def engine_kwargs(key: str) -> dict[str, Any]:
    from rollout_parity.engines.sglang.recipe import sglang_parity_kwargs

    if key == "defaults":
        return {}
    if key == "recipe_bf16":
        return sglang_parity_kwargs(fp32_lm_head=False)
    if key == "recipe_fp32":
        return sglang_parity_kwargs(fp32_lm_head=True)
    if key == "recipe_fp32_cached":
        return sglang_parity_kwargs(fp32_lm_head=True, prefix_cache_policy="reset")
    raise KeyError(key)


#: The rows at parity: the recipe engine with fp32 heads, and the same engine under truncation scored in the form
#: SGLang returns. The advice must not reject their data.
PARITY_ROWS = ("d", "s/full-vocab")

ROW_SPECS: dict[str, RowSpec] = {
    s.name: s
    for s in (
        RowSpec("a", "SGLang defaults", "a", False, "processed",
                "engine: SGLang defaults (radix cache on, flushed by its own weight update; overlap scheduler on); "
                "trainer bf16 head"),
        RowSpec("c", "+ radix cache/overlap off", "c", False, "processed",
                "engine: sglang_parity_kwargs(); trainer bf16 head"),
        RowSpec("d", "+ fp32 head both sides", "d", True, "processed",
                "engine: sglang_parity_kwargs(fp32_lm_head=True); trainer apply_fp32_lm_head"),
        RowSpec("d/sglang-only", "fp32 head in SGLang only", "d", False, "processed",
                "row d's rollouts (no new sampling); trainer bf16 head: fp32 on one side only"),
        RowSpec("s/full-vocab", "truncated, tempered trainer", "s", True, "full",
                "row d's engine, truncating sampler; SGLang returns log_softmax(z/T) over the full vocabulary, the "
                "trainer (fp32 head) computes the same: SGLang's parity under truncation"),
        RowSpec("d/reset", "recipe, cache on + flush", "reset", True, "processed",
                "engine: recipe, fp32 head, radix cache on; flush_cache after each update (shared engine)"),
    )
}

TABLE = EngineRows(
    key="sglang", rows=ROW_SPECS, default_rows=DEFAULT_ROWS, configs=CONFIGS, parity_rows=PARITY_ROWS,
    steps=(("radix cache and overlap scheduler off", "a", "c"), ("fp32 lm_head on both sides", "c", "d")),
    kwargs=engine_kwargs)

NO_UPDATES_NOTE = "this SGLang has no update_weights_from_tensor: weight updates were loads that change nothing"


def check_requirements(plot: bool = True) -> Optional[str]:
    """None when SGLang and the doctor's other needs are installed, else what is missing, naming the extra."""
    missing = [m for m in ("sglang", "transformers", "tqdm") if importlib.util.find_spec(m) is None]
    if missing:
        return f"the doctor on SGLang needs {' and '.join(missing)}: pip install 'rollout-parity[sglang]'"
    if plot and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install matplotlib, or --plot none"
    return None


def refuse(opts: Any) -> None:
    """What SGLang's rows cannot measure, refused before anything loads."""
    from rollout_parity.engines.sglang.recipe import refuse_original_logprobs

    refuse_original_logprobs(opts.temperature)  # its logprobs would be before the temperature, the trainer's after


@contextlib.contextmanager
def environment(threads: Optional[int]) -> Iterator[Optional[int]]:
    """In-process SGLang engines: its CPU path where there is no GPU (``SGLANG_USE_CPU_ENGINE``, read when SGLang
    imports), quiet tokenizers, torch's threads (None: left alone). Values the caller set win; restored on exit."""
    import torch

    from rollout_parity.grpo_rounds import env_defaults, torch_threads

    wanted = {"TOKENIZERS_PARALLELISM": "false"}
    if not torch.cuda.is_available():
        wanted["SGLANG_USE_CPU_ENGINE"] = "1"
    with env_defaults(wanted), torch_threads(threads):
        yield threads


def version() -> Optional[str]:
    from rollout_parity.engines.sglang.features import installed_sglang_version

    import sglang  # noqa: F401  (fails early, before the trainer model loads)

    return installed_sglang_version()


def sizing(opts: Any, max_len: int) -> dict[str, Any]:
    """The sizing kwargs of every doctor engine: context, seed, dtype, memory, and the platform's execution path.

    ``dtype="bfloat16"``: the doctor's trainer body (SGLang's ``auto`` loads a float32 checkpoint as float16). On a
    GPU, ``mem_fraction_static`` is ``--gpu_memory_utilization`` and SGLang's defaults do the rest (CUDA graphs,
    its attention backend). Without one, SGLang's CPU device with its torch-native attention and a KV pool that
    holds one version's batch, and ``sleep_on_idle`` (an idle scheduler otherwise spins a core: the doctor's four
    engines took 18, 28, 30 and 44 s to start one after another on two cores, and their rounds slowed alike).
    """
    import torch

    common = dict(context_length=max_len, random_seed=opts.seed, dtype="bfloat16", log_level="error")
    if torch.cuda.is_available():
        return dict(common, mem_fraction_static=opts.gpu_memory_utilization)
    return dict(common, device="cpu", attention_backend="torch_native", sleep_on_idle=True,
                max_total_tokens=max(4096, opts.num_prompts * opts.samples * max_len))


def supports_updates() -> bool:
    import sglang

    return callable(getattr(sglang.Engine, "update_weights_from_tensor", None))


def start(model_path: str, key: str, sizing_kwargs: dict[str, Any]) -> Any:
    import sglang

    return sglang.Engine(model_path=model_path, **engine_kwargs(key), **sizing_kwargs)


def _answer(what: str, result: Any) -> None:
    """SGLang's update calls answer ``(success, message, ...)`` (the length varies by release) or an object with
    ``success``; a failure raises, naming the call and SGLang's message."""
    ok = getattr(result, "success", None)
    message = getattr(result, "message", "")
    if ok is None and isinstance(result, (tuple, list)) and result:
        ok, message = result[0], (result[1] if len(result) > 1 else "")
    if ok is False:
        raise RuntimeError(f"SGLang's {what} failed: {message}")


def load(engine: Any, weights: Optional[Mapping[str, Any]], policy: str, version: Any) -> float:
    """Load a weight version into a live engine; returns the seconds it took.

    ``update_weights_from_tensor`` with SGLang's defaults (it flushes the radix cache itself), inside
    ``begin_weight_update()`` / ``end_weight_update()`` where the installed SGLang requires them; under
    ``policy="reset"`` an explicit ``flush_cache()`` after it, what the recipe's reset asks of the caller.
    ``weights=None``: a load that changes nothing (the policy's cost only).
    """
    from rollout_parity.engines.sglang.features import installed_sglang_version, sglang_has

    t0 = time.perf_counter()
    if weights is not None:
        session = sglang_has("weight_update_session", installed_sglang_version())
        if session:
            _answer("begin_weight_update", engine.begin_weight_update())
        try:
            _answer("update_weights_from_tensor", engine.update_weights_from_tensor(list(weights.items())))
        finally:
            if session:
                _answer("end_weight_update", engine.end_weight_update())
    if policy == "reset":
        _answer("flush_cache", engine.flush_cache())
    version.bump()
    return time.perf_counter() - t0


def _sampling(sampling: Mapping[str, Any], max_tokens: int) -> dict[str, Any]:
    params = dict(sampling, max_new_tokens=max_tokens, ignore_eos=True)
    if params.get("top_k") == 0:
        params["top_k"] = -1  # "off" is 0 or -1 to the doctor; SGLang takes -1 only
    return params


def generate(cfg: Any, prompts: Sequence[list[int]], samples: int, max_tokens: int) -> Any:
    """One configuration's rollouts of a batch of prompts: each prompt ``samples`` times (a GRPO group), with the
    engine's logprob of every sampled token (``meta_info["output_token_logprobs"]``)."""
    from rollout_parity.grpo_rounds import Batch

    ids = [list(p) for p in prompts for _ in range(samples)]
    t0 = time.perf_counter()
    outs = cfg.llm.generate(input_ids=ids, sampling_params=_sampling(cfg.sampling, max_tokens), return_logprob=True)
    seconds = time.perf_counter() - t0
    batch = Batch(version=cfg.version.value, prompts=[], completions=[], logprobs=[], seconds=seconds, tokens=0,
                  cached_tokens=0, update_seconds=0.0)
    for prompt, out in zip(ids, outs):
        completion = [int(t) for t in out["output_ids"]]
        batch.prompts.append(prompt)
        batch.completions.append(completion)
        batch.logprobs.append([float(x[0]) for x in out["meta_info"]["output_token_logprobs"]])
        batch.tokens += len(completion)
        batch.cached_tokens += int(out["meta_info"].get("cached_tokens") or 0)
    return batch


def _flush(engine: Any) -> None:
    _answer("flush_cache", engine.flush_cache())


def ops() -> Any:
    from rollout_parity.grpo_rounds import EngineOps

    return EngineOps(load=load, generate=generate, reset_cache=_flush)


def describe(engine: Any) -> dict[str, Any]:
    from rollout_parity.engines.sglang.recipe import describe_engine

    return describe_engine(engine)


def verify(engine: Any, *, fp32_lm_head: bool, prefix_cache_policy: str) -> dict[str, bool]:
    from rollout_parity.engines.sglang.recipe import verify_engine

    return verify_engine(engine, fp32_lm_head=fp32_lm_head, prefix_cache_policy=prefix_cache_policy)


def shutdown(engine: Any) -> None:
    import gc

    with contextlib.suppress(Exception):
        engine.shutdown()
    gc.collect()


def float16_refusal(model_path: str) -> Optional[str]:
    return None  # SGLang's table has no float16 rows
