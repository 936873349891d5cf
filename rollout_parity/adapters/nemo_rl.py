"""NeMo RL adapter: the shared correction flags inside NeMo RL's policy loss.

Interface matched: NVIDIA-NeMo/RL v0.7.0, commit 81aa43dda4765b0429cf31dab44441e4e4383911
(``nemo_rl/algorithms/loss/interfaces.py``, ``nemo_rl/algorithms/loss/loss_functions.py``,
``nemo_rl/algorithms/loss/wrapper.py``, ``nemo_rl/algorithms/grpo.py``,
``nemo_rl/models/generation/vllm/vllm_worker.py``). NeMo RL does not install on this machine;
the tests drive this module through a test double of that interface
(``integration_tests/support/nemo_rl_double``).

``RolloutParityLossFn`` satisfies NeMo RL's ``LossFunction`` protocol:

* ``loss_type`` (``LossType.TOKEN_LEVEL`` or ``SEQUENCE_LEVEL``) and
  ``input_type = LossInputType.LOGPROB``, NeMo RL's own enums (the workers compare them);
* ``__call__(next_token_logprobs, data, global_valid_seqs, global_valid_toks)`` with the
  ``ClippedPGLossDataDict`` keys: every ``data`` tensor is ``(B, S)`` and is aligned to
  ``next_token_logprobs`` ``(B, S-1)`` by ``[:, 1:]``; the mask is
  ``token_mask[:, 1:] * sample_mask[:, None]``; the loss is normalised by the *global* valid
  token count (token level) or sequence count (sequence level), so per-microbatch losses add
  up to the global-batch loss.

The math is the core's only: ``compute_correction`` (old = ``prev_logprobs``, rollout =
``generation_logprobs``) and ``policy_loss`` with ``global_num_tokens`` /
``global_num_seqs``; the clip range comes from ``ratio_clip_min``/``ratio_clip_max``/
``ratio_clip_c``.

NeMo RL's own truncated-IS keys map onto the shared flags (``correction_from_nemo_rl``):

=====================  ==========================================================
NeMo RL                shared flags
=====================  ==========================================================
IS on, type null       ``token_truncate`` at e^20 (the log-ratio clamp): w = r
``tis``                ``token_truncate``, C = ratio, lower = ratio_min
``icepop``             ``token_mask``, [ratio_min, ratio]
``seq-mask-tis``       ``sequence_mask``, ``geometric_mean``, weight ``token``,
                       [ratio_min, ratio]
=====================  ==========================================================

The same numbers as NeMo RL's formulas for finite logprobs. Non-finite engine logprobs differ
by design: NeMo RL zeroes the weight (``nan_to_num``), the core neutralises NaN to weight 1
and counts it (DESIGN.md, "Bad input").
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

from rollout_parity.core.config import CorrectionConfig
from rollout_parity.core.correction import compute_correction
from rollout_parity.core.loss import policy_loss
from rollout_parity.core.ratios import LOG_RATIO_BOUND

__all__ = [
    "NEMO_RL_VERSION",
    "NEMO_RL_COMMIT",
    "RolloutParityLossFn",
    "correction_from_nemo_rl",
    "nemo_rl_generation_config",
    "check_nemo_rl_vllm_kwargs",
]

NEMO_RL_VERSION = "0.7.0"
NEMO_RL_COMMIT = "81aa43dda4765b0429cf31dab44441e4e4383911"

NEMO_IS_TYPES = ("tis", "icepop", "seq-mask-tis")
_NEMO_IS_KEYS = ("use_importance_sampling_correction", "truncated_importance_sampling_type",
                 "truncated_importance_sampling_ratio", "truncated_importance_sampling_ratio_min")
# Features of ClippedPGLossFn this loss does not reproduce: refused unless at their off value.
_UNSUPPORTED = {
    "disable_ppo_ratio": False,
    "sequence_level_importance_ratios": False,
    "force_on_policy_ratio": False,
    "use_cispo": False,
    "positive_example_nll_weight": 0.0,
    "use_on_policy_kl_approximation": False,
}
_KNOWN_NEMO_KEYS = set(_NEMO_IS_KEYS) | set(_UNSUPPORTED) | {
    "token_level_loss", "ratio_clip_min", "ratio_clip_max", "ratio_clip_c",
    "reference_policy_kl_penalty", "reference_policy_kl_type", "kl_input_clamp_value",
    "kl_output_clamp_value", "use_kl_in_reward",
}
# What NeMo RL v0.7's vllm_worker.py passes to vllm.LLM itself: the same key in vllm_kwargs
# is a duplicate keyword (TypeError), so the recipe routes these elsewhere.
NEMO_RL_FIXED_LLM_KWARGS = (
    "model", "served_model_name", "load_format", "skip_tokenizer_init", "tensor_parallel_size",
    "pipeline_parallel_size", "enable_expert_parallel", "gpu_memory_utilization",
    "enable_prefix_caching", "dtype", "seed", "enforce_eager", "max_model_len",
    "trust_remote_code", "worker_extension_cls", "enable_sleep_mode", "disable_log_stats",
    "logprobs_mode",
)
_REQUIRED_DATA = ("token_mask", "sample_mask", "advantages", "prev_logprobs",
                  "generation_logprobs")

# Metrics that are means over sequences (weighted by the sequence share when summed over
# microbatches) and extrema (not additive: dropped in "nemo" metrics mode).
_SEQ_METRICS = {"chi2_seq", "rejected_seq_frac", "off_policy_masked_frac", "training_ppl",
                "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
                "log_ppl_abs_diff", "ppl_ratio"}
_EXTREMA = {"log_ppl_diff_max", "log_ppl_diff_min", "delta_abs_max"}


def _nemo_interfaces():
    try:
        from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType
    except ImportError as exc:  # pragma: no cover - message checked in tests
        raise ImportError(
            "rollout_parity.adapters.nemo_rl needs NeMo RL >= 0.6 "
            "(nemo_rl.algorithms.loss.interfaces): install NeMo RL, and "
            "pip install rollout-parity[nemo-rl]") from exc
    return LossType, LossInputType


def _as_dict(cfg: Any) -> dict:
    if cfg is None:
        return {}
    if hasattr(cfg, "model_dump"):  # pydantic (NeMo RL's ClippedPGLossConfig)
        return dict(cfg.model_dump())
    if hasattr(cfg, "_metadata") and hasattr(cfg, "_content"):  # OmegaConf node
        from omegaconf import OmegaConf

        return dict(OmegaConf.to_container(cfg, resolve=True))
    return dict(cfg)


def correction_from_nemo_rl(loss_cfg: Any) -> CorrectionConfig:
    """The shared flags that reproduce NeMo RL's own importance-sampling settings.

    Reads ``use_importance_sampling_correction``, ``truncated_importance_sampling_type``
    (``tis`` | ``icepop`` | ``seq-mask-tis``), ``truncated_importance_sampling_ratio`` and
    ``truncated_importance_sampling_ratio_min`` from a ``loss_fn`` block (dict, OmegaConf or
    NeMo RL's pydantic ``ClippedPGLossConfig``). Invalid combinations raise ``ValueError``
    naming the key, where NeMo RL would assert.
    """
    cfg = _as_dict(loss_cfg)
    enabled = bool(cfg.get("use_importance_sampling_correction", False))
    kind = cfg.get("truncated_importance_sampling_type")
    ratio = cfg.get("truncated_importance_sampling_ratio")
    ratio_min = cfg.get("truncated_importance_sampling_ratio_min")
    if kind is None:
        if not enabled:
            return CorrectionConfig()
        # Plain IS: w = r. The core clamps log r to ±LOG_RATIO_BOUND, so C = e^bound never cuts.
        return CorrectionConfig(rollout_importance_sampling_mode="token_truncate",
                                rollout_importance_sampling_threshold=math.exp(LOG_RATIO_BOUND))
    if kind not in NEMO_IS_TYPES:
        raise ValueError(f"truncated_importance_sampling_type: unknown value {kind!r}; "
                         f"expected one of {NEMO_IS_TYPES}")
    if not enabled:
        raise ValueError("truncated_importance_sampling_type is set but "
                         "use_importance_sampling_correction is false (NeMo RL refuses this too)")
    if ratio is None or not ratio > 0:
        raise ValueError(f"truncated_importance_sampling_ratio must be > 0, got {ratio!r}")
    if kind in ("icepop", "seq-mask-tis") and ratio_min is None:
        raise ValueError(f"truncated_importance_sampling_ratio_min is required for {kind!r}")
    if ratio_min is not None and not ratio_min < ratio:
        raise ValueError(
            f"truncated_importance_sampling_ratio_min ({ratio_min}) must be < "
            f"truncated_importance_sampling_ratio ({ratio}) (an empty or single-point range)")
    if kind == "tis":
        # NeMo RL's default lower bound 0 never binds (r > 0): same as no lower bound.
        lower = None if not ratio_min else ratio_min
        return CorrectionConfig(rollout_importance_sampling_mode="token_truncate",
                                rollout_importance_sampling_threshold=ratio,
                                rollout_importance_sampling_threshold_lower=lower)
    if kind == "icepop":
        return CorrectionConfig(rollout_importance_sampling_mode="token_mask",
                                rollout_importance_sampling_threshold=ratio,
                                rollout_importance_sampling_threshold_lower=ratio_min)
    return CorrectionConfig(rollout_importance_sampling_mode="sequence_mask",
                            rollout_importance_sampling_threshold=ratio,
                            rollout_importance_sampling_threshold_lower=ratio_min,
                            rollout_importance_sampling_sequence_reduction="geometric_mean",
                            rollout_importance_sampling_sequence_mask_weight="token")


class RolloutParityLossFn:
    """A NeMo RL ``LossFunction`` (v0.7) computing the clipped policy loss with the shared
    correction. Build it from a ``loss_fn`` config block with ``from_nemo_config``, or
    directly::

        loss_fn = RolloutParityLossFn(CorrectionConfig.preset("tis_srs_k3"),
                                      ratio_clip_min=0.2, ratio_clip_max=0.28)
        grpo_train(..., loss_fn=loss_fn, ...)

    ``metrics="nemo"`` (default) returns every metric pre-divided for NeMo RL's aggregation,
    which *sums* a metric over microbatches and data-parallel ranks: a token mean is returned
    times (this microbatch's valid tokens / global valid tokens), a sequence mean times the
    sequence share, so the sum is the global-batch value (exact for the correction's token
    means; a share-weighted average for the non-linear ``ess``/``ppl`` ones and, under
    rejection, for the ``policy/*`` means over kept tokens); extrema are not additive and are
    left out. ``metrics="local"`` returns the core's metrics of this microbatch unchanged.
    Besides ``policy/*`` and ``rollout_correction/*`` it returns the keys NeMo RL's GRPO
    loop reads: ``loss``, ``token_mult_prob_error`` (``grpo_train`` indexes it) and
    ``num_valid_samples``.
    """

    def __init__(self, correction: CorrectionConfig | Mapping | None = None, *,
                 ratio_clip_min: float = 0.2, ratio_clip_max: float = 0.2,
                 ratio_clip_c: Optional[float] = None, token_level_loss: bool = True,
                 metrics: str = "nemo") -> None:
        LossType, LossInputType = _nemo_interfaces()
        if correction is None or isinstance(correction, Mapping):
            correction = CorrectionConfig.from_dict(correction)
        if not isinstance(correction, CorrectionConfig):
            raise TypeError(f"correction must be a CorrectionConfig or a mapping of the shared "
                            f"flags, got {type(correction).__name__}")
        if metrics not in ("nemo", "local"):
            raise ValueError(f"metrics: expected 'nemo' or 'local', got {metrics!r}")
        if ratio_clip_c is not None and not ratio_clip_c > 1:
            raise ValueError(f"ratio_clip_c must be > 1 (dual clip), got {ratio_clip_c}")
        self.correction = correction
        self.ratio_clip_min = float(ratio_clip_min)
        self.ratio_clip_max = float(ratio_clip_max)
        self.ratio_clip_c = ratio_clip_c
        self.metrics_mode = metrics
        self.loss_type = LossType.TOKEN_LEVEL if token_level_loss else LossType.SEQUENCE_LEVEL
        self.input_type = LossInputType.LOGPROB
        self._token_level = bool(token_level_loss)
        self.last_correction = None

    @classmethod
    def from_nemo_config(cls, loss_cfg: Any, *, metrics: str = "nemo") -> "RolloutParityLossFn":
        """Build from NeMo RL's ``loss_fn`` block (dict, OmegaConf or ``ClippedPGLossConfig``).

        The shared flags come from its ``rollout_correction`` sub-block
        (``configs/nemo_rl_loss.yaml``) or, without one, from NeMo RL's own truncated-IS keys
        (``correction_from_nemo_rl``). Both at once is the correction enabled twice: an
        error. Features of ``ClippedPGLossFn`` this loss does not reproduce (a KL-to-reference
        term, CISPO, GSPO ratios, ...) must be off.
        """
        cfg = _as_dict(loss_cfg)
        ours = cfg.pop("rollout_correction", None)
        unknown = sorted(set(cfg) - _KNOWN_NEMO_KEYS)
        if unknown:
            raise ValueError(f"loss_fn: unknown key(s) {unknown} (rollout-parity matches NeMo RL "
                             f"{NEMO_RL_VERSION}; put the shared flags under loss_fn.rollout_correction)")
        for key, off in _UNSUPPORTED.items():
            if cfg.get(key, off) != off:
                raise ValueError(f"loss_fn.{key}={cfg[key]!r} is not supported by "
                                 f"RolloutParityLossFn; set it to {off!r} or use NeMo RL's "
                                 "ClippedPGLossFn")
        kl = cfg.get("reference_policy_kl_penalty", 0.0) or 0.0
        if kl != 0 and not cfg.get("use_kl_in_reward", False):
            raise ValueError(
                f"loss_fn.reference_policy_kl_penalty={kl}: RolloutParityLossFn has no "
                "KL-to-reference term; set it to 0 (or use_kl_in_reward: true)")
        nemo_is_on = bool(cfg.get("use_importance_sampling_correction")) or \
            cfg.get("truncated_importance_sampling_type") is not None
        if ours is not None:
            if nemo_is_on:
                raise ValueError(
                    "correction enabled twice: loss_fn.rollout_correction and NeMo RL's own "
                    "use_importance_sampling_correction/truncated_importance_sampling_type; "
                    "keep one (NeMo RL's keys are translated when rollout_correction is absent)")
            correction = CorrectionConfig.from_dict(ours)
        else:
            correction = correction_from_nemo_rl(cfg)
        return cls(correction,
                   ratio_clip_min=cfg.get("ratio_clip_min", 0.2),
                   ratio_clip_max=cfg.get("ratio_clip_max", 0.2),
                   ratio_clip_c=cfg.get("ratio_clip_c"),
                   token_level_loss=cfg.get("token_level_loss", True),
                   metrics=metrics)

    def __call__(self, next_token_logprobs: torch.Tensor, data: Mapping[str, Any],
                 global_valid_seqs: Any, global_valid_toks: Any) -> tuple[torch.Tensor, dict]:
        missing = [k for k in _REQUIRED_DATA if k not in data]
        if missing:
            raise KeyError(f"data is missing ClippedPGLossDataDict key(s) {missing}")
        cur = next_token_logprobs
        if cur.dim() != 2:
            raise ValueError(f"next_token_logprobs must be (B, S-1), got shape {tuple(cur.shape)}")
        B, S1 = cur.shape
        for key in ("token_mask", "prev_logprobs", "generation_logprobs"):
            if tuple(data[key].shape) != (B, S1 + 1):
                raise ValueError(
                    f"data[{key!r}] has shape {tuple(data[key].shape)} but next_token_logprobs has "
                    f"{tuple(cur.shape)}: data tensors are (B, S) and are read as [:, 1:]")
        sample_mask = data["sample_mask"]
        if tuple(sample_mask.shape) != (B,):
            raise ValueError(f"data['sample_mask'] must be (B,) = ({B},), got {tuple(sample_mask.shape)}")
        advantages = data["advantages"]
        if advantages.dim() == 2:
            if tuple(advantages.shape) != (B, S1 + 1):
                raise ValueError(f"data['advantages'] has shape {tuple(advantages.shape)}; "
                                 f"expected (B, S) = {(B, S1 + 1)}")
            advantages = advantages[:, 1:]
        elif tuple(advantages.shape) != (B,):
            raise ValueError(f"data['advantages'] must be (B, S) or (B,), got {tuple(advantages.shape)}")

        dtype = torch.promote_types(cur.dtype, torch.float32)
        mask = data["token_mask"][:, 1:].to(dtype) * sample_mask.to(dtype).unsqueeze(-1)
        prev = data["prev_logprobs"][:, 1:].to(dtype)
        gen = data["generation_logprobs"][:, 1:].to(dtype)
        cfg = self.correction
        out = compute_correction(cfg, old_logprobs=prev, rollout_logprobs=gen, response_mask=mask,
                                 advantages=advantages, current_logprobs=cur,
                                 with_metrics=True)
        self.last_correction = out  # weights/mask of the last microbatch, for inspection
        gvt, gvs = float(global_valid_toks), float(global_valid_seqs)
        loss, metrics = policy_loss(
            cfg, current_logprobs=cur, advantages=advantages, correction=out, response_mask=mask,
            clip_ratio_low=self.ratio_clip_min, clip_ratio_high=self.ratio_clip_max,
            clip_ratio_c=self.ratio_clip_c,
            loss_agg_mode="token-mean" if self._token_level else "seq-mean-token-mean",
            global_num_tokens=gvt if self._token_level else None,
            global_num_seqs=None if self._token_level else gvs,
        )
        with torch.no_grad():
            # NeMo RL's token_mult_prob_error: mean_t exp(|gen − prev|) over valid tokens.
            diff = torch.nan_to_num((gen - prev).abs(), nan=0.0, posinf=0.0, neginf=0.0)
            mult = float((torch.exp(diff * mask) * mask).sum())
        local_toks, local_seqs = float(mask.sum()), float(sample_mask.sum())
        extra = {"loss": float(loss.detach()), "num_valid_samples": local_seqs}
        if self.metrics_mode == "local":
            extra["token_mult_prob_error"] = mult / max(local_toks, 1.0)
            return loss, {**metrics, **extra}
        tok_share = local_toks / gvt if gvt > 0 else 0.0
        seq_share = local_seqs / gvs if gvs > 0 else 0.0
        scaled = {}
        for name, value in metrics.items():
            short = name.rsplit("/", 1)[-1]
            if short in _EXTREMA:
                continue
            scaled[name] = value * (seq_share if short in _SEQ_METRICS else tok_share)
        extra["token_mult_prob_error"] = mult / gvt if gvt > 0 else 0.0
        return loss, {**scaled, **extra}


def nemo_rl_generation_config(fp32_lm_head: bool = False, prefix_cache_policy: str = "off",
                              **vllm_kwargs: Any) -> dict:
    """The vLLM parity recipe placed where NeMo RL v0.7 reads it.

    Returns ``{"policy": {"generation": {"vllm_cfg": {...}, "vllm_kwargs": {...}},
    "hf_config_overrides": {...}}}`` to merge into a NeMo RL config. NeMo RL's
    ``vllm_worker.py`` already passes ``logprobs_mode="processed_logprobs"`` and
    ``enable_prefix_caching=<vllm_cfg.enable_prefix_caching>`` to ``vllm.LLM`` itself, so the
    same keys inside ``vllm_kwargs`` would be duplicate keywords (a TypeError at engine start):
    prefix caching goes to ``vllm_cfg``, ``logprobs_mode`` is checked and left to NeMo RL, and
    ``hf_overrides`` go to ``policy.hf_config_overrides`` (``grpo.py`` overwrites
    ``vllm_kwargs["hf_overrides"]`` with it). Everything else (``async_scheduling``) is
    ``policy.generation.vllm_kwargs``.
    """
    try:
        from rollout_parity.core.vllm_recipe import vllm_parity_kwargs
    except ImportError:  # pragma: no cover - the recipe module ships with the package
        vllm_parity_kwargs = None
    if vllm_parity_kwargs is not None:
        recipe = vllm_parity_kwargs(fp32_lm_head=fp32_lm_head,
                                    prefix_cache_policy=prefix_cache_policy, **vllm_kwargs)
    else:  # pragma: no cover
        recipe = dict(logprobs_mode="processed_logprobs",
                      enable_prefix_caching=prefix_cache_policy != "off",
                      async_scheduling=False, **vllm_kwargs)
        if fp32_lm_head:
            recipe["hf_overrides"] = {"head_dtype": "float32"}
    recipe = dict(recipe)
    logprobs_mode = recipe.pop("logprobs_mode", "processed_logprobs")
    if logprobs_mode != "processed_logprobs":
        raise ValueError(f"logprobs_mode={logprobs_mode!r}: NeMo RL {NEMO_RL_VERSION} always "
                         "uses processed_logprobs")
    vllm_cfg = {"enable_prefix_caching": bool(recipe.pop("enable_prefix_caching"))}
    hf_overrides = dict(recipe.pop("hf_overrides", None) or {})
    check_nemo_rl_vllm_kwargs(recipe)
    policy: dict[str, Any] = {"generation": {"vllm_cfg": vllm_cfg, "vllm_kwargs": recipe}}
    if hf_overrides:
        policy["hf_config_overrides"] = hf_overrides
    return {"policy": policy}


def check_nemo_rl_vllm_kwargs(vllm_kwargs: Mapping[str, Any]) -> None:
    """Refuse ``policy.generation.vllm_kwargs`` keys NeMo RL v0.7 already passes to vLLM."""
    clash = sorted(set(vllm_kwargs) & set(NEMO_RL_FIXED_LLM_KWARGS))
    if clash:
        raise ValueError(
            f"policy.generation.vllm_kwargs has {clash}, which NeMo RL {NEMO_RL_VERSION} passes to "
            "vllm.LLM itself (a duplicate keyword at engine start); set enable_prefix_caching "
            "in policy.generation.vllm_cfg, and leave logprobs_mode to NeMo RL")
