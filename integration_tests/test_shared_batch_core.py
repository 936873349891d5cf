"""The shared cross-framework batch through the core itself: the reference every adapter meets.

The frozen file is checked twice: the core must reproduce it, and it must agree with the
independent per-token reference (``tests/naive_reference.py``, fed the raw flags), so the
adapters' tests compare against correct numbers, not only against the core's own.
"""

from __future__ import annotations

import math

import pytest
import torch

from rollout_parity import CorrectionConfig

from rollout_parity.check.shared_batch import (all_config_names, config_for, core_reference, load_expected,
                                               make_shared_batch, raw_flags)

from .shared_batch import naive_disagreements, naive_outputs


@pytest.mark.parametrize("name", all_config_names())
def test_core_reproduces_the_frozen_outputs(name):
    ref = core_reference(name)
    expected = load_expected()[name]
    torch.testing.assert_close(ref["weights"], torch.tensor(expected["weights"]), rtol=0, atol=1e-6)
    assert ref["mask"].tolist() == expected["mask"]
    assert ref["loss"].item() == pytest.approx(expected["loss"], abs=1e-6)
    torch.testing.assert_close(ref["grad"], torch.tensor(expected["grad"]), rtol=0, atol=1e-6)
    assert ref["metrics"].keys() == expected["metrics"].keys()
    for key, value in expected["metrics"].items():
        assert ref["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("name", all_config_names())
def test_frozen_outputs_agree_with_the_naive_reference(name):
    """Weights, mask, loss, gradient and every metric in the JSON, against the naive reference."""
    assert naive_disagreements(name, load_expected()[name]) == []


@pytest.mark.parametrize("name", all_config_names())
def test_raw_flags_are_the_config_the_core_runs(name):
    """The naive reference reads the YAML/dict as written; the core reads it through CorrectionConfig."""
    assert CorrectionConfig.from_dict(raw_flags(name)) == config_for(name)


def test_the_batch_crosses_every_bad_input_rule():
    batch = make_shared_batch()
    valid = batch.response_mask.bool()
    assert torch.isnan(batch.rollout_logprobs[valid]).any()
    assert torch.isneginf(batch.rollout_logprobs[valid]).any()
    assert (batch.response_mask.sum(-1) == 0).any()  # an empty sequence
    assert (batch.advantages > 0).any() and (batch.advantages < 0).any()
    for name in all_config_names():
        ref = core_reference(name, batch)
        assert all(math.isfinite(v) for v in ref["metrics"].values()), name
        assert torch.isfinite(ref["grad"]).all(), name
        assert ref["metrics"]["rollout_correction/nonfinite_frac"] > 0


# The flag each extra config and preset exists to exercise, and the (naive) metric that shows it acting.
ACTS = {
    "tis_srs_k3": ("rollout_correction/rejected_seq_frac", "rollout_correction/clipped_frac"),
    "ms_swift_default": ("rollout_correction/clipped_frac",),
    "trl_default": ("rollout_correction/clipped_frac",),
    "verl_decoupled_token_is": ("rollout_correction/clipped_frac",),
    "icepop": ("rollout_correction/clipped_frac",),
    "sequence_truncate_geo": ("rollout_correction/clipped_frac",),
    "sequence_mask_token": ("rollout_correction/clipped_frac",),
    "k1_k2_rejection": ("rollout_correction/rejected_token_frac", "rollout_correction/rejected_seq_frac"),
    "off_policy_mask": ("rollout_correction/off_policy_masked_frac",),
    "metrics_only": ("policy/pg_clipfrac",),
}


@pytest.mark.parametrize("name", all_config_names())
def test_every_config_acts_on_the_batch(name):
    """Guards against a batch on which a flag is a no-op (then the frozen numbers prove nothing about it)."""
    metrics = naive_outputs(name)["metrics"]
    for key in ACTS[name]:
        assert metrics[key] > 0, (name, key)


def test_presets_act_differently_on_it():
    """Guards against a batch too easy to tell the modes apart."""
    losses = {name: round(core_reference(name)["loss"].item(), 6) for name in all_config_names()}
    distinct = set(losses.values())
    assert len(distinct) >= len(losses) - 1, losses  # ms_swift_default == verl_decoupled_token_is on purpose
