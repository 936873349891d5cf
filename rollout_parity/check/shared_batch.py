"""The shared cross-framework batch: one fixed, seeded batch every adapter is checked on.

It is deliberately hard: rollout logprobs mismatched by a heavy-tailed noise, one NaN and
one −inf from the "engine", mixed-sign advantages, ragged masks (one sequence empty), so
every branch of the core's bad-input rules is crossed. ``core_reference(name)`` is what
the core gives on it for a preset; adapters must give the same weights, mask, loss,
gradient and metrics to 1e-6 in fp32.

``shared_batch_expected.json`` beside this file (package data) freezes the core's outputs:
``rollout-parity check`` compares the installed stack with it. The suite checks it against
the independent naive reference (``integration_tests/shared_batch.py``, which also
regenerates it, only on an intended change of the math).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
import yaml

from rollout_parity import CorrectionConfig, compute_correction, policy_loss
from rollout_parity.core.config import configs_dir

__all__ = ["B", "T", "SEED", "PRESETS", "EXTRA_CONFIGS", "LOSS_KWARGS", "EXPECTED_PATH", "SharedBatch",
           "make_shared_batch", "raw_flags", "config_for", "all_config_names", "core_reference", "to_json",
           "load_expected"]

B, T = 8, 12
SEED = 20260521
PRESETS = ("tis_srs_k3", "ms_swift_default", "trl_default", "verl_decoupled_token_is", "icepop")
EXTRA_CONFIGS = {
    # Flags beyond the presets, so every mode and the off-policy mask cross the adapters too.
    "sequence_truncate_geo": dict(rollout_importance_sampling_mode="sequence_truncate",
                                  rollout_importance_sampling_threshold=1.5),
    "sequence_mask_token": dict(rollout_importance_sampling_mode="sequence_mask",
                                rollout_importance_sampling_threshold=1.05,
                                rollout_importance_sampling_threshold_lower=0.95),
    "k1_k2_rejection": dict(rollout_rejection=["token_k2", "seq_mean_k1"],
                            rollout_rejection_threshold=[0.5, "0.9_1.1"]),
    "off_policy_mask": dict(rollout_importance_sampling_mode="token_truncate", off_policy_sequence_mask_delta=0.02),
    "metrics_only": dict(log_rollout_offpolicy_metrics=True),
}
LOSS_KWARGS = dict(clip_ratio=0.2, loss_agg_mode="token-mean")
EXPECTED_PATH = Path(__file__).with_name("shared_batch_expected.json")


@dataclass
class SharedBatch:
    old_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    current_logprobs: torch.Tensor  # a leaf requiring grad; clone per use
    response_mask: torch.Tensor
    advantages: torch.Tensor  # (B,)

    def fresh_current(self) -> torch.Tensor:
        return self.current_logprobs.detach().clone().requires_grad_(True)


def make_shared_batch() -> SharedBatch:
    g = torch.Generator().manual_seed(SEED)
    lengths = torch.tensor([12, 9, 5, 12, 0, 7, 11, 3])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    old = -torch.rand(B, T, generator=g) * 3.0 - 0.01
    # Heavy-tailed mismatch: mostly ~1e-2, a few tokens near 1 (the paper's Fig. 1 shape).
    noise = torch.randn(B, T, generator=g) * 0.02
    spikes = (torch.rand(B, T, generator=g) < 0.08).float() * torch.randn(B, T, generator=g) * 0.8
    rollout = old + noise + spikes
    rollout[3, 2] = float("nan")
    rollout[6, 4] = float("-inf")
    current = old + torch.randn(B, T, generator=g) * 0.05
    current[0, 1] += 0.5  # one token far outside the PPO clip range
    advantages = torch.tensor([1.0, -0.5, 0.75, -1.25, 0.3, -0.8, 0.6, -0.2])
    return SharedBatch(old, rollout, current.requires_grad_(True), mask, advantages)


def raw_flags(name: str) -> dict:
    """The flags of config ``name`` as written (the preset's YAML or ``EXTRA_CONFIGS``), unparsed."""
    if name in EXTRA_CONFIGS:
        return dict(EXTRA_CONFIGS[name])
    data = yaml.safe_load((configs_dir() / "presets" / f"{name}.yaml").read_text())
    data.pop("description", None)
    return data


def config_for(name: str) -> CorrectionConfig:
    if name in EXTRA_CONFIGS:
        return CorrectionConfig(**EXTRA_CONFIGS[name])
    return CorrectionConfig.preset(name)


def all_config_names() -> tuple[str, ...]:
    return PRESETS + tuple(EXTRA_CONFIGS)


def core_reference(name: str, batch: SharedBatch | None = None, tamper=None) -> dict:
    """The core's weights, mask, loss, gradient wrt current logprobs and metrics.

    ``tamper(correction)``, if given, may change the correction before the loss reads it
    (``rollout-parity check``'s self-test); the weights and mask returned are the untampered ones.
    """
    batch = batch or make_shared_batch()
    cfg = config_for(name)
    current = batch.fresh_current()
    out = compute_correction(cfg, old_logprobs=batch.old_logprobs, rollout_logprobs=batch.rollout_logprobs,
                             response_mask=batch.response_mask, advantages=batch.advantages,
                             current_logprobs=current, with_metrics=True)
    weights, mask = out.weights, out.mask
    if tamper is not None:
        tamper(out)
    loss, metrics = policy_loss(cfg, current_logprobs=current, old_logprobs=batch.old_logprobs,
                                advantages=batch.advantages, correction=out, **LOSS_KWARGS)
    loss.backward()
    return {"weights": weights, "mask": mask, "loss": loss.detach(), "grad": current.grad.detach(),
            "metrics": metrics}


def to_json(ref: dict) -> dict:
    """One config's outputs as the JSON file holds them."""
    return {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in ref.items()}


@lru_cache(maxsize=1)
def _expected_text() -> str:
    return EXPECTED_PATH.read_text()


def load_expected() -> dict:
    """The frozen outputs of every config (a fresh copy: callers may change it)."""
    return json.loads(_expected_text())
