"""The shared cross-framework batch through the core itself: the reference every adapter meets."""

from __future__ import annotations

import math

import pytest
import torch

from .shared_batch import all_config_names, core_reference, load_expected, make_shared_batch


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


def test_presets_act_differently_on_it():
    """Guards against a batch too easy to tell the modes apart."""
    losses = {name: round(core_reference(name)["loss"].item(), 6) for name in all_config_names()}
    distinct = set(losses.values())
    assert len(distinct) >= len(losses) - 1, losses  # ms_swift_default == verl_decoupled_token_is on purpose
