"""Where a head pass's time goes on a GPU: each pass timed, the plain pass's steps timed one by one, and
torch.profiler's kernel table of the plain, top-p and top-k + top-p passes.

    python scripts/gpu_head_pass_profile.py                       # on a GPU: N = 8,192, H = 4,096, V = 151,936, bf16
    python scripts/gpu_head_pass_profile.py --device cpu --small  # the same code end to end (no bf16 GEMM on CPU)

The inputs are ``benchmarks/sampler_pass.py``'s LM-shaped logits; the chunk is the one the passes choose. The
steps of the plain pass are the bf16 GEMM with fp32 output alone, then with the division by the temperature (a
(rows, 1) tensor, as vLLM divides), then with torch's in-place log-softmax (what the pass runs), and two
alternatives (logsumexp with and without the division). ``TIME name ms`` lines (minimum of 5 runs, synchronised);
a step the device cannot run prints ``ERROR name ...`` (CPU torch has no ``mm(..., out_dtype=)``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from rollout_parity.core.fp32_logprobs import chunked_fp32_logprobs  # noqa: E402
from rollout_parity.core.head_matmul import chunk_rows, exact_fp32_matmul  # noqa: E402
from rollout_parity.core.sampler import sampler_logprobs_from_hidden  # noqa: E402
from sampler_pass import lm_like  # noqa: E402


def timeit(fn, sync, n: int = 5) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="N=512, H=256, V=8192")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    n, hidden, vocab, temp = (512, 256, 8192, 0.7) if args.small else (8192, 4096, 151936, 0.7)
    g = torch.Generator().manual_seed(0)
    h, w = lm_like(n, hidden, vocab, dict(flat=0.005, open=0.08, few=0.30), g)
    h, w = h.to(dev, torch.bfloat16), w.to(dev, torch.bfloat16)
    ids = torch.randint(0, vocab, (n,), generator=g).to(dev)
    rows = chunk_rows(n, vocab, dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"head pass profile: {name}, torch {torch.__version__}, N={n} H={hidden} V={vocab} T={temp} bf16, "
          f"chunk {rows}", flush=True)
    passes = {
        "plain": lambda: chunked_fp32_logprobs(h, w, ids, temperature=temp),
        "top_p": lambda: sampler_logprobs_from_hidden(h, w, ids, temp, top_p=0.9),
        "top_k50_top_p": lambda: sampler_logprobs_from_hidden(h, w, ids, temp, top_k=50, top_p=0.9),
        "min_p": lambda: sampler_logprobs_from_hidden(h, w, ids, temp, min_p=0.05),
    }
    buf = torch.empty(rows, vocab, device=dev)
    tcol = torch.full((rows, 1), temp, device=dev)

    def steps(div: bool, tail):
        def run():
            with exact_fp32_matmul():
                for s in range(0, n, rows):
                    o = buf[: min(rows, n - s)]
                    torch.mm(h[s:s + rows], w.t(), out_dtype=torch.float32, out=o)
                    if div:
                        o.div_(tcol[: o.shape[0]])
                    if tail is not None:
                        tail(o)
        return run

    variants = {
        "gemm_only": steps(False, None),
        "gemm_div": steps(True, None),
        "gemm_div_logsoftmax_inplace": steps(True, lambda o: torch.ops.aten._log_softmax.out(o, 1, False, out=o)),
        "gemm_div_logsumexp": steps(True, lambda o: torch.logsumexp(o, 1)),
        "gemm_logsumexp_nodiv": steps(False, lambda o: torch.logsumexp(o, 1)),
    }
    with torch.no_grad():
        for label, fn in {**passes, **variants}.items():
            try:
                print(f"TIME {label} {timeit(fn, sync):.2f} ms", flush=True)
            except (RuntimeError, TypeError) as err:
                print(f"ERROR {label} {str(err).splitlines()[0][:200]}", flush=True)
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        sort = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
        for label in ("plain", "top_p", "top_k50_top_p"):
            with profile(activities=activities) as prof:
                passes[label]()
                sync()
            print(f"\n=== PROFILE {label}")
            print(prof.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
