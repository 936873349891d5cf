"""Anchor checks of the TRL adapter on the shared cross-framework batch (issue 2 item 7c, issue 4).

1. Through the adapter: the patched ``GRPOTrainer._compute_loss`` gives the core's frozen
   weights, mask, loss, gradient and metrics (``integration_tests/shared_batch_expected.json``)
   to 1e-6 in fp32, for every preset and extra config. Only the model forward is replaced (it
   returns the batch's current logprobs); everything else is the real trainer.
2. Against TRL's own code: TRL 1.16 computes its vLLM importance-sampling ratio inline in
   ``_generate_and_score_completions``. We run that real method on the same batch (the
   batch enters through TRL's public ``rollout_func`` hook, and the old-logprob forward returns
   the batch's old logprobs) and compare ``inputs["importance_sampling_ratio"]`` with our
   weights: ``trl_default`` and the other TRL modes, mapped onto the shared flags.
3. TRL's static ``get_off_policy_mask`` against our ``off_policy_sequence_mask_delta`` (rows
   included, the one with a NaN sampler logprob too).
4. With an on-policy batch, the corrected loss equals TRL's own ``_compute_loss`` for each
   supported ``loss_type`` (dapo, bnpo, grpo): the aggregation mapping is TRL's.
"""

from __future__ import annotations

import math

import pytest

from rollout_parity.testing.stack import need

need("trl", extra="trl")

import torch  # noqa: E402

from integration_tests.shared_batch import (  # noqa: E402
    B,
    T,
    all_config_names,
    config_for,
    load_expected,
    make_shared_batch,
)
from rollout_parity import CorrectionConfig, compute_correction  # noqa: E402
from rollout_parity.adapters import trl as trl_adapter  # noqa: E402
from rollout_parity.testing.tiny_model import build_tiny_model  # noqa: E402

pytestmark = [pytest.mark.trl]

TOL = 1e-6


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A real GRPOTrainer on the tiny model, generating with transformers (no engine needed)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl-anchor")), use_cpu=True, bf16=False, report_to="none",
        per_device_train_batch_size=B, num_generations=2, max_completion_length=T, loss_type="bnpo",
        model_init_kwargs={"dtype": "float32"}, save_strategy="no", seed=0,
    )
    dataset = Dataset.from_dict({"prompt": [f"prompt {i}" for i in range(B)]})
    tr = GRPOTrainer(model=build_tiny_model(), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                     args=args, train_dataset=dataset)
    tr.current_gradient_accumulation_steps = 1  # set by the training loop; we call the loss directly
    tr.model.train()
    return tr


def _inputs(batch, **extra):
    mask = batch.response_mask.long()
    inputs = {
        "prompt_ids": torch.full((B, 2), 7, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.full((B, T), 9, dtype=torch.long),
        "completion_mask": mask,
        "advantages": batch.advantages.clone(),
        "old_per_token_logps": batch.old_logprobs.clone(),
        "sampling_per_token_logps": batch.rollout_logprobs.clone(),
        "num_items_in_batch": mask.sum(),
    }
    inputs.update(extra)
    return inputs


class _Forward:
    """Stands in for the model forward: returns the given per-token logprobs."""

    def __init__(self, logprobs):
        self.logprobs = logprobs
        self.calls = 0

    def __call__(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                 **kwargs):
        self.calls += 1
        assert input_ids.shape[1] - logits_to_keep >= 0 and logits_to_keep == T
        entropies = torch.zeros_like(self.logprobs.detach()) if compute_entropy else None
        return self.logprobs, entropies, None


@pytest.fixture
def pretend_vllm(trainer):
    """TRL only keeps sampler logprobs with vLLM (or a rollout_func): say it sampled with vLLM."""
    saved = {k: trainer.__dict__.get(k) for k in ("use_vllm", "vllm_importance_sampling_correction")}
    trainer.use_vllm = True
    yield trainer
    trainer.__dict__.pop("_get_per_token_logps_and_entropies", None)
    trainer.__dict__.pop("rollout_func", None)
    trl_adapter.revert(trainer)
    trainer.__dict__.update(saved)
    trainer._metrics["train"].clear()


def _close(actual, expected, what):
    actual = torch.as_tensor(actual, dtype=torch.float32)
    expected = torch.as_tensor(expected, dtype=torch.float32)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.allclose(actual, expected, atol=TOL, rtol=TOL, equal_nan=True), (
        f"{what}: max abs diff {(actual - expected).abs().nan_to_num(0).max().item():.3g}")


@pytest.mark.parametrize("name", all_config_names())
def test_shared_batch_through_adapter_matches_core(pretend_vllm, monkeypatch, name):
    tr = pretend_vllm
    expected = load_expected()[name]
    batch = make_shared_batch()
    cfg = config_for(name)
    if not cfg.changes_loss:
        # Diagnostics only leave TRL's loss as configured: switch TRL's own IS off so the loss is comparable.
        tr.vllm_importance_sampling_correction = False
    current = batch.fresh_current()
    tr.__dict__["_get_per_token_logps_and_entropies"] = _Forward(current)

    seen = []
    real = trl_adapter.compute_correction
    monkeypatch.setattr(trl_adapter, "compute_correction", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])

    trl_adapter.apply(tr, cfg)
    tr._metrics["train"].clear()
    loss = tr._compute_loss(tr.model, _inputs(batch))
    loss.backward()

    assert len(seen) == 1
    _close(seen[0].weights, expected["weights"], f"{name} weights")
    _close(seen[0].mask, expected["mask"], f"{name} mask")
    _close(loss.detach(), expected["loss"], f"{name} loss")
    _close(current.grad, expected["grad"], f"{name} gradient")
    logged = {k: v[-1] for k, v in tr._metrics["train"].items()}
    keys = [k for k in expected["metrics"] if cfg.changes_loss or k.startswith("rollout_correction/")]
    assert keys and all(k in logged for k in keys), f"missing metrics: {sorted(set(keys) - set(logged))}"
    for key in keys:
        want, got = expected["metrics"][key], logged[key]
        assert math.isclose(got, want, rel_tol=TOL, abs_tol=TOL) or (math.isnan(got) and math.isnan(want)), (
            f"{name} {key}: adapter {got} != core {want}")


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
def test_trl_importance_sampling_ratio_equals_ours(pretend_vllm, name):
    """TRL's real ``_generate_and_score_completions`` on the shared batch vs our weights."""
    tr = pretend_vllm
    mode, clip_max, clip_min = TRL_MODES[name]
    batch = make_shared_batch()
    lengths = batch.response_mask.sum(-1).long().tolist()
    assert 0 in lengths
    # TRL can not hold an empty completion (it reads ids[-1]): the empty row becomes one token that
    # TRL's own env_mask (its multi-turn mask) takes out of the loss, so TRL's loss mask is the batch's.

    def rollout_func(prompts, trainer):  # TRL's hook for custom generation: ids and sampler logprobs
        return {
            "prompt_ids": [[7, 7] for _ in prompts],
            "completion_ids": [[9] * max(n, 1) for n in lengths],
            "logprobs": [batch.rollout_logprobs[i, :n].tolist() or [0.0] for i, n in enumerate(lengths)],
            "env_mask": [[1] * n if n else [0] for n in lengths],
        }

    tr.rollout_func = rollout_func
    tr._last_loaded_step = tr.state.global_step  # no engine to sync weights into
    tr.vllm_importance_sampling_correction = True
    tr.vllm_importance_sampling_mode, tr.vllm_importance_sampling_clip_max = mode, clip_max
    tr.vllm_importance_sampling_clip_min = clip_min
    forward = _Forward(batch.old_logprobs.clone())
    tr.__dict__["_get_per_token_logps_and_entropies"] = forward

    out = tr._generate_and_score_completions([{"prompt": f"prompt {i}"} for i in range(B)])
    assert forward.calls == 1, "TRL should have recomputed the old logprobs once"
    mask = (out["completion_mask"] * out["tool_mask"]).bool()
    assert torch.equal(mask, batch.response_mask.bool())
    ratio = out["importance_sampling_ratio"].expand(B, T)

    ours = compute_correction(_our_flags(name, mode, clip_max, clip_min), old_logprobs=batch.old_logprobs,
                              rollout_logprobs=batch.rollout_logprobs, response_mask=batch.response_mask,
                              with_metrics=False)
    _close(torch.where(mask, ours.weights, 0.0), torch.where(mask, ratio, 0.0), f"{name}: ours vs TRL's IS ratio")
    # Same sequences / tokens dropped, and the batch does exercise the mask or the bound.
    assert torch.equal((ours.weights == 0) & mask, (ratio == 0) & mask)
    assert ((ratio == 0) | (ratio == clip_max) | ((clip_min is not None) & (ratio == (clip_min or 0))))[mask].any()


@pytest.mark.parametrize("delta", [0.02, 0.1, 0.5])
def test_trl_off_policy_mask_equals_ours(delta):
    from trl import GRPOTrainer

    batch = make_shared_batch()
    current = batch.current_logprobs.detach()
    keep_trl = GRPOTrainer.get_off_policy_mask(
        advantages=batch.advantages.unsqueeze(1), per_token_logps=current,
        sampling_per_token_logps=batch.rollout_logprobs, mask=batch.response_mask, off_policy_threshold=delta,
    ).squeeze(1).bool()
    ours = compute_correction(CorrectionConfig(off_policy_sequence_mask_delta=delta), old_logprobs=batch.old_logprobs,
                              rollout_logprobs=batch.rollout_logprobs, response_mask=batch.response_mask,
                              advantages=batch.advantages, current_logprobs=current, with_metrics=False)
    # A NaN sampler logprob is a zero drift that still counts in the mean, in both.
    assert torch.equal(~ours.off_policy_masked, keep_trl)
    if delta == 0.02:
        assert ours.off_policy_masked.any()  # the batch crosses the mask


@pytest.mark.parametrize("loss_type", sorted(trl_adapter.SUPPORTED_LOSS_TYPES))
def test_on_policy_loss_equals_trl_own_loss(pretend_vllm, loss_type):
    """No mismatch: the adapter's loss and gradient are TRL's ``_compute_loss`` (its IS off)."""
    from trl import GRPOTrainer

    tr = pretend_vllm
    batch = make_shared_batch()
    inputs = _inputs(batch, sampling_per_token_logps=batch.old_logprobs.clone(),
                     num_items_in_batch=batch.response_mask.sum() * 3)  # a 'global' count, as dapo uses
    saved = tr.loss_type
    tr.loss_type = loss_type
    tr.vllm_importance_sampling_correction = False
    try:
        results = []
        for patched in (False, True):
            current = batch.fresh_current()
            tr.__dict__["_get_per_token_logps_and_entropies"] = _Forward(current)
            if patched:
                trl_adapter.apply(tr, CorrectionConfig(rollout_importance_sampling_mode="token_truncate"))
            loss = tr._compute_loss(tr.model, inputs) if patched else GRPOTrainer._compute_loss(tr, tr.model, inputs)
            loss.backward()
            results.append((loss.detach(), current.grad.clone()))
            trl_adapter.revert(tr)
    finally:
        tr.loss_type = saved
    (trl_loss, trl_grad), (our_loss, our_grad) = results
    _close(our_loss, trl_loss, f"{loss_type} loss")
    _close(our_grad, trl_grad, f"{loss_type} gradient")
    assert trl_grad.abs().sum() > 0
