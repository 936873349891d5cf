"""TRL adapter: the shared flags (docs/flags.md) in TRL's ``GRPOTrainer``, through TRL's own loss.

Use ``ParityGRPOConfig``/``ParityGRPOTrainer`` in a script, ``rollout-parity launch`` around an
unmodified one, or :func:`apply` on a built ``GRPOTrainer``. ``compute_correction`` runs once per
generation batch and reaches TRL's ``_compute_loss`` through its own channels
(``importance_sampling_ratio``, the loss-only ``tool_mask``, ``num_items_in_batch``,
``off_policy_mask_threshold``), so every ``loss_type`` and option of TRL keeps working.

The rooms, in the order a run meets them:

* ``config``      translate: ``ParityGRPOConfig``, TRL's config with the shared flags;
* ``refusals``    what cannot be expressed, refused by name before the model and engine load;
* ``precision``   ``precision``: TRL's fp16/bf16, the load dtype and the engine's dtype, both sides read back;
* ``engine``      TRL's vLLM engine on the parity recipe (built with it, or checked against it);
* ``generation``  hand over: the correction once per generation batch, into TRL's channels;
* ``diagnostics`` the metrics only TRL's loss can see, from a pass-through;
* ``sync``        TRL's weight sync: fused-MoE layers completed, the optional sync check;
* ``routing``     ``moe_routing_replay``: the policy routes as TRL's engine did;
* ``patches``     ``apply``, ``revert``, ``is_applied`` on one trainer, through ``adapters/_patching.py``;
* ``trainer``     ``ParityGRPOTrainer``.

Math: docs/flags.md and ``rollout_parity.core``. Everything else: docs/trl.md.
"""

from __future__ import annotations

try:
    import trl  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "rollout_parity.adapters.trl needs TRL (tested with trl>=1.15,<1.17): pip install rollout-parity[trl]"
    ) from exc

from rollout_parity.adapters.trl.config import ParityGRPOConfig, correction_config_from_args
from rollout_parity.adapters.trl.engine import parity_vllm_engine, server_command
from rollout_parity.adapters.trl.patches import REQUIRED_TRL_NAMES, TESTED_TRL, apply, is_applied, revert
from rollout_parity.adapters.trl.refusals import MissingRolloutLogprobsError
from rollout_parity.adapters.trl.trainer import ParityGRPOTrainer

__all__ = ["ParityGRPOConfig", "ParityGRPOTrainer", "MissingRolloutLogprobsError", "apply", "revert", "is_applied",
           "correction_config_from_args", "parity_vllm_engine", "server_command", "TESTED_TRL", "REQUIRED_TRL_NAMES"]

