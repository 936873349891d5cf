"""The shared cross-framework batch: one fixed, seeded batch every adapter is checked on.

It is deliberately hard: rollout logprobs mismatched by a heavy-tailed noise, one NaN and
one −inf from the "engine", mixed-sign advantages, ragged masks (one sequence empty), so
every branch of the core's bad-input rules is crossed. ``core_reference(name)`` is what
the core gives on it for a preset; adapters must give the same weights, mask, loss,
gradient and metrics to 1e-6 in fp32.

``shared_batch_expected.json`` beside this file freezes the core's outputs; regenerate it
only on an intended change of the math: ``python -m integration_tests.shared_batch``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from rollout_parity import CorrectionConfig, compute_correction, policy_loss

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
PRESETS_DIR = Path(__file__).resolve().parents[1] / "configs" / "presets"


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
    data = yaml.safe_load((PRESETS_DIR / f"{name}.yaml").read_text())
    data.pop("description", None)
    return data


def config_for(name: str) -> CorrectionConfig:
    if name in EXTRA_CONFIGS:
        return CorrectionConfig(**EXTRA_CONFIGS[name])
    return CorrectionConfig.preset(name)


def all_config_names() -> tuple[str, ...]:
    return PRESETS + tuple(EXTRA_CONFIGS)


def core_reference(name: str, batch: SharedBatch | None = None) -> dict:
    """The core's weights, mask, loss, gradient wrt current logprobs and metrics."""
    batch = batch or make_shared_batch()
    cfg = config_for(name)
    current = batch.fresh_current()
    out = compute_correction(cfg, old_logprobs=batch.old_logprobs, rollout_logprobs=batch.rollout_logprobs,
                             response_mask=batch.response_mask, advantages=batch.advantages,
                             current_logprobs=current, with_metrics=True)
    loss, metrics = policy_loss(cfg, current_logprobs=current, old_logprobs=batch.old_logprobs,
                                advantages=batch.advantages, correction=out, **LOSS_KWARGS)
    loss.backward()
    return {"weights": out.weights, "mask": out.mask, "loss": loss.detach(), "grad": current.grad.detach(),
            "metrics": metrics}


def _to_json(ref: dict) -> dict:
    return {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in ref.items()}


def naive_reference():
    """``tests/naive_reference.py``, loaded by path: verl installs a top-level ``tests`` package of
    its own, so ``import tests.naive_reference`` could find the wrong one."""
    name = "rollout_parity_tests_naive_reference"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "tests" / "naive_reference.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def naive_outputs(name: str, batch: SharedBatch | None = None) -> dict:
    """The naive reference's weights, keep mask, loss, gradient and metrics for config ``name``."""
    batch = batch or make_shared_batch()
    return naive_reference().naive_everything(
        raw_flags(name), batch.old_logprobs.tolist(), batch.rollout_logprobs.tolist(),
        batch.response_mask.tolist(), batch.advantages.tolist(), batch.current_logprobs.detach().tolist(),
        eps_low=LOSS_KWARGS["clip_ratio"], eps_high=LOSS_KWARGS["clip_ratio"], agg=LOSS_KWARGS["loss_agg_mode"])


def naive_disagreements(name: str, frozen: dict, batch: SharedBatch | None = None) -> list[str]:
    """Where ``frozen`` (one config's outputs, as in the JSON) and the naive reference disagree."""
    naive = naive_outputs(name, batch)
    problems = []

    def close(a, b, rel=1e-5, abs_=1e-6):
        return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)

    for what, ours in (("weights", frozen["weights"]), ("grad", frozen["grad"])):
        theirs = naive[what]
        bad = [(i, t) for i, row in enumerate(ours) for t, v in enumerate(row) if not close(v, theirs[i][t])]
        if bad:
            i, t = bad[0]
            problems.append(f"{what}: {len(bad)} entries differ, first [{i}][{t}] {ours[i][t]} vs naive {theirs[i][t]}")
    if frozen["mask"] != [[float(k) for k in row] for row in naive["keep"]]:
        problems.append("mask differs")
    if not close(frozen["loss"], naive["loss"]):
        problems.append(f"loss {frozen['loss']} vs naive {naive['loss']}")
    if set(frozen["metrics"]) != set(naive["metrics"]):
        problems.append(f"metric names differ: {sorted(set(frozen['metrics']) ^ set(naive['metrics']))}")
    for key in sorted(set(frozen["metrics"]) & set(naive["metrics"])):
        if not close(frozen["metrics"][key], naive["metrics"][key]):
            problems.append(f"{key}: {frozen['metrics'][key]} vs naive {naive['metrics'][key]}")
    return problems


def write_expected() -> None:
    data = {name: _to_json(core_reference(name)) for name in all_config_names()}
    problems = {name: naive_disagreements(name, frozen) for name, frozen in data.items()}
    problems = {name: p for name, p in problems.items() if p}
    if problems:
        raise SystemExit(f"not writing {EXPECTED_PATH.name}: the core disagrees with tests/naive_reference.py: "
                         f"{json.dumps(problems, indent=1)}")
    EXPECTED_PATH.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def load_expected() -> dict:
    return json.loads(EXPECTED_PATH.read_text())


if __name__ == "__main__":
    write_expected()
    print(f"wrote {EXPECTED_PATH}")
