"""The frozen shared-batch numbers against the independent naive reference, and their regeneration.

The batch, its configs and the frozen file live in the package
(``rollout_parity/check/shared_batch.py``, ``shared_batch_expected.json``) because
``rollout-parity check`` ships them; the naive reference (``tests/naive_reference.py``) does
not ship, so comparing with it and writing the file happen here. Regenerate the file only on an
intended change of the math: ``python -m integration_tests.shared_batch``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

from rollout_parity.check.shared_batch import (
    EXPECTED_PATH,
    LOSS_KWARGS,
    SharedBatch,
    all_config_names,
    core_reference,
    make_shared_batch,
    raw_flags,
    to_json,
)

__all__ = ["naive_reference", "naive_outputs", "naive_disagreements", "write_expected"]


def naive_reference():
    """``tests/naive_reference.py``, loaded by path: verl installs a top-level ``tests`` package of
    its own, so ``import tests.naive_reference`` could find the wrong one."""
    name = "rollout_parity_tests_naive_reference"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "tests" / "naive_reference.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def naive_outputs(name: str, batch: SharedBatch | None = None) -> dict:
    """The naive reference's weights, keep mask, loss, gradient and metrics for config ``name``."""
    batch = batch or make_shared_batch()
    return naive_reference().naive_everything(
        raw_flags(name), batch.old_logprobs.tolist(), batch.rollout_logprobs.tolist(),
        batch.response_mask.tolist(), batch.advantages.tolist(), batch.current_logprobs.detach().tolist(),
        eps_low=LOSS_KWARGS["clip_ratio"], eps_high=LOSS_KWARGS["clip_ratio"], agg=LOSS_KWARGS["loss_agg_mode"])


def naive_disagreements(name: str, frozen: dict, batch: SharedBatch | None = None) -> list[str]:
    """Where ``frozen`` (one config's outputs, as in the JSON) and the naive reference disagree."""
    naive = naive_outputs(name, batch)
    problems = []

    def close(a, b, rel=1e-5, abs_=1e-6):
        return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)

    for what, ours in (("weights", frozen["weights"]), ("grad", frozen["grad"])):
        theirs = naive[what]
        bad = [(i, t) for i, row in enumerate(ours) for t, v in enumerate(row) if not close(v, theirs[i][t])]
        if bad:
            i, t = bad[0]
            problems.append(f"{what}: {len(bad)} entries differ, first [{i}][{t}] {ours[i][t]} vs naive {theirs[i][t]}")
    if frozen["mask"] != [[float(k) for k in row] for row in naive["keep"]]:
        problems.append("mask differs")
    if not close(frozen["loss"], naive["loss"]):
        problems.append(f"loss {frozen['loss']} vs naive {naive['loss']}")
    if set(frozen["metrics"]) != set(naive["metrics"]):
        problems.append(f"metric names differ: {sorted(set(frozen['metrics']) ^ set(naive['metrics']))}")
    for key in sorted(set(frozen["metrics"]) & set(naive["metrics"])):
        if not close(frozen["metrics"][key], naive["metrics"][key]):
            problems.append(f"{key}: {frozen['metrics'][key]} vs naive {naive['metrics'][key]}")
    return problems


def write_expected() -> None:
    data = {name: to_json(core_reference(name)) for name in all_config_names()}
    problems = {name: naive_disagreements(name, frozen) for name, frozen in data.items()}
    problems = {name: p for name, p in problems.items() if p}
    if problems:
        raise SystemExit(f"not writing {EXPECTED_PATH.name}: the core disagrees with tests/naive_reference.py: "
                         f"{json.dumps(problems, indent=1)}")
    EXPECTED_PATH.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    write_expected()
    print(f"wrote {EXPECTED_PATH}")
