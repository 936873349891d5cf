"""TRL's config in: ``ParityGRPOConfig`` is ``GRPOConfig`` plus the shared flags (docs/flags.md).

Parsed by ``TrlParser``/``HfArgumentParser`` like any TRL config, on the command line
(``--rollout_importance_sampling_mode token_truncate``; list flags take several values) or in a TRL
YAML file; TRL's own fields keep their defaults and meaning, and the shared fields carry the core's
defaults and help text. Values arrive as text and are read by the core (``flag_from_text``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from trl import GRPOConfig

from rollout_parity.core.config import CorrectionConfig, flag_from_text

__all__ = ["ParityGRPOConfig", "correction_config_from_args", "as_correction_config"]


def _shared_field(name: str) -> Any:
    """A dataclass field with the core's default and help text for one shared flag."""
    core = CorrectionConfig.__dataclass_fields__[name]
    return field(default=core.default, metadata={"help": f"[rollout-parity] {core.metadata.get('help', '')}"})


@dataclass
class ParityGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the shared rollout-parity flags (docs/flags.md)."""

    rollout_importance_sampling_mode: Optional[str] = _shared_field("rollout_importance_sampling_mode")
    rollout_importance_sampling_threshold: float = _shared_field("rollout_importance_sampling_threshold")
    rollout_importance_sampling_threshold_lower: Optional[float] = _shared_field(
        "rollout_importance_sampling_threshold_lower")
    rollout_importance_sampling_sequence_reduction: str = _shared_field(
        "rollout_importance_sampling_sequence_reduction")
    rollout_importance_sampling_sequence_mask_weight: str = _shared_field(
        "rollout_importance_sampling_sequence_mask_weight")
    rollout_rejection: Optional[list[str]] = _shared_field("rollout_rejection")
    # Strings on the command line so K1 ranges ('0.5_2.0') pass; numbers are converted.
    rollout_rejection_threshold: Optional[list[str]] = _shared_field("rollout_rejection_threshold")
    off_policy_sequence_mask_delta: Optional[float] = _shared_field("off_policy_sequence_mask_delta")
    old_logprob_source: str = _shared_field("old_logprob_source")
    log_rollout_offpolicy_metrics: bool = _shared_field("log_rollout_offpolicy_metrics")
    fp32_lm_head: bool = _shared_field("fp32_lm_head")
    weight_sync_check_interval: Optional[int] = _shared_field("weight_sync_check_interval")
    weight_sync_check_threshold: float = _shared_field("weight_sync_check_threshold")
    moe_routing_replay: bool = _shared_field("moe_routing_replay")
    rollout_sampling_replay: bool = _shared_field("rollout_sampling_replay")

    def __post_init__(self) -> None:
        for name in CorrectionConfig.field_names():
            setattr(self, name, flag_from_text(name, getattr(self, name)))
        self.correction_config()  # validates; the error names the flag
        super().__post_init__()

    def correction_config(self) -> CorrectionConfig:
        """The core's ``CorrectionConfig`` for these flags."""
        return CorrectionConfig(**{name: getattr(self, name) for name in CorrectionConfig.field_names()})


def correction_config_from_args(args: Any) -> CorrectionConfig:
    """``CorrectionConfig`` from a ``ParityGRPOConfig``; the default (nothing on) otherwise."""
    return args.correction_config() if isinstance(args, ParityGRPOConfig) else CorrectionConfig()


def as_correction_config(config: CorrectionConfig | Mapping[str, Any] | None, args: Any) -> CorrectionConfig:
    """``config`` as the core's type, or the flags of ``args`` when ``config`` is None."""
    if config is None:
        return correction_config_from_args(args)
    return config if isinstance(config, CorrectionConfig) else CorrectionConfig.from_dict(config)
