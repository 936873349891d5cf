"""Import a file that is not in a package (``scripts/``, ``benchmarks/``) for a test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str) -> ModuleType:
    """``path`` executed afresh as module ``name``, registered in ``sys.modules`` (dataclasses look their module
    up there; a later call replaces it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
