"""Servers and ranks the tests start as subprocesses: a free local port, and a sure stop."""

from __future__ import annotations

import socket
import subprocess

__all__ = ["free_port", "stop"]


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
