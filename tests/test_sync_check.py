"""The weight-sync check's core (core/sync_check.py): probe, trainer scoring, verdict, attribution, schedule."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_parity.core.sync_check import SyncCheckResult, SyncProbe, SyncSchedule, WeightSyncError, judge, \
    make_probe, parameter_group, trainer_probe_logprobs, unsent_groups


def test_the_probe_is_fixed_by_its_seed():
    a, b, c = make_probe(100), make_probe(100), make_probe(100, seed=1)
    assert a == b and a != c and a.num_tokens == 32
    assert all(len(p) == 16 and all(0 <= t < 100 for t in p) for p in a.prompts)
    with pytest.raises(ValueError, match="vocab_size"):
        make_probe(1)


def test_the_probe_s_sizes_and_seed_are_what_the_caller_asks():
    probe = make_probe(50, num_prompts=3, prompt_len=5, new_tokens=2, seed=7)
    assert len(probe.prompts) == 3 and all(len(p) == 5 for p in probe.prompts)
    assert probe.new_tokens == 2 and probe.seed == 7 and probe.num_tokens == 6
    assert probe.prompts == make_probe(50, num_prompts=3, prompt_len=5, seed=7).prompts  # the seed fixes them
    by_hand = SyncProbe(probe.prompts, new_tokens=3, seed=1)
    assert by_hand.num_tokens == 9 and by_hand != probe


def test_the_message_names_what_the_sync_left_out_or_says_everything_was_sent():
    common = dict(sync_index=4, delta_abs_mean=0.3, delta_abs_max=0.9, threshold=0.05, tokens=32)
    unsent = SyncCheckResult(**common, unsent=("model.layers.1.mlp",), sent_known=True)
    assert not unsent.ok and "Never handed to the engine in this sync" in unsent.message()
    assert "model.layers.1.mlp" in unsent.message()
    everything = SyncCheckResult(**common, sent_known=True)
    assert "Every trainer parameter was sent" in everything.message()
    unknown = SyncCheckResult(**common)  # the caller did not record what it sent: both causes stay open
    assert "A parameter group the sync did not send" in unknown.message()
    healthy = SyncCheckResult(**{**common, "delta_abs_mean": 0.01}, unsent=("lm_head",))
    assert healthy.ok and "(not sent in this sync: lm_head)" in healthy.message()


def test_judge_passes_the_parity_level_and_fails_a_gap():
    engine = torch.log(torch.full((4, 8), 0.5))
    healthy = judge(engine, engine + 1e-3, 0.05, sync_index=2)
    assert healthy.ok and healthy.tokens == 32 and math.isclose(healthy.delta_abs_mean, 1e-3, rel_tol=1e-4)
    assert healthy.metrics()["weight_sync/check_failed"] == 0.0 and ": ok" in healthy.message()
    broken = judge(engine, engine + 0.2, 0.05, sync_index=3, unsent=())
    assert not broken.ok and broken.metrics()["weight_sync/check_failed"] == 1.0
    assert "weight sync 3" in broken.message() and "Every trainer parameter was sent" in broken.message()
    unknown = judge(engine, engine + 0.2, 0.05)  # the caller did not record what it sent
    assert "A parameter group the sync did not send" in unknown.message()
    named = judge(engine, engine + 0.2, 0.05, unsent=("model.layers.1.mlp (3 of 3 tensors)",))
    assert "left at their old values): model.layers.1.mlp (3 of 3 tensors)" in str(WeightSyncError(named))


def test_judge_skips_nan_padding_and_counts_one_sided_inf():
    engine = torch.tensor([[-1.0, -2.0, float("nan")]])
    trainer = torch.tensor([[-1.0, -2.5, float("nan")]])
    result = judge(engine, trainer, 1.0)
    assert result.tokens == 2 and math.isclose(result.delta_abs_mean, 0.25)
    assert not judge(torch.tensor([[-float("inf")]]), torch.tensor([[-1.0]]), 1.0).ok
    assert judge(torch.tensor([[-float("inf")]]), torch.tensor([[-float("inf")]]), 1.0).ok
    with pytest.raises(ValueError, match="disagree in shape"):
        judge(torch.zeros(2, 3), torch.zeros(3, 2), 1.0)


def test_groups_and_unsent_names():
    assert parameter_group("model.layers.3.mlp.experts.down_proj") == "model.layers.3.mlp"
    assert parameter_group("model.layers.12.self_attn.q_proj.weight") == "model.layers.12.self_attn"
    assert parameter_group("lm_head.weight") == "lm_head" and parameter_group("model.norm.weight") == "model.norm"
    names = ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj",
             "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"]
    assert unsent_groups(names, names) == ()
    assert unsent_groups(names, names[2:]) == ("model.layers.1.mlp (2 of 2 tensors)",)
    assert unsent_groups(names, names[1:]) == ("model.layers.1.mlp (1 of 2 tensors)",)


def test_schedule_checks_the_first_then_every_nth():
    every_third = SyncSchedule(3)
    assert [every_third.next_is_checked() for _ in range(7)] == [True, False, False, True, False, False, True]
    assert not any(SyncSchedule(None).next_is_checked() for _ in range(3))
    assert all(SyncSchedule(1).next_is_checked() for _ in range(3))


def test_trainer_probe_logprobs_is_the_model_s_log_softmax_at_the_temperature():
    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 10)

        def forward(self, input_ids, attention_mask):
            assert attention_mask.shape == input_ids.shape
            return type("Out", (), {"logits": self.emb(input_ids) * 3})()

    model = Toy()
    prompts, completions = [[1, 2], [3, 4, 5]], [[6, 7, 8], [9]]
    got = trainer_probe_logprobs(model, prompts, completions, temperature=0.7)
    assert got.shape == (2, 3) and got[1, 1:].isnan().all()
    with torch.no_grad():
        seq = torch.tensor([1, 2, 6, 7, 8])
        want = (model.emb(seq) * 3 / 0.7).log_softmax(-1)[1:4].gather(-1, seq[2:, None])[:, 0]
    torch.testing.assert_close(got[0], want)


def test_trainer_probe_logprobs_feeds_the_device_the_trainer_names():
    """A trainer whose parameters sit elsewhere than where it computes (verl's FSDP2 offload_policy keeps the shards
    on the CPU): the probe's inputs go to ``device``, not to the first parameter's device."""
    class Offloaded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.shard = torch.nn.Parameter(torch.empty(4, device="meta"))  # first parameter, not where it computes
            self.emb = torch.nn.Embedding(10, 10)

        def forward(self, input_ids, attention_mask):
            seen.append(input_ids.device.type)
            return type("Out", (), {"logits": self.emb(input_ids.to("cpu"))})()

    model, seen = Offloaded(), []
    with pytest.raises(NotImplementedError, match="meta"):  # by default: the first parameter's device
        trainer_probe_logprobs(model, [[1, 2]], [[3, 4]])
    got = trainer_probe_logprobs(model, [[1, 2]], [[3, 4]], device="cpu")
    assert seen == ["meta", "cpu"]
    with torch.no_grad():
        want = model.emb(torch.tensor([1, 2, 3, 4])).log_softmax(-1)[1:3].gather(-1, torch.tensor([[3], [4]]))[:, 0]
    torch.testing.assert_close(got[0], want)


def test_one_token_routed_differently_is_no_stale_sync_but_a_broad_gap_is():
    """The verl MoE run's healthy sync 2: 31 tokens at ~0.012 and one at 4.0 nats (a routing flip between the
    bf16 engine and the fp32 trainer): 0.136 untrimmed, above the default threshold; trimmed it passes."""
    engine = torch.log(torch.full((4, 8), 0.5))
    trainer = engine + 0.012
    trainer[2, 5] = engine[2, 5] - 4.0
    flip = judge(engine, trainer, 0.05, sync_index=2)
    assert math.isclose(flip.delta_abs_mean, (31 * 0.012 + 4.0) / 32, rel_tol=1e-5) and flip.delta_abs_mean > 0.05
    assert flip.trimmed == 2 and math.isclose(flip.delta_abs_trimmed_mean, 0.012, rel_tol=1e-5) and flip.ok
    assert "the largest 2 of 32 gaps left out" in flip.message()
    assert flip.metrics()["weight_sync/probe_delta_abs_trimmed_mean"] == flip.delta_abs_trimmed_mean
    stale = judge(engine, engine + torch.linspace(0.02, 0.2, 32).reshape(4, 8), 0.05)  # every token moved
    assert not stale.ok and stale.delta_abs_trimmed_mean > 0.05
    three = trainer.clone()
    three[0, 0] = three[1, 1] = engine[0, 0] - 4.0  # three tokens of 32 at 4 nats: more than a trim hides
    assert not judge(engine, three, 0.05).ok


def test_a_probe_under_16_tokens_is_not_trimmed():
    engine = torch.zeros(1, 15)
    trainer = engine.clone()
    trainer[0, 0] = 1.5  # one gap of 1.5 among 15: mean 0.1
    result = judge(engine, trainer, 0.05)
    assert result.trimmed == 0 and result.delta_abs_trimmed_mean == result.delta_abs_mean and not result.ok
    assert "(15 tokens, max 1.5)" in result.message()


def test_a_result_decides_on_the_trimmed_mean_when_given():
    common = dict(sync_index=1, delta_abs_mean=0.2, delta_abs_max=4.0, threshold=0.05, tokens=32)
    assert not SyncCheckResult(**common).ok  # no trimmed mean given: the plain mean decides
    assert SyncCheckResult(**common, delta_abs_trimmed_mean=0.01, trimmed=2).ok
