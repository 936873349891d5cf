"""Chunked fp32-head logprobs: peak extra memory and time over the unavoidable matmuls.

    python benchmarks/fp32_logprobs.py [--device cpu|cuda] [--n 8192 --hidden 1024 --vocab 32768]

Inputs are fp32 hidden (N, H), weight (V, H), token ids (N,).  Printed:

(a) peak extra memory of ``chunked_fp32_logprobs`` in units of one chunk of logits
    (chunk_size x V x 4 bytes).  On CPU measured as the peak of bytes live in torch's CPU
    allocator during the call, from the allocator's own alloc/free events (``torch.profiler``
    with ``profile_memory=True``: every tensor torch allocates, including temporaries inside
    kernels; not BLAS-internal scratch); on a GPU from torch's CUDA allocator statistics.
    Outputs every path must produce are subtracted: the (N,) logprobs forward; plus the
    gradients (N x H and V x H) forward+backward.
(b) time over the floor: forward floor = one N x H x V product, forward+backward floor =
    three (logits, grad wrt hidden, grad wrt weight).  The floor is timed as the bare
    matmuls, both chunked into a reused buffer and as single full products; the faster one
    counts (the stricter ratio).
(c) the naive path: full N x V fp32 logits, log_softmax, gather (and autograd's backward).

Times are the minimum over ``--repeats`` interleaved runs.  The ratios of the RESULT line use
process CPU time by default (``--clock cpu``): on a machine shared with other jobs wall time
mostly measures the neighbours, while CPU time counts the work done by this process's
threads (it includes OpenMP spin-waits between small ops, which penalises the chunked path,
not the floor).  Wall-time ratios are printed alongside.  On a GPU both clocks are wall time
between synchronisations.  Every matmul, the floor's included, runs in exact fp32 (no TF32).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from rollout_parity.core.fp32_logprobs import chunked_fp32_logprobs
from rollout_parity.core.head_matmul import exact_fp32_matmul
from rollout_parity.testing.memory import peak_extra_bytes

MiB = 1024 * 1024


def mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--clock", choices=["cpu", "wall"], default="cpu",
        help="clock of the RESULT ratios: process CPU time (default; robust when other jobs "
        "share the cores) or wall time",
    )
    args = ap.parse_args(argv)

    n, H, V, c = args.n, args.hidden, args.vocab, args.chunk
    device = torch.device(args.device)
    available = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else mem_available_bytes()
    # The naive forward+backward holds about four N x V fp32 tensors; leave half the memory.
    note = ""
    while 4 * n * V * 4 + 4 * (n * H + V * H) * 4 > available // 2 and n > c:
        n //= 2
        note = f" (N reduced from {args.n} to {n}: the naive path would not fit in memory)"
    print(f"fp32 logprobs benchmark: device={device} N={n} H={H} V={V} chunk={c} "
          f"threads={torch.get_num_threads()}{note}")
    g = torch.Generator().manual_seed(args.seed)
    hidden = (torch.randn(n, H, generator=g) / H**0.5).to(device).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 2).to(device).requires_grad_()
    ids = torch.randint(0, V, (n,), generator=g).to(device)
    chunk_bytes = c * V * 4
    grads_bytes = (n * H + V * H) * 4

    def clear():
        hidden.grad = weight.grad = None

    def chunked_fwd():
        with torch.no_grad():
            return chunked_fp32_logprobs(hidden, weight, ids, chunk_size=c)

    def chunked_fwdbwd():
        chunked_fp32_logprobs(hidden, weight, ids, chunk_size=c).sum().backward()

    def chunked_fwdbwd_entropy():
        lp, ent = chunked_fp32_logprobs(hidden, weight, ids, chunk_size=c, return_entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()

    def naive_fwd():
        with torch.no_grad():
            z = hidden @ weight.t()
            return torch.log_softmax(z, -1).gather(-1, ids[:, None]).squeeze(-1)

    def naive_fwdbwd():
        z = hidden @ weight.t()
        torch.log_softmax(z, -1).gather(-1, ids[:, None]).sum().backward()

    hd, wd = hidden.detach(), weight.detach()
    buf = torch.empty(c, V, device=device)
    gh = torch.empty(n, H, device=device)
    gw = torch.empty(V, H, device=device)

    def floor_fwd_chunked():
        with exact_fp32_matmul():
            for s in range(0, n, c):
                torch.mm(hd[s : s + c], wd.t(), out=buf[: min(c, n - s)])

    def floor_fwd_full():
        with exact_fp32_matmul():
            torch.mm(hd, wd.t())

    def floor_fwdbwd_chunked():
        with exact_fp32_matmul():
            gw.zero_()
            for s in range(0, n, c):
                z = torch.mm(hd[s : s + c], wd.t(), out=buf[: min(c, n - s)])
                torch.mm(z, wd, out=gh[s : s + c])
                gw.addmm_(z.t(), hd[s : s + c])

    def floor_fwdbwd_full():
        with exact_fp32_matmul():
            z = torch.mm(hd, wd.t())
            torch.mm(z, wd, out=gh)
            torch.mm(z.t(), hd, out=gw)

    # Correctness of what is timed: the chunked result equals the naive one.
    lp_c, lp_n = chunked_fwd(), naive_fwd()
    max_err = (lp_c - lp_n).abs().max().item()

    # (a) memory; gradients are cleared before each measured call (outside the profile), so
    # freeing the previous ones cannot hide part of the peak.
    def peak_chunks(fn, outputs_bytes):
        clear()
        return (peak_extra_bytes(fn, device) - outputs_bytes) / chunk_bytes

    mem = {
        "chunked fwd": peak_chunks(chunked_fwd, n * 4),
        "chunked fwd+bwd": peak_chunks(chunked_fwdbwd, grads_bytes + n * 4),
        "chunked fwd+bwd +entropy": peak_chunks(chunked_fwdbwd_entropy, grads_bytes + 2 * n * 4),
        "naive fwd": peak_chunks(naive_fwd, n * 4),
        "naive fwd+bwd": peak_chunks(naive_fwdbwd, grads_bytes + n * 4),
    }

    # (b), (c) time: interleaved repeats, minimum of each
    timed = {
        "floor fwd (chunked mm)": floor_fwd_chunked,
        "floor fwd (one mm)": floor_fwd_full,
        "chunked fwd": chunked_fwd,
        "naive fwd": naive_fwd,
        "floor fwd+bwd (chunked 3 mm)": floor_fwdbwd_chunked,
        "floor fwd+bwd (3 full mm)": floor_fwdbwd_full,
        "chunked fwd+bwd": chunked_fwdbwd,
        "chunked fwd+bwd +entropy": chunked_fwdbwd_entropy,
        "naive fwd+bwd": naive_fwdbwd,
    }
    wall = {k: float("inf") for k in timed}
    cpu = {k: float("inf") for k in timed}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for r in range(args.repeats):
        for name, fn in timed.items():
            clear()
            sync()
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()
            cpu[name] = min(cpu[name], time.process_time() - c0)
            wall[name] = min(wall[name], time.perf_counter() - w0)
    if device.type == "cuda":
        cpu = wall  # a GPU's work is not this process's CPU time
        print(f"  repeat {r + 1}/{args.repeats} done", file=sys.stderr)
    clear()
    best = cpu if args.clock == "cpu" else wall
    other = wall if args.clock == "cpu" else cpu
    floor_f = min(best["floor fwd (chunked mm)"], best["floor fwd (one mm)"])
    floor_fb = min(best["floor fwd+bwd (chunked 3 mm)"], best["floor fwd+bwd (3 full mm)"])
    ofloor_f = min(other["floor fwd (chunked mm)"], other["floor fwd (one mm)"])
    ofloor_fb = min(other["floor fwd+bwd (chunked 3 mm)"], other["floor fwd+bwd (3 full mm)"])

    print(f"one chunk of logits = {c} x {V} x 4 B = {chunk_bytes / MiB:.0f} MiB; "
          f"full logits = {n * V * 4 / MiB:.0f} MiB = {n / c:.0f} chunks; "
          f"max |chunked - naive| logprob = {max_err:.2e}")
    oc = "wall" if args.clock == "cpu" else "cpu"
    print(f"{'path':<30} {args.clock + ' s':>8} {'vs floor':>9} {oc + ' s':>8} {'vs floor':>9} "
          f"{'extra mem (chunks)':>19}")
    rows = [
        ("floor fwd (chunked mm)", floor_f, None),
        ("floor fwd (one mm)", floor_f, None),
        ("chunked fwd", floor_f, "chunked fwd"),
        ("naive fwd", floor_f, "naive fwd"),
        ("floor fwd+bwd (chunked 3 mm)", floor_fb, None),
        ("floor fwd+bwd (3 full mm)", floor_fb, None),
        ("chunked fwd+bwd", floor_fb, "chunked fwd+bwd"),
        ("chunked fwd+bwd +entropy", floor_fb, "chunked fwd+bwd +entropy"),
        ("naive fwd+bwd", floor_fb, "naive fwd+bwd"),
    ]
    for name, floor, mkey in rows:
        m = f"{mem[mkey]:.2f}" if mkey else "-"
        ofloor = ofloor_f if floor == floor_f else ofloor_fb
        print(f"{name:<30} {best[name]:>8.2f} {best[name] / floor:>8.2f}x "
              f"{other[name]:>8.2f} {other[name] / ofloor:>8.2f}x {m:>19}")
    mem_chunks = max(mem["chunked fwd"], mem["chunked fwd+bwd"])
    fwd_ratio = best["chunked fwd"] / floor_f
    fb_ratio = best["chunked fwd+bwd"] / floor_fb
    ok = mem_chunks <= 1.5 and fwd_ratio <= 1.25 and fb_ratio <= 1.5
    print(f"targets: mem <= 1.5 chunks, fwd <= 1.25x, fwd+bwd <= 1.5x: {'met' if ok else 'NOT met'}")
    print(
        f"RESULT mem_chunks={mem_chunks:.3f} fwd_vs_floor={fwd_ratio:.3f} "
        f"fwdbwd_vs_floor={fb_ratio:.3f} clock={args.clock} naive_fwd_vs_floor={best['naive fwd'] / floor_f:.3f} "
        f"naive_fwdbwd_vs_floor={best['naive fwd+bwd'] / floor_fb:.3f} "
        f"naive_mem_chunks={mem['naive fwd+bwd']:.3f} device={device.type} n={n} hidden={H} vocab={V} chunk={c}"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    sys.exit(main())
