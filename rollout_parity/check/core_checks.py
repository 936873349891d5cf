"""The core on the shared batch against the packaged frozen numbers (torch only, always runs).

The frozen numbers were checked against an independent per-token reference when they were
written; here the installed core (this torch, this CPU or GPU build) must reproduce them:
weights and mask, loss and gradient, every metric, for every preset and extra config.
"""

from __future__ import annotations

from typing import Any, Callable

from rollout_parity.check.report import Check, FrameworkReport, corrupt
from rollout_parity.check.shared_batch import all_config_names, core_reference, load_expected

__all__ = ["CORE_CHECKS", "run_core_checks", "run"]

#: name -> what it compares (the table's description); all but core/metrics take the self-test knob.
CORE_CHECKS = {
    "core/weights": "weights & mask vs packaged numbers",
    "core/loss": "loss & gradient vs packaged numbers",
    "core/metrics": "every metric vs packaged numbers",
}


def run_core_checks(report: FrameworkReport, tick=lambda: None) -> None:
    weights = Check("core/weights", CORE_CHECKS["core/weights"])
    loss = Check("core/loss", CORE_CHECKS["core/loss"])
    metrics = Check("core/metrics", CORE_CHECKS["core/metrics"], tolerance=1e-5)
    expected_all = load_expected()
    def tamper(out):  # the self-test knob, on the weights the loss reads
        out.weights = corrupt("core/loss", out.weights, out.mask)

    for name in all_config_names():
        ref, expected = core_reference(name, tamper=tamper), expected_all[name]
        weights.close(name, "weights", corrupt("core/weights", ref["weights"], ref["mask"]),
                      expected["weights"])
        weights.close(name, "mask", ref["mask"], expected["mask"], atol=0.0)
        loss.close(name, "loss", ref["loss"], expected["loss"])
        loss.close(name, "gradient", ref["grad"], expected["grad"])
        metrics.expect(name, set(ref["metrics"]) == set(expected["metrics"]),
                       f"metric names differ: {sorted(set(ref['metrics']) ^ set(expected['metrics']))}")
        for key, value in expected["metrics"].items():
            if key in ref["metrics"]:
                metrics.close(name, key, ref["metrics"][key], value, atol=1e-6, rtol=1e-5)
        tick()
    report.checks += [weights.result(), loss.result(), metrics.result()]


def run(report: FrameworkReport, opts: Any, tick: Callable[[], None]) -> None:
    """``rollout-parity check``'s entry (``check/runner.py``): the core's checks."""
    run_core_checks(report, tick)
