"""Test support observer (not a shim): records what verl's own GRPO step computed, unchanged.

With ``ROLLOUT_PARITY_TEST_ADVANTAGE_LOG=<file>`` in the environment, the V1 trainer's
``compute_advantage_for_multi_trajectories`` (looked up by name in
``verl.trainer.ppo.v1.trainer_base``) is wrapped so that, after verl computed the advantages,
one JSON line per batch records its inputs and outputs: ``uid`` (as our driver hook left it),
the unmasked scores (``token_level_scores``), the rewards verl summed (``token_level_rewards``),
the corrected ``response_mask`` and verl's ``advantages``. The test then recomputes GRPO
independently and checks which rows verl's baselines used. Loaded through
``VERL_USE_EXTERNAL_MODULES`` like the shims; it changes nothing verl returns.
"""

from __future__ import annotations

import functools
import json
import os
import sys

from . import _AfterImport

ENV = "ROLLOUT_PARITY_TEST_ADVANTAGE_LOG"
TARGET = "verl.trainer.ppo.v1.trainer_base"
NAME = "compute_advantage_for_multi_trajectories"


def _wrap(module) -> None:
    original = getattr(module, NAME)
    if getattr(original, "__advantage_log__", False):
        return
    path = os.environ[ENV]

    @functools.wraps(original)
    def observed(data, *args, **kwargs):
        out = original(data, *args, **kwargs)
        batch = out.batch
        record = {
            "uid": [str(u) for u in out.non_tensor_batch["uid"]],
            "scores": batch["token_level_scores"].sum(-1).tolist(),
            "rewards": batch["token_level_rewards"].sum(-1).tolist(),
            "mask": batch["response_mask"].tolist(),
            "advantages": batch["advantages"].tolist(),
            "norm_adv_by_std_in_grpo": kwargs.get("norm_adv_by_std_in_grpo", True),
        }
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return out

    observed.__advantage_log__ = True
    setattr(module, NAME, observed)


def install() -> None:
    if not os.environ.get(ENV):
        return
    if TARGET in sys.modules:
        _wrap(sys.modules[TARGET])
    else:
        sys.meta_path.insert(0, _AfterImport(TARGET, lambda: _wrap(sys.modules[TARGET])))


install()
