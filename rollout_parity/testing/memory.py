"""Peak memory of a call, as torch's CPU allocator saw it (for tests and benchmarks)."""

from __future__ import annotations

from typing import Callable

from torch.profiler import ProfilerActivity, profile


def peak_alloc_bytes(fn: Callable[[], object]) -> int:
    """Peak of bytes live in torch's CPU allocator during ``fn()``, from the profiler's memory events.

    Unlike RSS or tracemalloc this sees every tensor allocation, temporaries inside kernels
    included, and nothing else.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def peak_extra_bytes(fn: Callable[[], object], device) -> int:
    """Peak bytes allocated by ``fn()`` beyond what was live before it: torch's CUDA allocator statistics on a GPU,
    :func:`peak_alloc_bytes` on CPU."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return peak_alloc_bytes(fn)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base
