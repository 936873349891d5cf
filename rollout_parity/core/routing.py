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
(padding, the last token, a layer without experts), and those tokens keep the trainer's own routing;
:class:`RouteTable` finds a forward's routes by its rows' tokens. Both run on the device without reading
anything back to the host (no sync per forward or per layer). The patch that puts this into a Hugging Face
model is ``adapters/_routing.py``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

__all__ = ["replayed_routing", "align_routes", "RouteTable"]


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


def _compact(rows: Sequence[Any], num_layers: int, top_k: int) -> tuple[torch.Tensor, list[int]]:
    """Host rows (``[n_i, L, k]`` each, or None) as one (N, max n_i, L, k) int16 tensor, -1 padded, and the n_i."""
    tensors = []
    for i, row in enumerate(rows):
        row = torch.zeros(0, num_layers, top_k) if row is None else torch.as_tensor(row)
        if row.dim() != 3 or row.shape[1:] != (num_layers, top_k):
            raise ValueError(f"routes of row {i} have shape {tuple(row.shape)}, "
                             f"expected [tokens, {num_layers}, {top_k}]")
        tensors.append(row.to(torch.int16))
    lengths = [t.shape[0] for t in tensors]
    out = torch.full((len(tensors), max(lengths, default=0) or 1, num_layers, top_k), -1, dtype=torch.int16)
    for i, t in enumerate(tensors):
        out[i, :t.shape[0]] = t
    return out, lengths


def _spread(compact: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(b, t, L, k): row j's compact routes (b, n, L, k) at the positions where ``mask[j]`` is set, in order;
    -1 elsewhere and past the row's routes (padded with -1). Device ops only: no host sync."""
    position = (mask != 0).long().cumsum(-1) - 1  # the j-th real token reads row j
    inside = (mask != 0) & (position < compact.shape[1])
    index = position.clamp(0, compact.shape[1] - 1)[:, :, None, None].expand(-1, -1, *compact.shape[2:])
    spread = compact.gather(1, index)
    return torch.where(inside[:, :, None, None], spread, torch.full_like(spread, -1))


def align_routes(routes: Sequence[Any], attention_mask: torch.Tensor, num_layers: int, top_k: int) -> torch.Tensor:
    """(B, T, num_layers, top_k) int16 routes on a padded batch, on ``attention_mask``'s device: row i's routes
    (``[n_i, L, k]``, array or tensor, or None) go, in order, to the first ``n_i`` positions where
    ``attention_mask[i]`` is 1 (its real tokens: prompt, then completion); everything else is -1 (the trainer's
    own routing). One copy to the device; the placement runs there."""
    if len(routes) != attention_mask.shape[0]:
        raise ValueError(f"{len(routes)} route rows for a batch of {attention_mask.shape[0]}")
    compact, _ = _compact(routes, num_layers, top_k)
    return _spread(compact.to(attention_mask.device), attention_mask)


class RouteTable:
    """The routes of one generation batch, found for any forward by its rows' tokens, on the device.

    ``sequences[i]`` are sequence i's tokens (prompt then completion), ``routes[i]`` its routes (``[n, L, k]``:
    vLLM's ``routed_experts``, the tokens fed forward). :meth:`lookup` gives a forward's (b, t, L, k) routes:
    each row's real tokens (``attention_mask``) are compared with every sequence's on the device and the match's
    routes placed at its real positions; a row that matches none keeps -1 (the trainer's own routing). The table
    goes to the device once (on its first lookup there); a lookup reads nothing back to the host, so it adds no
    host sync to a forward. Device memory: the sequences' tokens (int64) and routes (int16: tokens x layers x
    top_k x 2 bytes).
    """

    def __init__(self, sequences: Sequence[Sequence[int]], routes: Sequence[Any], num_layers: int, top_k: int) -> None:
        if len(sequences) != len(routes):
            raise ValueError(f"{len(sequences)} sequences for {len(routes)} route rows")
        self.num_layers, self.top_k = num_layers, top_k
        self._routes, _ = _compact(routes, num_layers, top_k)
        lengths = [len(s) for s in sequences]
        self._tokens = torch.full((len(sequences), max(lengths, default=0) or 1), -1, dtype=torch.long)
        for i, seq in enumerate(sequences):
            self._tokens[i, :len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
        self._lengths = torch.tensor(lengths, dtype=torch.long)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return self._tokens.shape[0]

    def __call__(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """:meth:`lookup`, as the routes function ``adapters/_routing.RoutingReplay`` calls per forward."""
        return self.lookup(input_ids, attention_mask)

    def _device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if device not in self._on:
            self._on[device] = tuple(t.to(device) for t in (self._tokens, self._lengths, self._routes))
        return self._on[device]

    def lookup(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(b, t, L, k) int16 routes of one forward, on ``input_ids``' device."""
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        b, t = input_ids.shape
        shape = (b, t, self.num_layers, self.top_k)
        if len(self) == 0:
            return torch.full(shape, -1, dtype=torch.int16, device=input_ids.device)
        tokens, lengths, routes = self._device(input_ids.device)
        keep = mask != 0
        position = keep.long().cumsum(-1) - 1
        compact = torch.full((b, t + 1), -1, dtype=torch.long, device=input_ids.device)
        compact.scatter_(1, torch.where(keep, position, torch.full_like(position, t)), input_ids.long())
        width = min(t, tokens.shape[1])
        same = (compact[:, None, :width] == tokens[None, :, :width]).all(-1)
        same &= keep.sum(-1)[:, None] == lengths[None, :]
        found = same.any(-1)
        last = same.shape[1] - 1 - same.flip(-1).int().argmax(-1)  # a sequence generated twice: its last routes
        rows = routes[last]  # (b, n, L, k); a row that matched none is masked out next
        return _spread(rows, keep & found[:, None])


