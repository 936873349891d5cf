"""Diagnostics under the ``rollout_correction/`` prefix, in one pass and one host sync.

ms-swift's set (../shared/seeds/ms-swift-rollout-importance-sampling.txt): ``k1_mean``
(ms-swift's ``kl``, renamed: a KL name must not go negative), ``k3_kl``, the perplexities,
``chi2_token``, ``chi2_seq``, ``ess``, ``is_weight_mean``, ``clipped_frac``. Beyond it: ``delta_abs_mean``/``delta_abs_max`` (paper eq. 1),
``rejected_token_frac``, ``rejected_seq_frac``, ``off_policy_masked_frac``,
``nonfinite_frac`` and the zero-centred loss contribution ``C(r) = −(r−1)A`` split by the
sign of A (paper eq. 5, ../shared/seeds/tim-diagnosis-paper.txt), whose skew warns of
TIM before KL does.

Every statistic is built from sums, counts, maxima and minima. With a process group
they are all-reduced in float64 (two collectives: SUM and MAX), so a data-parallel run logs the
metrics of the global batch, equal to one process seeing the concatenated batch.
The names are ours; ``metric_names.py`` maps them to each framework's (docs/metrics.md).

Definitions (``lr = log r`` sanitised and clamped, see ``ratios.py``; token means are
over valid tokens; sequence means over sequences with at least one valid token):

* ``k1_mean = mean_t(log π_rollout − log π_train) = mean_t(−lr)``, the signed k1 estimate of
  KL(π_rollout‖π_train); ``k3_kl = mean_t(r − 1 − lr)`` ≥ 0.
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

import math
from typing import Any, Optional, Sequence

import torch

from .distributed import all_reduce
from .ratios import LOG_RATIO_BOUND, TokenStats, nonfinite_to_zero_

#: ``correction_metric_values`` and ``finish_correction_metrics`` are reached through ``compute_correction`` only.
__all__ = ["PREFIX", "weight_distribution_metrics", "rejection_rule_metrics", "perplexity_metrics"]

PREFIX = "rollout_correction/"

#: The sums every diagnostic is built from, in the order of the one vector that is all-reduced and read back:
#: row sums over sequences, token sums, then per-sequence values over valid sequences and over sequences
#: with a finite token, then C(r).
_SUM_KEYS = (
    "n_tok", "lr", "k3", "rej_tok",
    "chi2_tok", "delta_abs", "nonfinite", "clipped", "w", "w2",
    "n_seq", "chi2_seq", "off_seq", "rej_seq",
    "n_ppl_seq", "train_log_ppl", "train_ppl", "roll_log_ppl", "roll_ppl", "lpd", "lpd_abs", "ppl_ratio",
    "c_pos", "c_neg", "c_roll_pos", "c_roll_neg",
)
_MAX_KEYS = ("delta_abs_max", "lpd_max", "neg_lpd_min")


def correction_metric_values(
    *,
    stats: TokenStats,
    seq_log_ratio: torch.Tensor,
    base_logprobs: torch.Tensor,
    base_name: str,
    rollout_logprobs: torch.Tensor,
    weights: Optional[torch.Tensor],
    clipped: Optional[torch.Tensor],
    rejected: Optional[torch.Tensor],
    rejected_rows: Optional[torch.Tensor],
    off_policy: torch.Tensor,
    advantages: Optional[torch.Tensor],
    current_logprobs: Optional[torch.Tensor],
    bypass: bool,
) -> torch.Tensor:
    """All diagnostics of one batch as one float64 vector on the device (sums, then maxima; reduced over ranks
    by :func:`reduce_metric_values`); :func:`finish_correction_metrics` turns it, read back, into the named
    metrics. ``weights``/``clipped``/``rejected`` are None when off.

    ``clipped`` is the count of valid tokens the IS mode truncated or zeroed (0-d); ``rejected`` a
    float 0/1 mask over valid tokens, and ``rejected_rows`` the rejected sequences (bool ``(B,)``)
    when rejection removes whole sequences only, which spares a pass over ``rejected``.

    Token-level passes reduce at once (to a scalar or to one value per sequence); the per-sequence
    values are stacked and finished together in float64, so the whole set is a few dozen small
    operations and one transfer to the host.
    """
    log_ratio, valid_f = stats.log_ratio, stats.valid_f
    dtype = valid_f.dtype
    zero = valid_f.new_zeros(())
    n_pad = valid_f.numel() - stats.tokens_per_seq.sum()
    scratch = stats.scratch

    # Token-level sums, each a 0-d tensor. log_ratio is 0 on padding, so r = 1 there: whole-tensor
    # sums minus the padding count are valid-token sums without a masking pass.
    ratio = stats.ratio
    abs_lr = torch.abs(log_ratio, out=scratch)  # 0 on padding and >= 0 elsewhere: the plain max is the valid max
    delta_abs, delta_abs_max = _total(abs_lr), _total(abs_lr, largest=True) if abs_lr.numel() else zero - math.inf
    # Diagnostics only: the weight an IS correction would start from, r. Masked by a product, not
    # "whole sum minus padding count", which cancels every digit of tiny weights (ess of r = e^-20).
    w = torch.mul(ratio, valid_f, out=scratch) if weights is None else weights
    tokens = [_total(ratio, squares=True) - n_pad, delta_abs, _total(stats.read_nonfinite_f),
              zero if clipped is None else clipped.to(dtype), _total(w), _total(w, squares=True)]

    # One value per sequence: (B,) rows stacked, finished in float64 (a one-token sequence at logprob −90
    # has perplexity e^90, past fp32). Perplexities use each sequence's tokens where both logprobs are finite.
    if rejected is None:
        rej_row = torch.zeros_like(stats.tokens_per_seq)
    elif rejected_rows is not None:
        rej_row = stats.tokens_per_seq * rejected_rows.to(dtype)
    else:
        rej_row = rejected.sum(dim=-1)
    k3_row = stats.row_sum("k3")
    train_row = stats.finite_row_sum(base_name, base_logprobs)
    roll_row = stats.finite_row_sum("rollout", rollout_logprobs)
    c_train_row = c_roll_row = torch.zeros_like(stats.tokens_per_seq)
    c_tokens = None
    if advantages is not None and current_logprobs is not None:
        c_train_row, c_roll_row, c_tokens = _loss_contributions(stats, advantages, current_logprobs,
                                                                rollout_logprobs, bypass)
    rows = torch.stack([stats.tokens_per_seq, stats.row_log_ratio, k3_row, rej_row, stats.finite_per_seq,
                        train_row, roll_row, seq_log_ratio, off_policy.to(dtype), c_train_row, c_roll_row,
                        advantages.to(dtype) if advantages is not None and advantages.dim() == 1
                        else torch.zeros_like(stats.tokens_per_seq)]).to(torch.float64)
    n, lr_row, k3_row, rej_row, n_fin, train_row, roll_row, seq_lr, off, c_train_row, c_roll_row, adv = rows
    seq_valid = (n > 0).to(torch.float64)
    ppl_valid = n_fin > 0
    ppl_f = ppl_valid.to(torch.float64)
    denom = n_fin.clamp_min(1.0)
    mean_train, mean_roll = train_row / denom, roll_row / denom
    lpd = mean_roll - mean_train
    neg_train, neg_roll = -mean_train, -mean_roll
    exps = torch.stack([2.0 * seq_lr, neg_train, neg_roll, lpd]).exp()
    per_seq = torch.stack([seq_valid, exps[0], off, (rej_row > 0).to(torch.float64)])
    per_ppl = torch.stack([ppl_f, neg_train, exps[1], neg_roll, exps[2], lpd, lpd.abs(), exps[3]])
    # Zero-centred loss contribution C(r) = −(r−1)A, split by the sign of the sequence's advantage (paper eq. 5).
    contrib = -torch.stack([c_train_row, c_roll_row]) * adv
    signs = torch.stack([(adv > 0), (adv < 0)]).to(torch.float64)
    sums = torch.cat([
        rows[:4].sum(dim=-1),
        torch.stack(tokens).to(torch.float64),
        per_seq @ seq_valid,
        per_ppl @ ppl_f,
        (contrib @ signs.T).reshape(-1) if c_tokens is None else torch.stack(c_tokens).to(torch.float64),
    ])
    neg_inf = torch.full((), -math.inf, dtype=torch.float64, device=valid_f.device)
    extrema = torch.where(ppl_valid, torch.stack([lpd, -lpd]), neg_inf).amax(dim=-1) if lpd.numel() else (
        neg_inf.expand(2))
    maxes = torch.cat([delta_abs_max.to(torch.float64).reshape(1), extrema])
    return torch.cat([sums, maxes])


def _total(x: torch.Tensor, *, squares: bool = False, largest: bool = False) -> torch.Tensor:
    """The sum (of squares with ``squares``, or the maximum with ``largest``) of a ``(B, T)`` tensor as a 0-d tensor. Eager: one BLAS dot or flat
    reduction. Under torch.compile: per row, then over rows, so Inductor fuses it into the loops over rows that the
    row sums already run (a flat reduction is a loop of its own, one more pass over the batch)."""
    if not torch.compiler.is_compiling():
        if largest:
            return x.amax()
        flat = x.reshape(-1)
        return torch.dot(flat, flat) if squares else flat.sum()
    if largest:
        return x.amax(dim=-1).amax()
    return (x * x if squares else x).sum(dim=-1).sum()


def reduce_metric_values(values: torch.Tensor, process_group: Any) -> torch.Tensor:
    """:func:`correction_metric_values`' vector all-reduced in place over ``process_group``: SUM over the sums,
    MAX over the maxima (two collectives; nothing without a group). Returns ``values``."""
    n_sums = len(_SUM_KEYS)
    all_reduce(values[:n_sums], process_group)
    all_reduce(values[n_sums:], process_group, "max")
    return values


def finish_correction_metrics(values: Sequence[float]) -> dict[str, float]:
    """The named diagnostics from :func:`correction_metric_values`' vector, read back (its one host sync)."""
    if len(values) != len(_SUM_KEYS + _MAX_KEYS):
        raise ValueError(f"expected {len(_SUM_KEYS + _MAX_KEYS)} values (correction_metric_values), got {len(values)}")
    return _finalise(dict(zip(_SUM_KEYS + _MAX_KEYS, values)))


def _loss_contributions(stats: TokenStats, advantages: torch.Tensor, current_logprobs: torch.Tensor,
                        rollout_logprobs: torch.Tensor, bypass: bool):
    """Σ_t −(r − 1) over each sequence's finite tokens for r_ppo^train = π_θ/π_old and r_ppo^rollout.

    Returns ``(train_rows, rollout_rows, token_sums)``: with one advantage per sequence the row sums
    (the split by the sign of A happens per sequence), else zeros and the four sums
    ``Σ C`` over tokens with A > 0 / A < 0, train then rollout. r_ppo^rollout = r_ppo^train · r_corr
    (the same thing under bypass, where π_old is π_rollout).
    """
    dtype = stats.valid_f.dtype
    clean = stats.clean_f  # every logprob read is finite
    if stats.ppo_log_ratio is not None:
        lr_train = stats.ppo_log_ratio  # π_θ − π_old as read; this is its last reader, so work in place
    else:
        old = rollout_logprobs  # bypass: π_old is π_rollout (the only case without the kept difference)
        lr_train = torch.sub(current_logprobs.detach().to(dtype), old.detach().to(dtype), out=stats.scratch)
    lr_train = nonfinite_to_zero_(lr_train).clamp_(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).mul_(clean)
    r_train = lr_train.exp_()  # 1 off the finite tokens, so r - 1 needs no mask there
    roll = None
    if not bypass:
        roll = torch.mul(r_train, stats.ratio, out=stats.scratch).sub_(1.0).mul_(clean)
    train = r_train.sub_(1.0)
    roll = train if roll is None else roll
    if advantages.dim() == 1:
        return train.sum(dim=-1), roll.sum(dim=-1), None
    adv = advantages.to(dtype)
    pos, neg = (adv > 0).to(dtype), (adv < 0).to(dtype)
    zero_rows = torch.zeros_like(stats.tokens_per_seq)
    sums = []
    for minus_c in (train, roll):
        contrib = -(minus_c * adv)
        sums += [(contrib * pos).sum(), (contrib * neg).sum()]
    return zero_rows, zero_rows, sums


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
        "k1_mean": -tok(g["lr"]) if n_tok > 0 else 0.0,
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



# ---------------------------------------------------------------------------------------------------------------
# Beyond the one-pass set: the distribution of the IS weights, each rejection rule's statistic, and the
# perplexity of one policy alone. Framework-neutral quantities of a finished correction (``CorrectionOutput``'s
# ``weights``, ``log_ratio`` and ``sequence_log_ratio``), read back once each; ``metric_names.py`` gives each
# framework's name where the framework logs the same formula (verl: ``rollout_is_*``, ``rollout_rs_<option>_*``).


def _row_values_summary(rows: torch.Tensor, upper: float, lower: Optional[float], reference: float,
                        with_low: bool = True) -> dict[str, float]:
    """mean, std (unbiased, 0 for one row), max, min, max |x − reference|, shares above ``upper`` / below ``lower``."""
    if rows.numel() == 0:
        out = dict(seq_mean=0.0, seq_std=0.0, seq_max=0.0, seq_min=0.0, seq_max_deviation=0.0, seq_fraction_high=0.0)
        if with_low:
            out["seq_fraction_low"] = 0.0
        return out
    out = dict(seq_mean=rows.mean().item(), seq_std=rows.std().item() if rows.numel() > 1 else 0.0,
               seq_max=rows.max().item(), seq_min=rows.min().item(),
               seq_max_deviation=(rows - reference).abs().max().item(),
               seq_fraction_high=(rows > upper).double().mean().item())
    if with_low:
        out["seq_fraction_low"] = (rows < lower).double().mean().item() if lower is not None else 0.0
    return out


def _masked_std(values: torch.Tensor, valid: torch.Tensor, n: float) -> float:
    """Population std over the valid entries (0 with fewer than two)."""
    if n <= 1:
        return 0.0
    mean = (values * valid).sum() / n
    var = (values.square() * valid).sum() / n - mean.square()
    return var.clamp_min(0.0).sqrt().item()


def weight_distribution_metrics(weights: torch.Tensor, log_ratio: torch.Tensor, response_mask: torch.Tensor, *,
                                upper: float, lower: Optional[float] = None,
                                sequence_log_ratio: Optional[torch.Tensor] = None,
                                with_mean_and_ess: bool = False) -> dict[str, float]:
    """How the IS weights are spread, under ``rollout_correction/is_*`` (docs/metrics.md).

    ``weights``: the applied ``(B, T)`` weights; ``log_ratio``: the sanitised token log-ratios they came from (the
    raw, unbounded ratio is ``exp(log_ratio)``); ``upper``/``lower``: the IS mode's bounds (``lower`` defaults to
    ``1/upper`` for the shares below). ``sequence_log_ratio`` ``(B,)`` for a sequence mode: the raw ratio of a row is
    then ρ_seq = exp(that), and the bounds are judged per row. Token means run over valid tokens, row statistics
    over rows with a valid token. ``with_mean_and_ess``: also ``is_weight_mean`` and ``ess`` of these weights (the
    one-pass set's definitions), for weights that did not come from ``compute_correction``.
    """
    dtype = torch.float64
    valid = (response_mask != 0).to(dtype)
    n = valid.sum().item()
    w = weights.detach().to(dtype) * valid
    lo = 1.0 / upper if lower is None else lower
    rows_valid = valid.sum(dim=-1) > 0
    out: dict[str, float] = {}
    if with_mean_and_ess:
        total, squares = w.sum().item(), w.square().sum().item()
        out["is_weight_mean"] = total / n if n else 1.0
        out["ess"] = total ** 2 / (n * squares) if squares > 0 else (1.0 if n == 0 else 0.0)
    if sequence_log_ratio is not None:
        seq_lr = sequence_log_ratio.detach().to(dtype)
        raw = seq_lr.exp().unsqueeze(-1) * valid
    else:
        seq_lr = None
        raw = log_ratio.detach().to(dtype).exp() * valid
    if n > 0:
        vb = valid.bool()
        out["is_weight_max"] = w.masked_fill(~vb, -math.inf).max().item()
        out["is_weight_min"] = w.masked_fill(~vb, math.inf).min().item()
    else:
        out["is_weight_max"] = out["is_weight_min"] = 0.0
    out["is_weight_std"] = _masked_std(w, valid, n)
    if seq_lr is not None:
        live = seq_lr[rows_valid]
        out["is_ratio_fraction_high"] = (live > math.log(upper)).double().mean().item() if live.numel() else 0.0
        out["is_ratio_fraction_low"] = (live < math.log(lo)).double().mean().item() if live.numel() else 0.0
        out["is_seq_ratio_max"] = live.max().exp().item() if live.numel() else 1.0
        out["is_seq_ratio_min"] = live.min().exp().item() if live.numel() else 1.0
    else:
        out["is_ratio_fraction_high"] = ((raw > upper).to(dtype) * valid).sum().item() / n if n else 0.0
        out["is_ratio_fraction_low"] = ((raw < lo).to(dtype) * valid).sum().item() / n if n else 0.0
    per_row = valid.sum(dim=-1).clamp_min(1.0)
    seq_w = (w.sum(dim=-1) / per_row)[rows_valid]
    seq_raw = (raw.sum(dim=-1) / per_row)[rows_valid]
    weights_rows = _row_values_summary(seq_w, upper, lo, reference=1.0)
    raw_rows = _row_values_summary(seq_raw, upper, lo, reference=1.0)
    for key in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation"):
        out[f"is_{key}"] = weights_rows[key]
    out["is_seq_fraction_high"] = raw_rows["seq_fraction_high"]
    out["is_seq_fraction_low"] = raw_rows["seq_fraction_low"]
    return {PREFIX + k: float(v) for k, v in out.items()}


def rejection_rule_metrics(rules: Sequence[Any], log_ratio: torch.Tensor,
                           response_mask: torch.Tensor) -> dict[str, float]:
    """Each rejection rule's statistic and what the rule alone removed, under ``rollout_correction/rejection/<option>/*``.

    Per rule (a ``RejectionRule`` of ``CorrectionConfig.rejection_rules``), on the sanitised token log-ratios: the
    statistic S (per token K1 = −lr, K2, K3; per sequence their sum, mean or max), with its bounds ``hi``
    (``log hi`` for K1) and, for K1 only, ``log lo``:

    * ``mean``: the token mean of S (a sequence rule's S counted once per valid token of its row);
    * ``max``/``min``: over valid tokens (token rules) or valid rows (sequence rules);
    * ``fraction_high``/``fraction_low``: the share above ``hi`` / below ``log lo`` (0 for K2/K3), over the same;
    * ``std``: the token std of S clamped to its bounds ([0, hi] for K2/K3);
    * ``seq_*``: over valid rows of S (a token rule's row value is its row mean): mean, std (unbiased),
      max, min, max |S|, the shares above ``hi`` and (K1) below ``log lo``;
    * ``masked_fraction`` / ``seq_masked_fraction``: the share of valid tokens / valid rows this rule rejects.
    """
    from .ratios import TokenStats  # the same estimators the correction used (imported here: no cycle)
    from .correction import rejection_keep

    dtype = torch.float64
    valid_f = (response_mask != 0).to(log_ratio.dtype)
    stats = TokenStats(log_ratio.detach(), valid_f, torch.zeros_like(valid_f))
    valid = valid_f.to(dtype)
    vb = valid.bool()
    n = valid.sum().item()
    rows_valid = valid.sum(dim=-1) > 0
    n_rows = int(rows_valid.sum().item())
    per_row = valid.sum(dim=-1).clamp_min(1.0)
    out: dict[str, float] = {}
    for rule in rules:
        k1 = rule.estimator == "k1"
        hi = math.log(rule.upper) if k1 else rule.upper
        lo = math.log(rule.lower) if k1 else 0.0
        token_stat = stats.estimator(rule.estimator).to(dtype) * valid
        if rule.level == "token":
            per_token = token_stat
            rows = (token_stat.sum(dim=-1) / per_row)[rows_valid]
            over, over_n = per_token.masked_select(vb), n
        else:
            if rule.level == "seq_sum":
                seq = token_stat.sum(dim=-1)
            elif rule.level == "seq_mean":
                seq = token_stat.sum(dim=-1) / per_row
            else:
                seq = token_stat.masked_fill(~vb, -math.inf).amax(dim=-1)
                seq = torch.where(rows_valid, seq, torch.zeros_like(seq))
            per_token = seq.unsqueeze(-1) * valid
            rows = seq[rows_valid]
            over, over_n = rows, n_rows
        name = f"rejection/{rule.option}/"
        m = {"mean": per_token.sum().item() / n if n else 0.0}
        if over.numel():
            m.update(max=over.max().item(), min=over.min().item(),
                     fraction_high=(over > hi).double().sum().item() / over_n,
                     fraction_low=(over < lo).double().sum().item() / over_n if k1 else 0.0)
        else:
            m.update(max=0.0, min=0.0, fraction_high=0.0, fraction_low=0.0)
        m["std"] = _masked_std(per_token.clamp(min=lo, max=hi), valid, n)
        m.update(_row_values_summary(rows, hi, lo, reference=0.0, with_low=k1))
        seq_keep, token_keep = rejection_keep((rule,), stats)
        keep = valid * seq_keep.to(dtype).unsqueeze(-1)
        if token_keep is not None:
            keep = keep * token_keep.to(dtype)
        removed = valid - keep
        m["masked_fraction"] = removed.sum().item() / n if n else 0.0
        m["seq_masked_fraction"] = ((removed.sum(dim=-1) > 0)[rows_valid]).double().sum().item() / n_rows \
            if n_rows else 0.0
        out.update({PREFIX + name + k: float(v) for k, v in m.items()})
    return out


def perplexity_metrics(logprobs: torch.Tensor, response_mask: torch.Tensor, name: str = "training") -> dict[str, float]:
    """``<name>_ppl`` and ``<name>_log_ppl`` of one policy alone (no second logprob needed): the row means of
    −log π over each row's finite valid tokens, then ``mean_i`` of them and of their ``exp``, in float64, over rows
    with such a token (the definitions of the one-pass set, docs/metrics.md)."""
    dtype = torch.float64
    lp = logprobs.detach().to(dtype)
    use = (response_mask != 0).to(dtype) * torch.isfinite(lp).to(dtype)
    counts = use.sum(dim=-1)
    rows = counts > 0
    neg_mean = -(torch.where(use > 0, lp, torch.zeros_like(lp)).sum(dim=-1) / counts.clamp_min(1.0))[rows]
    if neg_mean.numel() == 0:
        return {PREFIX + f"{name}_ppl": 1.0, PREFIX + f"{name}_log_ppl": 0.0}
    return {PREFIX + f"{name}_ppl": neg_mean.exp().mean().item(), PREFIX + f"{name}_log_ppl": neg_mean.mean().item()}
