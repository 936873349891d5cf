"""NeMo RL adapter: the shared correction flags inside NeMo RL's policy loss.

Run for real against NeMo RL's own source at v0.7.0 (NVIDIA-NeMo/RL 81aa43dd) and at main
7ea279ab ("head", which reports version 0.6.0): ``integration_tests/test_nemo_rl_*.py`` import
its ``ClippedPGLossFn``, ``BatchedDataDict``, ``LossType``/``LossInputType``/
``MetricNormalizer`` and its vLLM worker from ``../shared/anchors/nemo-rl`` and run this loss
beside NeMo RL's own. Interfaces read: ``nemo_rl/algorithms/loss/{interfaces,loss_functions}.py``,
``nemo_rl/models/policy/workers/dtensor_policy_worker_v2.py`` and ``models/automodel/train.py``
(global counts, microbatches, metric scaling), ``nemo_rl/algorithms/grpo.py`` (metric
aggregation and the keys it reads), ``models/policy/workers/megatron_policy_worker.py`` at head
(``metric_normalizations``), ``models/generation/vllm/vllm_worker.py`` (engine kwargs).

``RolloutParityLossFn`` is a NeMo RL ``LossFunction``:

* ``loss_type`` (NeMo RL's ``LossType.TOKEN_LEVEL`` or ``SEQUENCE_LEVEL``) and
  ``input_type = LossInputType.LOGPROB``; at NeMo RL versions that define ``MetricNormalizer``
  (head), ``metric_normalizations`` names the global denominator of every metric it returns, so
  Megatron's split step (placeholder global counts, rescaled after) logs the same values.
* ``__call__(next_token_logprobs, data, global_valid_seqs, global_valid_toks)`` over the
  ``ClippedPGLossDataDict`` keys: every ``data`` tensor is ``(B, S)``, read as ``[:, 1:]``
  against ``next_token_logprobs`` ``(B, S-1)``; the mask is ``token_mask * sample_mask``; the
  loss is normalised by the *global* valid token (or sequence) count, so NeMo RL's sum over
  microbatches and data-parallel ranks is the global-batch loss.

The math is the core's: ``compute_correction`` (π_old = ``prev_logprobs``, π_rollout =
``generation_logprobs``) and ``policy_loss`` with ``global_num_tokens``/``global_num_seqs``.

NeMo RL's own importance-sampling keys map onto the shared flags (``correction_from_nemo_rl``):

=====================  ==========================================================
NeMo RL                shared flags
=====================  ==========================================================
IS on, type null       ``token_truncate`` at e^20 (the log-ratio clamp): w = r
``tis``                ``token_truncate``, C = ratio, lower = ratio_min
``icepop``             ``token_mask``, [ratio_min, ratio]
``seq-mask-tis``       ``sequence_mask``, ``geometric_mean``, weight ``token``,
                       [ratio_min, ratio]
=====================  ==========================================================

Non-finite logprobs (a valid token whose ``prev_logprobs`` or ``generation_logprobs`` is NaN
or ±inf) are counted in ``rollout_correction/nonfinite_frac`` and never give a large weight:

* built from NeMo RL's keys, the token gets NeMo RL's own weight (``nan_to_num`` to 0, then
  its truncation: ``tis`` clamps 0 up to ``ratio_min``; ``icepop``, ``seq-mask-tis`` and plain
  IS give 0) and counts as log-ratio 0 in ``seq-mask-tis``'s geometric mean, as in NeMo RL.
  Plain IS maps to a cap of e^20, so the shared rule (−inf is maximal mismatch, the cap) would
  give such a token a weight of ~5e8;
* built from the shared flags, the core's rule holds (NaN: weight 1; −inf: maximal mismatch,
  at most C), the same numbers as in verl and TRL;
* either way a non-finite π_old leaves the PPO ratio neutral (1, gradient ∇log π_θ), where
  NeMo RL's own loss would turn NaN; padding never matters (its values are replaced by 0).
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
    "NEMO_RL_TESTED",
    "NEMO_METRIC_KEYS",
    "RolloutParityLossFn",
    "correction_from_nemo_rl",
    "nemo_rl_generation_config",
    "check_nemo_rl_vllm_kwargs",
]

NEMO_RL_VERSION = "0.7.0"
NEMO_RL_COMMIT = "81aa43dda4765b0429cf31dab44441e4e4383911"
#: The NeMo RL sources this adapter was run against (tests import them from the anchors).
NEMO_RL_TESTED = {"v0.7.0": NEMO_RL_COMMIT, "main": "7ea279abfbeb698b092856d0dab61e7cf39bc909"}
# main's package_info still says 0.6.0, so the tested range starts there.
_TESTED_RANGE = ">=0.6,<0.8"
_REQUIRED_NAMES = ("nemo_rl.algorithms.loss.interfaces.LossType",
                   "nemo_rl.algorithms.loss.interfaces.LossInputType")

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
_KL_TYPES = ("k1", "k2", "k3")
_KNOWN_NEMO_KEYS = set(_NEMO_IS_KEYS) | set(_UNSUPPORTED) | {
    "token_level_loss", "ratio_clip_min", "ratio_clip_max", "ratio_clip_c",
    "reference_policy_kl_penalty", "reference_policy_kl_type", "kl_input_clamp_value",
    "kl_output_clamp_value", "use_kl_in_reward",
}
# What NeMo RL v0.7's vllm_worker.py passes to vllm.LLM itself: the same key in vllm_kwargs
# is a duplicate keyword (TypeError). Main passes the same minus logprobs_mode.
NEMO_RL_FIXED_LLM_KWARGS = (
    "model", "served_model_name", "load_format", "skip_tokenizer_init", "tensor_parallel_size",
    "pipeline_parallel_size", "enable_expert_parallel", "gpu_memory_utilization",
    "enable_prefix_caching", "dtype", "seed", "enforce_eager", "max_model_len",
    "trust_remote_code", "worker_extension_cls", "enable_sleep_mode", "disable_log_stats",
    "logprobs_mode",
)
_REQUIRED_DATA = ("token_mask", "sample_mask", "advantages", "prev_logprobs",
                  "generation_logprobs")

#: The metric keys NeMo RL's ClippedPGLossFn returns (is_oob_ratio only with a truncation
#: type). ``grpo_train`` reads ``loss``, ``gen_kl_error`` and ``token_mult_prob_error`` on
#: every step; it takes the min/max of the ``*_min``/``*_max`` ones and sums the rest.
NEMO_METRIC_KEYS = (
    "loss", "probs_ratio", "probs_ratio_clamped", "probs_ratio_min", "probs_ratio_max",
    "probs_ratio_clamped_min", "probs_ratio_clamped_max", "kl_penalty", "token_mult_prob_error",
    "gen_kl_error", "policy_kl_error", "js_divergence_error", "sampling_importance_ratio",
    "num_valid_samples", "approx_entropy", "positive_nll_loss",
)
_EXTREMA_KEYS = ("probs_ratio_min", "probs_ratio_max", "probs_ratio_clamped_min",
                 "probs_ratio_clamped_max")
_TOKEN_KEYS = ("probs_ratio", "probs_ratio_clamped", "token_mult_prob_error", "gen_kl_error",
               "policy_kl_error", "js_divergence_error", "approx_entropy",
               "sampling_importance_ratio")

# The core's rollout_correction/* diagnostics under "nemo" metrics, by their denominator
# (metrics.py): token means (over valid tokens), sequence means (over sequences with a valid
# token), perplexity means (over sequences with a finite token). Each is returned as this
# microbatch's sum over the global count NeMo RL passes in, so NeMo RL's sum over microbatches
# and ranks is exact. A sample without valid (finite) tokens counts as on-policy in the
# sequence means, whose denominator is NeMo RL's global_valid_seqs. Left out: the extrema,
# ess and the absolute perplexities (not sums, or no on-policy value for an empty sample).
_TOKEN_MEANS = ("kl", "k3_kl", "chi2_token", "is_weight_mean", "clipped_frac",
                "delta_abs_mean", "rejected_token_frac", "nonfinite_frac", "loss_contrib_pos",
                "loss_contrib_neg", "loss_contrib_rollout_pos", "loss_contrib_rollout_neg")
_SEQ_MEANS = ("chi2_seq", "rejected_seq_frac", "off_policy_masked_frac")
_PPL_MEANS = ("log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio")
_LEFT_OUT = ("ess", "delta_abs_max", "log_ppl_diff_max", "log_ppl_diff_min", "training_ppl",
             "training_log_ppl", "rollout_ppl", "rollout_log_ppl")
_POLICY_MEANS = ("policy/pg_clipfrac", "policy/ppo_kl", "policy/pg_clipfrac_lower")
_PREFIX = "rollout_correction/"


def _nemo_interfaces():
    """NeMo RL's loss enums, after the version and private-name check (STYLE.md rule 8)."""
    if not _nemo_rl_importable():
        raise ImportError(
            "rollout_parity.adapters.nemo_rl needs NeMo RL >= 0.6 "
            "(nemo_rl.algorithms.loss.interfaces): install NeMo RL, and "
            "pip install rollout-parity[nemo-rl]")
    from rollout_parity.adapters._compat import check_framework

    check_framework("NeMo RL", distributions=("nemo-rl", "nemo_rl"), tested=_TESTED_RANGE,
                    extra="nemo-rl", required=_REQUIRED_NAMES)
    from nemo_rl.algorithms.loss import interfaces

    return interfaces.LossType, interfaces.LossInputType, getattr(interfaces, "MetricNormalizer", None)


def _nemo_rl_importable() -> bool:
    import importlib.util
    import sys

    if "nemo_rl.algorithms.loss.interfaces" in sys.modules:
        return sys.modules["nemo_rl.algorithms.loss.interfaces"] is not None
    try:
        return importlib.util.find_spec("nemo_rl") is not None
    except (ImportError, ValueError):
        return False


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


def _nemo_nonfinite_weight(cfg: CorrectionConfig) -> float:
    """NeMo RL's weight for a token whose IS ratio is not finite: ``nan_to_num`` gives 0, which
    ``tis`` then clamps into [ratio_min, ratio] and the other types keep at 0."""
    if cfg.rollout_importance_sampling_mode == "token_truncate":
        return float(cfg.rollout_importance_sampling_threshold_lower or 0.0)
    return 0.0


class RolloutParityLossFn:
    """A NeMo RL ``LossFunction`` computing the clipped policy loss with the shared correction.

    Build it from a ``loss_fn`` config block with ``from_nemo_config``, or directly::

        loss_fn = RolloutParityLossFn(CorrectionConfig.preset("tis_srs_k3"),
                                      ratio_clip_min=0.2, ratio_clip_max=0.28)
        grpo_train(..., loss_fn=loss_fn, ...)

    Metrics (``metrics="nemo"``, the default) are pre-divided by NeMo RL's global counts, as
    NeMo RL's own loss does, because NeMo RL *sums* every metric over microbatches and
    data-parallel ranks (and takes min/max of ``*_min``/``*_max``): the sums are the global
    batch's values for any microbatching. They are

    * every key of NeMo RL's ``ClippedPGLossFn`` (``NEMO_METRIC_KEYS``; ``is_oob_ratio`` with
      NeMo RL's truncation keys) with NeMo RL's meaning: ``grpo_train`` reads ``loss``,
      ``gen_kl_error`` and ``token_mult_prob_error`` on every step. ``kl_penalty`` and
      ``positive_nll_loss`` are 0 (those terms are refused). Computed on finite values: a
      token with a non-finite logprob counts as if the engine had agreed with the trainer;
    * ``policy/*`` and the additive ``rollout_correction/*`` diagnostics (token means over the
      valid tokens, sequence means over NeMo RL's valid samples; see the module constants).

    ``metrics="local"`` returns the core's metrics of the microbatch unchanged (for
    inspection: NeMo RL's sums of them mean nothing).

    Args:
        correction: the shared flags (``CorrectionConfig`` or a mapping).
        ratio_clip_min, ratio_clip_max, ratio_clip_c: NeMo RL's clip keys (dual clip: c > 1).
        token_level_loss: NeMo RL's key: token-level (True) or sequence-level loss.
        reference_policy_kl_type: the KL estimator of ``gen_kl_error``/``policy_kl_error``.
        nonfinite: ``"shared"`` (the core's rule) or ``"nemo"`` (NeMo RL's weight for a token
            with a non-finite ratio); ``from_nemo_config`` picks ``"nemo"`` for NeMo RL's keys.
        nemo_truncation: the NeMo RL truncation type the flags came from (sets ``is_oob_ratio``).
    """

    def __init__(self, correction: CorrectionConfig | Mapping | None = None, *,
                 ratio_clip_min: float = 0.2, ratio_clip_max: float = 0.2,
                 ratio_clip_c: Optional[float] = None, token_level_loss: bool = True,
                 metrics: str = "nemo", reference_policy_kl_type: str = "k3",
                 nonfinite: str = "shared", nemo_truncation: Optional[str] = None) -> None:
        LossType, LossInputType, MetricNormalizer = _nemo_interfaces()
        if correction is None or isinstance(correction, Mapping):
            correction = CorrectionConfig.from_dict(correction)
        if not isinstance(correction, CorrectionConfig):
            raise TypeError(f"correction must be a CorrectionConfig or a mapping of the shared "
                            f"flags, got {type(correction).__name__}")
        if correction.rollout_sampling_replay:
            raise ValueError("rollout_sampling_replay=True: NeMo RL's generation hands the loss no per-token kept "
                             "sets (vLLM's sampling masks), so there is nothing to replay; leave it off here")
        if metrics not in ("nemo", "local"):
            raise ValueError(f"metrics: expected 'nemo' or 'local', got {metrics!r}")
        if ratio_clip_c is not None and not ratio_clip_c > 1:
            raise ValueError(f"ratio_clip_c must be > 1 (dual clip), got {ratio_clip_c}")
        if reference_policy_kl_type not in _KL_TYPES:
            raise ValueError(f"reference_policy_kl_type: expected one of {_KL_TYPES}, "
                             f"got {reference_policy_kl_type!r}")
        if nonfinite not in ("shared", "nemo"):
            raise ValueError(f"nonfinite: expected 'shared' or 'nemo', got {nonfinite!r}")
        if nemo_truncation not in (None,) + NEMO_IS_TYPES:
            raise ValueError(f"nemo_truncation: expected None or one of {NEMO_IS_TYPES}, "
                             f"got {nemo_truncation!r}")
        self.correction = correction
        self.ratio_clip_min = float(ratio_clip_min)
        self.ratio_clip_max = float(ratio_clip_max)
        self.ratio_clip_c = ratio_clip_c
        self.metrics_mode = metrics
        self.reference_policy_kl_type = reference_policy_kl_type
        self.nonfinite = nonfinite
        self.nemo_truncation = nemo_truncation
        self.loss_type = LossType.TOKEN_LEVEL if token_level_loss else LossType.SEQUENCE_LEVEL
        self.input_type = LossInputType.LOGPROB
        self._token_level = bool(token_level_loss)
        self.last_correction = None
        if MetricNormalizer is not None:
            self.metric_normalizations = self._metric_normalizations(MetricNormalizer)

    @classmethod
    def from_nemo_config(cls, loss_cfg: Any, *, metrics: str = "nemo") -> "RolloutParityLossFn":
        """Build from NeMo RL's ``loss_fn`` block (dict, OmegaConf or ``ClippedPGLossConfig``).

        The shared flags come from its ``rollout_correction`` sub-block
        (``configs/nemo_rl_loss.yaml``) or, without one, from NeMo RL's own truncated-IS keys
        (``correction_from_nemo_rl``, with NeMo RL's non-finite weights). Both at once is the
        correction enabled twice: an error. Features of ``ClippedPGLossFn`` this loss does not
        reproduce (a KL-to-reference term, CISPO, GSPO ratios, ...) must be off.
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
            nonfinite, truncation = "shared", None
        else:
            correction = correction_from_nemo_rl(cfg)
            nonfinite = "nemo"
            truncation = cfg.get("truncated_importance_sampling_type") if nemo_is_on else None
        return cls(correction,
                   ratio_clip_min=cfg.get("ratio_clip_min", 0.2),
                   ratio_clip_max=cfg.get("ratio_clip_max", 0.2),
                   ratio_clip_c=cfg.get("ratio_clip_c"),
                   token_level_loss=cfg.get("token_level_loss", True),
                   reference_policy_kl_type=cfg.get("reference_policy_kl_type") or "k3",
                   metrics=metrics, nonfinite=nonfinite, nemo_truncation=truncation)

    # ------------------------------------------------------------------ the call

    def __call__(self, next_token_logprobs: torch.Tensor, data: Mapping[str, Any],
                 global_valid_seqs: Any, global_valid_toks: Any) -> tuple[torch.Tensor, dict]:
        cur, prev, gen, mask, sample_mask, advantages = self._inputs(next_token_logprobs, data)
        valid = mask > 0
        finite_pair = torch.isfinite(prev) & torch.isfinite(gen)
        bad = valid & ~finite_pair
        cfg = self.correction
        gen_in = gen
        if self.nonfinite == "nemo":
            # NaN on one side is the core's neutral, counted token (log r = 0): NeMo RL's value in
            # seq-mask-tis's geometric mean; the weight is set to NeMo RL's below.
            gen_in = gen.masked_fill(bad, float("nan"))
        out = compute_correction(cfg, old_logprobs=prev, rollout_logprobs=gen_in,
                                 response_mask=mask, advantages=advantages,
                                 current_logprobs=cur, with_metrics=True)
        if self.nonfinite == "nemo" and cfg.rollout_importance_sampling_mode is not None:
            out.weights = out.weights.masked_fill(bad, _nemo_nonfinite_weight(cfg))
        self.last_correction = out  # weights/mask of the last microbatch, for inspection
        # The PPO ratio's π_old: NaN (the core's neutral ratio) wherever it is not finite.
        old = out.old_logprobs
        old = old.masked_fill(~torch.isfinite(old), float("nan"))
        gvt, gvs = float(global_valid_toks), float(global_valid_seqs)
        loss, core_metrics = policy_loss(
            cfg, current_logprobs=cur, advantages=advantages, old_logprobs=old, correction=out,
            response_mask=mask, clip_ratio_low=self.ratio_clip_min,
            clip_ratio_high=self.ratio_clip_max, clip_ratio_c=self.ratio_clip_c,
            loss_agg_mode="token-mean" if self._token_level else "seq-mean-token-mean",
            global_num_tokens=gvt if self._token_level else None,
            global_num_seqs=None if self._token_level else gvs,
        )
        with torch.no_grad():
            nemo = self._nemo_metrics(loss, cur, old, prev, gen, mask, sample_mask, out, bad,
                                      gvt, gvs)
        if self.metrics_mode == "local":
            return loss, {**core_metrics, **nemo}
        return loss, {**self._global_shares(core_metrics, out, mask, sample_mask, gvt, gvs),
                      **nemo}

    def _inputs(self, next_token_logprobs: torch.Tensor, data: Mapping[str, Any]):
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
        sample_mask = sample_mask.to(dtype)
        mask = data["token_mask"][:, 1:].to(dtype) * sample_mask.unsqueeze(-1)
        padding = mask <= 0
        # Padding is padding: whatever a worker left there (NaN, inf) never reaches a sum.
        cur = cur.masked_fill(padding, 0.0)
        prev = data["prev_logprobs"][:, 1:].to(dtype).masked_fill(padding, 0.0)
        gen = data["generation_logprobs"][:, 1:].to(dtype).masked_fill(padding, 0.0)
        advantages = advantages.to(dtype)
        if advantages.dim() == 2:
            advantages = advantages.masked_fill(padding, 0.0)
        return cur, prev, gen, mask, sample_mask, advantages

    # ------------------------------------------------------------------ metrics

    def _nemo_metrics(self, loss, cur, old, prev, gen, mask, sample_mask, out, bad, gvt, gvs):
        """NeMo RL's ClippedPGLossFn metrics, with its meaning and its global normalisation
        (loss_functions.py, ``__call__``'s return dict), on finite values."""
        cur = cur.detach()
        valid = mask > 0
        # A token with a non-finite logprob counts as one where the engine agreed with the trainer.
        prev_s = torch.where(torch.isfinite(prev), prev, cur)
        gen_s = torch.where(bad, prev_s, gen)
        old_s = torch.where(torch.isfinite(old), old, cur)

        def token_mean(values: torch.Tensor) -> float:
            return float(torch.where(valid, values, 0.0).sum()) / (gvt + 1e-8)

        log_ratio = (cur - old_s).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        ratios = log_ratio.exp()
        clamped = ratios.clamp(1.0 - self.ratio_clip_min, 1.0 + self.ratio_clip_max)
        if bool(valid.any()):
            extrema = [float(ratios[valid].min()), float(ratios[valid].max()),
                       float(clamped[valid].min()), float(clamped[valid].max())]
        else:  # NeMo RL's empty-microbatch values; grpo_train drops them
            extrema = [math.inf, -math.inf, math.inf, -math.inf]

        def kl(logprobs, reference):  # NeMo RL's calculate_kl without clamps
            logr = reference - logprobs
            if self.reference_policy_kl_type == "k1":
                return -logr
            if self.reference_policy_kl_type == "k2":
                return logr.square() / 2
            return torch.expm1(logr) - logr

        log_mix = torch.logaddexp(prev_s, gen_s) - math.log(2.0)
        js = 0.5 * (torch.expm1(prev_s - log_mix) - (prev_s - log_mix)) + \
            0.5 * (torch.expm1(gen_s - log_mix) - (gen_s - log_mix))
        if self.correction.rollout_importance_sampling_mode is not None and \
                self.correction.old_logprob_source != "bypass":
            is_weights = out.weights
        else:  # NeMo RL reports its raw ratio with IS off: r, 0 where not finite (nan_to_num)
            is_weights = torch.where(bad, 0.0, (prev_s - gen_s).clamp(-LOG_RATIO_BOUND,
                                                                       LOG_RATIO_BOUND).exp())
        metrics = {
            "loss": float(loss.detach()),
            "probs_ratio": token_mean(ratios),
            "probs_ratio_clamped": token_mean(clamped),
            "probs_ratio_min": extrema[0],
            "probs_ratio_max": extrema[1],
            "probs_ratio_clamped_min": extrema[2],
            "probs_ratio_clamped_max": extrema[3],
            "kl_penalty": 0.0,
            "token_mult_prob_error": token_mean(torch.exp((gen_s - prev_s).abs())),
            "gen_kl_error": token_mean(kl(gen_s, prev_s)),
            "policy_kl_error": token_mean(kl(prev_s, gen_s)),
            "js_divergence_error": token_mean(js),
            "sampling_importance_ratio": token_mean(is_weights),
            "num_valid_samples": float(sample_mask.sum()),
            "approx_entropy": -token_mean(torch.exp(cur - gen_s) * cur),
            "positive_nll_loss": 0.0,
        }
        if self.nemo_truncation is not None:
            metrics["is_oob_ratio"] = self._is_oob_ratio(out, prev_s, gen_s, bad, valid,
                                                         sample_mask, gvt, gvs)
        if self.metrics_mode == "local":  # this microbatch's own means
            n_tok, n_seq = float(mask.sum()), float(sample_mask.sum())
            for key in _TOKEN_KEYS:
                metrics[key] *= gvt / max(n_tok, 1.0)
            if "is_oob_ratio" in metrics:
                n = n_seq if self.nemo_truncation == "seq-mask-tis" else n_tok
                d = gvs if self.nemo_truncation == "seq-mask-tis" else gvt
                metrics["is_oob_ratio"] *= d / max(n, 1.0)
        return metrics

    def _is_oob_ratio(self, out, prev_s, gen_s, bad, valid, sample_mask, gvt, gvs) -> float:
        """NeMo RL's ``is_oob_ratio``: tokens (tis, icepop) or samples (seq-mask-tis) whose IS
        ratio lies outside [ratio_min, ratio]; a non-finite ratio is NeMo RL's 0."""
        cfg = self.correction
        upper = cfg.rollout_importance_sampling_threshold
        lower = cfg.rollout_importance_sampling_threshold_lower or 0.0
        if self.nemo_truncation == "seq-mask-tis":
            rho = out.sequence_log_ratio.exp()
            oob = ((rho < lower) | (rho > upper)).to(sample_mask.dtype) * sample_mask
            return float(oob.sum()) / (gvs + 1e-8)
        ratio = torch.where(bad, 0.0, (prev_s - gen_s).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp())
        oob = ((ratio < lower) | (ratio > upper)) & valid
        return float(oob.sum()) / (gvt + 1e-8)

    def _global_shares(self, core_metrics: dict, out, mask, sample_mask, gvt: float,
                       gvs: float) -> dict:
        """The core's local means as this microbatch's share of the global means (see the
        module constants): local mean × local count / global count."""
        n_tok = float(mask.sum())
        n_seq = float((mask.sum(dim=-1) > 0).sum())
        finite = mask - out.nonfinite.to(mask.dtype)
        n_ppl = float((finite.sum(dim=-1) > 0).sum())
        n_kept = float(out.mask.to(mask.dtype).mul(mask).sum())
        n_samples = float(sample_mask.sum())
        per_tok = 1.0 / gvt if gvt > 0 else 0.0
        per_seq = 1.0 / gvs if gvs > 0 else 0.0
        shares: dict[str, float] = {}
        for key in _POLICY_MEANS:
            if key in core_metrics:
                shares[key] = core_metrics[key] * n_kept * per_tok
        for name in _TOKEN_MEANS:
            if _PREFIX + name in core_metrics:
                shares[_PREFIX + name] = core_metrics[_PREFIX + name] * n_tok * per_tok
        for name in _SEQ_MEANS:
            if _PREFIX + name in core_metrics:
                shares[_PREFIX + name] = core_metrics[_PREFIX + name] * n_seq * per_seq
        for name in _PPL_MEANS:
            if _PREFIX + name in core_metrics:
                value = core_metrics[_PREFIX + name]
                if name == "ppl_ratio":  # on-policy value 1 for samples without a finite token
                    shares[_PREFIX + name] = ((value - 1.0) * n_ppl + n_samples) * per_seq
                else:
                    shares[_PREFIX + name] = value * n_ppl * per_seq
        return shares

    def _metric_normalizations(self, MetricNormalizer) -> dict:
        """``{metric: MetricNormalizer}`` as NeMo RL's own loss advertises it (main), so a
        split-step trainer rescales each metric by the denominator it was divided by."""
        if self.metrics_mode == "local":
            return {key: MetricNormalizer.NONE for key in NEMO_METRIC_KEYS}
        tokens, seqs, none = MetricNormalizer.TOKENS, MetricNormalizer.SEQUENCES, MetricNormalizer.NONE
        grad = tokens if self._token_level else seqs
        out = {"loss": grad, "kl_penalty": grad, "num_valid_samples": none,
               "positive_nll_loss": none}
        out.update({key: tokens for key in _TOKEN_KEYS})
        out.update({key: none for key in _EXTREMA_KEYS})
        if self.nemo_truncation is not None:
            out["is_oob_ratio"] = seqs if self.nemo_truncation == "seq-mask-tis" else tokens
        out.update({key: tokens for key in _POLICY_MEANS})
        out.update({_PREFIX + name: tokens for name in _TOKEN_MEANS})
        out.update({_PREFIX + name: seqs for name in _SEQ_MEANS + _PPL_MEANS})
        return out


def nemo_rl_generation_config(fp32_lm_head: bool = False, prefix_cache_policy: str = "off",
                              **vllm_kwargs: Any) -> dict:
    """The vLLM parity recipe placed where NeMo RL reads it (v0.7.0 and main).

    Returns ``{"policy": {"generation": {"vllm_cfg": {...}, "vllm_kwargs": {...}},
    "hf_config_overrides": {...}}}`` to merge into a NeMo RL config. NeMo RL's
    ``vllm_worker.py`` passes ``enable_prefix_caching=<vllm_cfg.enable_prefix_caching>`` (and,
    at v0.7, ``logprobs_mode="processed_logprobs"``) to ``vllm.LLM`` itself, so the same keys
    inside ``vllm_kwargs`` would be duplicate keywords (a TypeError at engine start). Main no
    longer fixes ``logprobs_mode``: it passes ``vllm_cfg.logprobs_mode`` when set and leaves
    vLLM's default (raw logprobs) otherwise. So ``logprobs_mode`` and prefix caching go to
    ``vllm_cfg`` (v0.7 ignores ``vllm_cfg.logprobs_mode`` and fixes the same value);
    ``hf_overrides`` go to ``policy.hf_config_overrides`` (``grpo.py`` overwrites
    ``vllm_kwargs["hf_overrides"]`` with it); everything else (``async_scheduling``) is
    ``policy.generation.vllm_kwargs``.
    """
    from rollout_parity.core.vllm_recipe import vllm_parity_kwargs

    recipe = dict(vllm_parity_kwargs(fp32_lm_head=fp32_lm_head,
                                     prefix_cache_policy=prefix_cache_policy, **vllm_kwargs))
    logprobs_mode = recipe.pop("logprobs_mode", "processed_logprobs")
    if logprobs_mode != "processed_logprobs":
        raise ValueError(f"logprobs_mode={logprobs_mode!r}: NeMo RL {NEMO_RL_VERSION} always "
                         "uses processed_logprobs")
    vllm_cfg = {"enable_prefix_caching": bool(recipe.pop("enable_prefix_caching")),
                "logprobs_mode": logprobs_mode}
    hf_overrides = dict(recipe.pop("hf_overrides", None) or {})
    check_nemo_rl_vllm_kwargs(recipe)
    policy: dict[str, Any] = {"generation": {"vllm_cfg": vllm_cfg, "vllm_kwargs": recipe}}
    if hf_overrides:
        policy["hf_config_overrides"] = hf_overrides
    return {"policy": policy}


def check_nemo_rl_vllm_kwargs(vllm_kwargs: Mapping[str, Any]) -> None:
    """Refuse ``policy.generation.vllm_kwargs`` keys NeMo RL already passes to vLLM itself."""
    clash = sorted(set(vllm_kwargs) & set(NEMO_RL_FIXED_LLM_KWARGS))
    if clash:
        raise ValueError(
            f"policy.generation.vllm_kwargs has {clash}, which NeMo RL {NEMO_RL_VERSION} passes to "
            "vllm.LLM itself (a duplicate keyword at engine start); set enable_prefix_caching "
            "and logprobs_mode in policy.generation.vllm_cfg")
