"""Routing replay for Mixture-of-Experts models (Rollout Routing Replay, "R3"), the math.

A token whose router logits sit near a tie can be sent to different experts by the engine and by the
trainer (bf16 against fp32, other kernels), and then its logprob differs by a whole expert's output.
Replay removes that source of mismatch: the trainer's pi_old and pi_theta forwards use the experts the
engine chose for each token, while the gate weights still come from the trainer's own router logits
(so the router keeps its gradient), computed as the model computes them: softmax over all experts,
gathered at the chosen ones, renormalised when the model sets ``norm_topk_prob`` (then it equals R3's
softmax over the chosen experts' logits).

Routes are what vLLM returns with ``enable_return_routed_experts`` (``CompletionOutput.routed_experts``:
``[num_tokens, num_layers, top_k]``, the tokens fed forward: the prompt and every generated token but the
last); :func:`align_routes` lays them out on the trainer's padded batch, -1 where no route is known
(padding, the last token, a layer without experts), and those tokens keep the trainer's own routing.
The patch that puts this into a Hugging Face model is ``adapters/_routing.py``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["replayed_routing", "align_routes"]


def replayed_routing(router_logits: torch.Tensor, routes: torch.Tensor, top_k: int,
                     norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate weights, expert ids), both (N, top_k): the experts of ``routes`` (N, top_k) where a row has no -1,
    the router's own top-k elsewhere; weights from ``softmax(router_logits)`` at those experts."""
    if routes.shape != (router_logits.shape[0], top_k):
        raise ValueError(f"routes {tuple(routes.shape)} do not match {router_logits.shape[0]} tokens x top_k {top_k}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    own = torch.topk(probs, top_k, dim=-1).indices
    given = (routes >= 0).all(dim=-1, keepdim=True)
    indices = torch.where(given, routes.to(device=own.device, dtype=own.dtype), own)
    weights = probs.gather(-1, indices)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), indices


def align_routes(routes: Sequence[Any], attention_mask: torch.Tensor, num_layers: int, top_k: int) -> torch.Tensor:
    """(B, T, num_layers, top_k) int16 routes on a padded batch: row i's routes (``[n_i, L, k]``, array or tensor)
    go, in order, to the first ``n_i`` positions where ``attention_mask[i]`` is 1 (its real tokens: prompt, then
    completion); everything else is -1 (the trainer's own routing)."""
    batch, width = attention_mask.shape
    out = torch.full((batch, width, num_layers, top_k), -1, dtype=torch.int16)
    for i, row in enumerate(routes):
        if row is None:
            continue
        row = torch.as_tensor(row).to(torch.int16)
        if row.dim() != 3 or row.shape[1:] != (num_layers, top_k):
            raise ValueError(f"routes of row {i} have shape {tuple(row.shape)}, "
                             f"expected [tokens, {num_layers}, {top_k}]")
        positions = attention_mask[i].nonzero().flatten().cpu()
        n = min(len(positions), row.shape[0])
        out[i, positions[:n]] = row[:n]
    return out
