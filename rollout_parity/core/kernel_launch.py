"""Launching the package's Triton kernels, with the torch path as the fallback when a launch fails.

The CUDA branches of :func:`~rollout_parity.core.fp32_logprobs.chunked_fp32_logprobs` and
:func:`~rollout_parity.core.sampler.sampler_logprobs_from_hidden` run Triton kernels
(:mod:`rollout_parity.kernels`). A kernel is compiled at its first launch on the user's machine, and that launch can
fail where an import did not: Triton builds its launcher with the host C compiler ("Failed to find C compiler"),
``ptxas`` or the driver can refuse the binary, a variant can exceed the device's shared memory or registers
(``OutOfResources``). Each of those is the machine's, not the data's, so the pass answers with its torch path (the
same values to float rounding, slower) instead of ending a training run: :func:`launch` catches the failure, warns
once with its cause (:class:`KernelFallbackWarning`), and every later call in the process skips that
``(device, variant)``. Errors the kernels' own wrappers raise about their arguments (``ValueError``) are the caller's
and propagate.

A ROCm build of torch reports its GPUs as ``cuda``; the kernels were written and compiled for NVIDIA's backend only,
so :func:`kernels_allowed` keeps HIP devices on the torch path.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

__all__ = ["KernelFallbackWarning", "failed_launches", "kernels_allowed", "launch", "reset_failed_launches"]


class KernelFallbackWarning(RuntimeWarning):
    """A Triton kernel failed to launch; the torch path computes its part from now on in this process."""


_failed: dict[tuple[str, str], str] = {}


def kernels_allowed(device: torch.device) -> bool:
    """Whether the Triton kernels may run for tensors on ``device``: a CUDA device of an NVIDIA build of torch."""
    return device.type == "cuda" and getattr(torch.version, "hip", None) is None


def launch(variant: str, device: torch.device, kernel: Callable[..., None], *args, **kwargs) -> bool:
    """Run ``kernel(*args, **kwargs)`` (a launch of the kernel variant named ``variant``, as
    ``scripts/compile_kernels.py`` names them); True if it ran. False, without running it, when the variant already
    failed on ``device`` in this process; False after a failure now, with one :class:`KernelFallbackWarning` naming
    the variant, the device and the cause. The caller then computes the same values with torch."""
    key = (str(device), variant)
    if key in _failed:
        return False
    try:
        kernel(*args, **kwargs)
    except ValueError:
        raise  # the wrapper's own check of its arguments: the caller's error, not the machine's
    except Exception as e:  # noqa: BLE001 - any launch failure (compiler, driver, resources) falls back by name
        cause = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
        _failed[key] = cause
        warnings.warn(f"rollout-parity: the Triton kernel {variant} failed to launch on {device} ({cause}); this "
                      "process computes it with torch from now on (the same values to float rounding, slower). "
                      "scripts/compile_kernels.py names what Triton cannot compile here.",
                      KernelFallbackWarning, stacklevel=3)
        return False
    return True


def failed_launches() -> dict[tuple[str, str], str]:
    """``{(device, variant): cause}`` of the launches that failed in this process."""
    return dict(_failed)


def reset_failed_launches() -> None:
    """Forget the failed launches (a test, or a process that fixed its compiler): the next call tries again."""
    _failed.clear()
