"""GRPO-shaped rollout rounds on live vLLM engines, with real weight updates between versions.

One measuring method shared by the doctor (its rows and its tok/s column) and by
``benchmarks/prefix_cache_throughput.py``:

* **Prompts** (:func:`grpo_prompt`): each weight version draws new prompts of a few hundred
  tokens behind one shared system prompt that is longer than a KV-cache block, so a prefix
  cache has something to reuse across versions (and, without a guard, something stale to
  serve after an update: vllm#9744). Each prompt is sampled ``n`` times in one request
  (``SamplingParams(n=...)``, a GRPO group), which the prefix cache shares within a version.
* **Weight versions** (:func:`weight_versions`): version 0 is the model; each next version
  adds a seeded perturbation to every weight, the size of an optimizer step, so an engine that
  misses an update (or serves KV cached under older weights) is visible in |delta|.
* **Rounds** (:func:`run_rounds`): for every version, every configuration (an engine, its
  prefix-cache policy and its sampling settings) loads that version through
  ``engines.vllm.weight_update.update_weights_sync`` with its policy (vLLM's own
  ``Worker.reload_weights``, no test shim), then samples the version's prompts. The order of
  the configurations rotates from version to version, so the slow and fast moments of a
  shared machine fall on every configuration alike: measurements are interleaved and
  repeated in one run.
* **Throughput** (:func:`throughput_summary`): generated tokens per second of wall time inside
  ``generate``, per configuration and version; summarised as the median over versions and,
  against a baseline configuration, the median of the per-version ratios (each ratio compares
  two measurements taken seconds apart).

Engines are ``vllm.LLM`` objects built by the caller (in-process, so weights travel as
tensors); this module imports vLLM only inside :func:`run_rounds`.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from rollout_parity.engines.vllm.weight_update import WeightVersion, update_weights_sync
from rollout_parity.engines.vllm.features import cpu_threads_bind

__all__ = [
    "Config",
    "Batch",
    "EngineOps",
    "VLLM_OPS",
    "grpo_prompt",
    "weight_versions",
    "supports_reload_weights",
    "warm_up",
    "run_rounds",
    "throughput_summary",
    "TrainerScores",
    "trainer_scores",
    "padded_logprobs",
    "engine_environment",
    "env_defaults",
    "is_vllm_cpu_build",
    "execution_mode_kwargs",
    "shutdown",
]


# ----------------------------------------------------------------------------- environment


def is_vllm_cpu_build() -> bool:
    """True when the installed vLLM is the ``vllm-cpu`` distribution."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def execution_mode_kwargs() -> dict:
    """How the doctor's and the check's engines execute: as users run them, except on CPU.

    On a ``vllm-cpu`` build, ``enforce_eager=True`` (what the CPU suite measured: no torch.compile warm-up
    per engine on a shared CPU). Elsewhere nothing: vLLM's defaults, the compiled model with CUDA graphs
    (``compilation_config`` mode VLLM_COMPILE, ``cudagraph_mode`` FULL_AND_PIECEWISE on a GPU), which is the
    engine a GPU user's trainer samples from, so that is the engine measured.
    """
    return {"enforce_eager": True} if is_vllm_cpu_build() else {}


@contextlib.contextmanager
def engine_environment(threads: int | None = None) -> Iterator[int | None]:
    """Environment for in-process engines (set before vLLM is imported), restored on exit.

    In-process engine cores (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: weights travel as tensors,
    several engines live side by side) and quiet vLLM logs. On a ``vllm-cpu`` build also
    ``threads`` (default 1) unpinned OpenMP threads per engine and a 1 GiB KV cache per engine
    (``VLLM_CPU_KVCACHE_SPACE``; vLLM's default, a share of RAM, is sized for one engine per
    machine): on a CPU shared with other work, OpenMP threads pinned to cores stall at every
    barrier whenever one core is taken, and tokens/s then swung 30x from row to row. Values
    the caller already set win. Yields the thread count used (None: left alone).
    """
    cpu = is_vllm_cpu_build()
    if threads is None and cpu:
        threads = 1
    wanted = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "ERROR"}
    if cpu:
        wanted["VLLM_CPU_KVCACHE_SPACE"] = "1"
    if threads:
        wanted.update(OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=cpu_threads_bind())
    # the env alone is too late if torch was imported before it was set
    with env_defaults(wanted), torch_threads(threads):
        yield threads


@contextlib.contextmanager
def env_defaults(wanted: Mapping[str, str]) -> Iterator[None]:
    """Each of ``wanted`` set in ``os.environ`` unless the caller set it already; every one restored on exit."""
    saved = {k: os.environ.get(k) for k in wanted}
    for k, v in wanted.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[int]:
    """torch's intra-op thread count set to ``count`` (None: left alone), restored on exit.

    Set through ``torch._C.set_num_threads``, the builtin torch exports as ``set_num_threads``:
    vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op once an engine has started
    in this process (``vllm/v1/worker/cpu_worker.py``, to protect its OpenMP thread binding,
    which ``engine_environment`` turns off with ``nobind``). Yields the count in effect.
    """
    import torch

    before = torch.get_num_threads()
    if count:
        torch._C.set_num_threads(count)
    try:
        yield torch.get_num_threads()
    finally:
        torch._C.set_num_threads(before)


@contextlib.contextmanager
def trainer_threads() -> Iterator[int]:
    """The idle cores too, for a trainer pass run while the in-process engines sit idle.

    ``engine_environment`` holds torch to the engines' one thread. The trainer's scoring is not
    timed and runs after the engines' rounds; on a CPU without native bf16 its bf16 GEMMs
    dominate the doctor (83 s of 190 s on one thread here, 43-49 s on two). It takes one thread
    plus one per core the 1-minute load average leaves free (this process counts for one): on
    a loaded machine extra OpenMP threads stall at every barrier (a second thread made scoring
    1.3x slower here with one core busy). The doctor's trainer scores at one and two threads
    were bit-identical here. Restores the previous count; yields the count used.
    """
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy_elsewhere = max(0, round(os.getloadavg()[0]) - 1) if hasattr(os, "getloadavg") else cores - 1
    with torch_threads(max(torch.get_num_threads(), cores - busy_elsewhere)) as count:
        yield count


# ----------------------------------------------------------------------------- prompts


def grpo_prompt(tokenizer: Any, version: int, index: int, *, sentences: int = 8, seed: int = 0) -> list[int]:
    """Token IDs of prompt ``index`` of weight version ``version``: deterministic, distinct per pair.

    A chat prompt (the tokenizer's chat template; plain text without one): the shared
    :data:`~rollout_parity.testing.tiny_model.SYSTEM_PROMPT`, then a user turn with a story of
    ``sentences`` sentences and a question (with the built-in tokenizer ~135 + ~18 per sentence
    tokens; ~280 at the default).
    """
    from rollout_parity.testing.tiny_model import SYSTEM_PROMPT, TOPICS, read_and_answer, story

    rng = random.Random(f"grpo-prompt-{seed}-{version}-{index}")  # str seeds are stable across runs
    topic = list(TOPICS)[(version + index) % len(TOPICS)]
    user = read_and_answer(story(rng, sentences), 17 * version + index, 3 * index + 1, topic)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = f"{SYSTEM_PROMPT}\n\n{user}\n"
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


# ----------------------------------------------------------------------------- weights


def weight_versions(base: Mapping[str, Any], count: int, *, scale: float = 0.02, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` weight versions: ``v_0 = base``, ``v_k = v_{k-1} + scale * rms(p) * N(0, 1)``.

    Every floating tensor moves (matrices, embeddings, norms, biases), by ``scale`` times its
    own root-mean-square, drawn from a generator seeded by ``seed`` and ``k``; the sum is formed
    in float32 and stored in the tensor's dtype. ``v_0`` is a copy of ``base`` (so loading a
    version into the model ``base`` came from never changes ``v_0``). Names that share one
    tensor (tied embeddings) share one tensor in every version. ``scale=0`` gives ``count``
    equal versions: loads that change nothing. Tensors stay on their device; memory is
    ``count`` times the model.
    """
    import torch

    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if not scale >= 0:
        raise ValueError(f"scale must be >= 0, got {scale}")

    def step(previous: Mapping[str, Any], change: Callable[[Any], Any]) -> dict[str, Any]:
        current: dict[str, Any] = {}
        by_storage: dict[tuple, Any] = {}
        for name in sorted(previous):
            t = previous[name]
            if not torch.is_tensor(t):
                current[name] = t
                continue
            ptr = (t.data_ptr(), tuple(t.shape), t.dtype)
            if ptr not in by_storage:
                by_storage[ptr] = change(t)
            current[name] = by_storage[ptr]
        return current

    versions = [step(base, lambda t: t.detach().clone())]
    for k in range(1, count):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + k)

        def perturb(t: Any) -> Any:
            if not t.is_floating_point() or scale == 0:
                return t
            x = t.detach().float()
            noise = torch.randn(t.shape, generator=gen).to(x.device)
            return (x + scale * x.pow(2).mean().sqrt() * noise).to(t.dtype)

        versions.append(step(versions[-1], perturb))
    return versions


def supports_reload_weights() -> bool:
    """True when the installed vLLM's workers reload weights from tensors (``reload_weights``).

    vLLM's own ``GPUModelRunner.reload_weights(weights_iterator=...)`` (also used by its CPU
    runner) re-runs each layer's post-load processing, so it works with vLLM's repacked CPU
    GEMM weights as it does on GPU.
    """
    import inspect

    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    fn = getattr(GPUModelRunner, "reload_weights", None)
    return callable(fn) and "weights_iterator" in inspect.signature(fn).parameters


# ----------------------------------------------------------------------------- rounds


@dataclass
class Config:
    """One measured configuration: an engine, its prefix-cache policy, its sampling settings.

    Several configurations may share an engine: each loads its version before sampling.
    """

    name: str
    llm: Any
    policy: str = "off"
    sampling: Mapping[str, Any] = field(default_factory=dict)  # temperature, top_k, top_p, min_p
    version: WeightVersion = field(default_factory=WeightVersion)


@dataclass
class Batch:
    """One configuration's rollouts of one weight version (one row per sampled sequence)."""

    version: int
    prompts: list[list[int]]
    completions: list[list[int]]
    logprobs: list[list[float]]
    seconds: float  # wall time inside generate()
    tokens: int  # generated tokens
    cached_tokens: int  # prompt tokens served from the prefix cache (vLLM's num_cached_tokens)
    update_seconds: float  # the weight load before it, with the policy's action

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def _load(llm: Any, weights: Mapping[str, Any] | None, policy: str, version: WeightVersion) -> float:
    t0 = time.perf_counter()
    if weights is None:  # a load that changes nothing: the policy's cost only
        update_weights_sync(llm, lambda: None, prefix_cache_policy=policy, version=version)
    else:
        update_weights_sync(llm, "reload_weights", load_kwargs={"weights_iterator": list(weights.items())},
                            prefix_cache_policy=policy, version=version)
    return time.perf_counter() - t0


def _generate(cfg: Config, prompts: Sequence[list[int]], samples: int, max_tokens: int) -> Batch:
    from vllm import SamplingParams

    reqs = [{"prompt_token_ids": list(p)} for p in prompts]
    if cfg.policy == "salt":
        reqs = cfg.version.stamp_all(reqs)
    # No per-request seed: vLLM 0.31 on CPU crashes when a seeded request's prefill is split
    # into chunks ("CPU Generator does not use offset"); the engine seed suffices.
    params = SamplingParams(n=samples, max_tokens=max_tokens, logprobs=0, ignore_eos=True, **dict(cfg.sampling))
    t0 = time.perf_counter()
    results = cfg.llm.generate(reqs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    batch = Batch(version=cfg.version.value, prompts=[], completions=[], logprobs=[], seconds=seconds, tokens=0,
                  cached_tokens=0, update_seconds=0.0)
    for prompt, res in zip(prompts, results):
        batch.cached_tokens += int(res.num_cached_tokens or 0)
        for comp in res.outputs:
            ids = list(comp.token_ids)
            batch.prompts.append(list(prompt))
            batch.completions.append(ids)
            batch.logprobs.append([float(d[t].logprob) for d, t in zip(comp.logprobs, ids)])
            batch.tokens += len(ids)
    return batch


def shutdown(llm: Any) -> None:
    """Stop an in-process ``vllm.LLM``'s engine core and free what it holds (best effort)."""
    import gc

    engine = getattr(llm, "llm_engine", None)
    for target in (getattr(engine, "engine_core", None), engine):
        fn = getattr(target, "shutdown", None)
        if callable(fn):
            with contextlib.suppress(Exception):
                fn()
                break
    gc.collect()


@dataclass(frozen=True)
class EngineOps:
    """How the rounds drive one kind of engine: ``load(engine, weights, policy, version) -> seconds`` (a weight
    version with the policy's action on the prefix cache), ``generate(config, prompts, samples, max_tokens) ->
    Batch``, ``reset_cache(engine)``. :data:`VLLM_OPS` drives ``vllm.LLM``; the doctor's SGLang rows bring theirs
    (``doctor/engine_sglang.py``)."""

    load: Callable[[Any, Mapping[str, Any] | None, str, WeightVersion], float]
    generate: Callable[[Config, Sequence[list[int]], int, int], Batch]
    reset_cache: Callable[[Any], None]


def _reset_prefix_cache(llm: Any) -> None:
    llm.reset_prefix_cache()


VLLM_OPS = EngineOps(load=_load, generate=_generate, reset_cache=_reset_prefix_cache)


def warm_up(configs: Sequence[Config], prompts: Sequence[list[int]], *, samples: int, max_tokens: int,
            ops: EngineOps = VLLM_OPS) -> None:
    """One unmeasured batch of the rounds' shape (other prompts) per configuration, then an
    empty prefix cache on every engine.

    The first calls of an engine pay one-off costs (allocation, first use of the logprobs and
    sampling paths); without this the first configuration measured would look slow.
    """
    for cfg in configs:
        ops.generate(Config(cfg.name, cfg.llm, "off", cfg.sampling), prompts, samples, max_tokens)
    for llm in {id(c.llm): c.llm for c in configs}.values():
        with contextlib.suppress(Exception):
            ops.reset_cache(llm)


def run_rounds(
    configs: Sequence[Config],
    prompts_by_version: Sequence[Sequence[list[int]]],
    *,
    samples: int,
    max_tokens: int,
    weights: Sequence[Mapping[str, Any]] | None = None,
    tick: Callable[[str], None] | None = None,
    ops: EngineOps = VLLM_OPS,
) -> dict[str, list[Batch]]:
    """Sample every version's prompts with every configuration, loading each version first.

    ``weights[v]``: the (name -> tensor) weights of version ``v`` (``weight_versions``), loaded
    into each configuration's engine before it samples version ``v > 0``; None: loads that
    change nothing. Version 0 is what the engines were built with. Returns, per configuration
    name, one :class:`Batch` per version. ``tick(name)`` runs after each batch (progress). ``ops``: how
    the engines load and sample (:class:`EngineOps`; vLLM's by default).
    """
    if weights is not None and len(weights) < len(prompts_by_version):
        raise ValueError(f"{len(prompts_by_version)} versions of prompts but only {len(weights)} weight versions")
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"configuration names must be unique, got {names}")
    out: dict[str, list[Batch]] = {c.name: [] for c in configs}
    n = len(configs)
    for v, prompts in enumerate(prompts_by_version):
        order = [configs[(v + i) % n] for i in range(n)]  # rotate: interleaved measurements
        for cfg in order:
            update_s = 0.0
            if v > 0:
                update_s = ops.load(cfg.llm, None if weights is None else weights[v], cfg.policy, cfg.version)
            batch = ops.generate(cfg, prompts, samples, max_tokens)
            batch.update_seconds = update_s
            batch.version = v
            out[cfg.name].append(batch)
            if tick is not None:
                tick(cfg.name)
    return out


def throughput_summary(batches: Mapping[str, Sequence[Batch]], baseline: str | None = None) -> dict[str, dict[str, Any]]:
    """Per configuration: median tokens/s over versions, the per-version rates, and (with a
    ``baseline``) the median over versions of ``rate / baseline rate`` of the same version."""
    out: dict[str, dict[str, Any]] = {}
    base = batches.get(baseline) if baseline is not None else None
    for name, bs in batches.items():
        rates = [b.rate for b in bs]
        row: dict[str, Any] = {
            "tokens_per_s": statistics.median(rates) if rates else float("nan"),
            "tokens_per_s_versions": rates,
            "cached_tokens": sum(b.cached_tokens for b in bs),
            "update_seconds": sum(b.update_seconds for b in bs),
        }
        if base is not None:
            ratios = [b.rate / r.rate for b, r in zip(bs, base) if r.rate > 0]
            row["vs_baseline"] = statistics.median(ratios) if ratios else float("nan")
            row["vs_baseline_versions"] = ratios
        out[name] = row
    return out


# ----------------------------------------------------------------------------- trainer side


def padded_logprobs(logprobs: Sequence[Sequence[float]], width: int) -> Any:
    """An engine's per-token logprobs (one list per completion) as a ``(B, width)`` float32 tensor, right-padded
    with zeros: the layout of :class:`TrainerScores`, to subtract from the trainer's."""
    import torch

    out = torch.zeros(len(logprobs), width, dtype=torch.float32)
    for r, lps in enumerate(logprobs):
        out[r, : len(lps)] = torch.tensor(list(lps), dtype=torch.float32)
    return out


@dataclass
class TrainerScores:
    """The trainer's view of rollouts, (B, T) float32 each; ``mask`` marks completion tokens.

    processed: ``sampler_logprobs`` (vLLM's processed distribution: temperature, min-p, top-k,
               top-p renormalised over the kept set; a sampled token the recomputed kept set
               missed gets the boundary rule, ``core/sampler.py``).
    full:      ``log_softmax(z / T)`` over the whole vocabulary (what trainers compute).
    entropy:   entropy in nats of ``softmax(z / T)`` at each position.
    """

    processed: Any
    full: Any
    entropy: Any
    mask: Any
    num_outside: int
    outside: Any = None  # (B, T) bool: where the recomputed kept set missed the sampled token


def trainer_scores(model: Any, prompts: Sequence[list[int]], completions: Sequence[list[int]], *,
                   fp32_head: bool, sampling: Mapping[str, Any], batch_size: int = 32) -> TrainerScores:
    """Score sampled completions with a transformers causal LM, as the trainer recomputes pi_old.

    One forward of the body per ``batch_size`` sequences (right padding, so real tokens never
    attend to pads), the head at the completion positions only, in fp32 with
    ``apply_fp32_lm_head`` when ``fp32_head`` (reverted afterwards), else in the model dtype.
    ``sampling``: the rollout's temperature / top_k / top_p / min_p.
    """
    import torch

    from rollout_parity.core.fp32_head import apply_fp32_lm_head, revert_fp32_lm_head
    from rollout_parity.core.sampler import sampler_logprobs

    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    temperature = float(sampling.get("temperature", 1.0))
    proc = dict(temperature=temperature, top_k=sampling.get("top_k", -1), top_p=sampling.get("top_p", 1.0),
                min_p=sampling.get("min_p", 0.0))
    device = next(model.parameters()).device
    n, t_max = len(completions), max((len(c) for c in completions), default=0)
    out = {k: torch.zeros(n, t_max, dtype=torch.float32) for k in ("processed", "full", "entropy", "mask")}
    out_outside = torch.zeros(n, t_max, dtype=torch.bool)
    outside = 0
    (apply_fp32_lm_head if fp32_head else revert_fp32_lm_head)(model)
    head = model.get_output_embeddings()
    body = getattr(model, "model", None) or model.get_decoder()
    try:
        for start in range(0, n, batch_size):
            idx = range(start, min(n, start + batch_size))
            seqs = [list(prompts[i]) + list(completions[i]) for i in idx]
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            att = torch.zeros(len(seqs), width, dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, : len(s)] = torch.tensor(s)
                att[r, : len(s)] = 1
            with torch.no_grad():
                hidden = body(input_ids=ids.to(device), attention_mask=att.to(device)).last_hidden_state
                rows = torch.zeros(len(seqs), t_max, hidden.shape[-1], dtype=hidden.dtype, device=device)
                tok = torch.zeros(len(seqs), t_max, dtype=torch.long)
                mask = torch.zeros(len(seqs), t_max)
                for r, i in enumerate(idx):
                    p, c = len(prompts[i]), len(completions[i])
                    rows[r, :c] = hidden[r, p - 1 : p - 1 + c]  # position t predicts token t+1
                    tok[r, :c] = torch.tensor(list(completions[i]), dtype=torch.long)
                    mask[r, :c] = 1
                logits = head(rows)
                res = sampler_logprobs(logits, tok.to(device), **proc, response_mask=mask.to(device),
                                       return_outside=True)
                scaled = logits.float() / temperature if temperature >= 1e-5 else logits.float()
                logp = scaled.log_softmax(dim=-1)
                full = logp.gather(-1, tok.to(device).unsqueeze(-1)).squeeze(-1)
                entropy = -(logp.exp() * logp).nan_to_num().sum(-1)
            rows_out = slice(start, start + len(seqs))
            out["processed"][rows_out] = res.logprobs.float().cpu().masked_fill(mask == 0, 0.0)
            out["full"][rows_out] = full.float().cpu() * mask
            out["entropy"][rows_out] = entropy.float().cpu() * mask
            out["mask"][rows_out] = mask
            out_outside[rows_out] = res.outside_mask.cpu()
            outside += res.num_outside
    finally:
        revert_fp32_lm_head(model)
    return TrainerScores(processed=out["processed"], full=out["full"], entropy=out["entropy"], mask=out["mask"],
                         num_outside=outside, outside=out_outside)
