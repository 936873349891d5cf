"""Hand the shared correction to NeMo RL's own ``ClippedPGLossFn``: ``RolloutParityLossFn``.

A wrapper, not a copy: per microbatch it computes ``compute_correction`` from NeMo RL's data
dict, writes the result into the channels NeMo RL's loss already reads (the IS weight into
``advantages``, the rejection and off-policy masks into ``token_mask``) and calls NeMo RL's loss,
whose loss, KL term, clipping, metrics and ``metric_normalizations`` are NeMo RL's. Attributes
NeMo RL reads off a loss (``loss_type``, ``input_type``, ``reference_policy_kl_penalty``,
``use_fused_linear_logprobs``, ...) are the wrapped loss's. docs/nemo_rl_loss.md, "The loss",
says why these channels; docs/nemo_rl_nonfinite.md what differs from NeMo RL on non-finite input.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Mapping

import torch

from rollout_parity.adapters._refusals import refuse_engine_side_flags
from rollout_parity.adapters.nemo_rl import diagnostics
from rollout_parity.adapters.nemo_rl.recipe import NEMO_RL_FP32_HEAD_REFUSAL
from rollout_parity.adapters.nemo_rl.translate import (BLOCK_KEY, GUARD_KEY, NEMO_TRUNCATION_KEYS, as_dict,
                                                      correction_from_nemo_rl, split_loss_config)
from rollout_parity.adapters.nemo_rl.versions import nemo_loss_names
from rollout_parity.core.config import CorrectionConfig
from rollout_parity.core.correction import compute_correction
from rollout_parity.core.readback import read_back
from rollout_parity.core.metric_names import NemoRLLoss, nemo_rl_names

__all__ = ["RolloutParityLossFn"]

logger = logging.getLogger(__name__)
_DATA = ("token_mask", "sample_mask", "advantages", "generation_logprobs")


class RolloutParityLossFn:
    """NeMo RL's ``ClippedPGLossFn`` with the shared correction handed to it.

    Build it from a ``loss_fn`` block (``from_nemo_config``, what NeMo RL's ``setup()`` gets when
    the hook is on), or directly::

        loss_fn = RolloutParityLossFn(CorrectionConfig.preset("tis_srs_k3"),
                                      {"ratio_clip_max": 0.28, "reference_policy_kl_penalty": 0.01})

    Args:
        correction: the shared flags (``CorrectionConfig`` or a mapping; None: all null).
        nemo_config: NeMo RL's own ``loss_fn`` keys (dict, OmegaConf or ``ClippedPGLossConfig``;
            None: NeMo RL's defaults), for the wrapped ``ClippedPGLossFn``.
        *nemo_args, **nemo_kwargs: passed on to ``ClippedPGLossFn`` (``use_fused_linear_logprobs``).
        metrics: ``"nemo"`` (our diagnostics as shares of NeMo RL's global means, which NeMo RL
            sums) or ``"local"`` (the core's diagnostics of the microbatch, for inspection).

    With an IS mode in ``correction``, NeMo RL's own IS is off inside (its
    ``truncated_importance_sampling_type`` set as well is the correction enabled twice: an
    error); its bare ``use_importance_sampling_correction: true`` is the switch async GRPO and
    FP8 generation assert, and our weight is then the one applied. Without an IS mode, NeMo RL's
    own IS settings act as configured, with our rejection and masks added.
    """

    def __init__(self, correction: CorrectionConfig | Mapping | None = None, nemo_config: Any = None,
                 *nemo_args: Any, metrics: str = "nemo", **nemo_kwargs: Any) -> None:
        names = nemo_loss_names()
        if correction is None or isinstance(correction, Mapping):
            correction = CorrectionConfig.from_dict(correction)
        if not isinstance(correction, CorrectionConfig):
            raise TypeError(f"correction must be a CorrectionConfig or a mapping of the shared flags, "
                            f"got {type(correction).__name__}")
        if metrics not in ("nemo", "local"):
            raise ValueError(f"metrics: expected 'nemo' or 'local', got {metrics!r}")
        refuse_engine_side_flags(correction, "NeMo RL's loss function")
        if correction.rollout_sampling_replay:
            raise ValueError("rollout_sampling_replay=True: NeMo RL's generation hands the loss no per-token kept "
                             "sets (vLLM's sampling masks), so there is nothing to replay; leave it off here")
        if correction.fp32_lm_head:
            raise ValueError(f"rollout_correction.{NEMO_RL_FP32_HEAD_REFUSAL}")
        keys = as_dict(nemo_config)
        if set(keys) & {BLOCK_KEY, GUARD_KEY}:
            raise ValueError(f"nemo_config carries loss_fn.{BLOCK_KEY}: build from the whole block with "
                             "RolloutParityLossFn.from_nemo_config(loss_fn)")
        if correction.rollout_importance_sampling_mode is not None:
            if keys.get("truncated_importance_sampling_type") is not None:
                raise ValueError(
                    "correction enabled twice: rollout_correction.rollout_importance_sampling_mode="
                    f"{correction.rollout_importance_sampling_mode!r} and NeMo RL's "
                    f"truncated_importance_sampling_type={keys['truncated_importance_sampling_type']!r}; "
                    "keep one (correction_from_nemo_rl gives NeMo RL's types in shared flags)")
            if keys.get("use_importance_sampling_correction"):
                logger.info("rollout-parity: NeMo RL's loss_fn.use_importance_sampling_correction: true -> "
                            "false inside RolloutParityLossFn (rollout_correction's IS weight is the one applied)")
                keys["use_importance_sampling_correction"] = False
        self.correction = correction
        self.metrics_mode = metrics
        self.nemo_loss_fn = names.ClippedPGLossFn(names.ClippedPGLossConfig(**keys), *nemo_args, **nemo_kwargs)
        self.last_correction = None  # weights/mask of the last microbatch, for inspection
        inner = self.nemo_loss_fn
        #: what decides which of our diagnostics NeMo RL's loss logs itself (core/metric_names.py): left out of ours
        self.nemo_settings = NemoRLLoss(
            kl_type=getattr(inner, "reference_policy_kl_type", "k3"),
            own_truncation=getattr(inner, "truncated_importance_sampling_ratio", None) is not None,
            sequence_level=bool(getattr(inner, "sequence_level_importance_ratios", False)))
        #: NeMo RL's out-of-bounds share (diagnostics.OUT_OF_BOUNDS) from our bounds, with an IS mode of ours:
        #: True counts sequences, False tokens, None: not logged
        self.oob_per_sequence = None if correction.rollout_importance_sampling_mode is None else \
            diagnostics.oob_per_sequence(correction, self.nemo_settings.sequence_level)
        if hasattr(inner, "metric_normalizations") and names.MetricNormalizer is not None and correction.wants_metrics:
            # Only what the call returns: with the flags null the table is NeMo RL's own, object and all.
            ours = diagnostics.normalizations(names.MetricNormalizer, metrics == "local")
            if metrics == "nemo":
                ours = nemo_rl_names(ours, correction, self.nemo_settings)
            if self.oob_per_sequence is not None:
                norm = names.MetricNormalizer
                ours[diagnostics.OUT_OF_BOUNDS] = norm.SEQUENCES if self.oob_per_sequence else norm.TOKENS
            self.metric_normalizations = {**inner.metric_normalizations, **ours}

    @classmethod
    def from_nemo_config(cls, loss_cfg: Any, *nemo_args: Any, metrics: str = "nemo",
                         **nemo_kwargs: Any) -> "RolloutParityLossFn":
        """Build from NeMo RL's ``loss_fn`` block (dict, OmegaConf or ``ClippedPGLossConfig``):
        the shared flags from ``rollout_correction``, everything else for NeMo RL's loss."""
        correction, nemo = split_loss_config(loss_cfg)
        return cls(correction, nemo, *nemo_args, metrics=metrics, **nemo_kwargs)

    @classmethod
    def from_nemo_is_config(cls, loss_cfg: Any, *nemo_args: Any, metrics: str = "nemo",
                            **nemo_kwargs: Any) -> "RolloutParityLossFn":
        """NeMo RL's own ``loss_fn`` (no ``rollout_correction``) with its importance-sampling keys carried out by
        our correction: NeMo RL's own constructor checks the block first (its assertions, its messages), then
        ``correction_from_nemo_rl`` gives the shared flags and NeMo RL's truncation keys leave its loss (its
        ``use_importance_sampling_correction`` is then turned off inside, as for any IS mode of ours)."""
        keys = as_dict(loss_cfg)
        if set(keys) & {BLOCK_KEY, GUARD_KEY}:
            raise ValueError(f"loss_fn carries {BLOCK_KEY}: use RolloutParityLossFn.from_nemo_config")
        names = nemo_loss_names()
        names.ClippedPGLossFn(names.ClippedPGLossConfig(**keys), *nemo_args, **nemo_kwargs)  # NeMo RL's own checks
        correction = correction_from_nemo_rl(keys)
        if correction.rollout_importance_sampling_mode is not None:
            for key in NEMO_TRUNCATION_KEYS:
                keys.pop(key, None)
        return cls(correction, keys, *nemo_args, metrics=metrics, **nemo_kwargs)

    # --------------------------------------------------------------- NeMo RL reads these

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this object lacks: NeMo RL's attributes of its loss.
        if name.startswith("__") or "nemo_loss_fn" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["nemo_loss_fn"], name)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "last_correction": None}  # workers get the flags, not a batch

    def __repr__(self) -> str:
        return (f"RolloutParityLossFn({self.correction.to_dict()}, wrapping "
                f"{type(self.nemo_loss_fn).__module__}.{type(self.nemo_loss_fn).__qualname__})")

    # --------------------------------------------------------------- the call

    def __call__(self, next_token_logprobs: torch.Tensor, data: Any, global_valid_seqs: Any,
                 global_valid_toks: Any, **kwargs: Any) -> tuple[torch.Tensor, dict]:
        inner = self.nemo_loss_fn
        cfg = self.correction
        cur, prev, gen, mask, sample_mask, advantages = self._read(next_token_logprobs, data)
        valid = mask > 0
        want = cfg.wants_metrics
        out = compute_correction(cfg, old_logprobs=prev, rollout_logprobs=gen, response_mask=mask,
                                 advantages=advantages, current_logprobs=cur.detach(), with_metrics=want,
                                 defer_metrics=True)  # read back below with the rest, in one transfer
        self.last_correction = out
        # What NeMo RL's loss sees: the data as NeMo RL would, except
        # * π_old (the core's; bypass: the rollout's) is π_θ where it is not finite (a PPO ratio
        #   of 1, where NeMo RL's own loss turns NaN), and
        # * an engine logprob that is not finite is +inf: NeMo RL's loss collapses any of them to
        #   an IS weight of 0 (nan_to_num), and +inf gives it those very values without the NaN
        #   gradient a −inf leaves in its on-policy KL approximation (measured; docs/nemo_rl.md);
        # * padding is 0 everywhere, also in π_θ (NaN there would poison its sums).
        padding = ~valid
        old = out.old_logprobs
        seen_old = torch.where(torch.isfinite(old), old, cur.detach()).masked_fill(padding, 0.0)
        bad_gen = valid & ~torch.isfinite(gen)
        seen_gen = gen.masked_fill(bad_gen, float("inf")).masked_fill(padding, 0.0)
        view = copy.copy(data)
        view["prev_logprobs"] = _tail(data.get("prev_logprobs", data["generation_logprobs"]), seen_old)
        view["generation_logprobs"] = _tail(data["generation_logprobs"], seen_gen)
        if cfg.rollout_rejection is not None or cfg.off_policy_sequence_mask_delta is not None:
            removed = valid & ~(out.mask > 0)  # rejection and off-policy masking: out of NeMo RL's loss mask
            view["token_mask"] = _tail(data["token_mask"], data["token_mask"][:, 1:].masked_fill(removed, 0))
        if cfg.rollout_importance_sampling_mode is not None:  # our weight multiplies the token's loss
            view["advantages"] = _tail(data["advantages"], advantages * out.weights)
        cur_in = next_token_logprobs.masked_fill(padding, 0.0)
        call = dict(global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks, **kwargs)
        loss, metrics = inner(next_token_logprobs=cur_in, data=view, **call)
        oob = None if self.oob_per_sequence is None else \
            diagnostics.out_of_bounds(cfg, out, mask, sample_mask, self.oob_per_sequence)
        got, ours = self._read_back(loss, bad_gen, out, mask, sample_mask, global_valid_toks, global_valid_seqs, oob)
        if got["bad_gen"]:
            # NeMo RL's metrics of such a batch are NaN or inf. Ours come from the same loss on the
            # batch where the engine agreed with π_old on those tokens (a difference on purpose;
            # the tokens are counted in rollout_correction/nonfinite_frac).
            agreed = copy.copy(view)
            agreed["generation_logprobs"] = _tail(data["generation_logprobs"], torch.where(bad_gen, seen_old, seen_gen))
            with torch.no_grad():
                _, metrics = inner(next_token_logprobs=cur_in.detach(), data=agreed, **call)
            metrics = {**metrics, "loss": got["loss"]}
        if oob is not None:  # NeMo RL's name and normalisation for the share our bounds moved
            total = got["gvs"] if self.oob_per_sequence else got["gvt"]
            metrics = {**metrics, diagnostics.OUT_OF_BOUNDS: got["oob"] / total if total > 0 else 0.0}
        if not want:
            return loss, metrics
        if self.metrics_mode == "local":
            return loss, {**metrics, **ours}
        ours = diagnostics.global_shares(ours, got)
        return loss, {**metrics, **nemo_rl_names(ours, cfg, self.nemo_settings)}

    def _read_back(self, loss, bad_gen, out, mask, sample_mask, gvt, gvs, oob=None) -> tuple[dict[str, float], dict]:
        """Everything the hand-over needs on the host, in one transfer: whether an engine logprob is not
        finite, the loss, the counts :func:`diagnostics.global_shares` scales by, and the core's pending
        diagnostics (named)."""
        with torch.no_grad():
            parts = {"bad_gen": bad_gen.any(), "loss": loss.detach()}
            if oob is not None:
                parts["oob"] = oob
            if self.correction.wants_metrics or oob is not None:
                parts.update(diagnostics.counts(out, mask, sample_mask))
                for name, value in (("gvt", gvt), ("gvs", gvs)):
                    parts[name] = value.detach() if torch.is_tensor(value) else torch.tensor(float(value))
        return read_back(parts, out)  # the one host sync of the hand-over (on bad_gen's device, the loss's)

    def _read(self, next_token_logprobs: torch.Tensor, data: Any):
        """The ``(B, T)`` tensors of NeMo RL's ``ClippedPGLossDataDict``, read as ``[:, 1:]``."""
        force_on_policy = bool(getattr(self.nemo_loss_fn, "force_on_policy_ratio", False))
        required = _DATA if force_on_policy else _DATA + ("prev_logprobs",)
        missing = [k for k in required if k not in data]
        if missing:
            raise KeyError(f"data is missing ClippedPGLossDataDict key(s) {missing}")
        cur = next_token_logprobs
        if cur.dim() != 2:
            raise ValueError(f"next_token_logprobs must be (B, S-1), got shape {tuple(cur.shape)}")
        B, S1 = cur.shape
        for key in required:
            if key != "sample_mask" and tuple(data[key].shape) != (B, S1 + 1):
                raise ValueError(
                    f"data[{key!r}] has shape {tuple(data[key].shape)} but next_token_logprobs has "
                    f"{tuple(cur.shape)}: data tensors are (B, S) and are read as [:, 1:]")
        sample_mask = data["sample_mask"]
        if tuple(sample_mask.shape) != (B,):
            raise ValueError(f"data['sample_mask'] must be (B,) = ({B},), got {tuple(sample_mask.shape)}")
        dtype = torch.promote_types(cur.dtype, torch.float32)
        sample_mask = sample_mask.to(dtype)
        mask = data["token_mask"][:, 1:].to(dtype) * sample_mask.unsqueeze(-1)
        cur = cur.detach().to(dtype)
        # force_on_policy_ratio: NeMo RL's π_old is π_θ itself, for its ratio and its IS weight.
        prev = cur if force_on_policy else data["prev_logprobs"][:, 1:].to(dtype)
        gen = data["generation_logprobs"][:, 1:].to(dtype)
        return cur, prev, gen, mask, sample_mask, data["advantages"][:, 1:].to(dtype)


def _tail(full: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """``full`` with ``[:, 1:]`` replaced by ``tail`` (column 0, the first prompt token, kept)."""
    return torch.cat([full[:, :1], tail.to(full.dtype)], dim=1)

