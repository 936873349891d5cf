"""What more than one adapter needs, written once: flag text, sampler settings, pi_rollout on the
trainer's support, the framework-independent refusals, the masked reductions (one process here; two
gloo ranks in test_core_distributed.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rollout_parity import CorrectionConfig
from rollout_parity.adapters._refusals import active_penalties, head_modifiers, needs_rollout_logprobs, \
    refuse_unmatched_sampler
from rollout_parity.core.config import flag_from_text
from rollout_parity.core.distributed import all_reduce, masked_mean, masked_summary
from rollout_parity.core.sampler import SamplerSettings, rollout_on_full_vocabulary


# ----------------------------------------------------------------------------- flag_from_text

@pytest.mark.parametrize("name, raw, expected", [
    ("rollout_importance_sampling_mode", "null", None),
    ("rollout_importance_sampling_mode", " None ", None),
    ("rollout_importance_sampling_mode", "", None),
    ("rollout_importance_sampling_mode", "token_truncate", "token_truncate"),
    ("rollout_importance_sampling_threshold", "2.5", 2.5),
    ("off_policy_sequence_mask_delta", 0.02, 0.02),  # not text: passes through
    ("fp32_lm_head", "true", True),
    ("log_rollout_offpolicy_metrics", "False", False),
    ("rollout_rejection", "seq_sum_k3", ["seq_sum_k3"]),
    ("rollout_rejection", "seq_sum_k3, token_k1", ["seq_sum_k3", "token_k1"]),
    ("rollout_rejection", ["seq_sum_k3", "token_k2,token_k1"], ["seq_sum_k3", "token_k2", "token_k1"]),
    ("rollout_rejection", ["null"], None),
    ("rollout_rejection_threshold", "0.001", 0.001),
    ("rollout_rejection_threshold", ["0.001"], 0.001),  # TRL's parser gives a list of one
    ("rollout_rejection_threshold", "0.001,0.5_2.0", [0.001, "0.5_2.0"]),  # a K1 range stays text
    ("rollout_rejection_threshold", "0.9_1", "0.9_1"),  # not 0.91 (float() reads '_' as digit grouping)
    ("rollout_rejection_threshold", ["0.001", "0.5"], [0.001, 0.5]),
    ("rollout_rejection_threshold", [[0.5, 2.0]], [0.5, 2.0]),  # a pair given in code, for one K1 option
    ("rollout_rejection_threshold", [0.001, 3], [0.001, 3]),
])
def test_flag_from_text_reads_each_kind_of_value(name, raw, expected):
    assert flag_from_text(name, raw) == expected


def test_launcher_and_trl_config_read_the_same_text_into_the_same_flags():
    from rollout_parity.launcher import correction_from_args, parse_args

    argv = ["--rollout_rejection", "seq_sum_k3,seq_mean_k1", "--rollout_rejection_threshold", "0.01,0.9_1.1",
            "--rollout_importance_sampling_threshold_lower", "null", "--rollout_importance_sampling_mode",
            "token_mask", "--rollout_importance_sampling_threshold", "1.5", "script.py"]
    launched = correction_from_args(parse_args(argv))
    parsed = {name: flag_from_text(name, value) for name, value in [
        ("rollout_rejection", ["seq_sum_k3", "seq_mean_k1"]), ("rollout_rejection_threshold", ["0.01", "0.9_1.1"]),
        ("rollout_importance_sampling_threshold_lower", "none"), ("rollout_importance_sampling_mode", "token_mask"),
        ("rollout_importance_sampling_threshold", "1.5")]}
    assert launched == CorrectionConfig(**parsed)
    assert launched.rejection_rules[1].lower == pytest.approx(0.9)


# ----------------------------------------------------------------------------- SamplerSettings

@pytest.mark.parametrize("top_k", [None, 0, -1])
def test_a_top_k_that_is_off_is_none(top_k):
    assert SamplerSettings(top_k=top_k).top_k is None and not SamplerSettings(top_k=top_k).truncates


@pytest.mark.parametrize("kwargs", [{"top_k": 20}, {"top_p": 0.9}, {"min_p": 0.05}])
def test_each_filter_truncates(kwargs):
    settings = SamplerSettings(temperature=0.7, **kwargs)
    assert settings.truncates and SamplerSettings(**settings.to_dict()) == settings
    assert not SamplerSettings(temperature=0.7).truncates  # temperature alone renormalises nothing


@pytest.mark.parametrize("kwargs, match", [({"top_p": 0.0}, "top_p"), ({"min_p": 1.5}, "min_p"),
                                           ({"temperature": -1.0}, "temperature")])
def test_bad_sampler_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplerSettings(**kwargs)


# ----------------------------------------------------------------------------- pi_rollout on the trainer's support

def test_rollout_on_full_vocabulary_against_a_naive_per_token_rule():
    g = torch.Generator().manual_seed(0)
    full = -torch.rand(3, 5, generator=g) * 3
    log_s = -torch.rand(3, 5, generator=g) * 0.4
    processed = full - log_s
    rollout = processed + torch.randn(3, 5, generator=g) * 1e-2
    processed[0, 1] = -math.inf  # outside the trainer's kept set
    rollout[1, 2], rollout[2, 3] = math.nan, -math.inf  # the engine's NaN and -inf
    out = rollout_on_full_vocabulary(rollout, full, processed)
    for i in range(3):
        for j in range(5):
            finite = math.isfinite(processed[i, j]) and math.isfinite(rollout[i, j])
            want = rollout[i, j] + (full[i, j] - processed[i, j]) if finite else full[i, j]
            assert out[i, j].item() == pytest.approx(want.item(), abs=1e-6), (i, j)
    with pytest.raises(ValueError, match=r"full_old.*\(3, 4\)"):
        rollout_on_full_vocabulary(rollout, full[:, :4], processed)


# ----------------------------------------------------------------------------- refusals

TOKEN = CorrectionConfig(rollout_importance_sampling_mode="token_truncate")
METRICS = CorrectionConfig(log_rollout_offpolicy_metrics=True)


def test_flags_that_never_read_the_rollout_refuse_nothing():
    assert not needs_rollout_logprobs(CorrectionConfig(fp32_lm_head=True))
    refuse_unmatched_sampler(CorrectionConfig(fp32_lm_head=True), SamplerSettings(temperature=0.5, top_p=0.5),
                             penalties={"repetition_penalty": 1.2}, modifiers={"logit_scale": 2.0},
                             trainer_temperature=1.0)
    assert needs_rollout_logprobs(CorrectionConfig(old_logprob_source="bypass")) and needs_rollout_logprobs(METRICS)


def test_a_trainer_temperature_other_than_the_samplers_is_refused():
    with pytest.raises(ValueError, match="temperature=0.7 but the trainer's log-probs use temperature=1.0"):
        refuse_unmatched_sampler(METRICS, SamplerSettings(temperature=0.7), trainer_temperature=1.0)
    refuse_unmatched_sampler(METRICS, SamplerSettings(temperature=0.7), trainer_temperature=0.7)


def test_penalties_are_refused_only_when_the_loss_would_read_them():
    refuse_unmatched_sampler(METRICS, SamplerSettings(), penalties={"presence_penalty": 0.5})  # measuring is fine
    with pytest.raises(ValueError, match=r"presence_penalty=0\.5: vLLM's processed logprobs"):
        refuse_unmatched_sampler(TOKEN, SamplerSettings(), penalties={"presence_penalty": 0.5})


def test_scaled_heads_are_refused_only_under_a_truncating_sampler():
    refuse_unmatched_sampler(TOKEN, SamplerSettings(), modifiers={"logit_scale": 2.0})
    with pytest.raises(ValueError, match=r"top_p=0\.9.*logit_scale=2\.0"):
        refuse_unmatched_sampler(TOKEN, SamplerSettings(top_p=0.9), modifiers={"logit_scale": 2.0})


def test_sampling_replay_is_refused_where_vllm_cannot_return_kept_sets():
    replay = TOKEN.replace(rollout_sampling_replay=True)
    refuse_unmatched_sampler(replay, SamplerSettings(top_k=50, top_p=0.9))  # what vLLM replays
    with pytest.raises(ValueError, match=r"top_k=None: vLLM returns kept sets only for requests with top_k > 0"):
        refuse_unmatched_sampler(replay, SamplerSettings(top_p=0.9))
    with pytest.raises(ValueError, match="greedy sampling"):
        refuse_unmatched_sampler(replay, SamplerSettings(temperature=0.0, top_k=50))
    with pytest.raises(ValueError, match="nothing reads the sampler's logprobs"):
        refuse_unmatched_sampler(CorrectionConfig(rollout_sampling_replay=True), SamplerSettings(top_k=50))
    with pytest.raises(ValueError, match="rollout_sampling_replay"):
        CorrectionConfig(rollout_sampling_replay="yes")


def test_penalty_and_modifier_readers_skip_neutral_values():
    values = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "logit_bias": {}, "min_tokens": 4}
    assert active_penalties(values.get) == {"min_tokens": 4}
    text = SimpleNamespace(final_logit_softcapping=30.0, logit_scale=1.0)
    assert head_modifiers(SimpleNamespace(get_text_config=lambda: text)) == {"final_logit_softcapping": 30.0}
    assert head_modifiers({"logits_scaling": 0.5, "logit_scale": None}) == {"logits_scaling": 0.5}
    assert head_modifiers(None) == {}


# ----------------------------------------------------------------------------- masked reductions (one process)

def test_masked_summary_and_mean_against_plain_python():
    values = torch.tensor([[1.0, 5.0, -2.0], [math.nan, 3.0, 0.5]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    kept = [1.0, 5.0, 3.0, 0.5]
    summary = masked_summary(values, mask)
    assert summary == (sum(kept) / 4, min(kept), max(kept), 4)
    assert masked_mean(values, mask) == pytest.approx(sum(kept) / 4)
    assert masked_summary(values, torch.zeros_like(mask), empty=1.0) == (1.0, 1.0, 1.0, 0)
    assert masked_mean(values, torch.zeros_like(mask)) == 0.0
    t = torch.ones(2)
    assert all_reduce(t, None) is t  # no group: the local batch is the batch
    with pytest.raises(RuntimeError, match="not initialised"):
        all_reduce(torch.ones(1), object())


# Every shared flag at a value other than its default on ``rollout-parity launch``'s command line.
LAUNCH_EVERY_FLAG = [
    (["--rollout_importance_sampling_mode", "token_mask"], dict(rollout_importance_sampling_mode="token_mask")),
    (["--rollout_importance_sampling_threshold", "3.5"], dict(rollout_importance_sampling_threshold=3.5)),
    (["--rollout_importance_sampling_threshold_lower", "0.5"], dict(rollout_importance_sampling_threshold_lower=0.5)),
    (["--rollout_importance_sampling_sequence_reduction", "product"],
     dict(rollout_importance_sampling_sequence_reduction="product")),
    (["--rollout_importance_sampling_sequence_mask_weight", "sequence"],
     dict(rollout_importance_sampling_sequence_mask_weight="sequence")),
    (["--rollout_rejection", "seq_max_k2,token_k1", "--rollout_rejection_threshold", "0.02,0.5_2"],
     dict(rollout_rejection=["seq_max_k2", "token_k1"], rollout_rejection_threshold=[0.02, "0.5_2"])),
    (["--off_policy_sequence_mask_delta", "0.25"], dict(off_policy_sequence_mask_delta=0.25)),
    (["--old_logprob_source", "bypass"], dict(old_logprob_source="bypass")),
    (["--log_rollout_offpolicy_metrics"], dict(log_rollout_offpolicy_metrics=True)),
    (["--fp32_lm_head"], dict(fp32_lm_head=True)),
    (["--weight_sync_check_interval", "3"], dict(weight_sync_check_interval=3)),
    (["--weight_sync_check_threshold", "0.2"], dict(weight_sync_check_threshold=0.2)),
    (["--moe_routing_replay"], dict(moe_routing_replay=True)),
    (["--rollout_sampling_replay"], dict(rollout_sampling_replay=True)),
    (["--compile_correction"], dict(compile_correction=True)),
    (["--precision", "float16"], dict(precision="fp16")),
]


@pytest.mark.parametrize("argv,flags", LAUNCH_EVERY_FLAG, ids=lambda x: x[0] if isinstance(x, list) else "")
def test_every_shared_flag_on_the_launch_command_line(argv, flags):
    from rollout_parity.launcher import correction_from_args, parse_args

    args = parse_args([*argv, "script.py", "--old_logprob_source", "the script's"])
    assert correction_from_args(args) == CorrectionConfig(**flags) != CorrectionConfig()
    assert args.target == ["script.py", "--old_logprob_source", "the script's"]  # the script's own, untouched
    assert {k for _, f in LAUNCH_EVERY_FLAG for k in f} == set(CorrectionConfig.field_names())


def test_engine_side_flags_are_refused_where_only_the_loss_is_reached():
    from rollout_parity.adapters._refusals import refuse_engine_side_flags

    refuse_engine_side_flags(CorrectionConfig(weight_sync_check_threshold=0.1), "NeMo RL's loss function")
    for flags in (dict(weight_sync_check_interval=2), dict(moe_routing_replay=True)):
        with pytest.raises(ValueError, match=f"{next(iter(flags))}=.*NeMo RL's loss function has no hook"):
            refuse_engine_side_flags(CorrectionConfig(**flags), "NeMo RL's loss function")
