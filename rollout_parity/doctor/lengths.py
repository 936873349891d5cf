"""Rejection thresholds that fit the user's answer length, predicted from short measured completions.

A sum over tokens grows with the answer: ``seq_sum_k3`` at parity is about ``L x`` the mean
per-token K3, so a threshold set at one length rejects healthy data at a longer one (the paper's
0.001 was set for 8,192-token answers whose tokens are mostly bit-identical). The doctor measures
``M`` tokens per completion (``--max_tokens``) and predicts at the user's length ``L``
(``--response_length``) by a block bootstrap: a pseudo-answer of ``L`` tokens is whole measured
completions of the same row, drawn with replacement and concatenated (so the structure inside a
completion is kept), ``DRAWS`` of them; the statistic or the full correction is then computed on
them as on a real batch. It assumes later tokens of a long answer mismatch like the first ``M``;
``integration_tests/test_doctor_lengths.py`` checks it against completions measured at ``L``.

The advice (:func:`fit_rejection`) never prints a rejection that drops more than :data:`BUDGET` of
the parity rows' sequences (the recipe row ``d`` and, with a truncating sampler, ``s/sampler``), and
at a length it only predicts, no more than :data:`UNMEASURED` of that:

* ``seq_mean_*`` (length-normalised) is fitted at ``M``, where its spread is widest, and checked at
  ``L`` (or at :data:`REFERENCE_LENGTHS` when no length is given): a mean concentrates as ``L`` grows;
* ``seq_sum_*`` needs the length: without ``--response_length`` the advice switches to ``seq_mean_*``;
  with it, the sum is fitted at ``L`` unless the mismatch is dense (a healthy answer's median sum
  reaches the preset's threshold or :data:`DENSE_SHARE` of the fitted one, so the threshold mostly
  measures length; or nothing within 100x the preset fits), in which case it switches too;
* ``seq_max_*`` grows with ``L`` as well: fitted at ``L``, or replaced by the token-level option;
* token-level options are fitted on the share of tokens they remove.

A fitted threshold only loosens the preset's (the smallest value of :data:`GRID` that fits). K1
options and several options at once are left as they are and only predicted. docs/thresholds.md.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

from rollout_parity.core.config import CorrectionConfig, parse_rejection
from rollout_parity.core.correction import compute_correction
from rollout_parity.core.ratios import TokenStats, sanitized_log_ratio

__all__ = ["BUDGET", "UNMEASURED", "DENSE_SHARE", "DRAWS", "GRID", "REFERENCE_LENGTHS", "resample", "statistic",
           "dropped_share", "fit_rejection", "length_scan", "tokens_to_json", "tokens_from_report", "predict_dropped",
           "extrapolation"]

#: The advice never drops more than this share of the parity rows' sequences (or tokens, token-level).
BUDGET = 0.05
#: At a length it did not measure the doctor fits to this share of the budget: there the prediction
#: assumes later tokens mismatch like the first measured ones. They need not: the built-in model's 832-token
#: completions had 2.1-2.7x the K3 per token of their first 32 (|delta| 1.1x; its positions past the 384 it
#: was trained on), a model trained on 1,024-token windows 0.2-0.3x (integration_tests/test_doctor_lengths.py).
#: A mean is therefore also fitted at the measured length, where its spread is widest.
UNMEASURED = 0.5
#: A sum's mismatch is dense when a healthy answer's median sum reaches this share of the fitted threshold.
DENSE_SHARE = 0.1
#: Pseudo-answers per prediction.
DRAWS = 400
#: Lengths the advice is checked at when the user gives none.
REFERENCE_LENGTHS = (1024, 8192)
#: Thresholds tried: 1, 2, 3, 5 x 10^e.
GRID = tuple(sorted(float(f"{m}e{e}") for e in range(-7, 2) for m in (1, 2, 3, 5)))

Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (pi_old, pi_rollout, mask), each (B, M)


def extrapolation(measured: int, length: Optional[int], prompt_tokens: int,
                  trained_window: Optional[int] = None) -> Optional[dict[str, Any]]:
    """What a prediction at ``length`` takes on trust: tokens ``measured + 1 .. length`` of an answer, never
    measured, mismatching like its first ``measured``. ``None`` at a measured length.

    ``trained_window``: the sequence length the model was trained on, where known (the built-in model's). A
    predicted answer after a ``prompt_tokens`` prompt that reaches past it runs positions the model never
    trained on, where the bf16 engine and trainer may part more per token than the measured tokens show
    (the built-in model did, on every vLLM release measured: docs/thresholds.md): ``beyond_training``.
    """
    if length is None or length <= measured:
        return None
    last = prompt_tokens + length
    return {"assumes": f"tokens {measured + 1}-{length} of an answer mismatch like its first {measured} (not measured)",
            "last_position": last, "trained_window": trained_window,
            "beyond_training": trained_window is not None and last > trained_window}


def resample(tensors: Tensors, length: int, draws: int = DRAWS, seed: int = 0, group: int = 1) -> Tensors:
    """``draws`` pseudo-answers of ``length`` tokens: whole measured completions concatenated, then cut.

    ``group``: consecutive rows that answer one prompt (a GRPO group). Prompts differ in how much the
    engines disagree on the text they lead to, and a long answer carries its prompt's level through all
    its tokens: each pseudo-answer draws one group and takes each completion from it with probability
    ``q``, else from any group. ``q = sqrt(tau2 / v)``, with ``v`` the variance of the groups' mean K3
    (each token's K3 capped at the 99th percentile: the bulk's level, not a rare spike's) and
    ``tau2 = v - s2 / group`` its part not explained by the spread inside groups (``s2``): the
    between-prompt variance, without the noise of estimating each group's mean from ``group`` samples
    (drawing only from the group would count that noise once per completion of the answer).
    """
    old, rollout, mask = tensors
    valid = mask != 0
    lengths = valid.sum(-1)
    keep = lengths > 0
    if not bool(keep.any()):
        raise ValueError("no measured tokens to resample")
    flat_old, flat_rollout = old[valid], rollout[valid]
    starts = torch.cumsum(lengths, 0) - lengths
    rows = keep.nonzero().squeeze(-1)
    gen = torch.Generator().manual_seed(seed)
    per = max(1, math.ceil(length / max(1, int(lengths[rows].min())))) + 1
    picks = rows[torch.randint(0, rows.numel(), (draws, per), generator=gen)]
    q = _within_group_share(tensors, group) if bool(keep.all()) else 0.0
    if q > 0.0:
        first = torch.randint(0, old.shape[0] // group, (draws, 1), generator=gen) * group
        own = first + torch.randint(0, group, (draws, per), generator=gen)
        picks = torch.where(torch.rand(draws, per, generator=gen) < q, own, picks)
    # token positions of the concatenation: for each draw, the picked completions' tokens in turn
    counts = lengths[picks]
    if bool((lengths[rows] == lengths[rows][0]).all()):  # equal completions (the doctor's): one gather
        m = int(lengths[rows][0])
        index = (starts[picks][:, :, None] + torch.arange(m)).reshape(draws, -1)[:, :length]
        return flat_old[index], flat_rollout[index], torch.ones(draws, length, dtype=mask.dtype)
    index = torch.empty(draws, length, dtype=torch.long)
    for d in range(draws):
        pieces, total = [], 0
        for p, n in zip(picks[d].tolist(), counts[d].tolist()):
            pieces.append(torch.arange(int(starts[p]), int(starts[p]) + n))
            total += n
            if total >= length:
                break
        index[d] = torch.cat(pieces)[:length]
    return flat_old[index], flat_rollout[index], torch.ones(draws, length, dtype=mask.dtype)


def _within_group_share(tensors: Tensors, group: int) -> float:
    """``q`` of :func:`resample`: 0 without groups or without spread between them."""
    rows = tensors[0].shape[0]
    if group < 2 or rows % group or rows // group < 2:
        return 0.0
    # each completion's level of mismatch from its bulk: a rare spike token would make its group look apart
    # and then be drawn once per completion of every pseudo-answer from that group
    s = _stats(tensors)
    k3 = s.estimator("k3")
    cap = float(k3[s.valid_f != 0].quantile(0.99)) if bool((s.valid_f != 0).any()) else 0.0
    x = (k3.clamp(max=cap) * s.valid_f).sum(-1) / s.tokens_per_seq.clamp_min(1.0)
    x = x.reshape(rows // group, group)
    between = float(x.mean(-1).var())
    within = float(x.var(-1).mean())
    if not between > 0:
        return 0.0
    return math.sqrt(max(0.0, between - within / group) / between)


def _stats(tensors: Tensors) -> TokenStats:
    old, rollout, mask = tensors
    valid_f = (mask != 0).to(torch.float64)
    log_ratio, nonfinite = sanitized_log_ratio(old.to(torch.float64), rollout.to(torch.float64), valid_f)
    return TokenStats(log_ratio, valid_f, nonfinite)


def statistic(option: str, tensors: Tensors) -> torch.Tensor:
    """The rejection statistic of ``option`` (e.g. ``seq_sum_k3``): per sequence, or per valid token (token level)."""
    rule = parse_rejection([option], 1.0)[0]
    s = _stats(tensors)
    if rule.level == "token":
        return s.estimator(rule.estimator)[s.valid_f != 0]
    if rule.level == "seq_sum":
        return s.row_sum(rule.estimator)
    if rule.level == "seq_mean":
        return s.row_sum(rule.estimator) / s.tokens_per_seq.clamp_min(1.0)
    return s.estimator(rule.estimator).amax(dim=-1)


def dropped_share(cfg: CorrectionConfig, tensors: Tensors) -> float:
    """The share of sequences ``cfg`` takes wholly out of the loss (rejected or weighted 0), by ``compute_correction``."""
    old, rollout, mask = tensors
    out = compute_correction(cfg.replace(log_rollout_offpolicy_metrics=False), old_logprobs=old,
                             rollout_logprobs=rollout, response_mask=mask, with_metrics=False)
    alive = (out.mask.to(torch.float64) * out.weights.to(torch.float64)).abs().sum(-1) > 0
    has_tokens = (mask != 0).any(-1)
    n = int(has_tokens.sum())
    return float((has_tokens & ~alive).sum()) / n if n else 0.0


def tokens_to_json(tensors: Tensors) -> dict[str, list[str]]:
    """One row's measured ``(pi_old, pi_rollout, mask)`` for the JSON report: per completion, one string of
    its valid tokens' logprobs (space-separated, float32's 9 significant digits: exact).

    The mask of a doctor row is a prefix per completion (right padding), so :func:`tokens_from_report`
    gives back the same tensors and a saved run predicts any flags at any length without an engine
    (:func:`predict_dropped`).
    """
    old, rollout, mask = tensors
    valid = mask != 0
    n = valid.sum(-1)
    if not bool((valid == (torch.arange(mask.shape[1]) < n[:, None])).all()):
        raise ValueError("tokens_to_json: the mask must be a prefix of each completion (right padding)")

    def rows(t: torch.Tensor) -> list[str]:
        return [" ".join(f"{x:.9g}" for x in t[r, : int(n[r])].tolist()) for r in range(t.shape[0])]

    return {"trainer_logprobs": rows(old), "rollout_logprobs": rows(rollout)}


def tokens_from_report(report: Mapping[str, Any]) -> dict[str, Tensors]:
    """The parity rows' ``(pi_old, pi_rollout, mask)`` saved in a doctor report (``lengths.tokens``)."""
    out = {}
    for name, saved in ((report.get("lengths") or {}).get("tokens") or {}).items():
        seqs = [([float(x) for x in o.split()], [float(x) for x in ro.split()])
                for o, ro in zip(saved["trainer_logprobs"], saved["rollout_logprobs"], strict=True)]
        width = max((len(o) for o, _ in seqs), default=0)
        old, rollout, mask = (torch.zeros(len(seqs), width, dtype=torch.float32) for _ in range(3))
        for r, (o, ro) in enumerate(seqs):
            if len(o) != len(ro):
                raise ValueError(f"tokens_from_report: row {name!r} completion {r} has {len(o)} trainer and "
                                 f"{len(ro)} rollout logprobs")
            old[r, : len(o)] = torch.tensor(o, dtype=torch.float32)
            rollout[r, : len(ro)] = torch.tensor(ro, dtype=torch.float32)
            mask[r, : len(o)] = 1.0
        out[name] = (old, rollout, mask)
    if not out:
        raise ValueError("tokens_from_report: the report holds no measured tokens (lengths.tokens); rerun the "
                         "doctor with --json")
    return out


def predict_dropped(cfg: CorrectionConfig, report: Mapping[str, Any], length: int) -> dict[str, float]:
    """Each saved parity row's share of sequences ``cfg`` drops at ``length`` tokens, as the doctor predicts it.

    The doctor's own ``rej@L`` for a saved run: the measured completions at their length, or pseudo-answers
    of ``length`` tokens (:func:`resample`, with the run's seed and GRPO group) scored by the full correction.
    """
    opts = report.get("options") or {}
    measured = int((report.get("lengths") or {}).get("measured") or report["sampling"]["max_tokens"])
    seed, group = int(opts.get("seed", 0)), int(opts.get("samples", 1))
    return {name: dropped_share(cfg, _at(t, measured, length, seed, group))
            for name, t in tokens_from_report(report).items()}


def _at(tensors: Tensors, measured: int, length: int, seed: int, group: int = 1) -> Tensors:
    return tensors if length == measured else resample(tensors, length, seed=seed, group=group)


def length_scan(options: list[str], rows: Mapping[str, Tensors], measured: int, lengths: list[int],
                seed: int = 0, group: int = 1) -> list[dict[str, Any]]:
    """For each option and grid threshold: every row's share above it at each length (measured at ``measured``)."""
    out = []
    for option in options:
        values = {name: {n: statistic(option, _at(t, measured, n, seed, group)) for n in lengths}
                  for name, t in rows.items()}
        for tau in GRID:
            out.append({"option": option, "threshold": tau,
                        "rows": {name: {str(n): float((v > tau).double().mean()) if v.numel() else 0.0
                                        for n, v in per.items()} for name, per in values.items()}})
    return out


def _fit(option: str, rows: Mapping[str, Tensors], measured: int, lengths: list[int], floor: float, seed: int,
         group: int = 1) -> tuple[Optional[float], dict[str, dict[int, float]]]:
    """The smallest grid threshold >= ``floor`` that keeps every row within the budget at every length."""
    values = {name: {n: statistic(option, _at(t, measured, n, seed, group)) for n in lengths}
              for name, t in rows.items()}
    for tau in [floor] + [g for g in GRID if g > floor]:
        shares = {name: {n: float((v > tau).double().mean()) if v.numel() else 0.0 for n, v in per.items()}
                  for name, per in values.items()}
        if all(s <= (BUDGET if n == measured else BUDGET * UNMEASURED) for per in shares.values()
               for n, s in per.items()):
            return tau, shares
    return None, {}


def fit_rejection(cfg: CorrectionConfig, rows: Mapping[str, Tensors], measured: int, length: Optional[int],
                  seed: int = 0, group: int = 1) -> dict[str, Any]:
    """The rejection advice for ``cfg`` on the parity ``rows``: option, threshold, why, predicted shares.

    Returns a dict with ``option`` and ``threshold`` (None: leave the preset's rejection as it is),
    ``reason`` (one line, or None when the preset stands), ``checked_at`` (lengths) and ``shares``
    (row -> length -> share, of sequences; of tokens for a token-level option).
    """
    rules = cfg.rejection_rules
    checked = sorted({measured, *( [length] if length else REFERENCE_LENGTHS)})
    if len(rules) != 1 or rules[0].estimator == "k1" or not rows:
        return {"option": None, "threshold": None, "reason": None, "checked_at": checked, "shares": {}}
    rule = rules[0]
    preset, est = float(rule.upper), rule.estimator
    name = f"{rule.level}_{est}"

    def advice(option, tau, shares, reason):
        return {"option": option, "threshold": tau, "reason": reason, "checked_at": checked, "shares": shares,
                "preset_option": name, "preset_threshold": preset}

    def as_mean(why):
        mean = f"seq_mean_{est}"
        tau, shares = _fit(mean, rows, measured, checked, GRID[0], seed, group)
        if tau is None:
            return advice(None, None, {}, f"{why}; {mean} fits no threshold up to {GRID[-1]:g} either: drop the "
                          "rejection")
        return advice(mean, tau, shares, f"{why}; the lines use {mean} at {tau:g} (length-normalised: "
                      f"at most {_worst(shares):.1%} of the parity rows' sequences at "
                      f"{', '.join(f'{n:,}' for n in checked)} tokens)")

    if rule.level == "seq_sum":
        if length is None:
            return as_mean(f"{name} sums over the answer, so no one threshold fits every length (at parity it "
                           f"grows {_per_token(rows, est, measured):.1e} per token here); give --response_length "
                           "to fit a sum to yours")
        tau, shares = _fit(name, rows, measured, [length], preset, seed, group)
        typical = max(float(statistic(name, _at(t, measured, length, seed, group)).median()) for t in rows.values())
        # dense: a healthy answer of this length already sums to the preset's own threshold, or to a tenth of the
        # one fitted (then the threshold mostly measures length); or no threshold within 100x the preset fits
        if tau is not None and typical < preset and typical < DENSE_SHARE * tau and tau <= 100 * preset:
            reason = None if tau == preset else (f"{name} at {preset:g} drops more than {BUDGET:.0%} of the parity "
                                                 f"rows' sequences at {length:,} tokens: the lines use {tau:g}, set "
                                                 f"for answers of up to {length:,} tokens")
            return advice(name, tau, shares, reason)
        return as_mean(f"{name} does not fit {length:,}-token answers: at parity a healthy one already sums to "
                       f"{typical:.2g} (median; the preset's threshold is {preset:g}): dense mismatch, a sum threshold "
                       "mostly measures length")
    if rule.level == "seq_max" and length is None:
        token = f"token_{est}"
        tau, shares = _fit(token, rows, measured, [measured], preset, seed, group)
        return advice(token, tau, shares, f"{name} looks at more tokens the longer the answer, so no one threshold "
                      f"fits every length; the lines use {token} at {tau:g} (it removes the token only)")
    at = [measured] if rule.level == "token" else (checked if rule.level == "seq_mean" else [length])
    tau, shares = _fit(name, rows, measured, at, preset, seed, group)
    if tau is None:
        return advice(None, None, {}, f"{name}: no threshold up to {GRID[-1]:g} keeps {1 - BUDGET:.0%} of the parity "
                      "rows; drop the rejection")
    reason = None if tau == preset else (f"{name} at {preset:g} drops more than {BUDGET:.0%} of the parity rows "
                                         f"(noise, not mismatch): the lines use {tau:g}")
    return advice(name, tau, shares, reason)


def _worst(shares: Mapping[str, Mapping[Any, float]]) -> float:
    return max((s for per in shares.values() for s in per.values()), default=0.0)


def _per_token(rows: Mapping[str, Tensors], est: str, measured: int) -> float:
    return max(float(statistic(f"seq_mean_{est}", t).mean()) for t in rows.values())
