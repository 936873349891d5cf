"""The NeMo RL sources the adapter was run against, and the one place it imports NeMo RL's loss.

NeMo RL is optional: ``nemo_loss_names()`` raises an ImportError naming the extra when it is
missing, and checks the names the adapter reads (``framework_api.check_framework``) when it is there.
"""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

__all__ = ["NEMO_RL_VERSION", "NEMO_RL_COMMIT", "NEMO_RL_TESTED", "TESTED_RANGE", "nemo_loss_names"]

NEMO_RL_VERSION = "0.7.0"
NEMO_RL_COMMIT = "81aa43dda4765b0429cf31dab44441e4e4383911"
#: The NeMo RL sources this adapter was run against (tests import them from the anchors).
NEMO_RL_TESTED = {"v0.7.0": NEMO_RL_COMMIT, "main": "7ea279abfbeb698b092856d0dab61e7cf39bc909"}
# main's package_info still says 0.6.0, so the tested range starts there.
TESTED_RANGE = ">=0.6,<0.8"
DISTRIBUTIONS = ("nemo-rl", "nemo_rl")
_REQUIRED = ("nemo_rl.algorithms.loss.ClippedPGLossFn", "nemo_rl.algorithms.loss.ClippedPGLossConfig",
             "nemo_rl.algorithms.loss.interfaces.LossType")


def _importable() -> bool:
    if "nemo_rl.algorithms.loss.interfaces" in sys.modules:
        return sys.modules["nemo_rl.algorithms.loss.interfaces"] is not None
    try:
        return importlib.util.find_spec("nemo_rl") is not None
    except (ImportError, ValueError):
        return False


def nemo_loss_names() -> SimpleNamespace:
    """NeMo RL's ``ClippedPGLossFn``, ``ClippedPGLossConfig`` and ``MetricNormalizer`` (None
    before NeMo RL main), after the version and private-name check (framework_api.py)."""
    if not _importable():
        raise ImportError(
            "rollout_parity.adapters.nemo_rl needs NeMo RL >= 0.6 (nemo_rl.algorithms.loss): "
            "install NeMo RL, and pip install rollout-parity[nemo-rl]")
    from rollout_parity.framework_api import check_framework

    check_framework("NeMo RL", distributions=DISTRIBUTIONS, tested=TESTED_RANGE, extra="nemo-rl",
                    required=_REQUIRED)
    from nemo_rl.algorithms.loss import interfaces, loss_functions

    return SimpleNamespace(ClippedPGLossFn=loss_functions.ClippedPGLossFn,
                           ClippedPGLossConfig=loss_functions.ClippedPGLossConfig,
                           MetricNormalizer=getattr(interfaces, "MetricNormalizer", None))
