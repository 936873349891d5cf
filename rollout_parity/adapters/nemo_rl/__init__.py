"""NeMo RL adapter: the shared correction handed to NeMo RL's own ``ClippedPGLossFn``.

A recipe turns it on from its YAML alone (``configs/nemo_rl_loss.yaml``: ``loss_fn.rollout_correction``
plus the guard ``loss_fn.rollout_parity: ${rollout_parity:}``), run through
``rollout-parity launch examples/run_grpo.py --config recipe.yaml``. Without the hook the guard
stops NeMo RL at config load; with it ``grpo.setup()`` builds ``RolloutParityLossFn``.

Rooms: ``translate`` (the ``loss_fn`` block: our keys apart from NeMo RL's; NeMo RL's IS keys in
shared flags), ``handover`` (``RolloutParityLossFn``: weights into ``advantages``, masks into
``token_mask``, NeMo RL's loss does the rest), ``diagnostics`` (our ``rollout_correction/*``
metrics by NeMo RL's global counts), ``turn_on`` (resolver, patch, guard: ``apply``/``revert``/
``is_applied``/``launched``), ``recipe`` (the vLLM parity recipe where NeMo RL reads it), ``precision``
(the ``precision`` flag: ``policy.precision`` and the generation's dtype set at ``grpo.setup()``),
``versions`` (what it was run against; the one import of NeMo RL).

Run against NeMo RL v0.7.0 (81aa43dd) and main (7ea279ab) from ``../shared/anchors``; NeMo RL is
imported only when a loss is built or the hook applied (ImportError naming
``pip install rollout-parity[nemo-rl]`` without it). Details, tables, what ran on CPU and what
the worker environments need: docs/nemo_rl.md.
"""

from rollout_parity.adapters.nemo_rl.handover import RolloutParityLossFn
from rollout_parity.adapters.nemo_rl.recipe import (
    NEMO_RL_FIXED_LLM_KWARGS,
    NEMO_RL_FP32_HEAD_REFUSAL,
    check_nemo_rl_vllm_kwargs,
    nemo_rl_generation_config,
)
from rollout_parity.adapters.nemo_rl.translate import correction_from_nemo_rl, split_loss_config
from rollout_parity.adapters.nemo_rl.turn_on import apply, is_applied, launched, revert
from rollout_parity.adapters.nemo_rl.versions import NEMO_RL_COMMIT, NEMO_RL_TESTED, NEMO_RL_VERSION

__all__ = [
    "RolloutParityLossFn",
    "correction_from_nemo_rl",
    "split_loss_config",
    "nemo_rl_generation_config",
    "check_nemo_rl_vllm_kwargs",
    "NEMO_RL_FIXED_LLM_KWARGS",
    "NEMO_RL_FP32_HEAD_REFUSAL",
    "apply",
    "revert",
    "is_applied",
    "launched",
    "NEMO_RL_VERSION",
    "NEMO_RL_COMMIT",
    "NEMO_RL_TESTED",
]
