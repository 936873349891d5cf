"""GPU kernels the core uses where a device runs them; the core falls back to plain torch where it cannot.

Imported lazily by the core (which itself imports torch only): nothing here loads unless a pass runs on CUDA with
Triton installed (every CUDA build of torch ships it).
"""
