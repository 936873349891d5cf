"""The correction's diagnostics cost one host sync, whatever the flags (issue 31, item 11).

On a GPU every read of a device value on the host (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``,
``.cpu()``, a data-dependent shape such as ``nonzero`` or a boolean index) waits for the device to drain.
On CPU nothing waits, but every such read passes through one of a few entry points, so counting them is
a faithful proxy: the Python-level readers are wrapped, and a ``TorchDispatchMode`` counts the aten ops
behind the others (``_local_scalar_dense`` is what ``item``/``float``/``bool``/``int`` call; ``nonzero``,
``masked_select`` and ``unique`` have outputs sized by the data).
"""

from __future__ import annotations

import collections
import contextlib
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rollout_parity import CorrectionConfig, compute_correction
from rollout_parity.core.config import IS_MODES, REJECTION_OPTIONS

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


def test_the_counter_sees_every_kind_of_host_read():
    """The proxy itself: each way of reading a device value back is counted once."""
    x = torch.tensor([1.0, 2.0])
    reads = [lambda: x.sum().item(), lambda: float(x.sum()), lambda: bool(x.sum() > 0), lambda: int(x.sum()),
             lambda: x.tolist(), lambda: x.cpu(), lambda: x.nonzero(), lambda: x[x > 1], lambda: x.numpy()]
    for read in reads:
        with host_syncs() as counts:
            read()
        assert sum(counts.values()) == 1, (read, dict(counts))
    with host_syncs() as counts:
        (x * 2).sum().exp()
    assert sum(counts.values()) == 0


def _batch(seed: int = 0, B: int = 6, T: int = 10, token_advantages: bool = False, nonfinite: bool = True):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 3
    rollout = old + torch.randn(B, T, generator=g) * 0.3
    current = old + torch.randn(B, T, generator=g) * 0.1
    if nonfinite:
        rollout[0, 1], rollout[0, 2], current[0, 3] = math.nan, -math.inf, math.nan
    adv = torch.randn(B, T, generator=g) if token_advantages else torch.randn(B, generator=g)
    return old, rollout, current, mask, adv


CONFIGS = {
    "metrics_only": CorrectionConfig(log_rollout_offpolicy_metrics=True),
    "tis_srs_k3_off_policy": CorrectionConfig.preset("tis_srs_k3", off_policy_sequence_mask_delta=0.05),
    "token_rejection": CorrectionConfig(rollout_importance_sampling_mode="token_mask",
                                        rollout_importance_sampling_threshold_lower=0.5,
                                        rollout_rejection=["token_k2", "seq_max_k3"],
                                        rollout_rejection_threshold=[0.05, 0.1]),
    "sequence_modes": CorrectionConfig(rollout_importance_sampling_mode="sequence_mask",
                                       rollout_importance_sampling_threshold_lower=0.5,
                                       rollout_rejection=["seq_mean_k1"], rollout_rejection_threshold="0.9_1.1"),
    "bypass": CorrectionConfig(old_logprob_source="bypass", rollout_rejection=["seq_sum_k3"],
                               rollout_rejection_threshold=0.01, off_policy_sequence_mask_delta=0.05),
    **{f"mode_{mode}": CorrectionConfig(rollout_importance_sampling_mode=mode) for mode in IS_MODES},
    **{f"rejection_{option}": CorrectionConfig(rollout_rejection=[option],
                                               rollout_rejection_threshold="0.5_1.5" if option.endswith("k1") else 0.1)
       for option in REJECTION_OPTIONS},
}


@pytest.mark.parametrize("token_advantages", [False, True])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_compute_correction_reads_its_metrics_back_once(name, token_advantages):
    cfg = CONFIGS[name]
    old, rollout, current, mask, adv = _batch(token_advantages=token_advantages)
    bypass = cfg.old_logprob_source == "bypass"
    with host_syncs() as counts:
        out = compute_correction(cfg, old_logprobs=None if bypass else old, rollout_logprobs=rollout,
                                 response_mask=mask, advantages=adv, current_logprobs=current, with_metrics=True)
    assert dict(counts) == {"tolist": 1}, dict(counts)
    assert len(out.metrics) >= 25 and all(isinstance(v, float) for v in out.metrics.values())
    with host_syncs() as counts:
        compute_correction(cfg, old_logprobs=None if bypass else old, rollout_logprobs=rollout,
                           response_mask=mask, advantages=adv, current_logprobs=current, with_metrics=False)
    assert dict(counts) == {}, dict(counts)  # without diagnostics nothing is read back at all


def test_the_off_policy_mask_without_rollout_logprobs_reads_its_one_metric_back_once():
    old, _, current, mask, adv = _batch()
    cfg = CorrectionConfig(off_policy_sequence_mask_delta=0.05)
    with host_syncs() as counts:
        out = compute_correction(cfg, old_logprobs=old, response_mask=mask, advantages=adv, current_logprobs=current)
    assert sum(counts.values()) == 1 and list(out.metrics) == ["rollout_correction/off_policy_masked_frac"]
