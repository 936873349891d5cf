"""The correction's diagnostics cost one host sync, whatever the flags (issue 31, item 11).

The count is ``rollout_parity.testing.host_sync.host_syncs`` (a torch function mode): every host read of tensor
data on CPU, a faithful proxy for a GPU's device-to-host syncs (its module says why).
"""

from __future__ import annotations

import math

import pytest
import torch

from rollout_parity import CorrectionConfig, compute_correction
from rollout_parity.core.config import IS_MODES, REJECTION_OPTIONS
from rollout_parity.testing.host_sync import host_syncs


def test_the_counter_sees_every_kind_of_host_read():
    """The proxy itself: each way of reading a device value back is counted once, and device-side work not at all."""
    x, i = torch.tensor([1.0, 2.0]), torch.tensor([1, 2])
    reads = {"item": lambda: x.sum().item(), "float": lambda: float(x.sum()), "bool": lambda: bool(x.sum() > 0),
             "int": lambda: int(x.sum()), "index": lambda: range(x.sum().long()), "tolist": lambda: x.tolist(),
             "cpu": lambda: x.cpu(), "numpy": lambda: x.numpy(),
             "format": lambda: f"{x.sum():.2f}", "in": lambda: 1.0 in x, "equal": lambda: torch.equal(x, x),
             "nonzero": lambda: x.nonzero(), "where": lambda: torch.where(x > 1), "bool index": lambda: x[x > 1],
             "bool index put": lambda: x.clone().__setitem__(x > 1, 0.0),
             "masked_select": lambda: x.masked_select(x > 1),
             "unique": lambda: torch.unique(i), "repeat_interleave": lambda: torch.repeat_interleave(x, i),
             "tensor of tensors": lambda: torch.tensor([x.sum(), x.amax()]),
             "tensor bound": lambda: torch.arange(i.sum())}
    for what, read in reads.items():
        with host_syncs() as counts:
            read()
        assert sum(counts.values()) == 1, (what, dict(counts))
    with host_syncs() as counts:
        y = (x * 2).sum().exp()
        x[i - 1], x[0], torch.where(x > 1, x, 0.0), torch.repeat_interleave(x, 2), x.to(torch.float64), y.clone()
    assert sum(counts.values()) == 0, dict(counts)


def test_the_counter_leaves_torch_tensor_as_it_was():
    """A mode, never an attribute set on ``torch.Tensor``: after counting, building a tensor from 0-d tensors (which
    fails once ``torch.Tensor`` has had a Python-level ``__getitem__``) still works."""
    before = dict(vars(torch.Tensor))
    with host_syncs():
        torch.tensor([1.0])[0].item()
    assert dict(vars(torch.Tensor)) == before
    assert torch.tensor([torch.tensor(1.0), torch.tensor(2.0)]).tolist() == [1.0, 2.0]


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


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_deferred_diagnostics_read_nothing_back_and_name_the_same_values(name):
    """``defer_metrics``: the call reads nothing back; the pending vector, read back once by the caller (with values
    of its own, as verl's loss wrapper does), names exactly the metrics of the plain call."""
    cfg = CONFIGS[name]
    old, rollout, current, mask, adv = _batch()
    kwargs = dict(old_logprobs=None if cfg.old_logprob_source == "bypass" else old, rollout_logprobs=rollout,
                  response_mask=mask, advantages=adv, current_logprobs=current, with_metrics=True)
    plain = compute_correction(cfg, **kwargs)
    with host_syncs() as counts:
        deferred = compute_correction(cfg, defer_metrics=True, **kwargs)
    assert dict(counts) == {} and deferred.metrics == {} and plain.pending_metrics is None
    assert torch.equal(deferred.mask, plain.mask) and torch.equal(deferred.weights, plain.weights)
    theirs = torch.tensor([7.0], dtype=torch.float64)  # a caller's own value, read in the same transfer
    values = torch.cat([theirs, deferred.pending_metrics]).tolist()
    assert deferred.finish_metrics(values[1:]) == plain.metrics
    with pytest.raises(ValueError, match="expected"):
        deferred.finish_metrics(values)


def test_the_off_policy_mask_alone_defers_its_one_metric_too():
    old, _, current, mask, adv = _batch()
    cfg = CorrectionConfig(off_policy_sequence_mask_delta=0.05)
    plain = compute_correction(cfg, old_logprobs=old, response_mask=mask, advantages=adv, current_logprobs=current)
    with host_syncs() as counts:
        deferred = compute_correction(cfg, old_logprobs=old, response_mask=mask, advantages=adv,
                                      current_logprobs=current, defer_metrics=True)
    assert dict(counts) == {} and deferred.finish_metrics(deferred.pending_metrics.tolist()) == plain.metrics
    without = compute_correction(CorrectionConfig(), old_logprobs=old, response_mask=mask, defer_metrics=True)
    assert without.pending_metrics is None and without.finish_metrics([]) == {}
