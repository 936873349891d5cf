"""A pytest plugin (``-p integration_tests.support.verl_own_plugin``) that puts rollout-parity's adapter in place of
verl's own rollout correction, for running verl's OWN tests of it unmodified
(``integration_tests/test_verl_own_correction_tests.py``).

Loaded before pytest collects anything, it replaces the entry points verl's tests import from
``verl.trainer.ppo.rollout_corr_helper`` (their ``from ... import`` then binds ours) with the adapter's
``rollout_parity.adapters.verl.verl_keys`` functions, which answer verl's keys with the core:

* ``compute_rollout_correction_and_rejection_mask`` (also what verl's ``compute_rollout_correction_and_add_to_batch``
  and its ``bypass_mode`` loss call, looked up at call time);
* ``compute_offpolicy_metrics`` and ``compute_is_metrics``;
* ``compute_rollout_correction_weights`` and ``compute_rollout_rejection_mask`` (none of verl's two files calls
  them directly today; replaced so that a test of them added there runs against ours too).

verl's ``compute_rollout_correction_and_add_to_batch`` keeps its body: it calls the first one through the module.
Each call runs verl's own function beside ours on a copy of the same inputs and records where they differ
(weights to 1e-5, the mask exactly, every metric verl returns present in ours and equal to 1e-5, the same
exception type where verl refuses); ours is what the test sees. With ``VERL_OWN_CALLS=<path>`` the calls each
replacement answered and the differences are written there as JSON at the end of the session.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import math
import os

import torch

from verl.trainer.ppo import rollout_corr_helper as helper

from rollout_parity.adapters.verl import verl_keys

#: verl's name -> the adapter's answer.
REPLACED = {
    "compute_rollout_correction_and_rejection_mask": verl_keys.rollout_correction_and_rejection_mask,
    "compute_offpolicy_metrics": verl_keys.offpolicy_metrics,
    "compute_is_metrics": verl_keys.is_metrics,
    "compute_rollout_correction_weights": verl_keys.rollout_correction_weights,
    "compute_rollout_rejection_mask": verl_keys.rollout_rejection_mask,
}
#: verl's own functions, run beside ours on the same inputs.
ORIGINAL = {name: getattr(helper, name) for name in REPLACED}  # a verl without a name fails here, loudly
CALLS: collections.Counter = collections.Counter()
#: Every way ours differed from verl's on the same call: (function, what).
DIFFERENCES: list[tuple[str, str]] = []
RTOL = ATOL = 1e-5


def _clone(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL) or (math.isnan(a) and math.isnan(b))


def _compare(name: str, ours, theirs) -> None:
    """What verl's own call returned must be in ours, equal: weights and mask, and every metric verl logs."""
    def tensor(what, a, b, exact):
        if a is None or b is None:
            if (a is None) != (b is None):
                DIFFERENCES.append((name, f"{what}: ours {a is not None}, verl's {b is not None}"))
            return
        a = a.batch["rollout_is_weights"] if hasattr(a, "batch") else a
        b = b.batch["rollout_is_weights"] if hasattr(b, "batch") else b
        if a.shape != b.shape or not torch.allclose(a.double(), b.double(), rtol=0 if exact else RTOL,
                                                    atol=0 if exact else ATOL):
            DIFFERENCES.append((name, f"{what} differs"))

    if isinstance(theirs, tuple) and len(theirs) == 3:  # (weights, mask, metrics)
        tensor("rollout_is_weights", ours[0], theirs[0], exact=False)
        tensor("response_mask", ours[1], theirs[1], exact=True)
        ours, theirs = ours[2], theirs[2]
    elif isinstance(theirs, tuple):  # (weights or mask, metrics)
        exact = name == "compute_rollout_rejection_mask"
        tensor("response_mask" if exact else "rollout_is_weights", ours[0], theirs[0], exact=exact)
        ours, theirs = ours[1], theirs[1]
    for key, value in theirs.items():
        value = float(value)
        if key not in ours:
            DIFFERENCES.append((name, f"metric {key} missing"))
        elif not _close(float(ours[key]), value):
            DIFFERENCES.append((name, f"metric {key}: ours {float(ours[key])!r}, verl's {value!r}"))


@contextlib.contextmanager
def _verl_own():
    """verl's own functions back in its module while verl's run: its helpers call each other through the module."""
    ours = {name: getattr(helper, name) for name in ORIGINAL}
    for name, fn in ORIGINAL.items():
        setattr(helper, name, fn)
    try:
        yield
    finally:
        for name, fn in ours.items():
            setattr(helper, name, fn)


def _beside(name, ours_fn, theirs_fn):
    @functools.wraps(theirs_fn)
    def call(*args, **kwargs):
        CALLS[name] += 1
        try:
            with _verl_own():
                theirs = theirs_fn(*[_clone(a) for a in args], **{k: _clone(v) for k, v in kwargs.items()})
        except Exception as exc:  # noqa: BLE001 - verl refused: ours must refuse with the same exception type
            try:
                ours_fn(*args, **kwargs)
            except type(exc):
                raise
            except Exception as mine:  # noqa: BLE001
                DIFFERENCES.append((name, f"verl raised {type(exc).__name__}, ours {type(mine).__name__}"))
                raise
            DIFFERENCES.append((name, f"verl raised {type(exc).__name__}: {exc}; ours returned"))
            raise
        ours = ours_fn(*args, **kwargs)
        _compare(name, ours, theirs)
        return ours

    return call


for _name, _ours in REPLACED.items():
    setattr(helper, _name, _beside(_name, _ours, ORIGINAL[_name]))


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001 - pytest's hook signature
    path = os.environ.get("VERL_OWN_CALLS")
    if path:
        with open(path, "w") as f:
            json.dump({"calls": dict(CALLS), "differences": sorted(set(DIFFERENCES))}, f, indent=1)
