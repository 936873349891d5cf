"""A deliberately naive per-token, per-sequence Python re-implementation of DESIGN.md.

Plain floats and loops, written from DESIGN.md's text and not from the core's code, so
the core's vectorised tensors are checked against an independent reading of the contract.
"""

from __future__ import annotations

import math

BOUND = 20.0


def clamp(x, lo=-BOUND, hi=BOUND):
    return max(lo, min(hi, x))


def token_log_ratio(num, den):
    """DESIGN.md's bad-input rule: NaN (or +inf) neutral, -inf maximal mismatch."""
    if math.isnan(num) or math.isnan(den) or num == math.inf or den == math.inf:
        return 0.0
    if num == -math.inf and den == -math.inf:
        return 0.0
    if num == -math.inf:
        return -BOUND
    if den == -math.inf:
        return BOUND
    return clamp(num - den)


def naive_correction(cfg, old, rollout, mask, advantages=None, current=None):
    """Returns (weights, keep_mask, per-seq info) as nested lists."""
    B = len(old)
    T = len(old[0])
    weights = [[1.0] * T for _ in range(B)]
    keep = [[bool(mask[i][t]) for t in range(T)] for i in range(B)]
    mode = cfg.rollout_importance_sampling_mode
    C = cfg.rollout_importance_sampling_threshold
    lo = cfg.rollout_importance_sampling_threshold_lower
    base = current if cfg.old_logprob_source == "bypass" else old
    for i in range(B):
        toks = [t for t in range(T) if mask[i][t]]
        lrs = {t: token_log_ratio(base[i][t], rollout[i][t]) for t in toks}
        total = sum(lrs.values())
        if cfg.rollout_importance_sampling_sequence_reduction == "geometric_mean":
            seq_lr = total / len(toks) if toks else 0.0
        else:
            seq_lr = total
        rho = math.exp(clamp(seq_lr))
        if mode is not None:
            for t in range(T):
                if not mask[i][t]:
                    weights[i][t] = 0.0
                    continue
                r = math.exp(lrs[t])
                inside_tok = r <= C and (lo is None or r >= lo)
                inside_seq = rho <= C and (lo is None or rho >= lo)
                if mode == "token_truncate":
                    w = min(r, C)
                    weights[i][t] = max(w, lo) if lo is not None else w
                elif mode == "token_mask":
                    weights[i][t] = r if inside_tok else 0.0
                elif mode == "sequence_truncate":
                    w = min(rho, C)
                    weights[i][t] = max(w, lo) if lo is not None else w
                else:
                    kept_w = r if cfg.rollout_importance_sampling_sequence_mask_weight == "token" else rho
                    weights[i][t] = kept_w if inside_seq else 0.0
        for rule in cfg.rejection_rules:
            def k(t):
                x = lrs[t]
                if rule.estimator == "k1":
                    return -x
                if rule.estimator == "k2":
                    return 0.5 * x * x
                return math.exp(x) - 1.0 - x

            def ok(s):
                if rule.estimator == "k1":
                    return math.log(rule.lower) <= s <= math.log(rule.upper)
                return s <= rule.upper

            if rule.level == "token":
                for t in toks:
                    if not ok(k(t)):
                        keep[i][t] = False
            else:
                vals = [k(t) for t in toks]
                if rule.level == "seq_sum":
                    s = sum(vals)
                elif rule.level == "seq_mean":
                    s = sum(vals) / len(vals) if vals else 0.0
                else:
                    s = max(vals) if vals else 0.0
                if not ok(s):
                    for t in toks:
                        keep[i][t] = False
        if cfg.off_policy_sequence_mask_delta is not None:
            # δ_i: mean over valid tokens; a token with a non-finite logprob drifts 0 (neutral).
            fin = [t for t in toks if all(math.isfinite(v) for v in (base[i][t], rollout[i][t]))]
            drift = [rollout[i][t] - current[i][t] for t in fin]
            d = sum(drift) / len(toks) if toks else 0.0
            adv = advantages[i] if not isinstance(advantages[i], list) else (
                sum(advantages[i][t] for t in toks) / len(toks) if toks else 0.0)
            if d > cfg.off_policy_sequence_mask_delta and adv < 0:
                for t in toks:
                    keep[i][t] = False
    return weights, keep


def naive_ppo_loss(current, old, adv, weights, keep, eps_low, eps_high, clip_c=None, agg="token-mean"):
    B, T = len(current), len(current[0])
    per_seq = []
    total, count = 0.0, 0
    for i in range(B):
        s, n = 0.0, 0
        for t in range(T):
            if not keep[i][t]:
                continue
            r = math.exp(clamp(current[i][t] - old[i][t]))
            a = adv[i]
            loss = max(-a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high))
            if clip_c is not None and a < 0:
                loss = min(loss, -a * clip_c)
            loss *= weights[i][t]
            s += loss
            n += 1
        per_seq.append((s, n))
        total += s
        count += n
    if agg == "token-mean":
        return total / max(count, 1)
    seqs = [(s, n) for s, n in per_seq if n > 0]
    if agg == "seq-mean-token-mean":
        return sum(s / n for s, n in seqs) / max(len(seqs), 1)
    if agg == "seq-mean-token-sum":
        return sum(s for s, n in seqs) / max(len(seqs), 1)
    return sum(s for s, n in seqs) / max(len(seqs), 1) / T


def naive_metrics(cfg, old, rollout, mask, weights):
    """A subset of the diagnostics, from their textbook definitions."""
    B, T = len(old), len(old[0])
    lrs, seq_lrs, lpds, train_lppl, roll_lppl = [], [], [], [], []
    for i in range(B):
        toks = [t for t in range(T) if mask[i][t]]
        if not toks:
            continue
        x = [token_log_ratio(old[i][t], rollout[i][t]) for t in toks]
        lrs += x
        seq_lrs.append(clamp(sum(x) / len(x) if cfg.rollout_importance_sampling_sequence_reduction ==
                             "geometric_mean" else sum(x)))
        mt = sum(old[i][t] for t in toks) / len(toks)
        mr = sum(rollout[i][t] for t in toks) / len(toks)
        train_lppl.append(-mt)
        roll_lppl.append(-mr)
        lpds.append(mr - mt)
    w = [weights[i][t] for i in range(B) for t in range(T) if mask[i][t]]
    n = len(lrs)
    return {
        "kl": sum(-v for v in lrs) / n,
        "k3_kl": sum(math.exp(v) - 1 - v for v in lrs) / n,
        "chi2_token": sum(math.exp(2 * v) for v in lrs) / n - 1,
        "chi2_seq": sum(math.exp(2 * v) for v in seq_lrs) / len(seq_lrs) - 1,
        "training_log_ppl": sum(train_lppl) / len(train_lppl),
        "training_ppl": sum(math.exp(v) for v in train_lppl) / len(train_lppl),
        "rollout_log_ppl": sum(roll_lppl) / len(roll_lppl),
        "rollout_ppl": sum(math.exp(v) for v in roll_lppl) / len(roll_lppl),
        "log_ppl_diff": sum(lpds) / len(lpds),
        "log_ppl_abs_diff": sum(abs(v) for v in lpds) / len(lpds),
        "log_ppl_diff_max": max(lpds),
        "log_ppl_diff_min": min(lpds),
        "ppl_ratio": sum(math.exp(v) for v in lpds) / len(lpds),
        "delta_abs_mean": sum(abs(v) for v in lrs) / n,
        "delta_abs_max": max(abs(v) for v in lrs),
        "is_weight_mean": sum(w) / n,
        "ess": (sum(w) ** 2) / (n * sum(v * v for v in w)),
    }
