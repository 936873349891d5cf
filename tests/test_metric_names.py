"""The one table of metric names (core/metric_names.py): complete, honest about KL, and what the docs show.

The framework columns are checked against the frameworks' own metric code where the stack is installed
(integration_tests/test_anchor_verl.py, test_anchor_trl.py, test_nemo_rl_adapter.py: same value, same name);
here, what needs no framework.
"""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

from rollout_parity import CorrectionConfig, compute_correction, policy_loss
from rollout_parity.core.config import IS_MODES
from rollout_parity.core.metric_names import (BY_NAME, METRICS, RENAMED, NemoRLLoss, markdown_table, nemo_rl_names,
                                              trl_names, verl_names)
from rollout_parity.core.sampler import kept_mass_metrics

REPO = Path(__file__).resolve().parents[1]


def _batch(seed: int = 0, B: int = 6, T: int = 9, shift: float = -0.3):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 3
    rollout = old + shift + torch.randn(B, T, generator=g) * 0.3  # the engine less confident: k1 < 0
    current = old + torch.randn(B, T, generator=g) * 0.1
    return old, rollout, current, mask, torch.randn(B, generator=g)


CONFIGS = [CorrectionConfig(log_rollout_offpolicy_metrics=True), CorrectionConfig.preset("tis_srs_k3"),
           CorrectionConfig.preset("icepop"), CorrectionConfig.preset("verl_decoupled_token_is"),
           CorrectionConfig(rollout_importance_sampling_mode="sequence_mask",
                            rollout_importance_sampling_threshold_lower=0.5, off_policy_sequence_mask_delta=0.1),
           *(CorrectionConfig(rollout_importance_sampling_mode=mode) for mode in IS_MODES)]


def _everything_logged(cfg):
    old, rollout, current, mask, adv = _batch()
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, advantages=adv,
                             current_logprobs=current, with_metrics=True)
    _, loss_metrics = policy_loss(cfg, current_logprobs=current, advantages=adv, correction=out)
    sampler = kept_mass_metrics(torch.full_like(old, -0.1), mask, replayed_mask=mask)
    return {**loss_metrics, **sampler}


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: str(c.rollout_importance_sampling_mode))
def test_every_metric_the_core_logs_is_in_the_table(cfg):
    logged = _everything_logged(cfg)
    assert logged and not sorted(set(logged) - set(BY_NAME))


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: str(c.rollout_importance_sampling_mode))
def test_no_metric_called_kl_goes_negative_in_any_framework(cfg):
    """The batch's engine is more confident than the trainer, so the k1 estimate is negative: no name that says
    KL (ours, verl's or TRL's as we log them) carries it."""
    logged = _everything_logged(cfg)
    assert logged["rollout_correction/k1_mean"] < 0
    for names in (logged, verl_names(logged, cfg), trl_names(logged, cfg)):
        for key, value in names.items():
            if re.search(r"kl", key.rsplit("/", 1)[-1]):
                assert value >= 0, (key, value)
    said_kl = {m.name for m in METRICS if "kl" in m.name.rsplit("/", 1)[-1]}
    assert said_kl == {"rollout_correction/k3_kl"}  # k3 = r - 1 - log r >= 0 token by token


def test_framework_names_follow_their_conditions():
    """Each conditional name, on both sides of its condition (the values are checked against verl's own code in
    integration_tests/test_anchor_verl.py)."""
    ours = {"rollout_correction/" + k: 0.0 for k in ("chi2_seq", "ess", "is_weight_mean", "clipped_frac",
                                                     "rejected_token_frac", "k3_kl", "k1_mean", "delta_abs_mean")}
    geo_tis = CorrectionConfig(rollout_importance_sampling_mode="token_truncate")
    product_icepop = CorrectionConfig(rollout_importance_sampling_mode="token_mask",
                                      rollout_importance_sampling_threshold_lower=0.5,
                                      rollout_importance_sampling_sequence_reduction="product",
                                      rollout_rejection=["seq_sum_k3"], rollout_rejection_threshold=0.1)
    seq_token = CorrectionConfig(rollout_importance_sampling_mode="sequence_mask")
    plain = CorrectionConfig(log_rollout_offpolicy_metrics=True)
    assert set(verl_names(ours, geo_tis)) == {
        "rollout_correction/chi2_seq", "rollout_corr/rollout_is_eff_sample_size", "rollout_corr/rollout_is_mean",
        "rollout_corr/rollout_is_ratio_fraction_high", "rollout_correction/rejected_token_frac",
        "rollout_corr/k3_kl", "rollout_correction/k1_mean", "rollout_correction/delta_abs_mean"}
    assert set(verl_names(ours, product_icepop)) == {
        "rollout_corr/chi2_seq", "rollout_corr/rollout_is_eff_sample_size", "rollout_corr/rollout_is_mean",
        "rollout_corr/rollout_is_oob_ratio", "rollout_corr/rollout_rs_masked_fraction",
        "rollout_corr/k3_kl", "rollout_correction/k1_mean", "rollout_correction/delta_abs_mean"}
    seq = verl_names(ours, seq_token)  # per-token weights of kept sequences: verl's ESS clamps them first
    assert "rollout_correction/ess" in seq and "rollout_corr/rollout_is_mean" in seq
    assert "rollout_correction/clipped_frac" in seq  # a token share of clipped sequences: verl's is per sequence
    assert {"rollout_correction/ess", "rollout_correction/is_weight_mean"} <= set(verl_names(ours, plain))
    assert set(trl_names(ours, plain)) - set(ours) == {"sampling/sampling_logp_difference/mean"}
    k3 = NemoRLLoss(kl_type="k3", own_truncation=False, sequence_level=False)
    assert set(ours) - set(nemo_rl_names(ours, plain, k3)) == {"rollout_correction/k3_kl",
                                                                  "rollout_correction/is_weight_mean"}
    assert set(ours) - set(nemo_rl_names(ours, plain, k3._replace(kl_type="k1"))) == {
        "rollout_correction/k1_mean", "rollout_correction/is_weight_mean"}
    assert set(ours) - set(nemo_rl_names(ours, plain, k3._replace(own_truncation=True))) == {"rollout_correction/k3_kl"}
    assert set(ours) - set(nemo_rl_names(ours, plain, k3._replace(sequence_level=True))) == {
        "rollout_correction/k3_kl"}
    for removes in (product_icepop, plain.replace(off_policy_sequence_mask_delta=0.1),
                    plain.replace(old_logprob_source="bypass")):
        assert nemo_rl_names(ours, removes, k3) == ours  # NeMo RL's cover other tokens, or another pi_old


def test_docs_carry_the_table():
    """docs/metrics.md shows exactly the table the adapters read (regenerate: print(markdown_table()))."""
    docs = (REPO / "docs" / "metrics.md").read_text()
    assert markdown_table() in docs
    for old, new in RENAMED.items():  # the migration note
        assert f"`{old}`" in docs, old


#: The old names may appear only in the migration note and the table that maps them.
_OLD = re.compile(r"rollout_correction/kl\b|\bpolicy/ppo_kl\b|\bpolicy/nonfinite_frac\b")
_MAY_NAME_THEM = {"rollout_parity/core/metric_names.py", "docs/metrics.md", "tests/test_metric_names.py",
                  "README.md"}  # README.md: the lead's file, updated from this branch's report


def test_old_names_are_gone_from_the_repository():
    try:
        files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    left = []
    for name in files.split():
        path = REPO / name
        if name in _MAY_NAME_THEM or path.suffix not in (".py", ".md", ".json", ".yaml", ".sh", ".txt", ".toml"):
            continue
        text = path.read_text(errors="replace")
        left += [f"{name}: {m.group(0)}" for m in _OLD.finditer(text)]
    assert not left, left


def test_renamed_names_are_never_logged():
    logged = _everything_logged(CorrectionConfig.preset("tis_srs_k3"))
    assert not set(RENAMED) & set(logged)
    assert all(math.isfinite(v) for v in logged.values())
