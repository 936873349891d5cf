"""Routing replay in a Hugging Face MoE model: its routers use given experts while a block runs.

:class:`RoutingReplay` finds the top-k routers of a Hugging Face MoE model (transformers 5's Qwen2-MoE and
Qwen3-MoE ``*TopKRouter``: ``top_k``, ``norm_topk_prob``, ``weight``; the decoder layer index from the
module name) without importing transformers. :meth:`RoutingReplay.replaying` wraps each router's
``forward`` on the instance through the shared patch layer (marked, ``__wrapped__``, reverted bit for bit
when the block ends) and puts a forward pre-hook on the model that hands each forward the next rows of the
route tensor, so a framework that scores a batch in chunks (TRL's ``_get_per_token_logps_and_entropies``)
replays each chunk with its own rows. The wrapped router returns its own logits (the aux loss still sees
them) with the gate weights and experts of ``core.routing.replayed_routing``; with ``record=True`` the experts
used are kept per layer (``used``), so a test can compare them with the engine's.
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
    into a caller's ledger and :meth:`stop`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(f"moe_routing_replay: {type(model).__name__} has no MoE router to replay")
        self.used: dict[int, list[torch.Tensor]] = {}
        self.replayed = 0  # token-layer routings taken from the given routes
        self.changed = 0  # ... of which the router on its own would have picked other experts
        self._routes: Optional[Routes] = None
        self._cursor = 0
        self._slice: Optional[torch.Tensor] = None
        self._record = False
        self._handle: Any = None

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
        self.used = {layer: [] for layer, _, _ in self.routers}
        self.replayed = self.changed = 0
        for layer, name, router in self.routers:
            patches.wrap(router, "forward", functools.partial(self._routed, layer, router), dotted=f"{name}.forward")
        self._handle = self.model.register_forward_pre_hook(self._next_rows, with_kwargs=True)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
        self._handle, self._routes, self._slice = None, None, None

    def _next_rows(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ValueError("routing replay needs input_ids in the model's forward to place the routes")
        if callable(self._routes):
            self._slice = self._routes(ids, kwargs.get("attention_mask"))
            return
        rows, width = ids.shape
        if self._cursor + rows > self._routes.shape[0] or width > self._routes.shape[1]:
            raise ValueError(f"routing replay: a forward of {tuple(ids.shape)} at row {self._cursor} runs past the "
                             f"routes {tuple(self._routes.shape[:2])}")
        self._slice = self._routes[self._cursor:self._cursor + rows, :width]
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
        weights, indices = replayed_routing(logits, routes.to(logits.device), router.top_k, router.norm_topk_prob)
        given = (routes >= 0).all(-1).to(own.device)
        self.replayed += int(given.sum())
        self.changed += int(((own.sort(-1).values != indices.sort(-1).values).any(-1) & given).sum())
        if self._record:
            self.used[layer].append(indices.detach().cpu())
        return logits, weights, indices
