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
