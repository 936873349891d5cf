"""Anchor semantics: where the modes overlap, the core equals verl 0.9.1's own rollout correction.

verl's real ``rollout_corr_helper`` runs on CPU on the same batch as the core; weights,
masks and the shared metrics must agree to 1e-6 in fp32 (issue 2, item 7(c); issue 5).
The batch is finite and has no empty row: on NaN/inf verl has no neutral handling and its
per-sequence perplexities count empty rows, both intended differences (docs/verl_own_correction.md).
"""

from __future__ import annotations

import pytest
import torch

from rollout_parity.testing.stack import need

need("verl", extra="verl")

from verl import DataProto  # noqa: E402
from verl.trainer.ppo import rollout_corr_helper as helper  # noqa: E402

from rollout_parity import CorrectionConfig, compute_correction  # noqa: E402
from rollout_parity.adapters import verl as adapter  # noqa: E402
from rollout_parity.core.metric_names import verl_names  # noqa: E402
from integration_tests.support.verl_equivalent import verl_equivalent  # noqa: E402

pytestmark = [pytest.mark.verl]

ATOL = 1e-6

#: verl's names our diagnostics take on every batch (core/metric_names.py), whatever the flags: the table may add
#: more under a condition, never fewer.
ALWAYS_VERL = {"rollout_corr/" + k for k in (
    "k3_kl", "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff",
    "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token")}


def anchor_batch(seed: int = 7, B: int = 10, T: int = 14, spread: float = 0.15):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 3.0 - 0.01
    spikes = (torch.rand(B, T, generator=g) < 0.1).float() * torch.randn(B, T, generator=g) * 0.9
    rollout = old + torch.randn(B, T, generator=g) * spread + spikes
    return old, rollout, mask


def run_verl(old, rollout, mask, verl_cfg):
    weights_proto, new_mask, metrics = helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=rollout, response_mask=mask,
        rollout_is=verl_cfg["rollout_is"], rollout_is_threshold=verl_cfg["rollout_is_threshold"],
        rollout_rs=verl_cfg["rollout_rs"], rollout_rs_threshold=verl_cfg["rollout_rs_threshold"],
    )
    weights = None if weights_proto is None else weights_proto.batch["rollout_is_weights"]
    return weights, new_mask, metrics


def run_core(cfg, old, rollout, mask):
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, with_metrics=True)
    return out.weights, out.mask, out.metrics


def assert_same_as_verl(cfg, ours, theirs, also=()):
    """Every diagnostic the table names after verl under ``cfg`` is verl's own value under that name: same value,
    same name. ``also``: verl names this case must reach (beyond ``ALWAYS_VERL``), so a table that loses an entry
    fails here. Returns the names shared."""
    named = verl_names(ours, cfg)
    shared = {k for k in named if k.startswith("rollout_corr/")}
    assert ALWAYS_VERL | set(also) <= shared, sorted(ALWAYS_VERL | set(also) - shared)
    for key in shared:
        assert named[key] == pytest.approx(theirs[key], abs=ATOL, rel=ATOL), key
    # k1: verl's rollout_corr/kl is this very formula; the name is left to verl because it goes negative
    assert ours["rollout_correction/k1_mean"] == pytest.approx(theirs["rollout_corr/kl"], abs=ATOL, rel=ATOL)
    assert "rollout_corr/kl" not in named
    return shared


IS_CASES = {
    "verl_decoupled_token_is": CorrectionConfig.preset("verl_decoupled_token_is"),
    "token_truncate_1.3": CorrectionConfig(rollout_importance_sampling_mode="token_truncate",
                                           rollout_importance_sampling_threshold=1.3),
    "token_mask_icepop": CorrectionConfig.preset("icepop"),
    "token_mask_tight": CorrectionConfig(rollout_importance_sampling_mode="token_mask",
                                         rollout_importance_sampling_threshold=1.1,
                                         rollout_importance_sampling_threshold_lower=0.9),
    "sequence_truncate_product": CorrectionConfig(rollout_importance_sampling_mode="sequence_truncate",
                                                  rollout_importance_sampling_threshold=1.5,
                                                  rollout_importance_sampling_sequence_reduction="product"),
    "sequence_mask_product": CorrectionConfig(rollout_importance_sampling_mode="sequence_mask",
                                              rollout_importance_sampling_threshold=2.0,
                                              rollout_importance_sampling_threshold_lower=0.5,
                                              rollout_importance_sampling_sequence_reduction="product",
                                              rollout_importance_sampling_sequence_mask_weight="sequence"),
}


@pytest.mark.parametrize("name", sorted(IS_CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_is_weights_and_metrics_match_verl(name, seed):
    cfg = IS_CASES[name]
    old, rollout, mask = anchor_batch(seed)
    w_ours, m_ours, met_ours = run_core(cfg, old, rollout, mask)
    w_verl, m_verl, met_verl = run_verl(old, rollout, mask, verl_equivalent(cfg))
    torch.testing.assert_close(w_ours, w_verl, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(m_ours, m_verl.to(m_ours.dtype), atol=0, rtol=0)
    also = {"rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size"}
    if cfg.rollout_importance_sampling_sequence_reduction == "product":
        also.add("rollout_corr/chi2_seq")
    if name.startswith("token_mask"):  # our clipped_frac is verl's IcePop out-of-bounds ratio
        also.add("rollout_corr/rollout_is_oob_ratio")
    elif name.startswith("token_truncate") or name == "verl_decoupled_token_is":
        also.add("rollout_corr/rollout_is_ratio_fraction_high")
    assert_same_as_verl(cfg, met_ours, met_verl, also)
    # the batch is not trivially on-policy: something was actually truncated or zeroed
    assert 0 < met_ours["rollout_correction/clipped_frac"] or name.startswith("sequence")


def test_a_different_formula_keeps_our_name():
    """Our chi2_seq under the geometric mean (ms-swift's, our default) is not verl's product one: verl's value
    differs, so the table leaves it under our prefix; the same goes for clipped_frac of the sequence modes."""
    old, rollout, mask = anchor_batch(0)
    for cfg, key, verl_key in (
            (IS_CASES["token_truncate_1.3"], "chi2_seq", "chi2_seq"),
            (IS_CASES["sequence_truncate_product"], "clipped_frac", "rollout_is_ratio_fraction_high")):
        _, _, ours = run_core(cfg, old, rollout, mask)
        _, _, theirs = run_verl(old, rollout, mask, verl_equivalent(cfg))
        assert ours["rollout_correction/" + key] != pytest.approx(theirs["rollout_corr/" + verl_key], rel=1e-3)
        named = verl_names(ours, cfg)
        assert "rollout_correction/" + key in named and "rollout_corr/" + verl_key not in named


REJECTION_CASES = [
    dict(rollout_rejection=["token_k1"], rollout_rejection_threshold=1.3),
    dict(rollout_rejection=["token_k1"], rollout_rejection_threshold="0.8_1.5"),
    dict(rollout_rejection=["token_k2"], rollout_rejection_threshold=0.02),
    dict(rollout_rejection=["token_k3"], rollout_rejection_threshold=0.02),
    dict(rollout_rejection=["seq_sum_k1"], rollout_rejection_threshold="0.6_1.6"),
    dict(rollout_rejection=["seq_sum_k2"], rollout_rejection_threshold=0.1),
    dict(rollout_rejection=["seq_sum_k3"], rollout_rejection_threshold=0.1),
    dict(rollout_rejection=["seq_mean_k1"], rollout_rejection_threshold=1.05),
    dict(rollout_rejection=["seq_mean_k2"], rollout_rejection_threshold=0.03),
    dict(rollout_rejection=["seq_mean_k3"], rollout_rejection_threshold=0.03),
    dict(rollout_rejection=["seq_max_k2"], rollout_rejection_threshold=0.05),
    dict(rollout_rejection=["seq_max_k3"], rollout_rejection_threshold=0.05),
    dict(rollout_rejection=["token_k2", "seq_mean_k1", "seq_max_k3"],
         rollout_rejection_threshold=[0.2, [0.9, 1.1], 0.3]),
    # the paper's best recipe, as verl would run it
    dict(rollout_importance_sampling_mode="token_truncate", rollout_importance_sampling_threshold=2.0,
         rollout_rejection=["seq_sum_k3"], rollout_rejection_threshold=0.1),
]


@pytest.mark.parametrize("flags", REJECTION_CASES, ids=lambda f: "+".join(f["rollout_rejection"]))
@pytest.mark.parametrize("seed", [0, 3])
def test_rejection_masks_match_verl(flags, seed):
    cfg = CorrectionConfig(**flags)
    old, rollout, mask = anchor_batch(seed)
    w_ours, m_ours, met_ours = run_core(cfg, old, rollout, mask)
    w_verl, m_verl, met_verl = run_verl(old, rollout, mask, verl_equivalent(cfg))
    torch.testing.assert_close(m_ours, m_verl.to(m_ours.dtype), atol=0, rtol=0)
    kept, valid = m_ours.sum().item(), mask.sum().item()
    assert 0 < kept < valid, "thresholds should reject some but not all tokens on this batch"
    if w_verl is not None:
        torch.testing.assert_close(w_ours, w_verl, atol=ATOL, rtol=ATOL)
    assert_same_as_verl(cfg, met_ours, met_verl,
                        {"rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_rs_seq_masked_fraction"})


def test_tis_srs_k3_preset_matches_verl_at_paper_threshold():
    """The paper's tau_seq = 0.001 on a mildly mismatched batch (most sequences rejected)."""
    cfg = CorrectionConfig.preset("tis_srs_k3")
    old, rollout, mask = anchor_batch(11, spread=0.01)
    w_ours, m_ours, met_ours = run_core(cfg, old, rollout, mask)
    w_verl, m_verl, met_verl = run_verl(old, rollout, mask, verl_equivalent(cfg))
    torch.testing.assert_close(w_ours, w_verl, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(m_ours, m_verl.to(m_ours.dtype), atol=0, rtol=0)
    assert_same_as_verl(cfg, met_ours, met_verl, {
        "rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size",
        "rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/rollout_rs_masked_fraction",
        "rollout_corr/rollout_rs_seq_masked_fraction"})


@pytest.mark.parametrize("name", ["verl_decoupled_token_is", "token_mask_icepop", "sequence_truncate_product"])
def test_driver_hook_writes_what_verls_own_correction_writes(name):
    """Through verl's batch API: our driver hook vs verl's unpatched compute_rollout_correction_and_add_to_batch."""
    cfg = IS_CASES[name]
    old, rollout, mask = anchor_batch(5)

    def batch():
        return DataProto.from_dict(tensors={"old_log_probs": old.clone(), "rollout_log_probs": rollout.clone(),
                                            "response_mask": mask.clone()})

    original = getattr(helper.compute_rollout_correction_and_add_to_batch, "__wrapped__",
                       helper.compute_rollout_correction_and_add_to_batch)  # verl's own, unpatched
    theirs, their_metrics = original(batch(), verl_equivalent(cfg))
    adapter.set_active_config(cfg)
    try:
        ours, metrics = helper.compute_rollout_correction_and_add_to_batch(
            batch(), {"rollout_is": None, "rollout_rs": None, "bypass_mode": False})
    finally:
        adapter.set_active_config(None)
    torch.testing.assert_close(ours.batch["rollout_is_weights"], theirs.batch["rollout_is_weights"],
                               atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(ours.batch["response_mask"], theirs.batch["response_mask"], atol=0, rtol=0)
    # what the driver logs: verl's name where verl's own helper logs the same value, ours (documented) elsewhere
    shared = {k for k in metrics if k.startswith("rollout_corr/")}
    assert ALWAYS_VERL | {"rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size"} <= shared
    assert all(k.startswith(("rollout_corr/", "rollout_correction/")) for k in metrics)
    for key in shared:
        assert metrics[key] == pytest.approx(their_metrics[key], abs=ATOL, rel=ATOL), key
    # verl's rollout_corr/kl with verl's signed convention beside our k1_mean (docs/metrics.md)
    assert metrics["rollout_corr/kl"] == metrics["rollout_correction/k1_mean"]
    assert metrics["rollout_corr/kl"] == pytest.approx(their_metrics["rollout_corr/kl"], abs=ATOL, rel=ATOL)


def test_k1_single_threshold_means_reciprocal_range_like_verl():
    cfg = CorrectionConfig(rollout_rejection=["seq_mean_k1"], rollout_rejection_threshold=1.02)
    assert verl_equivalent(cfg)["rollout_rs_threshold"] == f"{1 / 1.02}_{1.02}"
    old, rollout, mask = anchor_batch(4)
    _, m_ours, _ = run_core(cfg, old, rollout, mask)
    _, m_verl, _ = helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=rollout, response_mask=mask, rollout_rs="seq_mean_k1",
        rollout_rs_threshold=1.02)  # verl's own parsing of a single K1 value
    torch.testing.assert_close(m_ours, m_verl.to(m_ours.dtype), atol=0, rtol=0)


@pytest.mark.parametrize("flags, flag", [
    (dict(rollout_importance_sampling_mode="token_truncate", rollout_importance_sampling_threshold_lower=0.5),
     "rollout_importance_sampling_threshold_lower"),
    (dict(rollout_importance_sampling_mode="sequence_truncate"), "rollout_importance_sampling_sequence_reduction"),
    (dict(rollout_importance_sampling_mode="sequence_mask", rollout_importance_sampling_threshold_lower=0.5,
          rollout_importance_sampling_sequence_reduction="product"), "rollout_importance_sampling_sequence_mask_weight"),
    (dict(off_policy_sequence_mask_delta=0.1), "off_policy_sequence_mask_delta"),
])
def test_modes_without_a_verl_equivalent_say_so(flags, flag):
    with pytest.raises(ValueError, match=flag):
        verl_equivalent(CorrectionConfig(**flags))
