"""Count host syncs on CPU: every read of tensor data back to the host, for tests (issue 31, item 11).

On a GPU every read of a device value on the host (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``,
``.cpu()``, a data-dependent shape such as ``nonzero`` or a boolean index) waits for the device to drain.
On CPU nothing waits, but every such read passes through one of a few entry points, so counting them is
a faithful proxy: the Python-level readers are wrapped, and a ``TorchDispatchMode`` counts the aten ops
behind the others (``_local_scalar_dense`` is what ``item``/``float``/``bool``/``int`` call; ``nonzero``,
``masked_select``, ``unique`` and a boolean index have outputs sized by the data).
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["host_syncs"]

#: aten ops whose result the host must wait for (a scalar read back, or an output sized by the data)
SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
            "aten::unique_dim", "aten::unique_consecutive", "aten::repeat_interleave"}
#: Tensor methods that hand device data to the host without an aten op in between
READERS = ("tolist", "numpy", "cpu")


class _SyncOps(TorchDispatchMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in SYNC_OPS or (name in ("aten::index", "aten::index_put", "aten::index_put_") and _bool_index(args)):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _bool_index(args) -> bool:
    """A boolean mask among ``aten::index``'s indices: the output's size depends on the data."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


@contextlib.contextmanager
def host_syncs():
    """Counts every host read of tensor data inside the block: ``{reader or aten op: count}``."""
    counts: collections.Counter = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READERS}

    def counted(name):
        original = originals[name]

        def reader(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)
        return reader

    for name in READERS:
        setattr(torch.Tensor, name, counted(name))
    try:
        with _SyncOps(counts):
            yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
