"""Bounds between two engines or runs, recorded so that their spread can be measured.

A bound that compares two engines (vLLM and a trainer, two vLLM engines, a run and a rerun) holds only as far
as their noise allows: the sampled tokens move with the seed, kernels with the thread count, a module-shared
engine or trainer with the tests that ran before. Each such bound is written as
``assert bound(name, value, op, limit)``, which checks it as the plain comparison would; when
``ROLLOUT_PARITY_SPREAD_LOG`` names a file it appends one JSON line per check instead (test, name, value, op,
limit, held, seed, threads) and lets the test go on. ``scripts/measure_spread.py`` runs chosen tests under
several seeds, thread counts and test orders with that log on, and prints each bound's spread and margin: the
numbers written beside the bounds come from it.

:func:`seed` is the seed the measuring script varies (``ROLLOUT_PARITY_SEED``; 0, the suite's value,
when unset). Engines built by ``vllm_cpu_shim.make_llm`` take it as their sampling seed; tests that seed
their requests themselves derive those seeds from it. The suite never sets it: a suite run is seed 0.
"""

from __future__ import annotations

import json
import math
import operator
import os
from typing import Any

__all__ = ["bound", "seed", "LOG_ENV", "SEED_ENV"]

LOG_ENV = "ROLLOUT_PARITY_SPREAD_LOG"
SEED_ENV = "ROLLOUT_PARITY_SEED"
_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}


def seed(default: int = 0) -> int:
    """The run's seed: ``ROLLOUT_PARITY_SEED`` when set (by ``scripts/measure_spread.py``), else ``default``."""
    text = os.environ.get(SEED_ENV, "").strip()
    return int(text) if text else default


def bound(name: str, value: Any, op: str, limit: float) -> bool:
    """``value op limit`` (a float or a one-element tensor), recorded for the spread log when it is on.

    ``name`` says what is measured; it is unique within a test (a test checking one bound per case puts the
    case in the name). With the log on (a measuring run) it records whether the bound held and returns True,
    so that one bound past its limit does not hide the values of the bounds after it in the same test.
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    x = float(value.item() if hasattr(value, "item") else value)
    held = _OPS[op](x, limit)
    path = os.environ.get(LOG_ENV)
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        record = {"test": test, "name": name, "value": x if math.isfinite(x) else str(x), "op": op, "limit": limit,
                  "held": held, "seed": seed(), "threads": _threads()}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return True
    return held


def _threads() -> int:
    try:
        import torch

        return torch.get_num_threads()
    except ImportError:  # pragma: no cover - torch is always there in this suite
        return -1
