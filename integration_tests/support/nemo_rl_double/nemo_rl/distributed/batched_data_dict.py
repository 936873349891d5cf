"""v0.7 ``BatchedDataDict``: a ``UserDict`` of per-sample tensors (only what losses use)."""

from collections import UserDict

import torch


class BatchedDataDict(UserDict):
    def slice(self, start: int, end: int) -> "BatchedDataDict":
        return BatchedDataDict({k: v[start:end] if torch.is_tensor(v) else v
                                for k, v in self.data.items()})

    @property
    def size(self) -> int:
        return next(len(v) for v in self.data.values() if torch.is_tensor(v))
