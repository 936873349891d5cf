"""The engine seam: what ``engines/spec.py`` shares and what vLLM's package reads from vLLM's outputs and tables.

Each against an independent reference: ``KeptSets.from_lists`` on the lists themselves, the error classes adapters
catch, a checkpoint's own ``config.json``.
"""

from __future__ import annotations

import json

import pytest
import torch

from rollout_parity.core.config import FlagError
from rollout_parity.core.replay import KeptSets
from rollout_parity.engines import spec
from rollout_parity.engines.vllm import outputs
from rollout_parity.engines.vllm.features import VllmKnobMissingError, require_vllm_feature
from rollout_parity.engines.vllm.fp16_models import float16_refusals, refuse_fp16_model


class SamplingMask:  # vllm.outputs.SamplingMask's one field (the live engine's: integration_tests/test_sampling_replay.py)
    def __init__(self, token_ids):
        self.token_ids = token_ids


def test_kept_sets_read_vllm_masks_into_the_batch_width():
    masks = [SamplingMask([[3, 1], [4]]), None, [[2, 6, 7]]]
    tight = outputs.kept_sets(masks)
    wide = outputs.kept_sets(masks, width=5)
    assert tight.shape == (3, 2) and wide.shape == (3, 5)
    reference = KeptSets.from_lists([[[3, 1], [4]], None, [[2, 6, 7]]], width=5)
    assert torch.equal(wide.ids, reference.ids) and torch.equal(wide.offsets, reference.offsets)
    assert wide.counts.tolist() == [[2, 1, 0, 0, 0], [0] * 5, [3, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="2 positions but the batch is 1 tokens wide"):
        outputs.kept_sets(masks, width=1)


def test_a_missing_vllm_feature_is_the_seams_error():
    """Adapters and ``check`` catch the seam's class, whichever engine refused."""
    with pytest.raises(spec.EngineFeatureMissingError, match="return_sampling_mask"):
        require_vllm_feature("return_sampling_mask", "0.27.0", option="rollout_sampling_replay=True")
    assert issubclass(VllmKnobMissingError, spec.EngineFeatureMissingError)


@pytest.mark.parametrize("policy, expected", [(None, "off"), (False, "off"), ("RESET", "reset"), ("salt", "salt")])
def test_prefix_cache_policies_normalize(policy, expected):
    assert spec.normalize_prefix_cache_policy(policy) == expected
    from rollout_parity.engines.vllm import recipe
    assert recipe.normalize_prefix_cache_policy is spec.normalize_prefix_cache_policy  # one rule for every engine


def test_an_unknown_prefix_cache_policy_names_the_choices():
    with pytest.raises(ValueError, match=r"prefix_cache_policy must be one of \('off', 'reset', 'salt'\)"):
        spec.normalize_prefix_cache_policy("sometimes")


def test_refuse_fp16_model_reads_the_table_it_is_given(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert "qwen2" not in float16_refusals()[0]
    refuse_fp16_model(str(tmp_path), "the model")  # vLLM's own table: qwen2 runs in float16
    with pytest.raises(FlagError, match="model type 'qwen2', which vLLM refuses in float16 \\(too wide\\)"):
        refuse_fp16_model(str(tmp_path), "the model", table={"qwen2": "too wide"})
