"""TRL adapter: the shared flags of DESIGN.md in TRL's ``GRPOTrainer``, plus vLLM parity.

What TRL 1.16 does (read from ``trl/trainer/grpo_trainer.py``, ``grpo_config.py``,
``trl/generation/vllm_generation.py``, ``trl/generation/vllm_client.py``,
``trl/scripts/vllm_serve.py``; TRL has no ``trl/extras/vllm_client.py`` any more):

* Sampling logprobs. ``_generate_single_turn`` asks vLLM for ``logprobs=0`` (the sampled
  token only); ``_generate_and_score_completions`` pads them (NaN where vLLM returned
  ``None``, 0.0 on padding) into ``inputs["sampling_per_token_logps"]`` (B, T). Generation with
  transformers returns no logprobs; a ``rollout_func`` may return them.
* Old logprobs. ``inputs["old_per_token_logps"]`` is computed in
  ``_generate_and_score_completions`` (no grad, the same fused head and temperature as the
  loss) only when ``use_vllm and vllm_importance_sampling_correction`` or when generation
  and optimisation steps are misaligned (``gradient_accumulation_steps %
  (steps_per_generation * num_iterations) != 0``). Otherwise ``_compute_loss`` uses
  ``per_token_logps.detach()``: the weights have not moved since the rollout, so that *is*
  the recomputed pi_old.
* TRL's own correction, **on by default**: ``vllm_importance_sampling_correction=True``,
  ``vllm_importance_sampling_mode="sequence_mask"``, ``vllm_importance_sampling_clip_max=3.0``
  (``_cap`` is its deprecated alias), ``vllm_importance_sampling_clip_min=None``. The ratio is
  ``exp(Σ_t (old - sampling))`` per sequence (a product, no ±20 clamp, NaN terms -> 0), a
  sequence outside ``[clip_min, clip_max]`` gets 0, a kept one its ratio; the (B, 1) or (B, T)
  result is stored as ``inputs["importance_sampling_ratio"]`` and multiplies the per-token
  loss in ``_compute_loss``. Metrics ``sampling/sampling_logp_difference/*`` and
  ``sampling/importance_sampling_ratio/*``. Our ``trl_default`` preset is exactly this.
* ``off_policy_mask_threshold`` (default None): ``get_off_policy_mask`` (a static method), the
  DeepSeek-V3.2 mask on ``mean_t(sampling - current)`` for negative-advantage sequences.
* ``_compute_loss(model, inputs)``: per-token logprobs through the fused LM head
  (``_get_per_token_logps_and_entropies``), clipped surrogate for ``loss_type`` grpo / bnpo /
  dr_grpo / dapo (default) / luspo, or cispo / sapo / vespo; optional ``delta`` two-sided clip,
  ``beta`` KL, entropy mask and bonus, MoE aux loss; aggregation per ``loss_type``, dapo
  normalised by ``num_items_in_batch / num_processes * gas / steps_per_generation``.
* Metrics: ``self._metrics[mode][name].append(float)``; ``log()`` averages each list and
  hands it to the Trainer's loggers.
* Colocate engine: ``VLLMGeneration._init_vllm`` calls the module global
  ``trl.generation.vllm_generation.LLM(model=..., tensor_parallel_size, gpu_memory_utilization,
  max_model_len, max_num_seqs, enable_sleep_mode, model_impl,
  distributed_executor_backend="external_launcher", seed, max_num_batched_tokens=4096,
  logprobs_mode="processed_logprobs", quantization, trust_remote_code)``. No
  ``enable_prefix_caching`` (vLLM V1 turns it on), no ``async_scheduling``, no
  ``hf_overrides``: we inject the recipe by wrapping that global while the trainer is built.
  Weight sync (``sync_weights``) loads every parameter and then resets the prefix cache.
* Trainer log-probs are ``log_softmax(logits / temperature)`` over the whole vocabulary; with
  ``top_k``/``top_p``/``min_p`` vLLM's processed logprobs are renormalised over the kept set, so
  the two differ by log(kept mass). ``apply`` warns in that case (not corrected here).
* fp32 head: ``cast_lm_head_to_fp32`` casts the trainer's (and reference's) ``lm_head`` to
  fp32 and tells the fused log-prob kernel (``add_fused_lm_head``) to project in fp32. The
  kernel reads ``lm_head.weight`` directly, not the module's forward, so a forward patch can
  not reach it: ``fp32_lm_head`` therefore turns TRL's own ``cast_lm_head_to_fp32`` on for the
  trainer and ``hf_overrides={"head_dtype": "float32"}`` on for vLLM (which TRL never does).
* Server mode: ``trl vllm-serve`` (deprecated in favour of ``vllm serve``) always passes
  ``--logprobs-mode processed_logprobs``, takes ``--enable_prefix_caching true|false``, and
  forwards unknown flags to ``vllm serve`` unchanged; ``server_command`` prints the recipe.

What this adapter does:

* ``ParityGRPOConfig(GRPOConfig)``: the shared flags as fields with their exact names, so
  ``TrlParser``/``HfArgumentParser`` read them from the command line and TRL YAML configs;
  ``correction_config()`` turns them into the core's ``CorrectionConfig`` (validated there, the
  error names the flag).
* Double correction: when a shared flag changes the loss, TRL's own correction must be off.
  ``ParityGRPOConfig`` declares ``vllm_importance_sampling_correction`` with default ``None``
  ("auto"): auto turns TRL's off with a logged warning; an explicit ``True`` is an error, and
  so is ``off_policy_mask_threshold`` (use ``off_policy_sequence_mask_delta``). On a plain
  ``GRPOConfig`` an explicit True can not be told from the default, so ``apply`` turns it off
  with the warning (and ``revert`` turns it back on). Diagnostics alone
  (``log_rollout_offpolicy_metrics``) leave TRL's loss and its correction as configured.
* ``apply(trainer, config)`` / ``revert(trainer)``: instance-level, marked, idempotent patches.
  A loss-changing config replaces ``_compute_loss`` by one that calls ``compute_correction`` and
  the core's ``policy_loss`` (grpo -> seq-mean-token-mean over all B rows, bnpo -> token-mean,
  dapo -> token-mean over TRL's global token count), and logs every ``rollout_correction/*``
  and ``policy/*`` metric into ``self._metrics``. Options the core's loss does not express
  (other loss types, sequence-level ratios, ``beta``, ``delta``, entropy masking or bonus,
  MoE aux loss) are refused by name rather than silently dropped.
* ``ParityGRPOTrainer``: builds the colocated engine with ``vllm_parity_kwargs`` (checked with
  ``verify_engine`` afterwards), logs the server-mode command, then calls ``apply``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shlex
import types
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

try:
    import trl  # noqa: F401
    from trl import GRPOConfig, GRPOTrainer
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "rollout_parity.adapters.trl needs TRL (tested with trl 1.16): pip install rollout-parity[trl]"
    ) from exc

import torch

from rollout_parity.core.config import CorrectionConfig
from rollout_parity.core.correction import compute_correction
from rollout_parity.core.loss import policy_loss

__all__ = [
    "ParityGRPOConfig",
    "ParityGRPOTrainer",
    "MissingRolloutLogprobsError",
    "apply",
    "revert",
    "is_applied",
    "correction_config_from_args",
    "parity_vllm_engine",
    "server_command",
    "SUPPORTED_LOSS_TYPES",
]

logger = logging.getLogger(__name__)

_STATE_ATTR = "_rollout_parity_trl"
_PATCH_MARK = "__rollout_parity_patch__"
#: TRL loss types the core's ``policy_loss`` reproduces, with the aggregation each maps to.
SUPPORTED_LOSS_TYPES = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean-token-mean"}
_MULTIMODAL_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)


class MissingRolloutLogprobsError(ValueError):
    """A correction is configured but the trainer has no sampler logprobs to correct against."""


def _missing_rollout_message(cfg: CorrectionConfig, where: str) -> str:
    asked = {k: v for k, v in cfg.to_dict().items()
             if k in ("rollout_importance_sampling_mode", "rollout_rejection", "off_policy_sequence_mask_delta",
                      "log_rollout_offpolicy_metrics") and v not in (None, False)}
    if cfg.old_logprob_source == "bypass":
        asked["old_logprob_source"] = "bypass"
    return (
        f"{', '.join(f'{k}={v!r}' for k, v in asked.items())} needs the sampler's per-token logprobs, but {where}. "
        "TRL only has them when it generates with vLLM (use_vllm=True, colocate or server) or when a "
        "rollout_func returns 'logprobs'; generation with transformers returns none."
    )


# ----------------------------------------------------------------------------- config

_SHARED_FLAGS = CorrectionConfig.field_names()


def _shared_field(name: str, **extra: Any) -> Any:
    """A dataclass field with the core's default and help text for one shared flag."""
    core = CorrectionConfig.__dataclass_fields__[name]
    help_text = f"[rollout-parity] {core.metadata.get('help', '')}"
    return field(default=core.default, metadata={"help": help_text, **extra})


def _none_if_null(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() in ("", "none", "null"):
        return None
    return value


def _number_if_numeric(value: Any) -> Any:
    """CLI strings '0.001' -> 0.001; K1 ranges such as '0.5_2.0' stay strings."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _normalise_rejection_threshold(value: Any) -> Any:
    value = _none_if_null(value)
    if isinstance(value, (list, tuple)):
        values = [_number_if_numeric(v) for v in value]
        return values[0] if len(values) == 1 else values
    return _number_if_numeric(value)


@dataclass
class ParityGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the shared rollout-parity flags (DESIGN.md, "The shared flags").

    Parsed by ``TrlParser``/``HfArgumentParser`` like any TRL config: on the command line
    (``--rollout_importance_sampling_mode token_truncate``) or in a TRL YAML file
    (``rollout_importance_sampling_mode: token_truncate``). List flags take several values on
    the command line (``--rollout_rejection token_k3 seq_sum_k3``) or a YAML list.
    """

    rollout_importance_sampling_mode: Optional[str] = _shared_field("rollout_importance_sampling_mode")
    rollout_importance_sampling_threshold: float = _shared_field("rollout_importance_sampling_threshold")
    rollout_importance_sampling_threshold_lower: Optional[float] = _shared_field(
        "rollout_importance_sampling_threshold_lower")
    rollout_importance_sampling_sequence_reduction: str = _shared_field(
        "rollout_importance_sampling_sequence_reduction")
    rollout_importance_sampling_sequence_mask_weight: str = _shared_field(
        "rollout_importance_sampling_sequence_mask_weight")
    rollout_rejection: Optional[list[str]] = _shared_field("rollout_rejection")
    # Strings on the command line so K1 ranges ('0.5_2.0') pass; numbers are converted.
    rollout_rejection_threshold: Optional[list[str]] = _shared_field("rollout_rejection_threshold")
    off_policy_sequence_mask_delta: Optional[float] = _shared_field("off_policy_sequence_mask_delta")
    old_logprob_source: str = _shared_field("old_logprob_source")
    log_rollout_offpolicy_metrics: bool = _shared_field("log_rollout_offpolicy_metrics")
    fp32_lm_head: bool = _shared_field("fp32_lm_head")

    # Redeclared with default None ("auto"): TRL's own correction is on by default, and ours must
    # be able to tell that default from an explicit request (see the module docstring).
    vllm_importance_sampling_correction: Optional[bool] = field(
        default=None,
        metadata={
            "help": "TRL's own vLLM importance-sampling correction. Default (unset): on, unless a rollout-parity "
            "flag corrects the loss, in which case it is turned off with a warning; true together with a "
            "rollout-parity correction is an error (double correction)."
        },
    )

    def __post_init__(self) -> None:
        self.rollout_importance_sampling_mode = _none_if_null(self.rollout_importance_sampling_mode)
        self.rollout_importance_sampling_threshold_lower = _none_if_null(
            self.rollout_importance_sampling_threshold_lower)
        self.off_policy_sequence_mask_delta = _none_if_null(self.off_policy_sequence_mask_delta)
        rejection = _none_if_null(self.rollout_rejection)
        if isinstance(rejection, str):
            rejection = [rejection]
        self.rollout_rejection = list(rejection) if rejection is not None else None
        self.rollout_rejection_threshold = _normalise_rejection_threshold(self.rollout_rejection_threshold)

        cfg = self.correction_config()  # validates; raises naming the flag
        if cfg.changes_loss:
            if self.vllm_importance_sampling_correction:
                raise ValueError(
                    "vllm_importance_sampling_correction=True: TRL's own importance-sampling correction would act "
                    f"together with rollout-parity's ({_describe_correction(cfg)}), correcting the mismatch twice. "
                    "Leave vllm_importance_sampling_correction unset (or false) to use rollout-parity's, or drop the "
                    "rollout-parity flags to use TRL's."
                )
            if self.off_policy_mask_threshold is not None:
                raise ValueError(
                    f"off_policy_mask_threshold={self.off_policy_mask_threshold}: TRL's off-policy sequence mask "
                    f"would act together with rollout-parity's correction ({_describe_correction(cfg)}). Use "
                    "off_policy_sequence_mask_delta (the same DeepSeek-V3.2 mask, shared across frameworks) instead."
                )
            if self.vllm_importance_sampling_correction is None:
                # Remembered so that revert() can give TRL its default back.
                self.rollout_parity_disabled_trl_correction = True
                logger.warning(
                    "rollout-parity: TRL's own vllm_importance_sampling_correction is turned off because "
                    "rollout-parity corrects the loss (%s); set the rollout-parity flags to null to use TRL's.",
                    _describe_correction(cfg),
                )
            self.vllm_importance_sampling_correction = False
        elif self.vllm_importance_sampling_correction is None:
            self.vllm_importance_sampling_correction = True  # TRL's default
        if self.fp32_lm_head and not self.cast_lm_head_to_fp32:
            logger.info("rollout-parity: fp32_lm_head=True turns on TRL's cast_lm_head_to_fp32 (trainer side)")
            self.cast_lm_head_to_fp32 = True
        super().__post_init__()

    def correction_config(self) -> CorrectionConfig:
        """The core's ``CorrectionConfig`` for these flags."""
        return CorrectionConfig(**{name: getattr(self, name) for name in _SHARED_FLAGS})


def _describe_correction(cfg: CorrectionConfig) -> str:
    parts = []
    if cfg.rollout_importance_sampling_mode is not None:
        parts.append(f"rollout_importance_sampling_mode={cfg.rollout_importance_sampling_mode!r}")
    if cfg.rollout_rejection is not None:
        parts.append(f"rollout_rejection={list(cfg.rollout_rejection)}")
    if cfg.off_policy_sequence_mask_delta is not None:
        parts.append(f"off_policy_sequence_mask_delta={cfg.off_policy_sequence_mask_delta}")
    return ", ".join(parts) or "diagnostics only"


def correction_config_from_args(args: Any) -> CorrectionConfig:
    """``CorrectionConfig`` from a ``ParityGRPOConfig``; the default (nothing on) otherwise."""
    if isinstance(args, ParityGRPOConfig):
        return args.correction_config()
    return CorrectionConfig()


# ----------------------------------------------------------------------------- vLLM parity


@contextlib.contextmanager
def parity_vllm_engine(fp32_lm_head: bool = False, prefix_cache_policy: str = "off") -> Iterator[dict]:
    """Build TRL's colocated ``vllm.LLM`` with the parity recipe while the block runs.

    Wraps the ``LLM`` global of ``trl.generation.vllm_generation`` so every engine TRL builds
    inside the block gets ``vllm_parity_kwargs(fp32_lm_head)`` on top of TRL's own kwargs
    (the recipe wins; ``hf_overrides`` are merged). Yields a dict that receives the kwargs the
    engine was finally built with under ``"kwargs"``. Restores the original on exit.
    """
    from trl.generation import vllm_generation

    from rollout_parity.core.vllm_recipe import vllm_parity_kwargs

    built: dict[str, Any] = {}
    original = getattr(vllm_generation, "LLM", None)
    if original is None or getattr(original, _PATCH_MARK, False):
        # vLLM absent (TRL raises its own error) or already inside a parity block.
        yield built
        return
    recipe = vllm_parity_kwargs(fp32_lm_head=fp32_lm_head, prefix_cache_policy=prefix_cache_policy)

    def llm_with_parity_recipe(*args: Any, **kwargs: Any) -> Any:
        merged = dict(kwargs)
        for key, value in recipe.items():
            if key == "hf_overrides":
                merged[key] = {**(kwargs.get(key) or {}), **value}
            else:
                merged[key] = value
        changed = {k: (kwargs.get(k), merged[k]) for k in recipe if kwargs.get(k) != merged[k]}
        if changed:
            logger.info("rollout-parity: TRL's vLLM engine built with the parity recipe: %s",
                        ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items()))
        built["kwargs"] = merged
        return original(*args, **merged)

    setattr(llm_with_parity_recipe, _PATCH_MARK, True)
    vllm_generation.LLM = llm_with_parity_recipe
    try:
        yield built
    finally:
        vllm_generation.LLM = original


def server_command(model: str, fp32_lm_head: bool = False, prefix_cache_policy: str = "off",
                   extra_args: Optional[list[str]] = None) -> str:
    """The ``trl vllm-serve`` command line that serves ``model`` with the parity recipe.

    TRL adds ``--logprobs-mode processed_logprobs`` itself; ``--enable_prefix_caching`` is
    TRL's option; the rest (``--no-async-scheduling``, ``--hf-overrides``) is forwarded by TRL
    to ``vllm serve`` unchanged.
    """
    from rollout_parity.core.vllm_recipe import vllm_serve_flags

    flags = vllm_serve_flags(fp32_lm_head, prefix_cache_policy, style="trl")
    return shlex.join(["trl", "vllm-serve", "--model", str(model), *flags, *(extra_args or [])])


# ----------------------------------------------------------------------------- patching


@dataclass
class _PatchState:
    config: CorrectionConfig
    saved_flags: dict[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)  # name -> (trainer, args)
    saved_methods: dict[str, Any] = dataclasses.field(default_factory=dict)  # name -> previous instance attr
    engine_checks: Optional[dict[str, bool]] = None
    capturing: bool = False
    captured_logprobs: Optional[torch.Tensor] = None


_ABSENT = object()


def _state(trainer: Any) -> Optional[_PatchState]:
    return trainer.__dict__.get(_STATE_ATTR)


def is_applied(trainer: Any) -> bool:
    return _state(trainer) is not None


def _patch_method(trainer: Any, state: _PatchState, name: str, fn: Any) -> None:
    state.saved_methods[name] = trainer.__dict__.get(name, _ABSENT)
    setattr(fn, _PATCH_MARK, True)
    trainer.__dict__[name] = types.MethodType(fn, trainer)


def _set_flag(trainer: Any, state: _PatchState, name: str, value: Any) -> None:
    args = getattr(trainer, "args", None)
    state.saved_flags.setdefault(name, (getattr(trainer, name, _ABSENT), getattr(args, name, _ABSENT)))
    setattr(trainer, name, value)
    if args is not None and hasattr(args, name):
        setattr(args, name, value)


def _refuse_unsupported(trainer: Any, cfg: CorrectionConfig) -> None:
    """Options of TRL's ``_compute_loss`` the core's ``policy_loss`` does not express."""
    args = trainer.args
    what = _describe_correction(cfg)

    def refuse(option: str, value: Any, why: str) -> None:
        raise ValueError(f"{option}={value!r} is not supported together with rollout-parity's correction ({what}): {why}")

    if trainer.loss_type not in SUPPORTED_LOSS_TYPES:
        refuse("loss_type", trainer.loss_type, f"the corrected loss reproduces {sorted(SUPPORTED_LOSS_TYPES)}")
    if trainer.importance_sampling_level != "token":
        refuse("importance_sampling_level", trainer.importance_sampling_level, "the PPO ratio is per token")
    if trainer.beta != 0.0:
        refuse("beta", trainer.beta, "the KL-to-reference term is not part of the core's policy loss yet")
    if getattr(args, "delta", None) is not None:
        refuse("delta", args.delta, "two-sided clipping is not part of the core's policy loss")
    if getattr(trainer, "top_entropy_quantile", 1.0) < 1.0:
        refuse("top_entropy_quantile", trainer.top_entropy_quantile, "entropy masking is not part of the core's loss")
    if getattr(trainer, "_entropy_bonus_enabled", False):
        refuse("entropy_coef", args.entropy_coef, "the entropy bonus is not part of the core's loss")
    if getattr(trainer, "aux_loss_enabled", False):
        refuse("router_aux_loss_coef", getattr(trainer, "router_aux_loss_coef", None),
               "the MoE auxiliary loss is not part of the core's loss")
    if trainer.off_policy_mask_threshold is not None:
        refuse("off_policy_mask_threshold", trainer.off_policy_mask_threshold,
               "TRL's off-policy mask would act together with ours; use off_policy_sequence_mask_delta")


def apply(trainer: Any, config: CorrectionConfig | Mapping[str, Any] | None = None) -> Any:
    """Make ``trainer`` (a ``GRPOTrainer``) use rollout-parity's correction and diagnostics.

    ``config`` defaults to the trainer's ``ParityGRPOConfig`` flags. Idempotent: applying the
    same config twice changes nothing; a different config replaces the previous one.
    Returns the trainer.
    """
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"apply expects a trl.GRPOTrainer, got {type(trainer).__name__}")
    if config is None:
        cfg = correction_config_from_args(trainer.args)
    elif isinstance(config, CorrectionConfig):
        cfg = config
    else:
        cfg = CorrectionConfig.from_dict(config)

    previous = _state(trainer)
    if previous is not None and previous.config == cfg:
        return trainer

    needs_rollout = cfg.wants_metrics or cfg.old_logprob_source == "bypass"
    if needs_rollout and not trainer.use_vllm and getattr(trainer, "rollout_func", None) is None:
        raise MissingRolloutLogprobsError(_missing_rollout_message(
            cfg, "this GRPOTrainer generates with transformers (use_vllm=False) and has no rollout_func"))
    if cfg.changes_loss or cfg.old_logprob_source == "bypass":
        _refuse_unsupported(trainer, cfg)
    if cfg.fp32_lm_head and not getattr(trainer.args, "cast_lm_head_to_fp32", False):
        raise ValueError(
            "fp32_lm_head=True on an already-built GRPOTrainer whose cast_lm_head_to_fp32 is False: TRL's fused "
            "log-prob kernel reads lm_head.weight directly and fixes its fp32 projection at construction. Build "
            "the trainer with GRPOConfig(cast_lm_head_to_fp32=True), or use ParityGRPOConfig/ParityGRPOTrainer."
        )

    if previous is not None:  # validated above, so a refused config leaves the previous one in place
        revert(trainer)
    state = _PatchState(config=cfg)
    if cfg.changes_loss or cfg.old_logprob_source == "bypass":
        if trainer.vllm_importance_sampling_correction:
            logger.warning(
                "rollout-parity: turning off TRL's own vllm_importance_sampling_correction (mode=%r, cap=%s) "
                "because rollout-parity corrects the loss (%s); revert() turns it back on.",
                trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_max,
                _describe_correction(cfg),
            )
            _set_flag(trainer, state, "vllm_importance_sampling_correction", False)
        elif getattr(trainer.args, "rollout_parity_disabled_trl_correction", False):
            state.saved_flags["vllm_importance_sampling_correction"] = (True, True)
        _patch_method(trainer, state, "_compute_loss", _corrected_compute_loss)
    elif cfg.wants_metrics:
        _patch_method(trainer, state, "_compute_loss", _diagnosed_compute_loss)
        _patch_method(trainer, state, "_get_per_token_logps_and_entropies", _capturing_logps)

    if cfg.wants_metrics and _truncating_sampler(trainer):
        logger.warning(
            "rollout-parity: top_k=%s, top_p=%s, min_p=%s truncate vLLM's sampling distribution, but TRL's trainer "
            "log-probs are the full temperature-scaled softmax; r_corr then carries a log(kept mass) bias that the "
            "correction will treat as mismatch (see rollout_parity.sampler_logprobs).",
            trainer.top_k, trainer.top_p, trainer.min_p)
    if trainer.use_vllm and getattr(trainer, "vllm_mode", None) == "colocate":
        llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
        if llm is not None:
            from rollout_parity.core.vllm_recipe import verify_engine

            state.engine_checks = verify_engine(llm, fp32_lm_head=cfg.fp32_lm_head)
            failed = [k for k, ok in state.engine_checks.items() if not ok]
            if failed:
                logger.warning(
                    "rollout-parity: TRL's vLLM engine misses the parity recipe (%s); build the trainer inside "
                    "`with parity_vllm_engine(...)` or use ParityGRPOTrainer.", ", ".join(failed))
    trainer.__dict__[_STATE_ATTR] = state
    return trainer


def _truncating_sampler(trainer: Any) -> bool:
    top_k, top_p, min_p = getattr(trainer, "top_k", 0), getattr(trainer, "top_p", 1.0), getattr(trainer, "min_p", None)
    return (top_k not in (None, 0, -1)) or (top_p is not None and top_p < 1.0) or bool(min_p)


def revert(trainer: Any) -> bool:
    """Undo ``apply``: TRL's own methods and flags come back. Returns False if nothing was applied."""
    state = _state(trainer)
    if state is None:
        return False
    for name, previous in state.saved_methods.items():
        current = trainer.__dict__.get(name, _ABSENT)
        if current is not _ABSENT and getattr(getattr(current, "__func__", None), _PATCH_MARK, False):
            if previous is _ABSENT:
                del trainer.__dict__[name]
            else:
                trainer.__dict__[name] = previous
    for name, (on_trainer, on_args) in state.saved_flags.items():
        if on_trainer is not _ABSENT:
            setattr(trainer, name, on_trainer)
        if on_args is not _ABSENT:
            setattr(trainer.args, name, on_args)
    del trainer.__dict__[_STATE_ATTR]
    return True


# ----------------------------------------------------------------------------- the patched loss


def _process_group(trainer: Any) -> Any:
    if trainer.accelerator.num_processes > 1 and torch.distributed.is_initialized():
        return torch.distributed.group.WORLD
    return None


def _log_metrics(trainer: Any, mode: str, metrics: Mapping[str, float]) -> None:
    for name, value in metrics.items():
        trainer._metrics[mode][name].append(float(value))


def _loss_mask(inputs: Mapping[str, Any]) -> torch.Tensor:
    mask = inputs["completion_mask"]
    return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]


def _rollout_logprobs(trainer: Any, inputs: Mapping[str, Any], cfg: CorrectionConfig) -> torch.Tensor:
    rollout = inputs.get("sampling_per_token_logps")
    if rollout is None:
        raise MissingRolloutLogprobsError(_missing_rollout_message(
            cfg, "this batch has no 'sampling_per_token_logps' (the generator returned no logprobs)"))
    return rollout


def _aggregation(trainer: Any, inputs: Mapping[str, Any], mode: str, batch_rows: int) -> tuple[str, dict, float]:
    """TRL's ``loss_type`` as the core's aggregation: (mode, normaliser kwargs, divisor)."""
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    if trainer.loss_type == "dapo":
        normaliser = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            normaliser = normaliser * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
        return "token-mean", {"global_num_tokens": normaliser}, 1.0
    if trainer.loss_type == "grpo":  # TRL averages over every row, empty ones included
        return "seq-mean-token-mean", {"global_num_seqs": float(batch_rows)}, accumulation
    return "token-mean", {}, accumulation  # bnpo


def _corrected_compute_loss(self: Any, model: Any, inputs: Mapping[str, Any]) -> torch.Tensor:
    """TRL's ``_compute_loss`` with the correction applied through the core's ``policy_loss``."""
    cfg = _state(self).config
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    mask = _loss_mask(inputs)
    per_token_logps, entropies, _ = self._get_per_token_logps_and_entropies(
        model,
        torch.cat([prompt_ids, completion_ids], dim=1),
        torch.cat([prompt_mask, completion_mask], dim=1),
        completion_ids.size(1),
        compute_entropy=True,
        **{k: inputs.get(k) for k in _MULTIMODAL_KEYS},
    )
    rollout = _rollout_logprobs(self, inputs, cfg)
    old = inputs.get("old_per_token_logps")
    if old is None:  # steps aligned: the weights are those of the rollout, so this is pi_old
        old = per_token_logps.detach()
    advantages = inputs["advantages"]
    correction = compute_correction(
        cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, advantages=advantages,
        current_logprobs=per_token_logps.detach(), process_group=_process_group(self),
    )
    mode = "train" if self.model.training else "eval"
    agg, normalisers, divisor = _aggregation(self, inputs, mode, completion_ids.size(0))
    loss, metrics = policy_loss(
        cfg, current_logprobs=per_token_logps, advantages=advantages, correction=correction,
        clip_ratio=self.epsilon_low, clip_ratio_low=self.epsilon_low, clip_ratio_high=self.epsilon_high,
        loss_agg_mode=agg, **normalisers,
    )
    loss = loss / divisor
    if entropies is not None:
        totals = self.accelerator.reduce(torch.stack([(entropies * mask).sum(), mask.sum().float()]), reduction="sum")
        metrics = {**metrics, "entropy": (totals[0] / totals[1].clamp(min=1.0)).item()}
    _log_metrics(self, mode, metrics)
    return loss


def _capturing_logps(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
    """Pass-through to TRL's log-prob forward that keeps pi_theta of the loss forward."""
    state = _state(self)
    previous = state.saved_methods.get("_get_per_token_logps_and_entropies", _ABSENT)
    forward = (types.MethodType(type(self)._get_per_token_logps_and_entropies, self)
               if previous is _ABSENT else previous)
    result = forward(model, *args, **kwargs)
    if state.capturing and kwargs.get("compute_entropy"):
        state.captured_logprobs = result[0].detach()
    return result


def _diagnosed_compute_loss(self: Any, model: Any, inputs: Mapping[str, Any]) -> torch.Tensor:
    """TRL's own ``_compute_loss``, unchanged, plus the ``rollout_correction/*`` diagnostics."""
    state = _state(self)
    previous = state.saved_methods.get("_compute_loss", _ABSENT)
    original = types.MethodType(type(self)._compute_loss, self) if previous is _ABSENT else previous
    state.capturing, state.captured_logprobs = True, None
    try:
        loss = original(model, inputs)
    finally:
        state.capturing = False
    current = state.captured_logprobs
    state.captured_logprobs = None
    rollout = _rollout_logprobs(self, inputs, state.config)
    old = inputs.get("old_per_token_logps")
    if old is None:
        old = current
    correction = compute_correction(
        state.config, old_logprobs=old, rollout_logprobs=rollout, response_mask=_loss_mask(inputs),
        advantages=inputs["advantages"], current_logprobs=current, process_group=_process_group(self),
        with_metrics=True,
    )
    _log_metrics(self, "train" if self.model.training else "eval", correction.metrics)
    return loss


# ----------------------------------------------------------------------------- the trainer


class ParityGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with rollout-parity's correction, diagnostics and vLLM parity recipe.

    Takes the shared flags from a ``ParityGRPOConfig`` (or ``rollout_correction=`` with a plain
    ``GRPOConfig``). In colocate mode the engine is built with ``vllm_parity_kwargs``; in server
    mode the ``trl vllm-serve`` command with the recipe is logged. ``revert(trainer)`` restores
    TRL's own behaviour (the engine keeps its recipe).
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, *rest: Any,
                 rollout_correction: CorrectionConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if rollout_correction is None:
            cfg = correction_config_from_args(args)
        elif isinstance(rollout_correction, CorrectionConfig):
            cfg = rollout_correction
        else:
            cfg = CorrectionConfig.from_dict(rollout_correction)
        if args is not None:
            if (cfg.wants_metrics or cfg.old_logprob_source == "bypass") and not args.use_vllm \
                    and kwargs.get("rollout_func") is None:
                raise MissingRolloutLogprobsError(_missing_rollout_message(
                    cfg, "use_vllm=False and no rollout_func was given"))
            if cfg.fp32_lm_head and not args.cast_lm_head_to_fp32:
                logger.info("rollout-parity: fp32_lm_head=True turns on TRL's cast_lm_head_to_fp32")
                args.cast_lm_head_to_fp32 = True
        colocate = args is not None and args.use_vllm and args.vllm_mode == "colocate"
        engine = parity_vllm_engine(fp32_lm_head=cfg.fp32_lm_head) if colocate else contextlib.nullcontext({})
        with engine as built:
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self.rollout_parity_engine_kwargs = built.get("kwargs")
        if self.use_vllm and self.vllm_mode == "server":
            logger.warning("rollout-parity: serve the model with the parity recipe:\n    %s",
                           server_command(self.model.name_or_path, fp32_lm_head=cfg.fp32_lm_head))
        apply(self, cfg)

    @property
    def rollout_correction(self) -> Optional[CorrectionConfig]:
        state = _state(self)
        return None if state is None else state.config
