"""What every rollout engine's side of the seam shares: the prefix-cache policies and the errors.

An engine package (``engines/vllm``) holds all that is specific to one engine: its recipe of settings, the
table of which release has what, the live-engine checks, weight updates, and how its outputs carry kept sets
and routed experts. What the adapters and the doctor say about any engine is here, so that an error raised
in one engine's code is caught by the same class whichever engine ran.

Imports the standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

__all__ = ["PREFIX_CACHE_POLICIES", "EngineFeature", "EngineFeatureMissingError", "EngineParityError",
           "feature_holds", "missing_feature_message", "normalize_prefix_cache_policy"]

#: How the prefix cache is treated across in-flight weight updates (``engines/vllm/weight_update.py``).
#: ``off``: no prefix cache (the recipe). ``reset``: cache on, reset after each weight load
#: (vllm#9744); requests in flight recompute under the new weights. ``salt``: cache on, every
#: request carries ``cache_salt`` = its weight version; requests in flight keep their own KV.
PREFIX_CACHE_POLICIES = ("off", "reset", "salt")


@dataclass(frozen=True)
class EngineFeature:
    """One capability of an engine: its first release, what it does, and our options that need it (one row of an
    engine's release table, ``engines/<engine>/features.py``)."""

    name: str
    since: str
    what: str
    flags: tuple[str, ...] = ()


class EngineFeatureMissingError(RuntimeError):
    """The installed engine lacks a setting or capability that an option needs (raised before anything loads)."""


def feature_holds(engine: str, features: Mapping[str, EngineFeature], feature: str, version: Optional[str],
                  parse: Callable[[str], tuple]) -> bool:
    """Whether ``engine`` release ``version`` has ``feature`` of its table ``features`` (``parse``: the engine's
    version order). ``version=None`` (no engine here: settings for one elsewhere) assumes a current release."""
    if feature not in features:
        raise KeyError(f"unknown {engine} feature {feature!r}; known: {sorted(features)}")
    return version is None or parse(version) >= parse(features[feature].since)


def missing_feature_message(engine: str, feature: EngineFeature, version: Optional[str], option: str) -> str:
    """The one-line refusal: the option, what it needs, the release that has it, and the two ways out."""
    return (f"{option} needs {feature.what}, which {engine} {version} lacks: it is in {engine} >= {feature.since}. "
            f"Upgrade {engine} to {feature.since} or later, or turn {option} off")


class EngineParityError(RuntimeError):
    """``verify_engine(strict=True)`` found settings that break parity."""


def normalize_prefix_cache_policy(policy: Any) -> str:
    """``off`` / ``reset`` / ``salt``. YAML's bare ``off`` loads as False: that means ``off``."""
    if policy is None or policy is False:
        return "off"
    if not isinstance(policy, str) or policy.lower() not in PREFIX_CACHE_POLICIES:
        raise ValueError(
            f"prefix_cache_policy must be one of {PREFIX_CACHE_POLICIES}, got {policy!r}"
        )
    return policy.lower()
