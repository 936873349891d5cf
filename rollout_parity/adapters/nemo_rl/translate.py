"""Translate a NeMo RL ``loss_fn`` block: our keys apart from NeMo RL's, and NeMo RL's own
importance-sampling keys in shared flags.

A recipe turns the adapter on with two keys inside ``loss_fn`` (``configs/nemo_rl_loss.yaml``):
``rollout_correction`` (the shared flags) and the guard ``rollout_parity: ${rollout_parity:}``,
an OmegaConf interpolation only rollout-parity's hook resolves. Everything else in the block is
NeMo RL's and goes to its own ``ClippedPGLossFn`` unchanged. docs/nemo_rl.md has the tables.
"""

from __future__ import annotations

import math
from typing import Any

from rollout_parity.core.config import CorrectionConfig, refuse_unknown
from rollout_parity.core.ratios import LOG_RATIO_BOUND

__all__ = ["BLOCK_KEY", "GUARD_KEY", "RESOLVER", "NEMO_IS_TYPES", "NEMO_TRUNCATION_KEYS", "as_dict", "carries_block",
           "split_loss_config", "correction_from_nemo_rl"]

#: ``loss_fn.rollout_correction``: the shared flags.
BLOCK_KEY = "rollout_correction"
#: ``loss_fn.rollout_parity: ${rollout_parity:}``: the guard (see ``turn_on``).
GUARD_KEY = "rollout_parity"
RESOLVER = "rollout_parity"
NEMO_IS_TYPES = ("tis", "icepop", "seq-mask-tis")
#: NeMo RL's truncation keys, which our flags replace (``RolloutParityLossFn.from_nemo_is_config``).
NEMO_TRUNCATION_KEYS = ("truncated_importance_sampling_type", "truncated_importance_sampling_ratio",
                        "truncated_importance_sampling_ratio_min")


def as_dict(cfg: Any) -> dict:
    """A plain dict of a ``loss_fn`` block: dict, OmegaConf node (resolved) or NeMo RL's
    pydantic ``ClippedPGLossConfig`` (its extra keys included)."""
    if cfg is None:
        return {}
    if hasattr(cfg, "model_dump"):  # pydantic
        return dict(cfg.model_dump())
    if hasattr(cfg, "_metadata") and hasattr(cfg, "_content"):  # OmegaConf node
        from omegaconf import OmegaConf

        out = {}
        for key in cfg.keys():  # resolved key by key: the guard stops NeMo RL's reading, not ours
            if key != GUARD_KEY:
                value = cfg[key]
                out[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        return out
    return dict(cfg)


def _keys(cfg: Any) -> set:
    if cfg is None:
        return set()
    if hasattr(cfg, "model_extra"):  # pydantic: our keys are extras
        return set(cfg.model_extra or {})
    try:
        return set(cfg.keys())
    except AttributeError:
        return set()


def carries_block(cfg: Any) -> bool:
    """Whether a ``loss_fn`` block carries our keys (without resolving or copying it)."""
    return bool(_keys(cfg) & {BLOCK_KEY, GUARD_KEY})


def split_loss_config(loss_cfg: Any) -> tuple[CorrectionConfig, dict]:
    """``(shared flags, NeMo RL's own keys)`` of a ``loss_fn`` block.

    Without ``rollout_correction`` the flags are all null (NeMo RL's loss as configured). The
    guard is dropped, resolved or not: it exists to stop NeMo RL's own config reading without the
    hook, and whoever calls this builds our loss anyway (``rollout-parity check`` on a recipe).
    """
    cfg = as_dict(loss_cfg)
    ours = cfg.pop(BLOCK_KEY, None)
    cfg.pop(GUARD_KEY, None)
    if ours is not None and not isinstance(ours, dict):
        raise ValueError(f"loss_fn.{BLOCK_KEY} must be a mapping of the shared flags, got {ours!r}")
    refuse_unknown(ours or {}, CorrectionConfig.field_names(), where=f"loss_fn.{BLOCK_KEY}.")
    return CorrectionConfig.from_dict(ours or {}), cfg


def correction_from_nemo_rl(loss_cfg: Any) -> CorrectionConfig:
    """The shared flags that reproduce NeMo RL's own importance-sampling settings.

    Reads ``use_importance_sampling_correction``, ``truncated_importance_sampling_type``
    (``tis`` | ``icepop`` | ``seq-mask-tis``), ``truncated_importance_sampling_ratio``,
    ``truncated_importance_sampling_ratio_min`` and ``sequence_level_importance_ratios`` (GSPO) from a
    ``loss_fn`` block (dict, OmegaConf or NeMo RL's pydantic ``ClippedPGLossConfig``). Invalid
    combinations raise ``ValueError`` naming the key, where NeMo RL would assert. Plain IS (no type)
    maps to a cap of e^20: the core clamps every log-ratio to ±20 (docs/nemo_rl_nonfinite.md, "extreme values").

    With ``sequence_level_importance_ratios`` NeMo RL weighs each sequence once, by
    ``exp(Σ_t (log π_old − log π_rollout))`` over its valid tokens, truncated (``tis``) or zeroed
    (``icepop``) as a whole: the ``sequence_*`` modes with the ``product`` reduction.
    A range with ``ratio_min == ratio`` (NeMo RL allows it; our flags need lower < C) gets the
    float just below ``ratio`` as its lower bound: the same bound in float32.
    """
    cfg = as_dict(loss_cfg)
    enabled = bool(cfg.get("use_importance_sampling_correction", False))
    kind = cfg.get("truncated_importance_sampling_type")
    ratio = cfg.get("truncated_importance_sampling_ratio")
    ratio_min = cfg.get("truncated_importance_sampling_ratio_min")
    per_sequence = bool(cfg.get("sequence_level_importance_ratios", False))
    sequence = dict(rollout_importance_sampling_sequence_reduction="product",
                    rollout_importance_sampling_sequence_mask_weight="sequence") if per_sequence else {}
    if kind is None:
        if not enabled:
            return CorrectionConfig()
        return CorrectionConfig(
            rollout_importance_sampling_mode="sequence_truncate" if per_sequence else "token_truncate",
            rollout_importance_sampling_threshold=math.exp(LOG_RATIO_BOUND), **sequence)
    if kind not in NEMO_IS_TYPES:
        raise ValueError(f"truncated_importance_sampling_type: unknown value {kind!r}; "
                         f"expected one of {NEMO_IS_TYPES}")
    if not enabled:
        raise ValueError("truncated_importance_sampling_type is set but "
                         "use_importance_sampling_correction is false (NeMo RL refuses this too)")
    if ratio is None or not ratio > 0:
        raise ValueError(f"truncated_importance_sampling_ratio must be > 0, got {ratio!r}")
    if kind in ("icepop", "seq-mask-tis") and ratio_min is None:
        raise ValueError(f"truncated_importance_sampling_ratio_min is required for {kind!r}")
    if kind == "seq-mask-tis" and per_sequence:
        raise ValueError("truncated_importance_sampling_type 'seq-mask-tis' with sequence_level_importance_ratios: "
                         "true (NeMo RL refuses this too: seq-mask-tis keeps token-level weights)")
    if ratio_min is not None and not ratio_min <= ratio:
        raise ValueError(
            f"truncated_importance_sampling_ratio_min ({ratio_min}) must be <= "
            f"truncated_importance_sampling_ratio ({ratio})")
    if ratio_min is not None and ratio_min == ratio:
        ratio_min = math.nextafter(ratio, 0.0)  # NeMo RL's single-point range; our lower bound must be < C
    if kind == "tis":
        # NeMo RL's default lower bound 0 never binds (r > 0): same as no lower bound.
        return CorrectionConfig(
            rollout_importance_sampling_mode="sequence_truncate" if per_sequence else "token_truncate",
            rollout_importance_sampling_threshold=ratio,
            rollout_importance_sampling_threshold_lower=ratio_min or None, **sequence)
    if kind == "icepop":
        return CorrectionConfig(rollout_importance_sampling_mode="sequence_mask" if per_sequence else "token_mask",
                                rollout_importance_sampling_threshold=ratio,
                                rollout_importance_sampling_threshold_lower=ratio_min, **sequence)
    return CorrectionConfig(rollout_importance_sampling_mode="sequence_mask",
                            rollout_importance_sampling_threshold=ratio,
                            rollout_importance_sampling_threshold_lower=ratio_min,
                            rollout_importance_sampling_sequence_reduction="geometric_mean",
                            rollout_importance_sampling_sequence_mask_weight="token")
