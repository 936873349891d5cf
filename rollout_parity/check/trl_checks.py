"""The shared batch through TRL's own ``GRPOTrainer`` with our adapter applied.

A real trainer (tiny local model; the batch enters through TRL's ``rollout_func`` and the model
forward returns its logprobs: ``trl_batch.py``) runs TRL's own ``_generate_and_score_completions``
and ``_compute_loss`` for every shared-batch config and three of TRL's loss types, and the
numbers must be the core's: for ``bnpo`` the packaged frozen numbers themselves; for ``dapo``
and ``grpo`` the core with TRL's denominators (``core_with_trl_denominators``). TRL's own
importance-sampling ratio and off-policy mask (the adapter off) must equal the shared flags
that claim to reproduce them.
"""

from __future__ import annotations

import math
import tempfile
from typing import Any, Callable, Optional

import torch

from rollout_parity import CorrectionConfig, compute_correction, policy_loss
from rollout_parity.check.report import Check, FrameworkReport, corrupt
from rollout_parity.check.shared_batch import B, T, all_config_names, config_for, load_expected, make_shared_batch
from rollout_parity.core.metric_names import trl_names

__all__ = ["TRL_CHECKS", "AGGREGATION", "core_with_trl_denominators", "run_trl_checks", "run"]

#: name -> what it compares; all but trl/metrics take the self-test knob (report.CORRUPT_ENV).
TRL_CHECKS = {
    "trl/bnpo": "TRL's bnpo loss & gradient vs packaged numbers",
    "trl/dapo": "TRL's dapo loss & gradient vs core",
    "trl/grpo": "TRL's grpo loss & gradient vs core",
    "trl/channels": "weights & mask in TRL's own channels",
    "trl/metrics": "metrics TRL logs vs packaged numbers",
    "trl/native": "TRL's own IS ratio & off-policy mask = shared flags",
}
#: TRL loss type -> the core's aggregation of the same loss (one process, gradient accumulation 1).
AGGREGATION = {"bnpo": "token-mean", "dapo": "token-mean", "grpo": "seq-mean-token-mean"}
TOL = 1e-6
_SAVED = ("loss_type", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
          "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min")
# TRL's own (mode, clip_max, clip_min) and the shared flags that must reproduce them.
_NATIVE = {
    "trl_default": (("sequence_mask", 3.0, None), lambda: CorrectionConfig.preset("trl_default")),
    "token_truncate": (("token_truncate", 2.0, None),
                       lambda: CorrectionConfig(rollout_importance_sampling_mode="token_truncate",
                                                rollout_importance_sampling_threshold=2.0)),
}


def core_with_trl_denominators(name: Optional[str], loss_type: str, cfg: Any = None,
                               batch: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The core's loss and gradient for TRL's ``loss_type``, with TRL's denominators.

    ``cfg`` and ``batch`` stand in for the shared config ``name`` and the shared batch. TRL's off-policy
    mask multiplies the loss: its sequences still count in the token denominators (bnpo, dapo); grpo
    averages sequence means over every row.
    """
    batch = batch or make_shared_batch()
    cfg = config_for(name) if cfg is None else cfg
    current = batch.fresh_current()
    out = compute_correction(cfg, old_logprobs=batch.old_logprobs, rollout_logprobs=batch.rollout_logprobs,
                             response_mask=batch.response_mask, advantages=batch.advantages, current_logprobs=current)
    tokens = (batch.response_mask * (1 - out.rejected)).sum()
    kwargs = {"global_num_seqs": float(B)} if loss_type == "grpo" else {"global_num_tokens": tokens}
    loss, _ = policy_loss(cfg, current_logprobs=current, old_logprobs=out.old_logprobs, advantages=batch.advantages,
                          correction=out, clip_ratio=0.2, loss_agg_mode=AGGREGATION[loss_type], **kwargs)
    loss.backward()
    return loss.detach(), current.grad


def _tamper(checks: tuple[str, ...]) -> Callable[[dict], None]:
    """The self-test knob at TRL's channel: our weight as TRL's loss will read it (see report.corrupt)."""
    def tamper(inputs: dict) -> None:
        if "importance_sampling_ratio" in inputs:
            in_loss = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            for check in checks:
                inputs["importance_sampling_ratio"] = corrupt(check, inputs["importance_sampling_ratio"], in_loss)
    return tamper


def _run(trainer: Any, saved: dict, cfg: Any, loss_type: str, batch: Any, corruptible: tuple[str, ...] = ()):
    from rollout_parity.adapters import trl as trl_adapter
    from rollout_parity.check.trl_batch import through_trl

    trainer.__dict__.update(saved)
    if cfg is not None and not cfg.changes_loss:
        trainer.vllm_importance_sampling_correction = False  # diagnostics only: TRL's own ratio off, as the core
    try:
        return through_trl(trainer, cfg, loss_type, batch, tamper=_tamper(corruptible))
    finally:
        trl_adapter.revert(trainer)
        trainer.__dict__.pop("rollout_func", None)
        trainer.__dict__.update(saved)


def run_trl_checks(report: FrameworkReport, tick: Callable[[], None] = lambda: None) -> None:
    from rollout_parity.adapters import trl as trl_adapter
    from rollout_parity.check.trl_batch import pretend_vllm_trainer

    report.tested = trl_adapter.TESTED_TRL
    checks = {name: Check(name, what, TOL) for name, what in TRL_CHECKS.items()}
    metrics = checks["trl/metrics"]
    metrics.tolerance = 1e-5
    expected_all = load_expected()
    with tempfile.TemporaryDirectory(prefix="rollout-parity-check-trl-") as tmp:
        trainer = pretend_vllm_trainer(tmp, B, T)
        saved = {k: getattr(trainer, k) for k in _SAVED}
        for loss_type in AGGREGATION:
            check = checks[f"trl/{loss_type}"]
            for name in all_config_names():
                cfg, expected = config_for(name), expected_all[name]
                corruptible = (check.name, "trl/channels") if loss_type == "bnpo" else (check.name,)
                loss, grad, logged, inputs = _run(trainer, saved, cfg, loss_type, make_shared_batch(), corruptible)
                want_loss, want_grad = core_with_trl_denominators(name, loss_type)
                if loss_type == "bnpo" and cfg.off_policy_sequence_mask_delta is None:  # the frozen aggregation
                    check.close(name, "loss", loss, expected["loss"], rtol=TOL)
                    check.close(name, "gradient", grad, expected["grad"], rtol=TOL)
                check.close(name, f"{loss_type} loss", loss, want_loss, rtol=TOL)
                check.close(name, f"{loss_type} gradient", grad, want_grad, rtol=TOL)
                check.expect(name, bool(grad.abs().sum() > 0), "the loss trained nothing")
                if loss_type == "bnpo":
                    _metrics(metrics, name, cfg, logged, expected)
                    _channels(checks["trl/channels"], name, cfg, inputs, expected)
                tick()
        _native(checks["trl/native"], trainer, saved)
        tick()
    report.checks += [c.result() for c in checks.values()]


def _metrics(check: Check, name: str, cfg: Any, logged: dict, expected: dict) -> None:
    # ours under TRL's names where TRL has the quantity (sampling/sampling_logp_difference/*)
    want = trl_names({k: v for k, v in expected["metrics"].items() if k.startswith("rollout_correction/")}, cfg)
    missing = sorted(set(want) - set(logged))
    check.expect(name, not missing, f"TRL logged no {missing}")
    for key, value in want.items():
        if key in logged:
            check.close(name, key, logged[key], value, atol=TOL, rtol=1e-5)
    if cfg.off_policy_sequence_mask_delta is None:  # TRL's mask keeps masked sequences in its metric means
        check.close(name, "rollout_correction/ppo_k1_mean", logged.get("rollout_correction/ppo_k1_mean", math.nan),
                    expected["metrics"]["policy/ppo_k1_mean"])
        # TRL's own clip fraction (its region rule) equals the core's on the same tokens
        check.close(name, "clip_ratio/region_mean", logged.get("clip_ratio/region_mean", math.nan),
                    expected["metrics"]["policy/pg_clipfrac"])


def _channels(check: Check, name: str, cfg: Any, inputs: dict, expected: dict) -> None:
    """What TRL's channels carry: our weights on its loss tokens, rejection out of ``tool_mask``."""
    if not cfg.changes_loss:
        return
    in_loss = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
    ratio = inputs["importance_sampling_ratio"].expand(B, T)
    check.close(name, "importance_sampling_ratio", torch.where(in_loss, ratio, 0.0),
                torch.where(in_loss, torch.tensor(expected["weights"]), 0.0), rtol=TOL)
    kept = torch.tensor(expected["mask"]).bool()
    if cfg.off_policy_sequence_mask_delta is not None:  # TRL's own mask acts in its loss, not in tool_mask
        kept = kept | (make_shared_batch().response_mask.bool() & in_loss)
    check.close(name, "completion_mask * tool_mask", in_loss.float(), kept.float(), atol=0.0)


def _native(check: Check, trainer: Any, saved: dict) -> None:
    """TRL's own code, the adapter off, against the shared flags that reproduce it."""
    from trl import GRPOTrainer

    batch = make_shared_batch()
    for name, ((mode, clip_max, clip_min), flags) in _NATIVE.items():
        own = dict(saved, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                   vllm_importance_sampling_clip_max=clip_max, vllm_importance_sampling_clip_min=clip_min)
        _, _, _, inputs = _run(trainer, own, None, "bnpo", batch)
        mask = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
        check.expect(name, torch.equal(mask, batch.response_mask.bool()), "TRL's loss mask is not the batch's")
        ratio = inputs["importance_sampling_ratio"].expand(B, T)
        ours = compute_correction(flags(), old_logprobs=batch.old_logprobs, rollout_logprobs=batch.rollout_logprobs,
                                  response_mask=batch.response_mask, with_metrics=False).weights
        ours = corrupt(check.name, ours, mask)
        check.close(f"{name} ratio", "TRL's ratio vs ours", torch.where(mask, ratio, 0.0),
                    torch.where(mask, ours, 0.0), rtol=TOL)
    current = batch.current_logprobs.detach()
    for delta in (0.02, 0.1):
        keep_trl = GRPOTrainer.get_off_policy_mask(
            advantages=batch.advantages.unsqueeze(1), per_token_logps=current,
            sampling_per_token_logps=batch.rollout_logprobs.masked_fill(~batch.rollout_logprobs.isfinite(), math.nan),
            mask=batch.response_mask, off_policy_threshold=delta).squeeze(1).bool()
        ours = compute_correction(CorrectionConfig(off_policy_sequence_mask_delta=delta),
                                  old_logprobs=batch.old_logprobs, rollout_logprobs=batch.rollout_logprobs,
                                  response_mask=batch.response_mask, advantages=batch.advantages,
                                  current_logprobs=current, with_metrics=False)
        check.close(f"off-policy mask {delta}", "kept sequences", keep_trl.float(),
                    (~ours.off_policy_masked).float(), atol=0.0)


def run(report: FrameworkReport, opts: Any, tick: Callable[[], None]) -> None:
    """``rollout-parity check``'s entry for TRL (``registry.py``)."""
    run_trl_checks(report, tick)
