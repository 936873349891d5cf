"""The kept set's mass per row, without sorting the vocabulary: the fast path of the sampler-aware pass.

vLLM's top-p sorts every row of the vocabulary (``apply_top_k_top_p_pytorch``). A trainer that only
needs, per sampled token, ``log q(y) = log p(y) - log S`` with ``S`` the kept mass, can find the kept
set among the row's ``m`` largest probabilities (``torch.topk``, a fraction of a sort's cost) whenever
the filters cut inside them, which is the common case for a trained LM (its nucleus holds a handful
of tokens). On the ``m`` candidates, in float64, in vLLM's order:

* min-p keeps ``p >= max(p) * min_p``;
* top-k keeps values ``>=`` the k-th largest (ties all kept, as vLLM's PyTorch path);
* top-p renormalises over the survivors and keeps a token when the mass ranked strictly above it
  is below ``top_p``: vLLM keeps position ``i`` of the ascending order when its cumulative sum
  exceeds ``1 - top_p``, and that ascending sum is one minus the mass ranked above ``i``.

A row is settled when the last candidate is dropped (the cut lies inside the candidates) and the first
dropped candidate is not tied with the last kept one (vLLM breaks top-p ties by its sort's order).
Other rows (a flat distribution, a wide top-k) are reported for the exact, sorting path
(``processed_logits``). The sums differ from vLLM's float32 ascending cumsum only by rounding, so a
kept set can differ from vLLM's only where the cumulative mass sits within ~1e-7 of the threshold.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["CANDIDATES", "kept_log_mass", "replayed_log_mass"]

#: Candidates per row of the fast path (a top-k of ``k`` needs ``k + 1``).
CANDIDATES = 32


def kept_log_mass(lp: torch.Tensor, top_k: Optional[int], top_p: float, min_p: float,
                  candidates: int = CANDIDATES) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of full log-probabilities ``lp`` (rows, V; temperature applied): the kept set's log mass.

    Returns ``(log_s, smallest, settled)``: float64 ``log S`` of the kept set, the smallest kept
    log-probability (a token is kept iff its log-probability is ``>=`` it), and a bool mask of the
    rows the candidates settle; the other rows' values are meaningless (use the exact path).
    """
    rows, vocab = lp.shape
    k = top_k if top_k is not None and 0 < top_k < vocab else None
    m = min(vocab, max(candidates, k + 1 if k else 0))
    vals = lp.topk(m, dim=-1).values  # sorted descending
    p = vals.double().exp()
    keep = torch.ones_like(p, dtype=torch.bool)
    if min_p > 0.0:
        keep &= p >= p[:, :1] * min_p
    if k:
        keep &= vals >= vals[:, k - 1:k]
    whole = m == vocab
    settled = torch.ones(rows, dtype=torch.bool, device=lp.device)
    if top_p < 1.0:
        if min_p > 0.0 or k:
            # the survivors' mass is known only when they all lie among the candidates
            settled &= ~keep[:, -1] | whole
            survivors = (p * keep).sum(-1, keepdim=True)
        else:
            survivors = p.new_ones(rows, 1)  # lp is normalised: the survivors are the whole vocabulary
        q = p * keep / survivors
        above = q.cumsum(-1) - q
        # vLLM drops a position when its float32 cumsum <= 1 - top_p (1 - top_p formed in float32)
        limit = 1.0 - float(torch.tensor(1.0, dtype=torch.float32) - torch.tensor(top_p, dtype=torch.float32))
        keep &= above < limit
        keep[:, 0] = True  # the largest always survives
    settled &= ~keep[:, -1] | whole
    n = keep.sum(-1)
    last = (n - 1).clamp_min(0).unsqueeze(-1)
    smallest = vals.gather(-1, last).squeeze(-1)
    first_dropped = vals.gather(-1, n.clamp_max(m - 1).unsqueeze(-1)).squeeze(-1)
    settled &= (n >= m) | (first_dropped != smallest)
    log_s = (p * keep).sum(-1).log()
    return log_s, smallest, settled


def replayed_log_mass(lp: torch.Tensor, token_ids: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                      recorded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``lp`` (rows, V): ``log S`` over the engine's kept set, and whether the sampled token is in it.

    ``(rows, ids)`` lists every kept entry (row index, vocabulary id); ``recorded`` marks rows that have
    a set. Rows without one get ``log S = 0`` and membership False.
    """
    n = lp.shape[0]
    vals = lp[rows, ids].double()
    peak = torch.full((n,), float("-inf"), dtype=torch.float64, device=lp.device)
    peak = peak.scatter_reduce(0, rows, vals, reduce="amax", include_self=True)
    total = torch.zeros(n, dtype=torch.float64, device=lp.device).index_add_(0, rows, (vals - peak[rows]).exp())
    log_s = torch.where(recorded, total.log() + peak, torch.zeros_like(total))
    hit = torch.zeros(n, dtype=torch.float64, device=lp.device).index_add_(0, rows, (ids == token_ids[rows]).double())
    return log_s, hit > 0
