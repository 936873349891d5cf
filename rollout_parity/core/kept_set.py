"""The kept set's mass per row, without sorting the vocabulary: the fast path of the sampler-aware pass.

vLLM's top-p sorts every row of the vocabulary (``apply_top_k_top_p_pytorch``). A trainer that only
needs, per sampled token, ``log q(y) = log p(y) - log S`` with ``S`` the kept mass, can find the kept
set among the row's ``m`` largest probabilities (``torch.topk``, a fraction of a sort's cost) whenever
the filters cut inside them, which is the common case for a trained LM (its nucleus holds a handful
of tokens). On the ``m`` candidates, in float64, in vLLM's order:

* min-p keeps ``p >= max(p) * min_p``;
* top-k keeps values ``>=`` the k-th largest (ties all kept, vLLM's PyTorch path, ``rule="pytorch"``), or
  exactly the k largest (``rule="triton"``: vLLM's Triton kernel keeps k of a tied group, by lowest id; the
  mass is the same whichever k it keeps, and a row whose edge cuts a tied group takes the sorting path,
  which picks the ids);
* top-p renormalises over the survivors and keeps a token when the mass ranked strictly above it
  is below ``top_p``: vLLM keeps position ``i`` of the ascending order when its cumulative sum
  exceeds ``1 - top_p``, and that ascending sum is one minus the mass ranked above ``i``.

A row is settled when the cut lies inside the candidates and the first dropped candidate is not
tied with the last kept one (vLLM breaks top-p ties by its sort's order). :func:`settle_kept_sets`
settles first the rows whose most likely token alone holds ``top_p`` (one ``amax`` pass: the
kept set is that token; 72% of the doctor's top-p positions), then tries the 32 and the 1024
largest (``torch.topk``) on the rows still open, and for top-p alone a nearly flat row from its
ascending end (:func:`_low_tail`: a bisection finds where top-p's cut lies, only that band is sorted). What is still open (top-p
ties, a flat row under top-k or min-p) takes the exact, sorting path (``processed_logits``). Measured on this CPU (2 threads,
V = 32768, 1024 rows): ``amax`` 0.016 s, ``topk(32)`` 0.09 s, a sort 2.7 s, the head's matmul at
H = 1024 0.54-0.66 s; bool reductions over (rows, V) cost more than ``topk`` and were dropped. The sums differ from vLLM's float32 ascending cumsum only by rounding, so a
kept set can differ from vLLM's only where the cumulative mass sits within ~1e-7 of the threshold.

On CUDA the sampler pass finds each row's candidates with a Triton kernel instead of the stages above (every entry
above a threshold that covers the filters: min-p's bound, or the first of 32 below the row's largest that holds
top-k's count or top-p's mass, :mod:`rollout_parity.kernels.kept_candidates`) and hands
them, sorted, to the same :func:`_on_candidates`; rows that do not settle there come back to
:func:`settle_kept_sets`.
"""

from __future__ import annotations

import struct
from typing import Callable, Optional

import torch

__all__ = ["CANDIDATES", "alone_holds_top_p", "kept_log_mass", "replayed_log_mass", "replayed_log_mass_of",
           "settle_kept_sets"]

#: Candidates per row of the first top-k stage (a top-k of ``k`` needs ``k + 1``).
CANDIDATES = 32
_WIDE = 1024  # candidates of the second top-k stage


def _float32(x: float) -> float:
    """``x`` rounded to the nearest float32, in Python (a torch scalar read back would count as a host read)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _one_minus_top_p(top_p: float) -> float:
    """``1 - top_p`` as vLLM forms it in float32 (both float32 numbers; their difference is exact in a double)."""
    return _float32(1.0 - _float32(top_p))


def _limit(top_p: float) -> float:
    """vLLM drops a position when its float32 cumsum <= 1 - top_p (formed in float32): keep above < this."""
    return 1.0 - _one_minus_top_p(top_p)


def alone_holds_top_p(top_p: float, rule: str, peak: Callable[[], torch.Tensor]
                      ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The first stage: ``(peak, alone)``, the rows' largest log-probability (``peak()``, computed only where the
    stage applies) and the rows whose most likely token alone holds ``top_p`` (then it is the whole kept set,
    whatever min-p and top-k did first). None where the stage does not apply: no top-p, or vLLM's Triton rule with
    ``top_p <= 0.5`` (two maxima tied at >= top_p can exist there, and the kernel keeps only the lower id)."""
    if top_p >= 1.0 or (rule == "triton" and top_p <= 0.5):
        return None
    p = peak()
    return p, p.double().exp() >= _limit(top_p)  # the mass ranked above the second token reaches the limit


def _on_candidates(vals: torch.Tensor, top_k: Optional[int], top_p: float, min_p: float, whole: bool,
                   rule: str = "pytorch") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's filters on each row's candidates ``vals`` (rows, m), sorted descending, -inf padded.

    Every non-candidate ranks below every candidate. ``whole``: the candidates are the whole row.
    ``rule``: the top-k tie rule (module docstring). Returns ``(log_s, smallest, settled)``.
    """
    rows, m = vals.shape
    p = vals.double().exp()
    keep = ~torch.isneginf(vals)
    if min_p > 0.0:
        keep &= p >= p[:, :1] * min_p
    if top_k and rule == "triton":
        keep &= torch.arange(m, device=vals.device) < top_k
    elif top_k:
        keep &= vals >= vals[:, top_k - 1:top_k]
    settled = torch.ones(rows, dtype=torch.bool, device=vals.device)
    if not whole and (min_p > 0.0 or top_k):
        settled &= ~keep[:, -1]  # beyond the candidates, unknown survivors would join the renormalisation
    if top_p < 1.0:
        survivors = (p * keep).sum(-1, keepdim=True) if (min_p > 0.0 or top_k) else p.new_ones(rows, 1)
        q = p * keep / survivors
        above = q.cumsum(-1) - q
        keep &= above < _limit(top_p)
        keep[:, 0] = True  # the largest always survives
        if not whole:  # the cut lies inside: the kept mass reached the limit (the next token is dropped)
            settled &= (q * keep).sum(-1) >= _limit(top_p)
    n = keep.sum(-1)
    smallest = vals.gather(-1, (n - 1).clamp_min(0).unsqueeze(-1)).squeeze(-1)
    first_dropped = vals.gather(-1, n.clamp_max(m - 1).unsqueeze(-1)).squeeze(-1)
    settled &= (n >= m) | (first_dropped != smallest)
    return (p * keep).sum(-1).log(), smallest, settled


def kept_log_mass(lp: torch.Tensor, top_k: Optional[int], top_p: float, min_p: float,
                  candidates: int = CANDIDATES, *, rule: str = "pytorch"
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of full log-probabilities ``lp`` (rows, V; temperature applied), from its ``candidates``
    largest: ``(log_s, smallest, settled)``: float64 ``log S`` of the kept set, the smallest kept
    log-probability (a token is kept iff its log-probability is ``>=`` it), and the rows the
    candidates settle; the other rows' values are meaningless. ``rule``: vLLM's top-k/top-p
    implementation whose tie rule applies, ``"pytorch"`` or ``"triton"``."""
    rows, vocab = lp.shape
    k = top_k if top_k is not None and 0 < top_k < vocab else None
    m = min(vocab, max(candidates, k + 1 if k else 0))
    return _on_candidates(lp.topk(m, dim=-1).values, k, top_p, min_p, whole=m == vocab, rule=rule)


def _low_tail(lp: torch.Tensor, top_p: float, steps: int = 10) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-p alone on nearly flat rows, from the ascending end as vLLM walks it: it drops the smallest
    tokens whose cumulative mass stays ``<= 1 - top_p``. A bisection on the log-probability finds a
    narrow band where that cut lies (``steps`` masked sums over the rows), and only the band is sorted."""
    limit = _one_minus_top_p(top_p)
    p32 = lp.exp()
    lo, hi = lp.amin(-1) - 1e-6, lp.amax(-1)
    for _ in range(steps):  # float32 sums only place the band; the cut itself is summed in float64 below
        mid = (lo + hi) / 2
        below = (p32 * (lp <= mid[:, None])).sum(-1) <= limit * (1 - 1e-5)
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    p = p32.double()
    base = (p * (lp <= lo[:, None])).sum(-1)  # the mass surely dropped
    r, c = ((lp > lo[:, None]) & (lp <= hi[:, None])).nonzero(as_tuple=True)
    v = lp[r, c]
    order = torch.sort(v, stable=True).indices
    order = order[torch.sort(r[order], stable=True).indices]  # by row, ascending within a row
    r, v, q = r[order], v[order], p[r[order], c[order]]
    first = torch.zeros(lp.shape[0], dtype=torch.long, device=lp.device)
    first[1:] = torch.bincount(r, minlength=lp.shape[0]).cumsum(0)[:-1]
    running = q.cumsum(0)
    cum = base[r] + running - (running - q)[first[r]] if r.numel() else running  # ascending cumulative mass
    dropped = cum <= limit
    drop_mass = base.index_add(0, r, torch.where(dropped, q, 0.0))
    inf = torch.full((lp.shape[0],), float("inf"), dtype=lp.dtype, device=lp.device)
    first_kept = inf.scatter_reduce(0, r[~dropped], v[~dropped], reduce="amin")
    last_dropped = (-inf).scatter_reduce(0, r[dropped], v[dropped], reduce="amax")
    above = torch.where(lp > hi[:, None], lp, torch.full_like(lp, float("inf"))).amin(-1)
    smallest = torch.minimum(first_kept, above)
    settled = (last_dropped != smallest) & torch.isfinite(smallest) & (drop_mass < 1.0)
    return torch.log1p(-drop_mass), smallest, settled


def settle_kept_sets(lp: torch.Tensor, top_k: Optional[int], top_p: float, min_p: float, *,
                     rule: str = "pytorch") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept set's ``(log_s, smallest, settled)`` for every row, through the fast stages.

    First the rows whose most likely token alone holds ``top_p`` (then it is the whole kept set, whatever
    min-p and top-k did first: a single row maximum), then :func:`kept_log_mass` with 32 and with 1024
    candidates, each on the rows still open: all rows in place, or blocks of a quarter of ``lp``'s rows copied one
    at a time. ``settled`` False: take the sorting path. ``rule``: as in :func:`kept_log_mass`; under
    ``"triton"`` with ``top_p <= 0.5`` the first stage is skipped (two maxima tied at >= top_p can exist
    there, and the kernel keeps only the lower id: the candidates see the tie and leave the row open).
    """
    rows, vocab = lp.shape
    dev = lp.device
    k = top_k if top_k is not None and 0 < top_k < vocab else None
    log_s = torch.zeros(rows, dtype=torch.float64, device=dev)
    smallest = torch.zeros(rows, dtype=lp.dtype, device=dev)
    done = torch.zeros(rows, dtype=torch.bool, device=dev)
    open_rows = torch.arange(rows, device=dev)
    stage = alone_holds_top_p(top_p, rule, lambda: lp.amax(-1))
    if stage is not None:
        peak, alone = stage
        log_s[alone], smallest[alone], done[alone] = peak[alone].double(), peak[alone], True
        open_rows = open_rows[~alone]
    flat = open_rows[:0]
    for candidates in (CANDIDATES, _WIDE):
        if candidates == _WIDE and top_p < 1.0 and k is None and min_p == 0.0 and open_rows.numel():
            # a row whose 32 largest hold so little that 1024 cannot reach top_p skips that stage
            top = lp[open_rows].topk(min(CANDIDATES, vocab), dim=-1).values.double().exp()
            reach = top.sum(-1) + (min(_WIDE, vocab) - top.shape[-1]) * top[:, -1]
            flat, open_rows = open_rows[reach < _limit(top_p)], open_rows[reach >= _limit(top_p)]
            if open_rows.numel() == 0:
                break
        still = []
        whole = open_rows.numel() == rows  # every row still open: read them in place, no copy
        for block in open_rows.split(rows if whole else -(-rows // 4)):
            a, b, ok = kept_log_mass(lp if whole else lp[block], k, top_p, min_p, candidates, rule=rule)
            idx = block[ok]
            log_s[idx], smallest[idx], done[idx] = a[ok], b[ok], True
            still.append(block[~ok])
        open_rows = torch.cat(still) if still else open_rows
        if open_rows.numel() == 0:
            break
    open_rows = torch.cat([open_rows, flat])
    if open_rows.numel() and top_p < 1.0 and k is None and min_p == 0.0:
        a, b, ok = _low_tail(lp[open_rows], top_p)
        idx = open_rows[ok]
        log_s[idx], smallest[idx], done[idx] = a[ok], b[ok], True
    return log_s, smallest, done


def replayed_log_mass(lp: torch.Tensor, token_ids: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                      recorded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``lp`` (rows, V): ``log S`` over the engine's kept set, and whether the sampled token is in it.

    ``(rows, ids)`` lists every kept entry (row index, vocabulary id); ``recorded`` marks rows that have
    a set. Rows without one get ``log S = 0`` and membership False.
    """
    return replayed_log_mass_of(lp[rows, ids], token_ids, rows, ids, recorded)


def replayed_log_mass_of(vals: torch.Tensor, token_ids: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                         recorded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`replayed_log_mass` from the kept entries' log-probabilities ``vals`` alone (``lp[rows, ids]``), for a
    caller that never holds the whole row of log-probabilities; ``recorded`` has one entry per row."""
    n = recorded.shape[0]
    vals = vals.double()
    peak = torch.full((n,), float("-inf"), dtype=torch.float64, device=vals.device)
    peak = peak.scatter_reduce(0, rows, vals, reduce="amax", include_self=True)
    total = torch.zeros(n, dtype=torch.float64, device=vals.device).index_add_(0, rows, (vals - peak[rows]).exp())
    log_s = torch.where(recorded, total.log() + peak, torch.zeros_like(total))
    hit = torch.zeros(n, dtype=torch.float64, device=vals.device).index_add_(0, rows,
                                                                             (ids == token_ids[rows]).double())
    return log_s, hit > 0
