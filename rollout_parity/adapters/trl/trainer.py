"""``ParityGRPOTrainer``: TRL's ``GRPOTrainer`` with the flags, refused or accepted before anything loads.

Everything that depends only on the config is checked before ``GRPOTrainer.__init__`` builds the
model and the vLLM engine (minutes on a real model); then the colocated engine is built with the
parity recipe and :func:`~rollout_parity.adapters.trl.patches.apply` hands the correction over.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, ClassVar, Mapping, Optional

from trl import GRPOTrainer

from rollout_parity.adapters.trl.config import ParityGRPOConfig, as_correction_config
from rollout_parity.adapters.trl.engine import engine_options, parity_vllm_engine
from rollout_parity.adapters.trl.patches import apply, state_of
from rollout_parity.adapters.trl.precision import precision_onto_args
from rollout_parity.adapters.trl.refusals import refuse
from rollout_parity.core.config import CorrectionConfig

__all__ = ["ParityGRPOTrainer"]

logger = logging.getLogger("rollout_parity.adapters.trl")


def _model_config(model: Any, args: Any) -> Any:
    """The model's Hugging Face config before the model is built (None if it cannot be read cheaply)."""
    if not isinstance(model, str):
        return getattr(model, "config", None)
    try:
        from transformers import AutoConfig

        kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
        return AutoConfig.from_pretrained(model, trust_remote_code=bool(kwargs.get("trust_remote_code", False)))
    except Exception:  # noqa: BLE001 - apply() checks the built model's head again
        return None


class ParityGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with rollout-parity's correction, diagnostics and vLLM parity recipe.

    The shared flags come from a ``ParityGRPOConfig``, else ``rollout_correction=``, else
    ``rollout_correction_default`` (set by ``rollout-parity launch``). The colocated engine is built
    with ``vllm_parity_kwargs``; a server is checked at start. ``fp32_lm_head`` turns TRL's own
    ``cast_lm_head_to_fp32`` on (logged); ``precision`` sets TRL's ``fp16``/``bf16``, the load dtype and the
    engine's dtype (``precision.py``). ``revert`` leaves engine and head with their recipe.
    """

    rollout_correction_default: ClassVar[Optional[CorrectionConfig]] = None

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, *rest: Any,
                 rollout_correction: CorrectionConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if rollout_correction is None and not isinstance(args, ParityGRPOConfig):
            rollout_correction = type(self).rollout_correction_default
        cfg = as_correction_config(rollout_correction, args)
        if args is not None:
            model_config = _model_config(model, args)
            refuse(cfg, args, args, model_config=model_config,  # before a model or engine exists
                   off_policy_mask_threshold=args.off_policy_mask_threshold)
            if cfg.precision is not None:  # TRL's fp16/bf16 and the load dtype, before TRL loads the model
                precision_onto_args(cfg.precision, args, model, model_config)
            if cfg.fp32_lm_head and not args.cast_lm_head_to_fp32:
                logger.info("rollout-parity: cast_lm_head_to_fp32: False -> True (fp32_lm_head=True)")
                args.cast_lm_head_to_fp32 = True
        colocate = args is not None and args.use_vllm and args.vllm_mode == "colocate"
        engine = parity_vllm_engine(**engine_options(cfg)) if colocate else contextlib.nullcontext({})
        with engine as built:
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self.rollout_parity_engine_kwargs = built.get("kwargs")
        apply(self, cfg)

    @property
    def rollout_correction(self) -> Optional[CorrectionConfig]:
        return getattr(state_of(self), "config", None)

    @property
    def rollout_parity_engine_checks(self) -> Optional[dict[str, bool]]:
        return getattr(state_of(self), "engine_checks", None)
