"""Our ``rollout_correction/*`` diagnostics beside NeMo RL's metrics, normalised by its global counts.

NeMo RL *sums* every loss metric over microbatches and data-parallel ranks (``grpo.py``), so each
diagnostic is returned as this microbatch's share of the global mean: local mean × local count /
global count. Token means divide by ``global_valid_toks``; sequence means by ``global_valid_seqs``
(a sample without valid, finite tokens counts as on-policy). Extrema and quantities no sum gives
are left out. ``normalizations`` names each denominator for NeMo RL main's ``MetricNormalizer``.
NeMo RL's own metrics are never computed here: they come from its ``ClippedPGLossFn``, and where one of them is
the same quantity as ours (the table and its conditions: ``core/metric_names.py``) ours is left out (the
hand-over does it).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["TOKEN_MEANS", "SEQ_MEANS", "PPL_MEANS", "LEFT_OUT", "PREFIX", "OUT_OF_BOUNDS", "counts", "global_shares",
           "normalizations", "out_of_bounds", "oob_per_sequence"]

PREFIX = "rollout_correction/"
TOKEN_MEANS = ("k1_mean", "k3_kl", "chi2_token", "is_weight_mean", "clipped_frac", "delta_abs_mean",
               "rejected_token_frac", "nonfinite_frac", "loss_contrib_pos", "loss_contrib_neg",
               "loss_contrib_rollout_pos", "loss_contrib_rollout_neg")
SEQ_MEANS = ("chi2_seq", "rejected_seq_frac", "off_policy_masked_frac")
PPL_MEANS = ("log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio")
#: NeMo RL's name for the share of weights its truncation moved (``truncated_importance_sampling_type`` set). With an
#: IS mode of ours NeMo RL's truncation is off, so the adapter logs it under that name from OUR correction's bounds
#: (not a copy of NeMo RL's computation: ``out_of_bounds`` reads our log-ratios and our flags).
OUT_OF_BOUNDS = "is_oob_ratio"
LEFT_OUT = ("ess", "delta_abs_max", "log_ppl_diff_max", "log_ppl_diff_min", "training_ppl",
            "training_log_ppl", "rollout_ppl", "rollout_log_ppl")


def counts(out: Any, mask: torch.Tensor, sample_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The local counts :func:`global_shares` scales by, on the device (read back with the diagnostics).
    ``mask`` is NeMo RL's ``token_mask * sample_mask`` before our rejection."""
    finite = mask - out.nonfinite.to(mask.dtype)
    return {"n_tok": mask.sum(), "n_seq": (mask.sum(dim=-1) > 0).sum(), "n_ppl": (finite.sum(dim=-1) > 0).sum(),
            "n_samples": sample_mask.sum()}


def global_shares(core_metrics: dict, counted: dict[str, float]) -> dict[str, float]:
    """The core's local means (``compute_correction`` on one microbatch) as shares of the global
    means; ``counted``: :func:`counts` read back, with NeMo RL's ``gvt``/``gvs`` (global valid tokens and
    sequences)."""
    n_tok, n_seq, n_ppl, n_samples = (counted[k] for k in ("n_tok", "n_seq", "n_ppl", "n_samples"))
    gvt, gvs = counted["gvt"], counted["gvs"]
    per_tok = 1.0 / gvt if gvt > 0 else 0.0
    per_seq = 1.0 / gvs if gvs > 0 else 0.0
    shares: dict[str, float] = {}
    for name in TOKEN_MEANS:
        if PREFIX + name in core_metrics:
            shares[PREFIX + name] = core_metrics[PREFIX + name] * n_tok * per_tok
    for name in SEQ_MEANS:
        if PREFIX + name in core_metrics:
            shares[PREFIX + name] = core_metrics[PREFIX + name] * n_seq * per_seq
    for name in PPL_MEANS:
        if PREFIX + name in core_metrics:
            value = core_metrics[PREFIX + name]
            if name == "ppl_ratio":  # on-policy value 1 for samples without a finite token
                shares[PREFIX + name] = ((value - 1.0) * n_ppl + n_samples) * per_seq
            else:
                shares[PREFIX + name] = value * n_ppl * per_seq
    return shares


def normalizations(MetricNormalizer: Any, local: bool = False) -> dict[str, Any]:
    """``{metric: MetricNormalizer}`` for our diagnostics (NeMo RL main's split-step contract)."""
    if local:
        return {PREFIX + name: MetricNormalizer.NONE for name in TOKEN_MEANS + SEQ_MEANS + PPL_MEANS + LEFT_OUT}
    out = {PREFIX + name: MetricNormalizer.TOKENS for name in TOKEN_MEANS}
    out.update({PREFIX + name: MetricNormalizer.SEQUENCES for name in SEQ_MEANS + PPL_MEANS})
    return out


def oob_per_sequence(cfg: Any, sequence_level_ratios: bool) -> bool:
    """Whether ``OUT_OF_BOUNDS`` counts sequences (÷ global valid sequences) or tokens (÷ global valid tokens).

    NeMo RL's convention: a sequence-level decision on token-level weights (its ``seq-mask-tis``; ours:
    any ``sequence_*`` mode) counts sequences; under GSPO (``sequence_level_importance_ratios``, one weight per
    sequence already) and for token modes it counts tokens.
    """
    mode = cfg.rollout_importance_sampling_mode or ""
    return mode.startswith("sequence") and not sequence_level_ratios


def out_of_bounds(cfg: Any, out: Any, mask: torch.Tensor, sample_mask: torch.Tensor,
                  per_sequence: bool) -> torch.Tensor:
    """How many tokens (or sequences, ``per_sequence``) our IS mode truncated or zeroed, a 0-d tensor on the device:
    a weight outside ``[lower, C]`` of our flags, read from the correction's own (clamped) log-ratios."""
    upper = cfg.rollout_importance_sampling_threshold
    lower = cfg.rollout_importance_sampling_threshold_lower

    def outside(log_ratio: torch.Tensor) -> torch.Tensor:
        ratio = log_ratio.exp()
        hit = ratio > upper
        if lower is not None:
            hit = hit | (ratio < lower)
        return hit.to(mask.dtype)

    if cfg.rollout_importance_sampling_mode.startswith("sequence"):
        seq = outside(out.sequence_log_ratio.to(mask.dtype))
        return (seq * sample_mask).sum() if per_sequence else (seq.unsqueeze(-1) * mask).sum()
    return (outside(out.log_ratio.to(mask.dtype)) * mask).sum()
