"""A deliberately naive, per-token Python re-implementation of docs/flags.md, to check the core against.

Plain floats (float64) and loops over sequences and tokens, written from that page's text, the
seeds (../shared/seeds/ms-swift-rollout-importance-sampling.txt for the diagnostics,
../shared/seeds/tim-diagnosis-paper.txt for δ_t, K1/K2/K3, rejection and C(r)) and verl's
published metric definitions, not from the core's code. It imports nothing from
``rollout_parity``: it takes the *raw* flags (a dict as written in YAML or passed to
``CorrectionConfig``) and parses them itself, so a parsing bug in the package cannot hide
behind the same parsing here.

Inputs are nested lists: ``old``, ``rollout``, ``current`` ``[B][T]`` logprobs, ``mask``
``[B][T]`` 0/1, ``advantages`` ``[B]`` or ``[B][T]``.

Bad-input rules (docs/flags.md, "Bad input"), one token at a time:

* the token log-ratio log r = num − den: a NaN (or +inf, which no logprob can be) on either
  side is neutral, log r = 0 (weight 1); −inf on one side is maximal mismatch, log r = ±20;
  −inf on both sides agree, log r = 0. Every log-ratio is clamped to ±20.
* a valid token with any non-finite logprob among those the correction reads is counted in
  ``nonfinite_frac``, and drifts 0 in the off-policy mask and contributes 0 to C(r); except that
  a −inf π_θ beside a finite behaviour logprob is infinite drift: its sequence's δ is +inf.
* in the loss, a NaN/+inf π_old is neutral (ratio 1, the token keeps ∇ log π_θ); a −inf
  π_θ or π_old is maximal mismatch (ratio at its bound, no gradient; ratio 1 if the other
  side is NaN or −inf too); a NaN/+inf π_θ has no value and no gradient to give, so the
  token leaves the loss.
* an empty batch logs the on-policy values (ratios 1, KL and fractions 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

BOUND = 20.0
INF = math.inf

#: The first flags of docs/flags.md's table: name -> default.
DEFAULTS = {
    "rollout_importance_sampling_mode": None,
    "rollout_importance_sampling_threshold": 2.0,
    "rollout_importance_sampling_threshold_lower": None,
    "rollout_importance_sampling_sequence_reduction": "geometric_mean",
    "rollout_importance_sampling_sequence_mask_weight": "token",
    "rollout_rejection": None,
    "rollout_rejection_threshold": None,  # "—": no default, required with rollout_rejection
    "off_policy_sequence_mask_delta": None,
    "old_logprob_source": "recompute",
    "log_rollout_offpolicy_metrics": False,
    "fp32_lm_head": False,
}
#: The later flags of docs/flags.md's table (they came with the parity layer and the weight-sync check);
#: none of them changes the correction (replay changes pi_old, which the reference takes as given), so the
#: reference ignores them.
LATER_DEFAULTS = {
    "weight_sync_check_interval": None,
    "weight_sync_check_threshold": 0.05,
    "moe_routing_replay": False,
    "rollout_sampling_replay": False,
    "compile_correction": False,
    "precision": None,
}


# ----------------------------------------------------------------------------- flags


@dataclass
class Rule:
    """One rejection option: ``level`` token/seq_sum/seq_mean/seq_max, ``k`` k1/k2/k3.

    K2/K3 keep a statistic ``<= hi``; K1 keeps ``lo <= exp(statistic) <= hi``.
    """

    level: str
    k: str
    hi: float
    lo: float | None = None


def _k1_range(spec):
    """docs/flags.md: K1 takes ``"lo_hi"`` or a pair; one value ``hi`` means ``[1/hi, hi]``."""
    if isinstance(spec, str):
        values = [float(v) for v in spec.split("_")]
    elif isinstance(spec, (list, tuple)):
        values = [float(v) for v in spec]
    else:
        values = [float(spec)]
    if len(values) == 1:
        return 1.0 / values[0], values[0]
    lo, hi = values
    return lo, hi


def parse_flags(raw: dict) -> dict:
    """The shared flags with their defaults filled in and the rejection options parsed."""
    unknown = set(raw) - set(DEFAULTS) - {"description"}
    if unknown:
        raise KeyError(f"not a shared flag: {sorted(unknown)}")
    f = dict(DEFAULTS)
    f.update({k: v for k, v in raw.items() if k != "description"})
    if f["rollout_importance_sampling_mode"] in ("null", "none", "None", ""):
        f["rollout_importance_sampling_mode"] = None
    options = f["rollout_rejection"]
    if isinstance(options, str):
        options = [o.strip() for o in options.split(",") if o.strip()]
    rules = []
    if options:
        spec = f["rollout_rejection_threshold"]
        if isinstance(spec, str) and "," in spec:
            spec = [s.strip() for s in spec.split(",")]
        if not isinstance(spec, (list, tuple)):
            per_option = [spec] * len(options)
        elif len(spec) == len(options):
            per_option = list(spec)
        elif len(spec) == 1:
            per_option = list(spec) * len(options)
        else:  # one K1 option given as a pair [lo, hi]
            assert len(options) == 1 and options[0].endswith("k1") and len(spec) == 2, (options, spec)
            per_option = [spec]
        for option, s in zip(options, per_option):
            level, k = option.rsplit("_", 1)
            if k == "k1":
                lo, hi = _k1_range(s)
                rules.append(Rule(level, k, hi, lo))
            else:
                rules.append(Rule(level, k, float(s)))
    f["rules"] = rules
    return f


# ----------------------------------------------------------------------------- tokens


def clamp(x, lo=-BOUND, hi=BOUND):
    return max(lo, min(hi, x))


def is_nan_like(x):
    """NaN, or +inf, which no logprob can be: no information."""
    return math.isnan(x) or x == INF


def token_log_ratio(num, den):
    """log(num/den) of two logprobs under the bad-input rule, clamped to ±20."""
    if is_nan_like(num) or is_nan_like(den):
        return 0.0
    if num == -INF and den == -INF:
        return 0.0
    if num == -INF:
        return -BOUND
    if den == -INF:
        return BOUND
    return clamp(num - den)


def K(estimator, x):
    """Paper §4.2 on log r = x: K1 = −log r, K2 = ½(log r)², K3 = r − 1 − log r."""
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x * x
    return math.exp(x) - 1.0 - x


def _adv(advantages, i, t):
    a = advantages[i]
    return a[t] if isinstance(a, (list, tuple)) else a


# ----------------------------------------------------------------------------- correction


@dataclass
class Naive:
    """Everything the naive correction decides, per token ``[B][T]`` or per sequence ``[B]``."""

    weights: list
    keep: list  # bool: the response mask after rejection and off-policy masking
    log_ratio: list  # sanitised log r_corr (0 on padding)
    clipped: list  # bool: weight truncated or zeroed by the IS mode
    rejected: list  # bool: removed by a rejection rule
    nonfinite: list  # bool: valid token with a non-finite logprob among those read
    off_policy: list  # bool per sequence
    seq_log_ratio: list  # per sequence, clamped
    flags: dict = field(default_factory=dict)


def naive_correction(raw_flags, old, rollout, mask, advantages=None, current=None) -> Naive:
    """The corrections for one batch, token by token."""
    f = parse_flags(raw_flags)
    bypass = f["old_logprob_source"] == "bypass"
    mode = f["rollout_importance_sampling_mode"]
    C = float(f["rollout_importance_sampling_threshold"])
    lo = f["rollout_importance_sampling_threshold_lower"]
    base = current if bypass else old
    B, T = len(mask), len(mask[0])
    # The logprobs the correction reads: π_old (π_θ under bypass) and π_rollout for r_corr,
    # π_θ (metrics, off-policy mask), π_old when the off-policy mask falls back to it.
    read = [x for x in (base, rollout, current) if x is not None]
    if rollout is None and old is not None:
        read.append(old)

    out = Naive([[1.0] * T for _ in range(B)], [[bool(mask[i][t]) for t in range(T)] for i in range(B)],
                [[0.0] * T for _ in range(B)], [[False] * T for _ in range(B)], [[False] * T for _ in range(B)],
                [[False] * T for _ in range(B)], [False] * B, [0.0] * B, f)
    for i in range(B):
        toks = [t for t in range(T) if mask[i][t]]
        for t in toks:
            out.nonfinite[i][t] = any(not math.isfinite(x[i][t]) for x in read)
            if rollout is not None and base is not None:
                out.log_ratio[i][t] = token_log_ratio(base[i][t], rollout[i][t])
        lrs = {t: out.log_ratio[i][t] for t in toks}
        total = sum(lrs.values())
        if f["rollout_importance_sampling_sequence_reduction"] == "geometric_mean":
            seq_lr = total / len(toks) if toks else 0.0
        else:
            seq_lr = total
        seq_lr = clamp(seq_lr)
        out.seq_log_ratio[i] = seq_lr
        rho = math.exp(seq_lr)

        # Importance-sampling weights (docs/flags.md, the four modes).
        if mode is not None:
            seq_inside = rho <= C and (lo is None or rho >= lo)
            for t in range(T):
                if not mask[i][t]:
                    out.weights[i][t] = 0.0
                    continue
                r = math.exp(lrs[t])
                tok_inside = r <= C and (lo is None or r >= lo)
                if mode == "token_truncate":
                    w = min(r, C)
                    out.weights[i][t] = max(w, lo) if lo is not None else w
                    out.clipped[i][t] = not tok_inside
                elif mode == "token_mask":
                    out.weights[i][t] = r if tok_inside else 0.0
                    out.clipped[i][t] = not tok_inside
                elif mode == "sequence_truncate":
                    w = min(rho, C)
                    out.weights[i][t] = max(w, lo) if lo is not None else w
                    out.clipped[i][t] = not seq_inside
                else:  # sequence_mask
                    kept = r if f["rollout_importance_sampling_sequence_mask_weight"] == "token" else rho
                    out.weights[i][t] = kept if seq_inside else 0.0
                    out.clipped[i][t] = not seq_inside

        # Rejection (paper §4.2): every rule must keep a token or sequence.
        for rule in f["rules"]:
            def ok(s, rule=rule):
                if rule.k == "k1":
                    return rule.lo <= math.exp(s) <= rule.hi
                return s <= rule.hi

            if rule.level == "token":
                for t in toks:
                    if not ok(K(rule.k, lrs[t])):
                        out.rejected[i][t] = True
            else:
                vals = [K(rule.k, lrs[t]) for t in toks]
                if rule.level == "seq_sum":
                    s = sum(vals)
                elif rule.level == "seq_mean":
                    s = sum(vals) / len(vals) if vals else 0.0
                else:
                    s = max(vals) if vals else 0.0
                if not ok(s):
                    for t in toks:
                        out.rejected[i][t] = True
        for t in toks:
            if out.rejected[i][t]:
                out.keep[i][t] = False

        # Off-policy sequence mask (DeepSeek-V3.2): δ_i = mean_t(log π_behaviour − log π_θ) > δ and A_i < 0.
        delta = f["off_policy_sequence_mask_delta"]
        if delta is not None and toks:
            behaviour = rollout if rollout is not None else old
            drift = sum(behaviour[i][t] - current[i][t] for t in toks if not out.nonfinite[i][t])
            d_i = drift / len(toks)
            # π_θ gives no mass to a token the behaviour policy sampled: infinite drift, maximal mismatch
            if any(current[i][t] == -math.inf and math.isfinite(behaviour[i][t]) for t in toks):
                d_i = math.inf
            a_i = sum(_adv(advantages, i, t) for t in toks) / len(toks)
            if d_i > delta and a_i < 0:
                out.off_policy[i] = True
                for t in toks:
                    out.keep[i][t] = False
    return out


# ----------------------------------------------------------------------------- diagnostics


def naive_metrics(raw_flags, old, rollout, mask, corr: Naive, advantages=None, current=None) -> dict:
    """Every ``rollout_correction/*`` diagnostic from its definition (module doc of
    ``rollout_parity/core/metrics.py`` lists them; ms-swift's and verl's are the source).

    Token means are over valid tokens, sequence means over sequences with a valid token.
    """
    f = corr.flags or parse_flags(raw_flags)
    bypass = f["old_logprob_source"] == "bypass"
    base = current if bypass else old
    B, T = len(mask), len(mask[0])
    valid = [(i, t) for i in range(B) for t in range(T) if mask[i][t]]
    seqs = [i for i in range(B) if any(mask[i])]
    n, S = len(valid), len(seqs)

    def tok_mean(values, empty=0.0):
        values = list(values)
        return sum(values) / n if n else empty

    def seq_mean(values, empty=0.0):
        values = list(values)
        return sum(values) / S if S else empty

    lr = {(i, t): corr.log_ratio[i][t] for i, t in valid}
    if f["rollout_importance_sampling_mode"] is not None:
        w = [corr.weights[i][t] for i, t in valid]
    else:  # diagnostics only: the weight an IS correction would start from, r
        w = [math.exp(lr[k]) for k in valid]
    sum_w2 = sum(x * x for x in w)
    if n == 0:
        ess = 1.0
    else:
        ess = sum(w) ** 2 / (n * sum_w2) if sum_w2 > 0 else 0.0

    # Perplexities per sequence over the tokens whose two logprobs are finite.
    train_lp, roll_lp = [], []
    for i in seqs:
        fin = [t for t in range(T) if mask[i][t] and math.isfinite(base[i][t]) and math.isfinite(rollout[i][t])]
        if fin:
            train_lp.append(sum(base[i][t] for t in fin) / len(fin))
            roll_lp.append(sum(rollout[i][t] for t in fin) / len(fin))
    lpd = [r - t for r, t in zip(roll_lp, train_lp)]

    def ppl_mean(values, empty):
        return sum(values) / len(values) if values else empty

    # C(r) = −(r − 1) A (paper eq. 5) over the tokens whose logprobs are all finite, split by sign of A.
    c = {"pos": 0.0, "neg": 0.0, "rollout_pos": 0.0, "rollout_neg": 0.0}
    if advantages is not None and current is not None:
        old_for_ppo = rollout if bypass else old
        for i, t in valid:
            if corr.nonfinite[i][t]:
                continue
            a = _adv(advantages, i, t)
            sign = "pos" if a > 0 else "neg" if a < 0 else None
            if sign is None:
                continue
            r_train = math.exp(clamp(current[i][t] - old_for_ppo[i][t]))
            r_roll = math.exp(clamp(current[i][t] - rollout[i][t]))
            c[sign] += -(r_train - 1.0) * a
            c["rollout_" + sign] += -(r_roll - 1.0) * a

    m = {
        "k1_mean": tok_mean(-lr[k] for k in valid),
        "k3_kl": tok_mean(K("k3", lr[k]) for k in valid),
        "training_ppl": ppl_mean([math.exp(-x) for x in train_lp], 1.0),
        "training_log_ppl": ppl_mean([-x for x in train_lp], 0.0),
        "rollout_ppl": ppl_mean([math.exp(-x) for x in roll_lp], 1.0),
        "rollout_log_ppl": ppl_mean([-x for x in roll_lp], 0.0),
        "log_ppl_diff": ppl_mean(lpd, 0.0),
        "log_ppl_abs_diff": ppl_mean([abs(x) for x in lpd], 0.0),
        "log_ppl_diff_max": max(lpd) if lpd else 0.0,
        "log_ppl_diff_min": min(lpd) if lpd else 0.0,
        "ppl_ratio": ppl_mean([math.exp(x) for x in lpd], 1.0),
        "chi2_token": tok_mean(math.exp(2 * lr[k]) for k in valid) - 1.0 if n else 0.0,
        "chi2_seq": seq_mean(math.exp(2 * corr.seq_log_ratio[i]) for i in seqs) - 1.0 if S else 0.0,
        "ess": ess,
        "is_weight_mean": sum(w) / n if n else 1.0,
        "clipped_frac": tok_mean(float(corr.clipped[i][t]) for i, t in valid),
        "delta_abs_mean": tok_mean(abs(lr[k]) for k in valid),
        "delta_abs_max": max((abs(lr[k]) for k in valid), default=0.0),
        "rejected_token_frac": tok_mean(float(corr.rejected[i][t]) for i, t in valid),
        "rejected_seq_frac": seq_mean(float(any(corr.rejected[i])) for i in seqs),
        "off_policy_masked_frac": seq_mean(float(corr.off_policy[i]) for i in seqs),
        "nonfinite_frac": tok_mean(float(corr.nonfinite[i][t]) for i, t in valid),
        "loss_contrib_pos": c["pos"] / n if n else 0.0,
        "loss_contrib_neg": c["neg"] / n if n else 0.0,
        "loss_contrib_rollout_pos": c["rollout_pos"] / n if n else 0.0,
        "loss_contrib_rollout_neg": c["rollout_neg"] / n if n else 0.0,
    }
    return {"rollout_correction/" + k: v for k, v in m.items()}


# ----------------------------------------------------------------------------- loss


def _ppo_log_ratio(cur, old):
    """(log r, d log r / d cur) of r = π_θ/π_old under the loss's bad-input rules.

    A −inf π_θ never gets a gradient (the model calls the token impossible); a finite π_θ
    next to a NaN π_old keeps its gradient at ratio 1.
    """
    if is_nan_like(old):
        return 0.0, (1.0 if math.isfinite(cur) else 0.0)
    if cur == -INF and old == -INF:
        return 0.0, 0.0
    if cur == -INF:
        return -BOUND, 0.0
    if old == -INF:
        return BOUND, 0.0
    x = cur - old
    return clamp(x), (1.0 if -BOUND < x < BOUND else 0.0)


def naive_ppo(current, old, adv, weights, keep, eps_low, eps_high, clip_c=None, agg="token-mean",
              num_tokens=None, num_seqs=None, scale_factor=None):
    """Paper eq. 2 with dual clip, token by token; returns ``(loss, grad [B][T], policy metrics)``.

    ``L_t = w_t · max(−r A, −clip(r, 1−ε_low, 1+ε_high) A)``, then ``min(L_t, −c A)`` for A < 0.
    The derivative wrt log π_θ: ``w_t · (−A) · r`` where the unclipped branch binds, else 0.
    ``keep`` is the loss mask; ``weights`` the detached IS weights (1 when no IS mode).
    ``num_tokens``/``num_seqs`` replace this batch's token/sequence counts in the denominators
    (global normalisation); ``scale_factor`` replaces T in ``seq-mean-token-sum-norm``.
    """
    B, T = len(current), len(current[0])
    terms = []  # (i, t, L, dL/dcur)
    clipped = dual = kl = 0.0
    for i in range(B):
        for t in range(T):
            if not keep[i][t] or is_nan_like(current[i][t]):
                continue
            lr, dlr = _ppo_log_ratio(current[i][t], old[i][t])
            r = math.exp(lr)
            a = _adv(adv, i, t)
            unclipped = -a * r
            clip_branch = -a * min(max(r, 1 - eps_low), 1 + eps_high)
            loss = max(unclipped, clip_branch)
            dloss_dr = -a if unclipped >= clip_branch else 0.0
            clipped += clip_branch > unclipped
            kl += -lr
            if clip_c is not None and a < 0 and loss > -a * clip_c:
                loss, dloss_dr = -a * clip_c, 0.0
                dual += 1
            terms.append((i, t, loss * weights[i][t], dloss_dr * r * dlr * weights[i][t]))

    n_tok = len(terms)
    per_seq = {}
    for i, t, _, _ in terms:
        per_seq[i] = per_seq.get(i, 0) + 1
    S = len(per_seq) if num_seqs is None else num_seqs
    N_loss = n_tok if num_tokens is None else num_tokens
    norm = T if scale_factor is None else scale_factor
    grad = [[0.0] * T for _ in range(B)]
    loss = 0.0
    for i, t, value, d in terms:
        if agg == "token-mean":
            scale = 1.0 / N_loss
        elif agg == "seq-mean-token-mean":
            scale = 1.0 / (S * per_seq[i])
        elif agg == "seq-mean-token-sum":
            scale = 1.0 / S
        else:  # seq-mean-token-sum-norm, default factor T
            scale = 1.0 / (S * norm)
        loss += value * scale
        grad[i][t] = d * scale
    N = max(n_tok, 1)
    metrics = {"policy/pg_clipfrac": clipped / N, "policy/ppo_k1_mean": kl / N, "policy/pg_clipfrac_lower": dual / N}
    return loss, grad, metrics


def naive_ppo_loss(current, old, adv, weights, keep, eps_low, eps_high, clip_c=None, agg="token-mean"):
    return naive_ppo(current, old, adv, weights, keep, eps_low, eps_high, clip_c, agg)[0]


def naive_everything(raw_flags, old, rollout, mask, advantages, current, eps_low=0.2, eps_high=0.2, clip_c=None,
                     agg="token-mean"):
    """What one ``compute_correction`` + ``policy_loss`` step gives: weights, keep, loss, grad, metrics."""
    corr = naive_correction(raw_flags, old, rollout, mask, advantages, current)
    f = corr.flags
    bypass = f["old_logprob_source"] == "bypass"
    old_for_ppo = rollout if bypass else old
    weights = corr.weights if f["rollout_importance_sampling_mode"] is not None else [
        [1.0] * len(mask[0]) for _ in mask]
    loss, grad, policy_metrics = naive_ppo(current, old_for_ppo, advantages, weights, corr.keep, eps_low, eps_high,
                                           clip_c, agg)
    metrics = dict(policy_metrics)
    metrics.update(naive_metrics(raw_flags, old, rollout, mask, corr, advantages, current))
    return {"weights": corr.weights, "keep": corr.keep, "loss": loss, "grad": grad, "metrics": metrics,
            "correction": corr}
