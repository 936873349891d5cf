"""TRL's own correction and ours, side by side on one real ``GRPOTrainer`` and one recorded batch.

The trainer is TRL's (``pretend_vllm_trainer``: the tiny local model, its real forward and TRL's fused head, told
it generates with vLLM); the sampler is TRL's ``rollout_func`` hook returning a recorded batch: completions of the
tiny vocabulary and their sampler logprobs, set to the trainer's own pi_old (read from TRL's pi_old forward of the
same tokens) minus a chosen log-ratio per token. So every TRL setting meets ratios on both sides of its bounds and
drifts on both sides of its off-policy threshold, with nothing at a tie.

:func:`run` drives TRL's ``_generate_and_score_completions`` and ``_compute_loss`` once, with TRL's own correction
(``ours=None``) or with the adapter's (``ours``: shared flags, TRL's own ratio fields at their defaults), and returns
what a user switching sees: the weights and masks of TRL's loss, the loss, the gradient of every parameter and
TRL's logged metrics.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch

__all__ = ["TRL_IS_CLIPS", "TRL_IS_MODES", "TRL_OFF_POLICY", "RecordedBatch", "Run", "TrlSetting", "trl_grid",
           "recorded_batch", "run", "compare"]

#: TRL's own parametrization of its importance sampling (tests/test_grpo_trainer.py,
#: ``test_train_vllm_importance_sampling_correction``): (clip_min, clip_max) = only max (the default), only min,
#: both (IcePop); there on TRL's default mode, here on each of its four modes.
TRL_IS_CLIPS = ((None, 3.0), (0.5, None), (0.5, 5.0))
TRL_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
#: TRL's off-policy thresholds: off, 0.5 (``test_train_with_off_policy_mask``), 1.0 (``test_get_off_policy_mask``)
#: and 0 (accepted by TRL's config: a negative-advantage sequence with any positive drift is masked).
TRL_OFF_POLICY = (None, 0.5, 1.0, 0.0)


@dataclass(frozen=True)
class TrlSetting:
    mode: str
    clip_min: Optional[float]
    clip_max: Optional[float]
    off_policy: Optional[float]

    @property
    def name(self) -> str:
        return f"{self.mode}-min{self.clip_min}-max{self.clip_max}-opm{self.off_policy}"

    def trl_fields(self) -> dict[str, Any]:
        return {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": self.mode,
                "vllm_importance_sampling_clip_max": self.clip_max, "vllm_importance_sampling_clip_min": self.clip_min,
                "off_policy_mask_threshold": self.off_policy}

    def our_flags(self) -> tuple[dict[str, Any], Optional[float]]:
        """The shared flags a user switching writes for this setting, and what stays in TRL's own
        ``off_policy_mask_threshold`` (its 0, which the shared flag does not take: docs/trl_own_correction.md)."""
        from rollout_parity.adapters.trl.refusals import trl_ratio_as_flags

        flags = trl_ratio_as_flags(self.mode, self.clip_max, self.clip_min)
        if self.off_policy:
            flags["off_policy_sequence_mask_delta"] = self.off_policy
            return flags, None
        return flags, self.off_policy


def trl_grid() -> list[TrlSetting]:
    return [TrlSetting(mode, lo, hi, opm) for mode in TRL_IS_MODES for lo, hi in TRL_IS_CLIPS for opm in TRL_OFF_POLICY]


# One row per case: (completion length, per-token log r = pi_old - pi_rollout (cycled), advantage, in TRL's loss).
# Drift (pi_rollout - pi_theta, pi_theta = pi_old on the first micro-step) is -log r.
_ROWS = (
    (10, (-0.05,), 1.0, True),          # rho 0.61, drift 0.05, positive advantage: kept by the mask
    (6, (0.2,), -1.0, True),            # rho 3.3: above clip_max 3, below 5; drift -0.2: kept at any threshold
    (8, (-0.3,), -1.0, True),           # rho 0.09 < clip_min 0.5; drift 0.3: masked at 0, kept at 0.5 and 1
    (4, (-0.8,), -0.5, True),           # token ratios 0.45 < 0.5; drift 0.8: masked at 0 and 0.5, kept at 1
    (5, (0.35,), -1.0, True),           # rho 5.8 > 5; drift -0.35
    (3, (0.1,), 1.0, False),            # no token in TRL's loss (env_mask 0): TRL's sequence ratio exp(0) = 1
    (10, (-1.5,), -1.0, True),          # drift 1.5: masked at every threshold (TRL's "neg adv + high KL -> drop")
    (7, (-0.6, 0.9, 1.3, 1.8), 1.0, True),  # token ratios 0.55, 2.5, 3.7 (> 3), 6.0 (> 5): positive advantage
)
_JITTER = 0.01  # per-token noise, far below every gap between a ratio and a bound


@dataclass
class RecordedBatch:
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    env_mask: list[list[int]]
    log_ratio: list[list[float]]
    advantages: torch.Tensor
    rollout: Optional[list[list[float]]] = None  # set by recorded_batch from the trainer's own pi_old
    bad: Mapping[tuple[int, int], float] = None  # (row, token) -> a value the engine returned instead

    def rollout_func(self):
        def rollout_func(prompts: list, trainer: Any) -> dict:
            assert len(prompts) == len(self.prompt_ids), "one generation batch: the recorded rows"
            logprobs = self.rollout or [[0.0] * len(ids) for ids in self.completion_ids]
            return {"prompt_ids": self.prompt_ids, "completion_ids": self.completion_ids,
                    "logprobs": [list(row) for row in logprobs], "env_mask": self.env_mask}
        return rollout_func


def recorded_batch(trainer: Any, bad: Optional[Mapping[tuple[int, int], float]] = None) -> RecordedBatch:
    """The rows of ``_ROWS`` on the tiny vocabulary, their sampler logprobs set from the trainer's own pi_old;
    ``bad`` replaces some of them by what a broken engine returns (NaN, -inf)."""
    g = torch.Generator().manual_seed(1234)
    vocab = trainer.model.config.vocab_size
    prompt_ids, completion_ids, env_mask, log_ratio = [], [], [], []
    for i, (n, pattern, _, in_loss) in enumerate(_ROWS):
        prompt_ids.append(torch.randint(10, vocab, (3 + i % 2,), generator=g).tolist())
        completion_ids.append(torch.randint(10, vocab, (n,), generator=g).tolist())
        env_mask.append([int(in_loss)] * n)
        noise = (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1) * _JITTER
        log_ratio.append([pattern[j % len(pattern)] + float(noise[j]) for j in range(n)])
    batch = RecordedBatch(prompt_ids, completion_ids, env_mask, log_ratio,
                          torch.tensor([a for _, _, a, _ in _ROWS]), bad=dict(bad or {}))
    with trl_settings(trainer, vllm_importance_sampling_correction=True, off_policy_mask_threshold=None):
        trainer.rollout_func = batch.rollout_func()
        out = trainer._generate_and_score_completions([{"prompt": f"p{i}"} for i in range(len(_ROWS))])
    old = out["old_per_token_logps"].double()
    batch.rollout = [[float(old[i, j]) - log_ratio[i][j] for j in range(len(log_ratio[i]))]
                     for i in range(len(_ROWS))]
    for (i, j), value in batch.bad.items():
        batch.rollout[i][j] = value
    return batch


@contextlib.contextmanager
def trl_settings(trainer: Any, **fields: Any) -> Iterator[None]:
    saved = {k: trainer.__dict__[k] for k in fields}
    trainer.__dict__.update(fields)
    try:
        yield
    finally:
        trainer.__dict__.update(saved)


@dataclass
class Run:
    ratio: torch.Tensor  # (B, T) the weight TRL's loss applies per token (its channel, expanded), 0 off the loss
    loss_mask: torch.Tensor  # (B, T) bool: completion_mask * tool_mask
    off_policy_keep: Optional[torch.Tensor]  # (B,) TRL's get_off_policy_mask, None when off
    loss: float
    grads: list[torch.Tensor]
    metrics: dict[str, float]


def run(trainer: Any, batch: RecordedBatch, setting: TrlSetting, ours: bool) -> Run:
    """One generation batch and one loss through TRL, with TRL's own correction or (``ours``) the adapter's."""
    from rollout_parity.adapters import trl as trl_adapter
    from rollout_parity.adapters.trl.config import as_correction_config

    defaults = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask",
                "vllm_importance_sampling_clip_max": 3.0, "vllm_importance_sampling_clip_min": None}
    if ours:
        flags, trl_threshold = setting.our_flags()
        fields = {**defaults, "off_policy_mask_threshold": trl_threshold}
    else:
        fields = setting.trl_fields()
    seen: list[torch.Tensor] = []
    own_mask = type(trainer).get_off_policy_mask

    def recorded_mask(*args: Any, **kwargs: Any) -> torch.Tensor:
        keep = own_mask(*args, **kwargs)
        seen.append(keep.detach().reshape(-1).clone())
        return keep

    with trl_settings(trainer, **fields):
        trainer.rollout_func = batch.rollout_func()
        trainer.__dict__["get_off_policy_mask"] = recorded_mask
        try:
            if ours:
                trl_adapter.apply(trainer, as_correction_config(flags, None))
            trainer._metrics["train"].clear()
            trainer.model.zero_grad(set_to_none=True)
            inputs = trainer._generate_and_score_completions([{"prompt": f"p{i}"} for i in range(len(_ROWS))])
            inputs["advantages"] = batch.advantages.clone()  # TRL's come from the (zero) rewards
            loss = trainer._compute_loss(trainer.model, inputs)
            loss.backward()
        finally:
            trl_adapter.revert(trainer)
            trainer.__dict__.pop("get_off_policy_mask", None)
    loss_mask = (inputs["completion_mask"] * inputs.get("tool_mask", 1)).bool()
    ratio = inputs["importance_sampling_ratio"].detach().expand(loss_mask.shape)
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
             for p in trainer.model.parameters()]
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    return Run(torch.where(loss_mask, ratio, 0.0), loss_mask, seen[0] if seen else None, float(loss.detach()), grads,
               metrics)


def _close(a: float, b: float, tol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= tol * (1 + abs(b))


def compare(theirs: Run, ours: Run, tol: float = 1e-6) -> list[str]:
    """The names of what differs: ``weights``, ``loss_mask``, ``off_policy_mask``, ``loss``, ``grad`` and each of
    TRL's ``sampling/*`` metrics (missing on our side counts as differing)."""
    out = []
    if not torch.allclose(ours.ratio.double(), theirs.ratio.double(), rtol=tol, atol=tol, equal_nan=True):
        out.append("weights")
    if not torch.equal(ours.loss_mask, theirs.loss_mask):
        out.append("loss_mask")
    if (ours.off_policy_keep is None) != (theirs.off_policy_keep is None) or (
            ours.off_policy_keep is not None and not torch.equal(ours.off_policy_keep, theirs.off_policy_keep)):
        out.append("off_policy_mask")
    if not _close(ours.loss, theirs.loss, tol):
        out.append("loss")
    if any(not torch.allclose(a, b, rtol=1e-5, atol=1e-7, equal_nan=True) for a, b in zip(ours.grads, theirs.grads)):
        out.append("grad")
    for key in sorted(k for k in theirs.metrics if k.startswith("sampling/")):
        if key not in ours.metrics or not _close(ours.metrics[key], theirs.metrics[key], tol):
            out.append(key)
    return out
