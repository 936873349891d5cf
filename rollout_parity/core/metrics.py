"""Diagnostics under the ``rollout_correction/`` prefix, in one pass and one host sync.

ms-swift's set (../shared/seeds/ms-swift-rollout-importance-sampling.txt): ``kl``,
``k3_kl``, the perplexities, ``chi2_token``, ``chi2_seq``, ``ess``, ``is_weight_mean``,
``clipped_frac``. Beyond it: ``delta_abs_mean``/``delta_abs_max`` (paper eq. 1),
``rejected_token_frac``, ``rejected_seq_frac``, ``off_policy_masked_frac``,
``nonfinite_frac`` and the zero-centred loss contribution ``C(r) = −(r−1)A`` split by the
sign of A (paper eq. 5, ../shared/seeds/tim-diagnosis-paper.txt), whose skew warns of
TIM before KL does.

Every statistic is built from sums, counts, maxima and minima. With a process group
they are all-reduced in float64 (two collectives: SUM and MAX), so a data-parallel run logs the
metrics of the global batch, equal to one process seeing the concatenated batch.

Definitions (``lr = log r`` sanitised and clamped, see ``ratios.py``; token means are
over valid tokens; sequence means over sequences with at least one valid token):

* ``kl = mean_t(log π_rollout − log π_train) = mean_t(−lr)``, ``k3_kl = mean_t(r − 1 − lr)``.
* ``training_log_ppl = mean_i(−mean_t log π_train)``, ``training_ppl = mean_i exp(that)``,
  the same for ``rollout_*``; ``log_ppl_diff_i = mean_t log π_rollout − mean_t log π_train``
  with its mean, mean absolute value, max and min; ``ppl_ratio = mean_i exp(log_ppl_diff_i)``.
  Perplexities use each sequence's tokens where both logprobs are finite, and are
  computed in float64 (a one-token sequence at logprob −90 has perplexity e^90, past fp32).
* ``chi2_token = mean_t r² − 1``; ``chi2_seq = mean_i ρ_seq² − 1`` with the configured
  sequence reduction (geometric mean in ms-swift, product in verl).
* ``is_weight_mean = mean_t w``; ``ess = (Σ w)² / (n Σ w²)`` over valid tokens, with
  ``w`` the applied IS weights (the raw ``r`` when no IS mode is set): 1 on-policy.
* ``clipped_frac``: valid tokens whose weight was truncated or zeroed by the IS mode.
* ``nonfinite_frac``: valid tokens with a NaN or ±inf among the logprobs the correction read
  (π_old, π_rollout, and π_θ when given), each counted once.
* ``loss_contrib_pos``/``loss_contrib_neg``: ``Σ C(r_ppo^train)`` over finite tokens with
  A > 0 / A < 0, divided by the valid-token count (so they add to the token-mean); the
  ``loss_contrib_rollout_*`` pair uses ``r_ppo^rollout = π_θ/π_rollout``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .distributed import all_reduce
from .ratios import LOG_RATIO_BOUND, TokenStats

#: ``correction_metrics`` is reached through ``compute_correction`` only (its one caller).
__all__ = ["PREFIX"]

PREFIX = "rollout_correction/"

_SUM_KEYS = (
    "n_tok", "n_seq", "n_ppl_seq", "kl", "k3", "train_log_ppl", "train_ppl", "roll_log_ppl", "roll_ppl",
    "lpd", "lpd_abs", "ppl_ratio", "chi2_tok", "chi2_seq", "w", "w2", "clipped", "delta_abs",
    "rej_tok", "rej_seq", "off_seq", "nonfinite", "c_pos", "c_neg", "c_roll_pos", "c_roll_neg",
)
_MAX_KEYS = ("delta_abs_max", "lpd_max", "neg_lpd_min")


def correction_metrics(
    *,
    stats: TokenStats,
    seq_log_ratio: torch.Tensor,
    base_logprobs: torch.Tensor,
    base_name: str,
    rollout_logprobs: torch.Tensor,
    weights: Optional[torch.Tensor],
    clipped: Optional[torch.Tensor],
    rejected: Optional[torch.Tensor],
    off_policy: torch.Tensor,
    nonfinite: torch.Tensor,
    advantages: Optional[torch.Tensor],
    current_logprobs: Optional[torch.Tensor],
    bypass: bool,
    process_group: Any = None,
) -> dict[str, float]:
    """All diagnostics of one batch; ``weights``/``clipped``/``rejected`` are None when off.

    ``clipped``, ``rejected`` and ``nonfinite`` are float 0/1 masks over valid tokens.
    """
    log_ratio, valid_f = stats.log_ratio, stats.valid_f
    dtype = valid_f.dtype
    zero = valid_f.new_zeros(())
    seq_valid = stats.tokens_per_seq > 0
    seq_valid_f = seq_valid.to(dtype)
    n_tok = stats.tokens_per_seq.sum()
    n_pad = valid_f.numel() - n_tok

    # log_ratio is 0 on padding, so r = 1 there: whole-tensor sums minus the padding count
    # are valid-token sums without a masking pass.
    ratio = stats.ratio
    abs_lr = log_ratio.abs()
    flat_ratio = ratio.reshape(-1)
    sum_r2 = torch.dot(flat_ratio, flat_ratio) - n_pad
    s: dict[str, torch.Tensor] = {
        "n_tok": n_tok,
        "n_seq": seq_valid_f.sum(),
        "kl": -stats.row_log_ratio.sum(),
        "k3": stats.estimator("k3").sum(),
        "chi2_tok": sum_r2,
        "chi2_seq": ((2.0 * seq_log_ratio).exp() * seq_valid_f).sum(),
        "delta_abs": abs_lr.sum(),
        "off_seq": (off_policy & seq_valid).to(dtype).sum(),
        "nonfinite": nonfinite.sum(),
        "clipped": zero if clipped is None else clipped.sum(),
        "rej_tok": zero if rejected is None else rejected.sum(),
        "rej_seq": zero if rejected is None else (rejected.sum(dim=-1) > 0).to(dtype).sum(),
    }
    # Diagnostics only: the weight an IS correction would start from, r. Masked by a product, not
    # "whole sum minus padding count", which cancels every digit of tiny weights (ess of r = e^-20).
    flat_w = (ratio * valid_f if weights is None else weights).reshape(-1)
    s["w"] = flat_w.sum()
    s["w2"] = torch.dot(flat_w, flat_w)

    # Perplexities: per sequence, over tokens where both sides are finite; (B,) vectors, so float64 is free.
    n_fin = stats.finite_per_seq
    ppl_seq = n_fin > 0
    ppl_seq_f = ppl_seq.to(torch.float64)
    denom = n_fin.clamp_min(1.0).to(torch.float64)
    mean_train = stats.finite_row_sum(base_name, base_logprobs).to(torch.float64) / denom
    mean_roll = stats.finite_row_sum("rollout", rollout_logprobs).to(torch.float64) / denom
    lpd = mean_roll - mean_train
    s["n_ppl_seq"] = ppl_seq_f.sum()
    s["train_log_ppl"] = (-mean_train * ppl_seq_f).sum()
    s["train_ppl"] = ((-mean_train).exp() * ppl_seq_f).sum()
    s["roll_log_ppl"] = (-mean_roll * ppl_seq_f).sum()
    s["roll_ppl"] = ((-mean_roll).exp() * ppl_seq_f).sum()
    s["lpd"] = (lpd * ppl_seq_f).sum()
    s["lpd_abs"] = (lpd.abs() * ppl_seq_f).sum()
    s["ppl_ratio"] = (lpd.exp() * ppl_seq_f).sum()

    # Zero-centred loss contribution C(r) = -(r - 1) A (paper eq. 5), split by the sign of A,
    # over finite tokens. r_ppo^train = π_θ/π_old; r_ppo^rollout = r_ppo^train · r_corr
    # (the same thing under bypass, where π_old is π_rollout).
    for key in ("c_pos", "c_neg", "c_roll_pos", "c_roll_neg"):
        s[key] = zero
    if advantages is not None and current_logprobs is not None:
        adv = advantages.detach().to(dtype)  # 0 on padding (compute_correction zeroed it there)
        finite_f = stats.clean_f  # every logprob read is finite
        old = rollout_logprobs if bypass else base_logprobs
        lr_train = (current_logprobs.detach().to(dtype) - old.detach().to(dtype)).nan_to_num_(0.0, 0.0, 0.0)
        lr_train.clamp_(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).mul_(finite_f)
        r_train = lr_train.exp_()  # 1 off the finite tokens, so r - 1 needs no mask there
        # r_ppo^rollout = r_ppo^train · r_corr (the same thing under bypass, where π_old is π_rollout)
        minus_c_roll = None if bypass else (r_train * ratio).sub_(1.0).mul_(finite_f)
        minus_c_train = r_train.sub_(1.0)
        minus_c_roll = minus_c_train if minus_c_roll is None else minus_c_roll
        for tag, minus_c in (("c", minus_c_train), ("c_roll", minus_c_roll)):
            if adv.dim() == 1:  # one advantage per sequence: split the row sums, not the tokens
                contrib = -minus_c.sum(dim=-1) * adv
            else:
                contrib = -(minus_c * adv)
            pos = (adv > 0).to(dtype)
            neg = (adv < 0).to(dtype)
            s[f"{tag}_pos"] = (contrib * pos).sum()
            s[f"{tag}_neg"] = (contrib * neg).sum()

    neg_inf = torch.full((), float("-inf"), dtype=torch.float64, device=valid_f.device)
    m = {
        # |lr| is 0 on padding and >= 0 elsewhere, so the plain max is the valid max.
        "delta_abs_max": abs_lr.amax() if log_ratio.numel() else neg_inf,
        "lpd_max": torch.where(ppl_seq, lpd, neg_inf).amax() if lpd.numel() else neg_inf,
        "neg_lpd_min": torch.where(ppl_seq, -lpd, neg_inf).amax() if lpd.numel() else neg_inf,
    }

    sums = torch.stack([s[k].to(torch.float64) for k in _SUM_KEYS])
    maxes = torch.stack([m[k].to(torch.float64) for k in _MAX_KEYS])
    all_reduce(sums, process_group)
    all_reduce(maxes, process_group, "max")
    values = torch.cat([sums, maxes]).tolist()  # the one host sync
    g = dict(zip(_SUM_KEYS + _MAX_KEYS, values))
    return _finalise(g)


def _finalise(g: dict[str, float]) -> dict[str, float]:
    n_tok, n_seq, n_ppl = g["n_tok"], g["n_seq"], g["n_ppl_seq"]
    tok = (lambda x: x / n_tok) if n_tok > 0 else (lambda x: 0.0)
    seq = (lambda x: x / n_seq) if n_seq > 0 else (lambda x: 0.0)
    ppl = (lambda x: x / n_ppl) if n_ppl > 0 else (lambda x: 0.0)
    finite_max = lambda x: x if x != float("-inf") else 0.0  # noqa: E731
    if g["w2"] > 0:
        ess = g["w"] ** 2 / (n_tok * g["w2"])
    else:
        ess = 1.0 if n_tok == 0 else 0.0
    out = {
        "kl": tok(g["kl"]),
        "k3_kl": tok(g["k3"]),
        "training_ppl": ppl(g["train_ppl"]) if n_ppl > 0 else 1.0,
        "training_log_ppl": ppl(g["train_log_ppl"]),
        "rollout_ppl": ppl(g["roll_ppl"]) if n_ppl > 0 else 1.0,
        "rollout_log_ppl": ppl(g["roll_log_ppl"]),
        "log_ppl_diff": ppl(g["lpd"]),
        "log_ppl_abs_diff": ppl(g["lpd_abs"]),
        "log_ppl_diff_max": finite_max(g["lpd_max"]),
        "log_ppl_diff_min": -g["neg_lpd_min"] if g["neg_lpd_min"] != float("-inf") else 0.0,
        "ppl_ratio": ppl(g["ppl_ratio"]) if n_ppl > 0 else 1.0,
        "chi2_token": tok(g["chi2_tok"]) - 1.0 if n_tok > 0 else 0.0,
        "chi2_seq": seq(g["chi2_seq"]) - 1.0 if n_seq > 0 else 0.0,
        "ess": ess,
        "is_weight_mean": tok(g["w"]) if n_tok > 0 else 1.0,
        "clipped_frac": tok(g["clipped"]),
        "delta_abs_mean": tok(g["delta_abs"]),
        "delta_abs_max": finite_max(g["delta_abs_max"]),
        "rejected_token_frac": tok(g["rej_tok"]),
        "rejected_seq_frac": seq(g["rej_seq"]),
        "off_policy_masked_frac": seq(g["off_seq"]),
        "nonfinite_frac": tok(g["nonfinite"]),
        "loss_contrib_pos": tok(g["c_pos"]),
        "loss_contrib_neg": tok(g["c_neg"]),
        "loss_contrib_rollout_pos": tok(g["c_roll_pos"]),
        "loss_contrib_rollout_neg": tok(g["c_roll_neg"]),
    }
    return {PREFIX + k: float(v) for k, v in out.items()}

