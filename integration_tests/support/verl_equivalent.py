"""verl's own ``algorithm.rollout_correction`` block with the same semantics as a ``CorrectionConfig``.

Test support: the anchor tests run verl's own rollout-correction helper with this block beside
the adapter, where verl can express the flags (docs/verl_own_correction.md, "Same numbers as verl where the
modes overlap").
"""

from __future__ import annotations

from typing import Any

from rollout_parity.core.config import CorrectionConfig


def verl_equivalent(cfg: CorrectionConfig) -> dict[str, Any]:
    """verl's own ``algorithm.rollout_correction`` block with the same semantics as ``cfg``.

    Exists where the modes overlap (docs/verl_own_correction.md): token TIS without a lower clamp, IcePop
    (``"lo_hi"``) for the mask modes, sequence ratios as a product, kept sequences weighted
    by ρ_seq, every rejection option. Raises ``ValueError`` naming the flag otherwise.
    """
    mode = cfg.rollout_importance_sampling_mode
    upper = cfg.rollout_importance_sampling_threshold
    lower = cfg.rollout_importance_sampling_threshold_lower
    out: dict[str, Any] = {"rollout_is": None, "rollout_is_threshold": upper, "rollout_rs": None,
                           "rollout_rs_threshold": None, "bypass_mode": cfg.old_logprob_source == "bypass",
                           "loss_type": "ppo_clip", "rollout_is_batch_normalize": False}
    if mode is not None:
        level = "token" if mode.startswith("token") else "sequence"
        if level == "sequence" and cfg.rollout_importance_sampling_sequence_reduction != "product":
            raise ValueError("rollout_importance_sampling_sequence_reduction: verl's sequence ratio is the product")
        if mode.endswith("truncate"):
            if lower is not None:
                raise ValueError("rollout_importance_sampling_threshold_lower: verl's TIS has no lower clamp")
            threshold: Any = upper
        else:
            if lower is None or not lower > 0:
                raise ValueError("rollout_importance_sampling_threshold_lower: verl's IcePop needs a lower bound > 0")
            if mode == "sequence_mask" and cfg.rollout_importance_sampling_sequence_mask_weight != "sequence":
                raise ValueError("rollout_importance_sampling_sequence_mask_weight: verl weights kept sequences "
                                 "by rho_seq ('sequence')")
            threshold = f"{lower}_{upper}"
        out.update(rollout_is=level, rollout_is_threshold=threshold)
    if cfg.rollout_rejection is not None:
        specs = []
        for rule in cfg.rejection_rules:
            specs.append(f"{rule.lower}_{rule.upper}" if rule.estimator == "k1" else f"{rule.upper}")
        out.update(rollout_rs=",".join(cfg.rollout_rejection), rollout_rs_threshold=",".join(specs))
    if cfg.off_policy_sequence_mask_delta is not None:
        raise ValueError("off_policy_sequence_mask_delta: verl's own rollout correction has no off-policy sequence mask")
    return out
