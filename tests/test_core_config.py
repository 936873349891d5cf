"""CorrectionConfig: every shared flag under its exact name, validated at construction."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from rollout_parity import CorrectionConfig
# The flag table written out (the naive reference's), checked against the code and against the docs' table
from tests.naive_reference import DEFAULTS as FLAG_DEFAULTS, LATER_DEFAULTS

FLAGS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "flags.md"


def docs_flag_table():
    """``{flag: default}`` parsed from the flag table of docs/flags.md (the one users read)."""
    rows = re.findall(r"^\| `([a-z0-9_]+)` \|[^|]*\| ([^|]+) \|", FLAGS_PAGE.read_text(), flags=re.M)
    words = {"`null`": None, "—": None, "false": False, "true": True}

    def value(text):
        text = text.strip()
        if text in words:
            return words[text]
        try:
            return float(text)
        except ValueError:
            return text.strip("`")

    return {name: value(default) for name, default in rows}


def test_every_flag_exists_with_its_default():
    """CorrectionConfig's fields and defaults are exactly the written-out table and the later flags."""
    fields = {f.name: f.default for f in dataclasses.fields(CorrectionConfig)}
    assert fields == {**FLAG_DEFAULTS, **LATER_DEFAULTS}
    cfg = CorrectionConfig()
    assert {name: getattr(cfg, name) for name in FLAG_DEFAULTS} == FLAG_DEFAULTS
    assert cfg.rollout_importance_sampling_threshold == 2.0 and type(cfg.rollout_importance_sampling_threshold) is float
    assert cfg.log_rollout_offpolicy_metrics is False and cfg.fp32_lm_head is False
    assert not cfg.changes_loss and not cfg.wants_metrics


def test_the_docs_flag_table_lists_every_flag_with_its_default():
    """docs/flags.md's table names every field of CorrectionConfig, with the default the code has."""
    table = docs_flag_table()
    fields = {f.name: f.default for f in dataclasses.fields(CorrectionConfig)}
    assert table == {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None else v)
                     for k, v in fields.items()}


@pytest.mark.parametrize("flags, flag_named", [
    (dict(rollout_importance_sampling_mode="token_clip"), "rollout_importance_sampling_mode"),
    (dict(rollout_importance_sampling_threshold=0.0), "rollout_importance_sampling_threshold"),
    (dict(rollout_importance_sampling_threshold=-1.0), "rollout_importance_sampling_threshold"),
    (dict(rollout_importance_sampling_threshold=float("nan")), "rollout_importance_sampling_threshold"),
    (dict(rollout_importance_sampling_threshold_lower=2.0), "rollout_importance_sampling_threshold_lower"),
    (dict(rollout_importance_sampling_threshold_lower=3.0), "rollout_importance_sampling_threshold_lower"),
    (dict(rollout_importance_sampling_threshold_lower=-0.1), "rollout_importance_sampling_threshold_lower"),
    (dict(rollout_importance_sampling_sequence_reduction="mean"), "rollout_importance_sampling_sequence_reduction"),
    (dict(rollout_importance_sampling_sequence_mask_weight="seq"), "rollout_importance_sampling_sequence_mask_weight"),
    (dict(rollout_rejection=["seq_max_k1"], rollout_rejection_threshold=2.0), "rollout_rejection"),
    (dict(rollout_rejection=["token_k3", "token_k3"], rollout_rejection_threshold=1.0), "rollout_rejection"),
    (dict(rollout_rejection=["token_k3"]), "rollout_rejection_threshold"),
    (dict(rollout_rejection=["token_k3"], rollout_rejection_threshold=0.0), "rollout_rejection_threshold"),
    (dict(rollout_rejection=["token_k3"], rollout_rejection_threshold="0.1_0.2"), "rollout_rejection_threshold"),
    (dict(rollout_rejection=["token_k1"], rollout_rejection_threshold="2_1"), "rollout_rejection_threshold"),
    (dict(rollout_rejection=["token_k1"], rollout_rejection_threshold="a_b"), "rollout_rejection_threshold"),
    (dict(rollout_rejection=["token_k2", "seq_sum_k3"], rollout_rejection_threshold=[1.0, 2.0, 3.0]),
     "rollout_rejection_threshold"),
    (dict(rollout_rejection_threshold=0.1), "rollout_rejection_threshold"),
    (dict(rollout_importance_sampling_threshold=float("inf")), "rollout_importance_sampling_threshold"),
    (dict(rollout_importance_sampling_threshold="two"), "rollout_importance_sampling_threshold"),
    (dict(rollout_importance_sampling_threshold=True), "rollout_importance_sampling_threshold"),
    (dict(rollout_importance_sampling_threshold_lower=float("nan")), "rollout_importance_sampling_threshold_lower"),
    (dict(rollout_rejection="token_k3, seq_sum_k5", rollout_rejection_threshold=1.0), "rollout_rejection"),
    (dict(rollout_rejection=["token_k1"], rollout_rejection_threshold=0.0), "rollout_rejection_threshold"),
    (dict(rollout_rejection=["token_k1"], rollout_rejection_threshold=[0.5, 1.0, 2.0]), "rollout_rejection_threshold"),
    (dict(rollout_rejection=["seq_max_k2"], rollout_rejection_threshold=float("nan")), "rollout_rejection_threshold"),
    (dict(rollout_rejection=["seq_mean_k3"], rollout_rejection_threshold="big"), "rollout_rejection_threshold"),
    (dict(off_policy_sequence_mask_delta=0.0), "off_policy_sequence_mask_delta"),
    (dict(off_policy_sequence_mask_delta=-0.1), "off_policy_sequence_mask_delta"),
    (dict(off_policy_sequence_mask_delta=float("nan")), "off_policy_sequence_mask_delta"),
    (dict(old_logprob_source="cache"), "old_logprob_source"),
    (dict(old_logprob_source="bypass", rollout_importance_sampling_mode="token_truncate"),
     "rollout_importance_sampling_mode"),
    (dict(log_rollout_offpolicy_metrics="yes"), "log_rollout_offpolicy_metrics"),
    (dict(fp32_lm_head=1), "fp32_lm_head"),
    (dict(weight_sync_check_interval=-1), "weight_sync_check_interval"),
    (dict(weight_sync_check_interval=1.5), "weight_sync_check_interval"),
    (dict(weight_sync_check_interval=True), "weight_sync_check_interval"),
    (dict(weight_sync_check_interval="often"), "weight_sync_check_interval"),
    (dict(weight_sync_check_threshold=0.0), "weight_sync_check_threshold"),
    (dict(weight_sync_check_threshold=-0.1), "weight_sync_check_threshold"),
    (dict(weight_sync_check_threshold=float("nan")), "weight_sync_check_threshold"),
    (dict(moe_routing_replay="yes"), "moe_routing_replay"),
])
def test_bad_flags_raise_naming_the_flag(flags, flag_named):
    with pytest.raises(ValueError, match=re.escape(flag_named)):
        CorrectionConfig(**flags)


def test_sync_and_routing_flags_read_as_the_command_line_gives_them():
    from rollout_parity.core.config import flag_from_text

    cfg = CorrectionConfig(weight_sync_check_interval=flag_from_text("weight_sync_check_interval", "3"),
                           weight_sync_check_threshold=flag_from_text("weight_sync_check_threshold", "0.01"),
                           moe_routing_replay=flag_from_text("moe_routing_replay", "true"))
    assert cfg.weight_sync_check_interval == 3 and type(cfg.weight_sync_check_interval) is int
    assert cfg.weight_sync_check_threshold == 0.01 and cfg.moe_routing_replay is True
    assert CorrectionConfig(weight_sync_check_interval=0).weight_sync_check_interval is None  # 0: off
    assert not cfg.changes_loss and not cfg.wants_metrics  # neither touches the correction
    assert CorrectionConfig.from_dict(cfg.to_dict()) == cfg


def test_unknown_keys_are_rejected_not_dropped():
    with pytest.raises(ValueError, match="rollout_importance_sampling_treshold"):
        CorrectionConfig.from_dict({"rollout_importance_sampling_treshold": 2.0})


def test_rejection_threshold_forms():
    cfg = CorrectionConfig(rollout_rejection="token_k1, seq_sum_k3", rollout_rejection_threshold="0.5_2,0.001")
    rules = cfg.rejection_rules
    assert [r.option for r in rules] == ["token_k1", "seq_sum_k3"]
    assert (rules[0].lower, rules[0].upper) == (0.5, 2.0)
    assert rules[1].upper == 0.001 and rules[1].lower is None
    one = CorrectionConfig(rollout_rejection=["seq_mean_k1"], rollout_rejection_threshold=4.0).rejection_rules[0]
    assert (one.lower, one.upper) == (0.25, 4.0)
    pair = CorrectionConfig(rollout_rejection=["token_k1"], rollout_rejection_threshold=[0.8, 1.25]).rejection_rules[0]
    assert (pair.lower, pair.upper) == (0.8, 1.25)
    shared = CorrectionConfig(rollout_rejection=["token_k2", "token_k3"], rollout_rejection_threshold=0.3)
    assert [r.upper for r in shared.rejection_rules] == [0.3, 0.3]


@pytest.mark.parametrize("name", CorrectionConfig.available_presets())
def test_presets_round_trip(name):
    cfg = CorrectionConfig.preset(name)
    again = CorrectionConfig.from_dict(cfg.to_dict())
    assert again == cfg
    # to_dict is plain YAML: it survives a dump/load.
    assert CorrectionConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg


#: Each required preset's flags that differ from the defaults, from its source (the preset's
#: description cites it): the paper's best recipe, ms-swift, TRL, verl, IcePop.
PRESET_MEANING = {
    "tis_srs_k3": dict(rollout_importance_sampling_mode="token_truncate", rollout_rejection=["seq_sum_k3"],
                       rollout_rejection_threshold=0.001),
    "ms_swift_default": dict(rollout_importance_sampling_mode="token_truncate"),
    "trl_default": dict(rollout_importance_sampling_mode="sequence_mask", rollout_importance_sampling_threshold=3.0,
                        rollout_importance_sampling_sequence_reduction="product",
                        rollout_importance_sampling_sequence_mask_weight="sequence"),
    "verl_decoupled_token_is": dict(rollout_importance_sampling_mode="token_truncate",
                                    rollout_importance_sampling_sequence_reduction="product"),
    "icepop": dict(rollout_importance_sampling_mode="token_mask", rollout_importance_sampling_threshold_lower=0.5),
}


@pytest.mark.parametrize("name", sorted(PRESET_MEANING))
def test_required_presets_and_their_meaning(name):
    """Every flag of the preset, so an edit of its YAML shows here even where a test batch cannot tell."""
    assert name in CorrectionConfig.available_presets()
    got = CorrectionConfig.preset(name).to_dict()
    changed = {k: v for k, v in got.items() if v != {**FLAG_DEFAULTS, **LATER_DEFAULTS}[k]}
    assert changed == PRESET_MEANING[name]


def test_preset_overrides_and_unknown_names():
    assert CorrectionConfig.preset("tis_srs_k3", rollout_importance_sampling_threshold=3.0
                                   ).rollout_importance_sampling_threshold == 3.0
    with pytest.raises(ValueError, match="unknown preset"):
        CorrectionConfig.preset("nope")


def test_from_omegaconf_node():
    from omegaconf import OmegaConf

    node = OmegaConf.create({"rollout_importance_sampling_mode": "token_mask",
                             "rollout_rejection": ["token_k3"], "rollout_rejection_threshold": 0.5})
    cfg = CorrectionConfig.from_dict(node)
    assert cfg.rollout_rejection == ("token_k3",) and cfg.rollout_importance_sampling_mode == "token_mask"


def test_null_spellings_of_mode():
    for spelling in (None, "none", "null", ""):
        assert CorrectionConfig(rollout_importance_sampling_mode=spelling).rollout_importance_sampling_mode is None
