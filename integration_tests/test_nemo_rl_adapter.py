"""The NeMo RL adapter against NeMo RL v0.7's formulas and call contract, and the shared batch.

NeMo RL does not install here; ``support/nemo_rl_double`` reproduces its loss interface (enums,
``ClippedPGLossConfig``, the data dict, the trainer's microbatched keyword call and metric
aggregation, the vLLM kwargs assembly) from v0.7.0 (81aa43dd). NeMo RL's tis / icepop /
seq-mask-tis formulas are re-implemented naively below, from its ``ClippedPGLossFn.__call__``.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

_DOUBLE = Path(__file__).parent / "support" / "nemo_rl_double"
if importlib.util.find_spec("nemo_rl") is None:
    sys.path.insert(0, str(_DOUBLE))
sys.path.insert(0, str(_DOUBLE))  # nemo_rl_contract.py

from nemo_rl_contract import global_counts, llm_kwargs, train_step  # noqa: E402
from nemo_rl.algorithms.loss import ClippedPGLossConfig  # noqa: E402
from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType  # noqa: E402
from nemo_rl.distributed.batched_data_dict import BatchedDataDict  # noqa: E402

from integration_tests.shared_batch import (  # noqa: E402
    all_config_names,
    config_for,
    load_expected,
    make_shared_batch,
)
from rollout_parity import CorrectionConfig, compute_correction, policy_loss  # noqa: E402
from rollout_parity.adapters.nemo_rl import (  # noqa: E402
    RolloutParityLossFn,
    check_nemo_rl_vllm_kwargs,
    correction_from_nemo_rl,
    nemo_rl_generation_config,
)

pytestmark = [pytest.mark.nemo_rl]

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TOL = 1e-6


def nemo_data(batch, sample_mask=None, finite=False) -> tuple[BatchedDataDict, torch.Tensor]:
    """The shared batch as NeMo RL's (B, S) data dict; column 0 is a prompt token holding junk
    (token_mask 1 there too), so a missing ``[:, 1:]`` cannot go unnoticed."""
    B = batch.old_logprobs.shape[0]
    rollout = batch.rollout_logprobs.clone()
    if finite:
        rollout = torch.where(torch.isfinite(rollout), rollout, batch.old_logprobs - 0.3)

    def pad(x, value):
        return torch.cat([torch.full((B, 1), value, dtype=x.dtype), x], dim=1)

    data = BatchedDataDict({
        "input_ids": torch.zeros(B, batch.old_logprobs.shape[1] + 1, dtype=torch.long),
        "advantages": pad(batch.advantages.unsqueeze(-1).expand_as(batch.old_logprobs), 9.0),
        "prev_logprobs": pad(batch.old_logprobs, -7.0),
        "generation_logprobs": pad(rollout, 3.0),
        "reference_policy_logprobs": pad(batch.old_logprobs, 0.0),
        "token_mask": pad(batch.response_mask, 1.0),
        "sample_mask": torch.ones(B) if sample_mask is None else sample_mask,
    })
    return data, batch.fresh_current()


# ----------------------------------------------------------------- NeMo RL's formulas, naively


def nemo_reference(cfg: dict, data, cur):
    """ClippedPGLossFn (v0.7) policy term, no KL, written out plainly per token and per sequence."""
    B, T = cur.shape
    prev = data["prev_logprobs"][:, 1:]
    gen = data["generation_logprobs"][:, 1:]
    adv = data["advantages"][:, 1:]
    tmask = data["token_mask"][:, 1:]
    smask = data["sample_mask"]
    gvs, gvt = global_counts(data)
    lo, hi, c = cfg.get("ratio_clip_min", 0.2), cfg.get("ratio_clip_max", 0.2), cfg.get("ratio_clip_c")
    kind = cfg.get("truncated_importance_sampling_type")
    ratio, ratio_min = cfg.get("truncated_importance_sampling_ratio"), cfg.get("truncated_importance_sampling_ratio_min")
    weights = torch.ones(B, T)
    if cfg.get("use_importance_sampling_correction"):
        for i in range(B):
            seq_mean = None
            if kind == "seq-mask-tis":
                n = sum(float(tmask[i, t]) for t in range(T))
                s = sum(float(prev[i, t] - gen[i, t]) * float(tmask[i, t]) for t in range(T))
                geo = math.exp(s / (n + 1e-8))
                seq_mean = ratio_min <= geo <= ratio
            for t in range(T):
                w = math.exp(float(prev[i, t] - gen[i, t]))
                if kind == "tis":
                    w = min(max(w, ratio_min or 0.0), ratio)
                elif kind == "icepop":
                    w = w if ratio_min <= w <= ratio else 0.0
                elif kind == "seq-mask-tis":
                    w = w if seq_mean else 0.0
                weights[i, t] = w
    terms = []
    for i in range(B):
        row = []
        for t in range(T):
            r = torch.exp(cur[i, t] - prev[i, t])
            a = adv[i, t]
            loss = torch.maximum(-a * r, -a * r.clamp(1 - lo, 1 + hi))
            if c is not None and a < 0:
                loss = torch.minimum(loss, -a * c)
            row.append(weights[i, t] * loss)
        terms.append(torch.stack(row))
    per_token = torch.stack(terms)
    mask = tmask * smask.unsqueeze(-1)
    if cfg.get("token_level_loss", True):
        total = (per_token * mask).sum() / (gvt + 1e-8)
    else:
        seq = (per_token * tmask).sum(-1) / (tmask.sum(-1) + 1e-8)
        total = (seq * smask).sum() / (gvs + 1e-8)
    return total, weights


NEMO_CASES = {
    "tis": dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=1.2),
    "tis_min": dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=1.2,
                    truncated_importance_sampling_ratio_min=0.9),
    "icepop": dict(truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=1.1,
                   truncated_importance_sampling_ratio_min=0.9),
    "seq_mask_tis": dict(truncated_importance_sampling_type="seq-mask-tis",
                         truncated_importance_sampling_ratio=1.02,
                         truncated_importance_sampling_ratio_min=0.98),
    "plain_is": dict(),
    "icepop_seq_level_dual_clip": dict(truncated_importance_sampling_type="icepop",
                                       truncated_importance_sampling_ratio=1.1,
                                       truncated_importance_sampling_ratio_min=0.9,
                                       token_level_loss=False, ratio_clip_c=3.0, ratio_clip_max=0.28),
}


@pytest.mark.parametrize("case", sorted(NEMO_CASES))
def test_nemo_truncated_is_mapping_matches_nemo_formulas(case):
    cfg = dict(reference_policy_kl_penalty=0.0, use_importance_sampling_correction=True, **NEMO_CASES[case])
    batch = make_shared_batch()
    data, cur = nemo_data(batch, finite=True)
    loss_fn = RolloutParityLossFn.from_nemo_config(ClippedPGLossConfig(**cfg))
    gvs, gvt = global_counts(data)
    loss, _ = loss_fn(cur, data, gvs, gvt)
    loss.backward()

    ref_cur = batch.fresh_current()
    ref_loss, ref_weights = nemo_reference(cfg, data, ref_cur)
    ref_loss.backward()
    mask = (data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)).bool()
    # The mapped flags give NeMo RL's weights on every valid token ...
    weights = torch.where(loss_fn.last_correction.mask.bool(), loss_fn.last_correction.weights,
                          torch.zeros(()))
    torch.testing.assert_close(weights[mask], ref_weights[mask], rtol=TOL, atol=TOL)
    # ... and its loss and gradient.
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=TOL, atol=TOL)
    torch.testing.assert_close(cur.grad, ref_cur.grad, rtol=TOL, atol=TOL)
    if case not in ("plain_is",):
        assert not torch.allclose(ref_weights[mask], torch.ones_like(ref_weights[mask]))


def test_mapping_table():
    assert correction_from_nemo_rl({}) == CorrectionConfig()
    tis = correction_from_nemo_rl(dict(use_importance_sampling_correction=True,
                                       truncated_importance_sampling_type="tis",
                                       truncated_importance_sampling_ratio=2.0))
    assert tis == CorrectionConfig(rollout_importance_sampling_mode="token_truncate",
                                   rollout_importance_sampling_threshold=2.0)
    icepop = correction_from_nemo_rl(dict(use_importance_sampling_correction=True,
                                          truncated_importance_sampling_type="icepop",
                                          truncated_importance_sampling_ratio=2.0,
                                          truncated_importance_sampling_ratio_min=0.5))
    assert icepop == CorrectionConfig.preset("icepop")
    seq = correction_from_nemo_rl(dict(use_importance_sampling_correction=True,
                                       truncated_importance_sampling_type="seq-mask-tis",
                                       truncated_importance_sampling_ratio=1.002,
                                       truncated_importance_sampling_ratio_min=0.999))
    assert seq.rollout_importance_sampling_mode == "sequence_mask"
    assert seq.rollout_importance_sampling_sequence_reduction == "geometric_mean"
    assert seq.rollout_importance_sampling_sequence_mask_weight == "token"
    bad = [
        (dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0),
         "use_importance_sampling_correction"),
        (dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
              truncated_importance_sampling_ratio=2.0), "ratio_min"),
        (dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="gspo",
              truncated_importance_sampling_ratio=2.0), "truncated_importance_sampling_type"),
        (dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
              truncated_importance_sampling_ratio=None), "truncated_importance_sampling_ratio"),
    ]
    for cfg, match in bad:
        with pytest.raises(ValueError, match=match):
            correction_from_nemo_rl(cfg)


# ----------------------------------------------------------------- the shared cross-framework batch


@pytest.mark.parametrize("name", all_config_names())
def test_shared_batch_through_adapter_equals_core(name):
    expected = load_expected()[name]
    batch = make_shared_batch()
    data, cur = nemo_data(batch)
    loss_fn = RolloutParityLossFn(config_for(name), ratio_clip_min=0.2, ratio_clip_max=0.2,
                                  metrics="local")
    assert loss_fn.loss_type == LossType.TOKEN_LEVEL and loss_fn.input_type == LossInputType.LOGPROB
    gvs, gvt = global_counts(data)
    loss, metrics = loss_fn(next_token_logprobs=cur, data=data, global_valid_seqs=gvs,
                            global_valid_toks=gvt)
    loss.backward()
    out = loss_fn.last_correction
    exp = {k: torch.tensor(v) for k, v in expected.items() if k != "metrics"}
    torch.testing.assert_close(out.weights, exp["weights"], rtol=TOL, atol=TOL, equal_nan=True)
    torch.testing.assert_close(out.mask.float(), exp["mask"].float(), rtol=0, atol=0)
    # NeMo RL normalises by the global valid-token count fixed before the loss (rejected tokens
    # still count, as NeMo RL's own icepop zeros count); the core's token-mean divides by the
    # tokens left after rejection. The two differ by exactly that ratio.
    scale = max(float(exp["mask"].sum()), 1.0) / float(gvt)
    torch.testing.assert_close(loss.detach(), exp["loss"] * scale, rtol=TOL, atol=TOL)
    torch.testing.assert_close(cur.grad, exp["grad"] * scale, rtol=TOL, atol=TOL)
    for key, value in expected["metrics"].items():
        assert metrics[key] == pytest.approx(value, rel=TOL, abs=TOL), key
    # And through the core directly with the same global normalisation: identical.
    cur2 = batch.fresh_current()
    mask = batch.response_mask
    core_out = compute_correction(config_for(name), old_logprobs=batch.old_logprobs,
                                  rollout_logprobs=batch.rollout_logprobs, response_mask=mask,
                                  advantages=batch.advantages, current_logprobs=cur2, with_metrics=True)
    core_loss, _ = policy_loss(config_for(name), current_logprobs=cur2, advantages=batch.advantages,
                               correction=core_out, clip_ratio=0.2, global_num_tokens=float(gvt))
    core_loss.backward()
    torch.testing.assert_close(loss.detach(), core_loss.detach(), rtol=TOL, atol=TOL)
    torch.testing.assert_close(cur.grad, cur2.grad, rtol=TOL, atol=TOL)


TOKEN_MEAN_METRICS = ("rollout_correction/kl", "rollout_correction/k3_kl", "rollout_correction/is_weight_mean",
                      "rollout_correction/clipped_frac", "rollout_correction/delta_abs_mean",
                      "rollout_correction/rejected_token_frac", "rollout_correction/nonfinite_frac",
                      "rollout_correction/loss_contrib_pos", "rollout_correction/loss_contrib_neg",
                      "rollout_correction/chi2_token")


@pytest.mark.parametrize("name", ["tis_srs_k3", "icepop", "sequence_mask_token"])
def test_microbatched_contract_gives_the_global_batch(name):
    """NeMo RL sums per-microbatch losses and metrics; with global normalisation the sums are the
    whole batch's loss, gradient and (token-mean) metrics."""
    batch = make_shared_batch()
    data, cur = nemo_data(batch)
    full_fn = RolloutParityLossFn(config_for(name), metrics="local")
    gvs, gvt = global_counts(data)
    full_loss, full_metrics = full_fn(cur, data, gvs, gvt)
    full_loss.backward()
    mb_cur = batch.fresh_current()
    mb_fn = RolloutParityLossFn(config_for(name))
    mb_loss, mb_metrics = train_step(mb_fn, data, mb_cur, microbatch_size=3)
    mb_loss.backward()
    torch.testing.assert_close(mb_loss.detach(), full_loss.detach(), rtol=TOL, atol=TOL)
    torch.testing.assert_close(mb_cur.grad, cur.grad, rtol=TOL, atol=TOL)
    n_valid = float(batch.response_mask.sum())
    for key in TOKEN_MEAN_METRICS:
        assert mb_metrics[key] == pytest.approx(full_metrics[key] * n_valid / float(gvt), rel=1e-5,
                                                abs=1e-6), key
    assert mb_metrics["loss"] == pytest.approx(float(full_loss.detach()), rel=1e-5)
    assert not any(k.endswith(("_max", "_min")) for k in mb_metrics if k.startswith("rollout_correction/"))


def test_sample_mask_and_sequence_level_loss():
    batch = make_shared_batch()
    sample_mask = torch.ones(8)
    sample_mask[2] = 0.0
    data, cur = nemo_data(batch, sample_mask=sample_mask)
    cfg = CorrectionConfig.preset("tis_srs_k3")
    loss_fn = RolloutParityLossFn(cfg, token_level_loss=False, ratio_clip_c=3.0)
    assert loss_fn.loss_type == LossType.SEQUENCE_LEVEL
    gvs, gvt = global_counts(data)
    assert float(gvs) == 7.0
    loss, _ = loss_fn(cur, data, gvs, gvt)
    loss.backward()
    cur2 = batch.fresh_current()
    mask = batch.response_mask * sample_mask.unsqueeze(-1)
    out = compute_correction(cfg, old_logprobs=batch.old_logprobs, rollout_logprobs=batch.rollout_logprobs,
                             response_mask=mask, advantages=batch.advantages, current_logprobs=cur2)
    ref, _ = policy_loss(cfg, current_logprobs=cur2, advantages=batch.advantages, correction=out,
                         clip_ratio=0.2, clip_ratio_c=3.0, loss_agg_mode="seq-mean-token-mean",
                         global_num_seqs=7.0)
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=TOL, atol=TOL)
    torch.testing.assert_close(cur.grad, cur2.grad, rtol=TOL, atol=TOL)
    assert torch.all(cur.grad[2] == 0)


# ----------------------------------------------------------------- config and vLLM recipe


def test_yaml_block_loads_through_omegaconf_and_nemo_config():
    from omegaconf import OmegaConf

    node = OmegaConf.load(CONFIGS / "nemo_rl_loss.yaml")
    # A defaults-style merge onto a base GRPO loss block, as NeMo RL's load_config does.
    base = OmegaConf.create({"loss_fn": {"reference_policy_kl_penalty": 0.01, "ratio_clip_min": 0.2}})
    merged = OmegaConf.merge(base, node)
    cfg = ClippedPGLossConfig(**OmegaConf.to_container(merged.loss_fn, resolve=True))
    assert cfg.rollout_correction["rollout_rejection"] == ["seq_sum_k3"]  # extra="allow" kept it
    loss_fn = RolloutParityLossFn.from_nemo_config(cfg)
    assert loss_fn.correction == CorrectionConfig.preset("tis_srs_k3")
    assert (loss_fn.ratio_clip_min, loss_fn.ratio_clip_max) == (0.2, 0.28)
    assert RolloutParityLossFn.from_nemo_config(merged.loss_fn).correction == loss_fn.correction
    # The policy block is the recipe, and NeMo RL's engine assembly accepts it.
    assert OmegaConf.to_container(node.policy) == nemo_rl_generation_config()["policy"]
    kwargs = llm_kwargs(OmegaConf.to_container(node.policy.generation), {})
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["enable_prefix_caching"] is False
    assert kwargs["async_scheduling"] is False


def test_vllm_recipe_routing():
    gen = nemo_rl_generation_config(fp32_lm_head=True)
    kwargs = llm_kwargs(gen["policy"]["generation"], gen["policy"])
    assert kwargs["hf_overrides"] == {"head_dtype": "float32"}
    assert kwargs["enable_prefix_caching"] is False and kwargs["async_scheduling"] is False
    # The recipe keys put naively into vllm_kwargs collide with what NeMo RL passes itself.
    naive = {"vllm_kwargs": {"logprobs_mode": "processed_logprobs", "enable_prefix_caching": False}}
    with pytest.raises(TypeError, match="multiple values"):
        llm_kwargs(naive, {})
    with pytest.raises(ValueError, match="vllm_cfg"):
        check_nemo_rl_vllm_kwargs(naive["vllm_kwargs"])


def test_bad_configs_and_data():
    with pytest.raises(ValueError, match="twice"):
        RolloutParityLossFn.from_nemo_config(dict(
            reference_policy_kl_penalty=0.0, use_importance_sampling_correction=True,
            truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0,
            rollout_correction={"rollout_importance_sampling_mode": "token_truncate"}))
    with pytest.raises(ValueError, match="use_cispo"):
        RolloutParityLossFn.from_nemo_config(dict(reference_policy_kl_penalty=0.0, use_cispo=True))
    with pytest.raises(ValueError, match="reference_policy_kl_penalty"):
        RolloutParityLossFn.from_nemo_config(dict(reference_policy_kl_penalty=0.01))
    with pytest.raises(ValueError, match="unknown correction flag"):
        RolloutParityLossFn.from_nemo_config(dict(reference_policy_kl_penalty=0.0,
                                                  rollout_correction={"rollout_is_mode": "x"}))
    with pytest.raises(ValueError, match="unknown key"):
        RolloutParityLossFn.from_nemo_config(dict(reference_policy_kl_penalty=0.0, ratio_clip=0.2))
    batch = make_shared_batch()
    data, cur = nemo_data(batch)
    loss_fn = RolloutParityLossFn(CorrectionConfig.preset("icepop"))
    gvs, gvt = global_counts(data)
    with pytest.raises(ValueError, match=r"\[:, 1:\]"):
        loss_fn(torch.cat([cur, cur[:, :1]], dim=1), data, gvs, gvt)
    broken = BatchedDataDict(dict(data))
    del broken["generation_logprobs"]
    with pytest.raises(KeyError, match="generation_logprobs"):
        loss_fn(cur, broken, gvs, gvt)


def test_missing_nemo_rl_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo_rl.algorithms.loss.interfaces", None)
    with pytest.raises(ImportError, match=r"rollout-parity\[nemo-rl\]"):
        RolloutParityLossFn()
