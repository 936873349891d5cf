"""The core imports torch only: no training or inference framework, not even transformers (nor Triton: its CUDA
kernels load lazily, on CUDA only)."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = ("vllm", "trl", "verl", "nemo_rl", "nemo_gym", "deepspeed", "transformers", "omegaconf", "hydra", "triton")


def test_core_imports_no_framework():
    code = (
        "import sys, pkgutil, importlib, rollout_parity, rollout_parity.core as core\n"
        "for m in pkgutil.iter_modules(core.__path__):\n"
        "    importlib.import_module('rollout_parity.core.' + m.name)\n"
        "for name in rollout_parity.__all__:\n"
        "    getattr(rollout_parity, name)\n"
        f"bad = sorted(k for k in sys.modules if k.split('.')[0] in {FRAMEWORKS!r})\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "", f"core pulled in: {result.stdout.strip()}"
