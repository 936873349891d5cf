"""Count host syncs on CPU: every read of tensor data back to the host, for tests (issue 31, items 11 and 12).

On a GPU every read of a device value on the host waits for the device to drain: ``.item()``, ``float(t)``,
``bool(t)``, ``.tolist()``, ``.cpu()``, formatting a tensor, and every op whose output is sized by the data
(``nonzero``, a boolean index, ``masked_select``, ``unique``, ...). On CPU nothing waits, and
``torch.cuda.set_sync_debug_mode`` needs a GPU, but every such read passes through a Python-visible torch
function, so counting those calls is a faithful CPU proxy. The count is a
:class:`torch.overrides.TorchFunctionMode`: nothing is set on ``torch.Tensor`` (a ``__getitem__`` once set on
``torch.Tensor`` leaves it a Python-level sequence slot even after it is removed, and ``torch.tensor([t0, t1])``
then calls ``len(t0)`` in every later test of the process).

A mode is off while it handles a call, so what a handled function does inside is not counted again:
``float(t)`` is one read, not a ``__float__`` and an ``item``; a Python-level torch function the mode handles
(``torch.nn.functional.*``) hides the reads inside it. ``.to(device)`` is not counted: on CPU a move to the
tensors' own device cannot be told from a copy to the host (``.cpu()`` is counted).
"""

from __future__ import annotations

import collections
import contextlib
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["host_syncs", "HostSyncCounter"]

#: Functions and methods that always hand tensor data to the host (or size their output by it).
READBACKS = frozenset({
    "item", "tolist", "numpy", "cpu", "__array__", "__int__", "__float__", "__bool__", "__index__", "__complex__",
    "__format__", "__repr__", "__contains__", "equal", "allclose", "nonzero", "argwhere", "masked_select",
    "unique", "unique_consecutive",
})
#: Indexing, which reads the data back when an index is a boolean tensor (the result's size is data).
INDEXING = frozenset({"__getitem__", "__setitem__", "index_put", "index_put_"})


def _has_bool_tensor(index) -> bool:
    parts = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _holds_a_tensor(data) -> bool:
    """``torch.tensor([t0, t1])`` reads each element's value; a bare tensor is copied on its device."""
    return isinstance(data, (list, tuple)) and any(isinstance(d, torch.Tensor) or _holds_a_tensor(d) for d in data)


def is_host_read(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the call ``name(*args, **kwargs)`` reads tensor data back to the host (a sync on a GPU)."""
    if name in READBACKS:
        return True
    if name in INDEXING:
        return len(args) > 1 and _has_bool_tensor(args[1])
    if name == "where":  # torch.where(cond) is nonzero
        return len(args) + len(kwargs) == 1
    if name == "repeat_interleave":  # tensor repeats without output_size: the output's length is data
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if len(args) == 1 else None)
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name in ("tensor", "as_tensor"):
        return _holds_a_tensor(args[0] if args else kwargs.get("data"))
    if name in ("arange", "range", "full", "zeros", "ones", "empty"):  # a size or bound given as a tensor
        return any(isinstance(a, torch.Tensor) for a in args) or _holds_a_tensor(args[0] if args else None)
    return False


class HostSyncCounter(TorchFunctionMode):
    """A torch function mode that counts host reads by function name in :attr:`counts`."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if is_host_read(name, args, kwargs):
            self.counts[name] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_syncs() -> Iterator[collections.Counter]:
    """Count every host read of tensor data inside the block: yields ``{function name: count}``, live."""
    counter = HostSyncCounter()
    with counter:
        yield counter.counts
