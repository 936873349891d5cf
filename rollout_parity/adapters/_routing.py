"""Routing replay in a Hugging Face MoE model: its routers use given experts while a block runs.

:class:`RoutingReplay` finds the top-k routers of a Hugging Face MoE model (transformers 5's Qwen2-MoE and
Qwen3-MoE ``*TopKRouter``: ``top_k``, ``norm_topk_prob``, ``weight``; the decoder layer index from the
module name) without importing transformers. :meth:`RoutingReplay.replaying` wraps each router's
``forward`` on the instance through the shared patch layer (marked, ``__wrapped__``, reverted bit for bit
when the block ends) and puts a forward pre-hook on the model that hands each forward the next rows of the
route tensor, so a framework that scores a batch in chunks (TRL's ``_get_per_token_logps_and_entropies``)
replays each chunk with its own rows. The wrapped router returns its own logits (the aux loss still sees
them) with the gate weights and experts of ``core.routing.replayed_routing``; with ``record=True`` the experts
used are kept per layer (``used``), so a test can compare them with the engine's. Nothing in a forward reads
back to the host: the routes reach the device once per forward and the counters stay there until read.
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Callable, Iterator, Optional, Union

import torch

from rollout_parity.adapters._patching import Patches
from rollout_parity.core.routing import replayed_routing

__all__ = ["RoutingReplay", "find_routers"]

_LAYER = re.compile(r"\blayers\.(\d+)\.")


def find_routers(model: torch.nn.Module) -> list[tuple[int, str, torch.nn.Module]]:
    """``(decoder layer, name, router)`` for every top-k router; an unsupported MoE router is an error naming it."""
    found = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if not kind.endswith("Router") or not hasattr(module, "top_k"):
            continue
        if not (hasattr(module, "norm_topk_prob") and isinstance(getattr(module, "weight", None), torch.Tensor)):
            raise NotImplementedError(f"routing replay supports Qwen2/Qwen3-MoE style top-k routers; {name} is a "
                                      f"{kind}")
        match = _LAYER.search(name)
        if match is None:
            raise NotImplementedError(f"routing replay: no decoder layer index in the router's name {name!r}")
        found.append((int(match.group(1)), name, module))
    return found


#: Routes for a whole batch, handed out row after row, or a function of one forward's
#: ``(input_ids, attention_mask)`` giving that forward's (b, t, L, k) routes.
Routes = Union[torch.Tensor, Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]]


class RoutingReplay:
    """Replays given routes in one model's routers while :meth:`replaying` runs (or between :meth:`install`
    into a caller's ledger and :meth:`stop`).

    No host sync: each forward's routes reach the device once, in the model's forward pre-hook (a function of
    the forward's tokens computes them there, a tensor is sliced and copied), and the routers read their layer's
    slice of them. The counters (:attr:`replayed`, :attr:`changed`) and the recorded experts (:attr:`used`) stay
    on the device until read; each router writes its forward's values into one slot per layer, so a forward
    recomputed under gradient checkpointing (its routers run again in the backward) counts once.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(f"moe_routing_replay: {type(model).__name__} has no MoE router to replay")
        self._used: dict[int, list[torch.Tensor]] = {}
        self._totals: list[Any] = [0, 0]  # replayed, changed: device tensors once a forward ran
        self._slots: dict[int, tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = {}
        self._forward = self._folded = 0  # the forward the routers run for; the last one counted
        self._routes: Optional[Routes] = None
        self._cursor = 0
        self._slice: Optional[torch.Tensor] = None
        self._record = False
        self._handle: Any = None

    @property
    def replayed(self) -> int:
        """Token-layer routings taken from the given routes (reads the device count: a sync)."""
        self._fold()
        return int(self._totals[0])

    @property
    def changed(self) -> int:
        """... of which the router on its own would have picked other experts (reads the device count: a sync)."""
        self._fold()
        return int(self._totals[1])

    @property
    def used(self) -> dict[int, list[torch.Tensor]]:
        """With ``record=True``: per layer, the experts each forward used, (tokens, top_k), on the device."""
        self._fold()
        return self._used

    @contextlib.contextmanager
    def replaying(self, routes: Routes, *, record: bool = False) -> Iterator["RoutingReplay"]:
        """Forwards inside the block take ``routes`` ((B, T, L, k), -1: own routing) row after row, or ask
        ``routes(input_ids, attention_mask)`` for theirs."""
        patches = Patches()
        try:
            self.install(patches, routes, record=record)
            yield self
        finally:
            self.stop()
            patches.revert()

    def install(self, patches: Patches, routes: Routes, *, record: bool = False) -> None:
        """Wrap the routers in ``patches`` (the caller's ledger reverts them) and hook the model; :meth:`stop`
        removes the hook."""
        self._routes, self._cursor, self._slice, self._record = routes, 0, None, record
        self._used = {layer: [] for layer, _, _ in self.routers}
        self._totals, self._slots, self._forward, self._folded = [0, 0], {}, 0, 0
        for layer, name, router in self.routers:
            patches.wrap(router, "forward", functools.partial(self._routed, layer, router), dotted=f"{name}.forward")
        self._handle = self.model.register_forward_pre_hook(self._next_rows, with_kwargs=True)

    def stop(self) -> None:
        self._fold()
        if self._handle is not None:
            self._handle.remove()
        self._handle, self._routes, self._slice = None, None, None

    def _fold(self) -> None:
        """Add the last forward's per-layer slots to the totals, once: a recomputation of that forward overwrote
        them before, and writes nothing after."""
        for layer, (replayed, changed, used) in self._slots.items():
            self._totals[0] = self._totals[0] + replayed
            self._totals[1] = self._totals[1] + changed
            if used is not None:
                self._used[layer].append(used)
        self._slots, self._folded = {}, self._forward

    def _next_rows(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ValueError("routing replay needs input_ids in the model's forward to place the routes")
        self._fold()
        self._forward += 1
        if callable(self._routes):
            self._slice = self._routes(ids, kwargs.get("attention_mask")).to(ids.device, non_blocking=True)
            return
        rows, width = ids.shape
        if self._cursor + rows > self._routes.shape[0] or width > self._routes.shape[1]:
            raise ValueError(f"routing replay: a forward of {tuple(ids.shape)} at row {self._cursor} runs past the "
                             f"routes {tuple(self._routes.shape[:2])}")
        self._slice = self._routes[self._cursor:self._cursor + rows, :width].to(ids.device, non_blocking=True)
        self._cursor += rows

    def _routed(self, layer: int, router: Any, original: Any, hidden_states: torch.Tensor, *args: Any,
                **kwargs: Any) -> Any:
        logits, weights, indices = original(hidden_states, *args, **kwargs)
        if self._slice is None:
            return logits, weights, indices
        routes = self._slice[:, :, layer].reshape(-1, router.top_k)
        if routes.shape[0] != logits.shape[0]:
            raise ValueError(f"routing replay: layer {layer} routes {routes.shape[0]} tokens, its router sees "
                             f"{logits.shape[0]}")
        own = indices
        weights, indices = replayed_routing(logits, routes, router.top_k, router.norm_topk_prob)
        given = (routes >= 0).all(-1)
        changed = (own.sort(-1).values != indices.sort(-1).values).any(-1) & given
        if self._forward > self._folded:  # else: this forward, recomputed, was counted already
            self._slots[layer] = (given.sum(), changed.sum(), indices.detach() if self._record else None)
        return logits, weights, indices
