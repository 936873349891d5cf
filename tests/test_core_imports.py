"""The core imports torch only: no training or inference framework, not even transformers (nor Triton: its CUDA
kernels load lazily, on CUDA only). The engines' packages import without their engine: the adapters, the doctor
and vLLM's own processes import them on machines where another engine (or none) is installed."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = ("vllm", "trl", "verl", "nemo_rl", "nemo_gym", "deepspeed", "transformers", "omegaconf", "hydra", "triton")
ENGINES = ("vllm", "sglang", "sgl_kernel")


def _pulled_in(imports: str, tops: tuple[str, ...]) -> str:
    """Run ``imports`` in a fresh interpreter; the imported modules whose top-level package is in ``tops``."""
    code = imports + f"\nimport sys\nprint(','.join(sorted(k for k in sys.modules if k.split('.')[0] in {tops!r})))\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_core_imports_no_framework():
    pulled = _pulled_in(
        "import pkgutil, importlib, rollout_parity, rollout_parity.core as core\n"
        "for m in pkgutil.iter_modules(core.__path__):\n"
        "    importlib.import_module('rollout_parity.core.' + m.name)\n"
        "for name in rollout_parity.__all__:\n"
        "    getattr(rollout_parity, name)", FRAMEWORKS)
    assert pulled == "", f"core pulled in: {pulled}"


def test_the_engine_packages_import_no_engine():
    pulled = _pulled_in(
        "import sys, pkgutil, importlib, rollout_parity.engines as engines\n"
        "for m in pkgutil.walk_packages(engines.__path__, 'rollout_parity.engines.'):\n"
        "    importlib.import_module(m.name)\n"
        "assert 'rollout_parity.engines.vllm.recipe' in sys.modules", ENGINES)
    assert pulled == "", f"an engine package pulled in: {pulled}"
