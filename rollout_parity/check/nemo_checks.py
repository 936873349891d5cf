"""The shared batch through our NeMo RL loss beside NeMo RL's own ``ClippedPGLossFn``.

NeMo RL comes from the installed package or from a source tree (``--nemo_rl_source``, imported
through ``nemo_source.SOURCES``). Each loss is called once on the whole batch as NeMo RL's
workers call a ``LossFunction``: ``loss_fn(next_token_logprobs, data, global_valid_seqs,
global_valid_toks)`` with NeMo RL's own ``BatchedDataDict`` in its ``(B, S)`` layout.

* ``nemo_rl/native``: no shared flags, NeMo RL's own importance-sampling keys (none, plain IS,
  tis, icepop, seq-mask-tis, dual clip): ours built with ``from_nemo_config`` gives NeMo RL's
  loss, gradient and every metric NeMo RL returns;
* ``nemo_rl/flags``: the shared flags under ``loss_fn.rollout_correction`` give the packaged
  loss and gradient, scaled by NeMo RL's token denominator (it counts rejected tokens).

The self-test knob (report.CORRUPT_ENV) changes, for our loss only, the sampler logprob that one
importance weight is computed from (the weights are computed inside the loss call).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import types
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from rollout_parity.check.report import Check, FrameworkReport, corrupt
from rollout_parity.check.shared_batch import all_config_names, config_for, load_expected, make_shared_batch

__all__ = ["NEMO_CHECKS", "NEMO_CASES", "TESTED_NEMO_RL", "load", "nemo_data", "nemo_context", "run_nemo_checks", "run"]

NEMO_CHECKS = {
    "nemo_rl/native": "NeMo RL's own IS keys: ours = ClippedPGLossFn",
    "nemo_rl/flags": "shared flags: loss & gradient vs packaged numbers",
}
#: What the adapter was run against: v0.7.0 (81aa43dd) and main 7ea279ab, which reports 0.6.0.
TESTED_NEMO_RL = ">=0.6,<0.8"
NEMO_CASES = {
    "no_is": dict(),
    "plain_is": dict(use_importance_sampling_correction=True),
    "tis": dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                truncated_importance_sampling_ratio=1.2),
    "tis_floor_dual_clip": dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                                truncated_importance_sampling_ratio=1.2, truncated_importance_sampling_ratio_min=0.9,
                                ratio_clip_c=3.0),
    "icepop": dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
                   truncated_importance_sampling_ratio=1.1, truncated_importance_sampling_ratio_min=0.9),
    "seq_mask_tis": dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="seq-mask-tis",
                         truncated_importance_sampling_ratio=1.02, truncated_importance_sampling_ratio_min=0.98),
}


def load(ns: types.SimpleNamespace) -> types.SimpleNamespace:
    """Attach the NeMo RL names the checks and tests use to an active namespace (``ns.load``)."""
    loss = ns.load("nemo_rl.algorithms.loss")
    interfaces = ns.load("nemo_rl.algorithms.loss.interfaces")
    ns.ClippedPGLossFn = loss.ClippedPGLossFn
    ns.ClippedPGLossConfig = loss.ClippedPGLossConfig
    ns.LossType = interfaces.LossType
    ns.LossInputType = interfaces.LossInputType
    ns.MetricNormalizer = getattr(interfaces, "MetricNormalizer", None)
    ns.BatchedDataDict = ns.load("nemo_rl.distributed.batched_data_dict").BatchedDataDict
    ns.process_global_batch = ns.load("nemo_rl.models.automodel.data").process_global_batch
    return ns


def nemo_data(ns, old, rollout, current, mask, advantages, sample_mask=None):
    """A ClippedPGLossDataDict ``(B, S)`` from ``(B, T)`` tensors, plus the current logprobs.

    Column 0 is a prompt token holding junk, token_mask 1 there too, so a loss that forgets
    NeMo RL's ``[:, 1:]`` cannot pass. ``next_token_logprobs`` is ``(B, S-1)``: the caller's
    leaf (sliced per microbatch, so gradients reach it).
    """
    B = old.shape[0]

    def pad(x, value):
        return torch.cat([torch.full((B, 1), value, dtype=x.dtype), x], dim=1)

    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1).expand_as(old)
    return ns.BatchedDataDict({
        "input_ids": torch.zeros(B, old.shape[1] + 1, dtype=torch.long),
        "advantages": pad(adv, 9.0),
        "prev_logprobs": pad(old, -7.0),
        "generation_logprobs": pad(rollout, 3.0),
        "reference_policy_logprobs": pad(old, 0.0),
        "token_mask": pad(mask, 1.0),
        "sample_mask": torch.ones(B) if sample_mask is None else sample_mask,
        "next_token_logprobs": current,
    })


def nemo_context(source: Optional[str]) -> contextlib.AbstractContextManager:
    """NeMo RL from ``source`` (a tree holding ``nemo_rl/``) or, without one, the installed package."""
    if source is not None:
        from rollout_parity.check.nemo_source import SOURCES

        return SOURCES.activate(Path(source))
    return contextlib.nullcontext(types.SimpleNamespace(tree=None, load=importlib.import_module))


def _call(loss_fn, ns, batch, rollout, sample_mask):
    """One loss call on the whole batch as NeMo RL's worker makes it; (loss, grad, metrics)."""
    current = batch.fresh_current()
    data = nemo_data(ns, batch.old_logprobs, rollout, current, batch.response_mask, batch.advantages,
                     sample_mask=sample_mask)
    gvs = data["sample_mask"].sum()
    gvt = (data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)).sum()
    loss, metrics = loss_fn(next_token_logprobs=current, data=data, global_valid_seqs=gvs, global_valid_toks=gvt)
    loss.backward()
    return loss.detach(), current.grad, dict(metrics)


def run_nemo_checks(report: FrameworkReport, source: Optional[str], tick: Callable[[], None] = lambda: None) -> None:
    from rollout_parity.adapters.nemo_rl import RolloutParityLossFn

    report.tested = TESTED_NEMO_RL
    native, flags = (Check(name, what) for name, what in NEMO_CHECKS.items())
    native.tolerance = 1e-5
    with nemo_context(source) as ns:
        load(ns)
        info = ns.load("nemo_rl.package_info")
        if source is not None or report.version is None:  # the tree's own version, not an installed one
            report.version = getattr(info, "__version__", None)
        if source is not None:
            report.notes.append(f"NeMo RL {report.version} from the source tree {ns.tree}")
        batch = make_shared_batch()
        finite = torch.where(torch.isfinite(batch.rollout_logprobs), batch.rollout_logprobs, batch.old_logprobs - 0.3)
        sample_mask = torch.ones(batch.old_logprobs.shape[0])
        sample_mask[2] = 0.0
        for case, keys in NEMO_CASES.items():
            cfg = ns.ClippedPGLossConfig(reference_policy_kl_penalty=0.0, **keys)
            theirs = _call(ns.ClippedPGLossFn(cfg), ns, batch, finite, sample_mask)
            ours = _call(RolloutParityLossFn.from_nemo_config(cfg), ns, batch,
                         corrupt(native.name, finite, batch.response_mask), sample_mask)
            native.close(case, "loss", ours[0], theirs[0], atol=1e-6, rtol=1e-5)
            native.close(case, "gradient", ours[1], theirs[1], atol=1e-6, rtol=1e-5)
            missing = sorted(set(theirs[2]) - set(ours[2]))
            native.expect(case, not missing, f"metrics NeMo RL returns but ours does not: {missing}")
            for key, value in theirs[2].items():
                if key in ours[2] and math.isfinite(float(value)):
                    native.close(case, key, float(ours[2][key]), float(value), atol=1e-6, rtol=1e-5)
            tick()
        expected_all = load_expected()
        gvt = float(batch.response_mask.sum())
        for name in all_config_names():
            expected = expected_all[name]
            block = ns.ClippedPGLossConfig(reference_policy_kl_penalty=0.0, ratio_clip_min=0.2, ratio_clip_max=0.2,
                                           rollout_correction=config_for(name).to_dict())
            loss_fn = RolloutParityLossFn.from_nemo_config(block)
            rollout = corrupt(flags.name, batch.rollout_logprobs, batch.response_mask)
            loss, grad, _ = _call(loss_fn, ns, batch, rollout, None)
            # NeMo RL fixes global_valid_toks before the loss: tokens removed by rejection still count
            # in the denominator (as NeMo RL's own icepop zeros do); the core divides by the kept ones.
            scale = max(float(torch.tensor(expected["mask"]).sum()), 1.0) / gvt
            flags.close(name, "loss", loss, float(expected["loss"]) * scale, atol=1e-7, rtol=1e-6)
            flags.close(name, "gradient", grad, torch.tensor(expected["grad"]) * scale, atol=1e-7, rtol=1e-6)
            tick()
    report.checks += [native.result(), flags.result()]


def run(report: FrameworkReport, opts: Any, tick: Callable[[], None]) -> None:
    """``rollout-parity check``'s entry for NeMo RL (``registry.py``): installed, or from ``--nemo_rl_source``."""
    run_nemo_checks(report, opts.nemo_rl_source, tick)
