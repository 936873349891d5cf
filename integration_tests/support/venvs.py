"""The venvs that run a component the project's own venv cannot hold (NeMo Gym on Python 3.12, SGLang's CUDA-pinned
wheel): each built once by its script under scripts/, stamped, and found by its Python."""

from __future__ import annotations

import subprocess
from pathlib import Path

from rollout_parity.testing.stack import missing

REPO = Path(__file__).resolve().parents[2]


def venv_python(script: str, what: str) -> str:
    """The Python of the venv ``scripts/<script>`` builds on first use (it prints it last); a venv that cannot be
    built is ``missing`` (a skip here, a failure where the stack is required), naming ``what`` and the reason."""
    path = REPO / "scripts" / script
    proc = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        missing(what, f"{path} exited {proc.returncode}: {proc.stderr.strip()[-1500:]}")
    return proc.stdout.strip().splitlines()[-1]
