"""The doctor's "what to watch" block: names the adapters log, alarms fitted to the measured floor."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from rollout_parity import CorrectionConfig, compute_correction
from rollout_parity.core.metric_names import NemoRLLoss, nemo_rl_names, trl_names, verl_names
from rollout_parity.doctor.watch import WATCH, format_watch, markdown_watch, watch_rows

SAVED = Path(__file__).resolve().parents[1] / "docs" / "data" / "doctor.json"


@pytest.fixture(scope="module")
def report():
    return json.loads(SAVED.read_text())


def _logged(cfg: CorrectionConfig) -> dict[str, set[str]]:
    """The metric names each adapter's renaming gives a real correction's metrics for ``cfg``."""
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 8, generator=g)
    old = rollout + 1e-2 * torch.randn(4, 8, generator=g)
    out = compute_correction(cfg.replace(log_rollout_offpolicy_metrics=True), old_logprobs=old,
                             rollout_logprobs=rollout, response_mask=torch.ones(4, 8), advantages=torch.randn(4))
    metrics = {k: float(v) for k, v in out.metrics.items()}
    return {"verl": set(verl_names(metrics, cfg)), "TRL": set(trl_names(metrics, cfg)),
            "NeMo RL": set(nemo_rl_names(metrics, cfg, NemoRLLoss("k3", False, False)))}


@pytest.mark.parametrize("flags", ["recommended", "no rejection"])
def test_every_watched_name_is_one_the_adapter_logs_for_the_recommended_flags(report, flags):
    """Where NeMo RL's own loss logs the quantity (its ``gen_kl_error`` is k3 without our rejection), ours is
    left out there and the watch names NeMo RL's."""
    report = copy.deepcopy(report)
    if flags == "no rejection":
        for key in ("rollout_rejection", "rollout_rejection_threshold"):
            report["recommendation"]["flags"].pop(key)
    cfg = CorrectionConfig(**report["recommendation"]["flags"])
    logged = _logged(cfg)
    for row in watch_rows(report):
        for framework, name in row["names"].items():
            ours = "rollout_correction/" + row["leaf"]
            if framework == "NeMo RL" and ours not in logged[framework]:
                assert name == "gen_kl_error" and row["leaf"] == "k3_kl" and flags == "no rejection"
            else:
                assert name in logged[framework], (row["leaf"], framework, name)


def test_alarms_move_with_the_floor_measured_on_the_model(report):
    """Each alarm is a function of row d's value: a model with twice the floor gets other alarm values."""
    before = {r["leaf"]: r for r in watch_rows(report)}
    noisier = copy.deepcopy(report)
    row_d = next(r for r in noisier["rows"] if r["row"] == "d")
    for key in ("delta_abs_mean", "k3_kl"):
        row_d[key] *= 2
    row_d["ess"] = 1 - 2 * (1 - row_d["ess"])
    after = {r["leaf"]: r for r in watch_rows(noisier)}
    assert after["delta_abs_mean"]["alarm"] == pytest.approx(3 * row_d["delta_abs_mean"])
    assert after["k3_kl"]["alarm"] == pytest.approx(2 * before["k3_kl"]["alarm"])
    assert after["ess"]["alarm"] < before["ess"]["alarm"] < 1


def test_the_rejection_floor_is_the_recommended_flags_share_not_the_measured_presets(report):
    """The doctor measured its preset (row d rejects 16 % of sequences there); the run uses the advice's
    threshold, whose share at the measured length is the doctor's own prediction."""
    row = next(r for r in watch_rows(report) if r["leaf"] == "rejected_seq_frac")
    shares = report["recommendation"]["rejection_shares"]["d"][str(report["lengths"]["measured"])]
    assert row["floor"] == shares
    measured_preset = next(r for r in report["rows"] if r["row"] == "d")["rejected_seq_frac"]
    assert measured_preset != shares
    measured = copy.deepcopy(report)
    next(r for r in measured["rows"] if r["row"] == "d")["rejected_seq_frac_advised"] = 0.03
    assert next(r for r in watch_rows(measured) if r["leaf"] == "rejected_seq_frac")["floor"] == 0.03
    without = copy.deepcopy(report)
    without["recommendation"]["flags"].pop("rollout_rejection")
    without["recommendation"]["flags"].pop("rollout_rejection_threshold")
    assert next(r for r in watch_rows(without) if r["leaf"] == "rejected_seq_frac")["floor"] == 0.0


def test_without_row_d_nothing_is_invented(report):
    partial = {**report, "rows": [r for r in report["rows"] if r["row"] != "d"]}
    assert all(r["floor"] is None and r["alarm"] is None for r in watch_rows(partial))
    assert "floor         -" in format_watch(partial)


def test_the_block_and_the_table_carry_every_quantity(report):
    text, table = format_watch(report), markdown_watch(report)
    for w in WATCH:
        assert w.leaf in text
        assert w.what.replace("|", "\\|") in table
    assert "rollout_corr/k3_kl" in table and "sampling/sampling_logp_difference/mean" in table
