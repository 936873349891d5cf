"""``core.readback.read_back``: an adapter's scalars and the correction's deferred diagnostics in one transfer, the
same diagnostics ``compute_correction`` names when it reads them itself."""

from __future__ import annotations

import pytest
import torch

from rollout_parity import CorrectionConfig, compute_correction
from rollout_parity.core.readback import read_back


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 16, generator=g) * 3
    return dict(old_logprobs=old, rollout_logprobs=old + torch.randn(4, 16, generator=g) * 0.2,
                response_mask=(torch.rand(4, 16, generator=g) > 0.1).float())


def test_the_parts_and_the_diagnostics_come_back_in_one_transfer(monkeypatch):
    cfg = CorrectionConfig.preset("tis_srs_k3", log_rollout_offpolicy_metrics=True)
    batch = _batch()
    direct = compute_correction(cfg, **batch, with_metrics=True).metrics
    deferred = compute_correction(cfg, **batch, with_metrics=True, defer_metrics=True)
    assert deferred.metrics == {} and deferred.pending_metrics is not None
    calls = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(self.shape) or real(self))
    kept = torch.tensor(True)
    parts = {"any_kept": kept, "tokens": batch["response_mask"].sum(), "loss": torch.tensor(0.25, dtype=torch.bfloat16)}
    named, metrics = read_back(parts, deferred)
    assert len(calls) == 1  # the one host sync
    assert named == {"any_kept": 1.0, "tokens": float(batch["response_mask"].sum()), "loss": 0.25}
    assert metrics.keys() == direct.keys()
    for key, value in direct.items():
        assert metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_without_pending_diagnostics_only_the_parts_come_back():
    cfg = CorrectionConfig.preset("tis_srs_k3")
    out = compute_correction(cfg, **_batch(), with_metrics=False, defer_metrics=True)
    assert out.pending_metrics is None
    assert read_back({"n": torch.tensor(3)}, out) == ({"n": 3.0}, {})
    assert read_back({"n": torch.tensor([2.5])}) == ({"n": 2.5}, {})  # a one-element tensor, no correction
    with pytest.raises(ValueError, match="at least one part"):
        read_back({}, out)
