"""The core imports torch only: no training or inference framework, not even transformers (nor Triton: its CUDA
kernels load lazily, on CUDA only). The engines' packages import without their engine: the adapters, the doctor
and vLLM's own processes import them on machines where another engine (or none) is installed."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = ("vllm", "trl", "verl", "nemo_rl", "nemo_gym", "deepspeed", "transformers", "omegaconf", "hydra", "triton")
ENGINES = ("vllm", "sglang", "sgl_kernel")


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


def test_the_engine_packages_import_no_engine():
    code = (
        "import sys, pkgutil, importlib, rollout_parity.engines as engines\n"
        "for m in pkgutil.walk_packages(engines.__path__, 'rollout_parity.engines.'):\n"
        "    importlib.import_module(m.name)\n"
        "assert 'rollout_parity.engines.vllm.recipe' in sys.modules\n"
        f"bad = sorted(k for k in sys.modules if k.split('.')[0] in {ENGINES!r})\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "", f"an engine package pulled in: {result.stdout.strip()}"
