"""rollout-parity: remove, then correct, the training-inference mismatch of LLM RL.

The public face (docs/flags.md); adapters and users import only these names.
Attributes resolve lazily so that ``import rollout_parity`` costs nothing beyond torch
and never imports a framework.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.4.0"

_EXPORTS = {
    # corrections
    "CorrectionConfig": "rollout_parity.core.config",
    "CorrectionOutput": "rollout_parity.core.correction",
    "compute_correction": "rollout_parity.core.correction",
    "policy_loss": "rollout_parity.core.loss",
    # parity, trainer side
    "apply_fp32_lm_head": "rollout_parity.core.fp32_head",
    "revert_fp32_lm_head": "rollout_parity.core.fp32_head",
    "is_fp32_lm_head": "rollout_parity.core.fp32_head",
    "chunked_fp32_logprobs": "rollout_parity.core.fp32_logprobs",
    "sampler_logprobs": "rollout_parity.core.sampler",
    "SamplerLogprobs": "rollout_parity.core.sampler",
    "SamplerSupportWarning": "rollout_parity.core.sampler",
    "sampler_logprobs_from_hidden": "rollout_parity.core.sampler",
    # parity, vLLM side
    "vllm_parity_kwargs": "rollout_parity.engines.vllm.recipe",
    "vllm_serve_flags": "rollout_parity.engines.vllm.recipe",
    "verify_engine": "rollout_parity.engines.vllm.recipe",
    "verify_engine_async": "rollout_parity.engines.vllm.recipe",
    "WeightVersion": "rollout_parity.engines.vllm.weight_update",
    "update_weights_in_flight": "rollout_parity.engines.vllm.weight_update",
    "update_weights_sync": "rollout_parity.engines.vllm.weight_update",
    # weight syncs and MoE (docs/moe.md)
    "finish_moe_weight_load": "rollout_parity.engines.vllm.moe",
    "make_probe": "rollout_parity.core.sync_check",
    "judge": "rollout_parity.core.sync_check",
    "WeightSyncError": "rollout_parity.core.sync_check",
    "replayed_routing": "rollout_parity.core.routing",
    "align_routes": "rollout_parity.core.routing",
    # multi-turn
    "splice_on_policy_token_ids": "rollout_parity.core.token_ids",
    "TokenSpliceError": "rollout_parity.core.token_ids",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollout_parity' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
