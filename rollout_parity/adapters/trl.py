"""TRL adapter: the shared flags of DESIGN.md in TRL's ``GRPOTrainer``, through TRL's own loss.

How TRL (1.15, 1.16: ``trl/trainer/grpo_trainer.py``, ``trl/generation/``) meets us:

* ``_generate_and_score_completions`` builds one generation batch: ``sampling_per_token_logps``
  (the sampler's logprobs, NaN where vLLM returned none, 0.0 on padding), ``old_per_token_logps``
  (pi_old, recomputed whenever ``use_vllm and vllm_importance_sampling_correction``: the decoupled
  pi_old), ``completion_mask`` (also the attention mask), the loss-only ``tool_mask``,
  ``num_items_in_batch`` (the global loss-token count, dapo/cispo/vespo's denominator) and its own
  ratio ``importance_sampling_ratio``. ``_prepare_inputs`` splits it into ``steps_per_generation``
  slices and reuses them ``num_iterations`` times.
* ``_compute_loss`` runs the loss of every ``loss_type`` (grpo, bnpo, dr_grpo, dapo, luspo, cispo,
  sapo, vespo), ``beta`` (KL to the reference), ``delta``, GSPO (``importance_sampling_level``),
  entropy masking and bonus, the MoE router loss and ``off_policy_mask_threshold`` (DeepSeek-V3.2),
  over ``completion_mask * tool_mask``; with ``use_vllm and vllm_importance_sampling_correction`` it
  multiplies the per-token policy loss by ``importance_sampling_ratio`` (vespo folds it into its
  sequence weight instead).

What this adapter does (STYLE.md rules 1-12):

* Once per generation batch (a wrapper of ``_generate_and_score_completions``) it calls the core's
  ``compute_correction`` on TRL's sampler logprobs and pi_old, then hands the result over through
  TRL's channels: the (B, T) weights become ``importance_sampling_ratio`` (1 outside the loss mask,
  so vespo's log-sum sees only kept tokens) with TRL's correction flag on, rejected tokens leave
  ``tool_mask`` (never ``completion_mask``) and ``num_items_in_batch`` (TRL's rule for a token out
  of the loss), and ``off_policy_sequence_mask_delta`` becomes TRL's own ``off_policy_mask_threshold``
  (its mask needs pi_theta of every micro-step). TRL's loss then runs unchanged, whatever its options.
* TRL semantics we follow: the off-policy mask multiplies the loss but stays in the bnpo/dapo
  denominators, and it averages its drift over the tokens left after token-level rejection.
* Sampler-aware r_corr: with top_k / top_p / min_p (read from ``vllm_generation`` and
  ``generation_kwargs``, where TRL takes them) vLLM's processed logprobs are renormalised over the
  kept set, TRL's pi_old is not. During TRL's own pi_old forward a hook reads the final hidden
  states and ``sampler_logprobs_from_hidden`` gives log(kept mass) chunk by chunk (fp32, no (N, V)
  logits, no extra backbone pass); r_corr uses ``pi_old - log(kept mass)``. The PPO ratio keeps
  TRL's full-vocabulary logprobs; TRL's off-policy mask gets the rollout logprobs shifted by the same
  log(kept mass). Refused: bypass with a truncating sampler, heads with logit scaling or soft-capping,
  a ``generation_kwargs`` temperature other than TRL's, sampler penalties.
* Diagnostics: ``rollout_correction/*`` once per generation batch, all-reduced over the
  data-parallel ranks; those needing pi_theta (C(r) split, off-policy fraction, ``policy/ppo_kl``)
  from a pass-through around ``_compute_loss`` that returns TRL's loss untouched. While our weights
  are in TRL's channel, TRL's ``sampling/*`` metrics describe them; TRL's ``clip_ratio/*`` stay.
* ``apply`` / ``revert`` / ``is_applied`` patch one trainer instance; ``revert`` also gives the
  batches still buffered in a generation window TRL's own values back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import shlex
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Mapping, Optional

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "rollout_parity.adapters.trl needs TRL (tested with trl>=1.15,<1.17): pip install rollout-parity[trl]"
    ) from exc

import torch

from rollout_parity.adapters._compat import FrameworkAPIError, check_framework
from rollout_parity.core.config import CorrectionConfig
from rollout_parity.core.correction import compute_correction
from rollout_parity.core.ratios import check_shapes
from rollout_parity.core.sampler import sampler_logprobs_from_hidden

__all__ = [
    "ParityGRPOConfig", "ParityGRPOTrainer", "MissingRolloutLogprobsError", "apply", "revert", "is_applied",
    "correction_config_from_args", "parity_vllm_engine", "server_command", "TESTED_TRL", "REQUIRED_TRL_NAMES",
]

logger = logging.getLogger(__name__)

#: TRL releases this adapter is tested with (the ``trl`` extra declares the same range).
TESTED_TRL = ">=1.15,<1.17"
#: Every private TRL name the adapter patches or calls, checked before anything is patched.
REQUIRED_TRL_NAMES = tuple(f"trl.trainer.grpo_trainer.GRPOTrainer.{name}" for name in (
    "_generate", "_generate_and_score_completions", "_get_per_token_logps_and_entropies", "_compute_loss",
)) + ("trl.trainer.utils.maybe_gather_lm_head_ctx",)
#: Trainer attributes (set in ``GRPOTrainer.__init__``) the adapter reads or sets.
_TRAINER_ATTRS = ("_metrics", "_buffered_inputs", "use_vllm", "loss_type", "temperature", "off_policy_mask_threshold",
                  "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                  "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min")
_PATCHED = ("_generate", "_generate_and_score_completions", "_get_per_token_logps_and_entropies", "_compute_loss")
_MARK = "__rollout_parity_patch__"
_STATE = "_rollout_parity"
_KEY = "rollout_parity/"  # our per-row tensors in TRL's batch dict (split and shuffled with it)
_ORIGINAL = _KEY + "trl/"  # TRL's own value of a key we replaced (None: TRL had none)
_TRL_SAMPLING_METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                         "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                         "sampling/importance_sampling_ratio/max")
_THETA_METRICS = tuple(f"rollout_correction/{k}" for k in (
    "loss_contrib_pos", "loss_contrib_neg", "loss_contrib_rollout_pos", "loss_contrib_rollout_neg",
    "off_policy_masked_frac"))
_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "bad_words",
              "allowed_token_ids", "min_tokens")
#: Head modifiers of the models TRL's fused head knows; an fp32 linear head can not reproduce them.
_HEAD_MODIFIERS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


class MissingRolloutLogprobsError(ValueError):
    """A correction is configured but the trainer has no sampler logprobs to correct against."""


# ----------------------------------------------------------------------------- config


def _shared_field(name: str) -> Any:
    """A dataclass field with the core's default and help text for one shared flag."""
    core = CorrectionConfig.__dataclass_fields__[name]
    return field(default=core.default, metadata={"help": f"[rollout-parity] {core.metadata.get('help', '')}"})


def _none_if_null(value: Any) -> Any:
    return None if isinstance(value, str) and value.strip().lower() in ("", "none", "null") else value


def _number_if_numeric(value: Any) -> Any:
    """CLI strings '0.001' -> 0.001; K1 ranges such as '0.5_2.0' stay strings."""
    try:
        return float(value) if isinstance(value, str) else value
    except ValueError:
        return value


@dataclass
class ParityGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the shared rollout-parity flags (DESIGN.md, "The shared flags").

    Parsed by ``TrlParser``/``HfArgumentParser`` like any TRL config: on the command line
    (``--rollout_importance_sampling_mode token_truncate``, list flags take several values) or in
    a TRL YAML file. TRL's own fields keep their defaults and meaning.
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

    def __post_init__(self) -> None:
        for name in ("rollout_importance_sampling_mode", "rollout_importance_sampling_threshold_lower",
                     "off_policy_sequence_mask_delta"):
            setattr(self, name, _none_if_null(getattr(self, name)))
        rejection = _none_if_null(self.rollout_rejection)
        self.rollout_rejection = [rejection] if isinstance(rejection, str) else (
            list(rejection) if rejection is not None else None)
        threshold = _none_if_null(self.rollout_rejection_threshold)
        if isinstance(threshold, (list, tuple)):
            threshold = [_number_if_numeric(v) for v in threshold]
            threshold = threshold[0] if len(threshold) == 1 else threshold
        self.rollout_rejection_threshold = _number_if_numeric(threshold)
        self.correction_config()  # validates; the error names the flag
        super().__post_init__()

    def correction_config(self) -> CorrectionConfig:
        """The core's ``CorrectionConfig`` for these flags."""
        return CorrectionConfig(**{name: getattr(self, name) for name in CorrectionConfig.field_names()})


def correction_config_from_args(args: Any) -> CorrectionConfig:
    """``CorrectionConfig`` from a ``ParityGRPOConfig``; the default (nothing on) otherwise."""
    return args.correction_config() if isinstance(args, ParityGRPOConfig) else CorrectionConfig()


def _as_config(config: CorrectionConfig | Mapping[str, Any] | None, args: Any) -> CorrectionConfig:
    if config is None:
        return correction_config_from_args(args)
    return config if isinstance(config, CorrectionConfig) else CorrectionConfig.from_dict(config)


def _needs_rollout(cfg: CorrectionConfig) -> bool:
    return cfg.wants_metrics or cfg.old_logprob_source == "bypass"


def _describe(cfg: CorrectionConfig) -> str:
    """The flags that differ from their defaults, as ``name=value`` (for messages)."""
    default = CorrectionConfig().to_dict()
    return ", ".join(f"{k}={v!r}" for k, v in cfg.to_dict().items() if v != default[k]) or "defaults"


# ----------------------------------------------------------------------------- vLLM parity


@contextlib.contextmanager
def parity_vllm_engine(fp32_lm_head: bool = False, prefix_cache_policy: str = "off") -> Iterator[dict]:
    """Build TRL's colocated ``vllm.LLM`` with the parity recipe while the block runs.

    Wraps the ``LLM`` global of ``trl.generation.vllm_generation`` so every engine TRL builds
    inside the block gets ``vllm_parity_kwargs(fp32_lm_head)`` on top of TRL's own kwargs (the
    recipe wins; ``hf_overrides`` are merged). Yields a dict that receives the final kwargs under
    ``"kwargs"``. Restores the original on exit.
    """
    from trl.generation import vllm_generation

    from rollout_parity.core.vllm_recipe import vllm_parity_kwargs

    built: dict[str, Any] = {}
    original = getattr(vllm_generation, "LLM", None)
    if original is None or getattr(original, _MARK, False):  # no vLLM (TRL raises its own error), or nested
        yield built
        return
    recipe = vllm_parity_kwargs(fp32_lm_head=fp32_lm_head, prefix_cache_policy=prefix_cache_policy)

    @functools.wraps(original)
    def llm_with_parity_recipe(*args: Any, **kwargs: Any) -> Any:
        merged = {**kwargs, **recipe, "hf_overrides": {**(kwargs.get("hf_overrides") or {}),
                                                       **recipe.get("hf_overrides", {})}}
        if not merged["hf_overrides"]:
            del merged["hf_overrides"]
        changed = [f"{k}: {kwargs.get(k)!r} -> {merged[k]!r}" for k in merged if kwargs.get(k) != merged[k]]
        if changed:
            logger.info("rollout-parity: TRL's vLLM engine built with the parity recipe: %s", ", ".join(changed))
        built["kwargs"] = merged
        return original(*args, **merged)

    setattr(llm_with_parity_recipe, _MARK, True)
    vllm_generation.LLM = llm_with_parity_recipe
    try:
        yield built
    finally:
        vllm_generation.LLM = original


def server_command(model: str, fp32_lm_head: bool = False, prefix_cache_policy: str = "off",
                   extra_args: Optional[list[str]] = None) -> str:
    """The ``trl vllm-serve`` command line that serves ``model`` with the parity recipe.

    TRL adds ``--logprobs-mode processed_logprobs`` itself; ``--enable_prefix_caching`` is TRL's
    option; the rest is forwarded by TRL to ``vllm serve`` unchanged.
    """
    from rollout_parity.core.vllm_recipe import vllm_serve_flags

    flags = vllm_serve_flags(fp32_lm_head, prefix_cache_policy, style="trl")
    return shlex.join(["trl", "vllm-serve", "--model", str(model), *flags, *(extra_args or [])])


def _server_recipe(trainer: Any, fp32_lm_head: bool) -> dict[str, bool]:
    """The recipe checked on the live server through TRL's own client (``/server_info``)."""
    client = trainer.vllm_generation.vllm_client
    if hasattr(client, "get_server_info"):  # TRL >= 1.16
        info = client.get_server_info()
    else:  # TRL 1.15's client has no wrapper for the endpoint: the same request through its session
        info = client._get(f"{client.base_url}/server_info", params={"config_format": "json"})["vllm_config"]
    model, cache, scheduler = info["model_config"], info["cache_config"], info["scheduler_config"]
    checks = {"logprobs_mode": model.get("logprobs_mode") == "processed_logprobs",
              "async_scheduling_off": not scheduler.get("async_scheduling"),
              "prefix_caching_off": not cache.get("enable_prefix_caching")}
    if fp32_lm_head:
        head = model.get("head_dtype") or (model.get("hf_overrides") or {}).get("head_dtype") or model.get("dtype")
        checks["fp32_lm_head"] = str(head).replace("torch.", "") in ("float32", "fp32")
    return checks


def _check_engine(trainer: Any, cfg: CorrectionConfig) -> Optional[dict[str, bool]]:
    """Verify TRL's vLLM (colocated engine or server) against the recipe; raise only for what biases r_corr."""
    if not trainer.use_vllm or not trainer.accelerator.is_main_process:
        return None
    mode = getattr(trainer, "vllm_mode", None)
    generation = getattr(trainer, "vllm_generation", None)
    try:
        if mode == "server":
            checks = _server_recipe(trainer, cfg.fp32_lm_head)
        elif getattr(generation, "llm", None) is not None:
            from rollout_parity.core.vllm_recipe import verify_engine

            checks = verify_engine(generation.llm, fp32_lm_head=cfg.fp32_lm_head)
        else:
            return None
    except Exception as exc:  # noqa: BLE001 - a server without /server_info: say so, do not guess
        logger.warning("rollout-parity: could not read TRL's vLLM %s configuration (%s); the parity recipe is "
                       "unverified", mode, exc)
        return None
    failed = [k for k, ok in checks.items() if not ok]
    if "logprobs_mode" in failed and _needs_rollout(cfg):
        raise ValueError(f"TRL's vLLM {mode} engine returns raw logprobs, not processed_logprobs: r_corr would carry "
                         "the sampler's temperature and truncation as mismatch. Serve it with --logprobs-mode "
                         f"processed_logprobs (server_command() prints the recipe)")
    if failed:
        logger.warning("rollout-parity: TRL's vLLM %s engine misses the parity recipe (%s); use ParityGRPOTrainer "
                       "(colocate) or serve with: %s", mode, ", ".join(failed),
                       server_command(trainer.model.name_or_path, fp32_lm_head=cfg.fp32_lm_head))
    return checks


# ----------------------------------------------------------------------------- sampling parameters


@dataclass(frozen=True)
class _Sampling:
    temperature: float
    top_k: Optional[int]
    top_p: float
    min_p: float

    @property
    def truncates(self) -> bool:
        return bool(self.top_k and self.top_k > 0) or self.top_p < 1.0 or self.min_p > 0.0


def _effective_sampling(trainer: Any) -> tuple[_Sampling, dict[str, Any]]:
    """vLLM's sampling parameters where TRL takes them: ``vllm_generation`` overridden by ``generation_kwargs``."""
    source = getattr(trainer, "vllm_generation", None) or trainer
    kwargs = dict(getattr(source, "generation_kwargs", None) or getattr(trainer.args, "generation_kwargs", None) or {})
    value = {k: kwargs.get(k, getattr(source, k, None)) for k in ("temperature", "top_k", "top_p", "min_p")}
    sampling = _Sampling(temperature=float(value["temperature"] if value["temperature"] is not None else 1.0),
                         top_k=value["top_k"] if value["top_k"] not in (None, 0, -1) else None,
                         top_p=float(value["top_p"] if value["top_p"] is not None else 1.0),
                         min_p=float(value["min_p"] or 0.0))
    penalties = {k: kwargs[k] for k in _PENALTIES if kwargs.get(k) not in (None, 1.0, 0.0, 0, [], {})}
    if getattr(source, "repetition_penalty", 1.0) not in (None, 1.0) and "repetition_penalty" not in kwargs:
        penalties["repetition_penalty"] = source.repetition_penalty
    return sampling, penalties


def _refuse_sampling(trainer: Any, cfg: CorrectionConfig) -> _Sampling:
    sampling, penalties = _effective_sampling(trainer)
    if not _needs_rollout(cfg):
        return sampling
    if abs(sampling.temperature - float(trainer.temperature)) > 1e-12:
        raise ValueError(f"generation_kwargs temperature={sampling.temperature} differs from temperature="
                         f"{trainer.temperature}, which TRL's trainer log-probs (pi_old, pi_theta) use: r_corr would "
                         "compare two temperatures. Set GRPOConfig.temperature instead")
    if penalties and cfg.changes_loss:
        raise ValueError(f"{', '.join(f'{k}={v!r}' for k, v in penalties.items())}: vLLM's processed logprobs then "
                         "include sampler penalties no trainer log-prob reproduces, so r_corr would correct them as "
                         "mismatch. Sample without them, or use log_rollout_offpolicy_metrics alone to measure")
    if sampling.truncates:
        what = f"top_k={sampling.top_k}, top_p={sampling.top_p}, min_p={sampling.min_p}"
        if cfg.old_logprob_source == "bypass":
            raise ValueError(f"old_logprob_source='bypass' with a truncating sampler ({what}): pi_old would be vLLM's "
                             "renormalised logprobs while TRL's pi_theta is over the whole vocabulary, a log(kept mass) "
                             "bias in every PPO ratio. Use old_logprob_source='recompute' (sampler-aware r_corr)")
        text = trainer.accelerator.unwrap_model(trainer.model).config.get_text_config()
        modifiers = {k: getattr(text, k) for k in _HEAD_MODIFIERS if getattr(text, k, None) not in (None, 1, 1.0)}
        if modifiers:
            raise ValueError(f"{what} with a head that has {modifiers}: the sampler-aware r_corr renormalises a plain "
                             "linear head's logits and can not reproduce logit scaling or soft-capping")
    return sampling


# ----------------------------------------------------------------------------- apply / revert


@dataclass
class _State:
    config: CorrectionConfig
    saved_flags: dict[str, Any] = dataclasses.field(default_factory=dict)  # trainer attribute -> its old value
    engine_checks: Optional[dict[str, bool]] = None
    capture_old: bool = False  # the next forward is TRL's pi_old forward: measure log(kept mass) on it
    kept_mass: Optional[list] = None
    loss_logps: Optional[list] = None

    @property
    def hands_weights(self) -> bool:
        """Our weights (or ones) replace TRL's ratio; otherwise TRL's own ratio acts as configured."""
        return (self.config.changes_loss or self.config.old_logprob_source == "bypass"
                or "vllm_importance_sampling_correction" in self.saved_flags)


def is_applied(trainer: Any) -> bool:
    return _STATE in getattr(trainer, "__dict__", {})


def _check_trl(trainer: Any) -> None:
    check_framework("TRL", distributions=("trl",), tested=TESTED_TRL, extra="trl", required=REQUIRED_TRL_NAMES)
    missing = [f"GRPOTrainer.{name}" for name in _TRAINER_ATTRS if not hasattr(trainer, name)]
    if missing:
        raise FrameworkAPIError(f"rollout-parity's TRL adapter needs {', '.join(missing)}, which this trainer does "
                                f"not have; it is tested with TRL {TESTED_TRL}")


def _own(trainer: Any, name: str) -> Any:
    """TRL's own value of a trainer attribute, even while ``apply`` has set it."""
    state = trainer.__dict__.get(_STATE)
    return state.saved_flags[name] if state is not None and name in state.saved_flags else getattr(trainer, name)


def _refuse(trainer: Any, cfg: CorrectionConfig) -> None:
    """Everything that can not be expressed through TRL's channels, by name, before any mutation."""
    args = trainer.args
    if _needs_rollout(cfg) and not trainer.use_vllm:
        raise MissingRolloutLogprobsError(
            f"{_describe(cfg)} needs the sampler's per-token logprobs and TRL's importance_sampling_ratio channel, but "
            "this GRPOTrainer has use_vllm=False: TRL keeps sampler logprobs, recomputes pi_old and applies the ratio "
            "only when it generates with vLLM (colocate or server, or a rollout_func with use_vllm=True)")
    if cfg.fp32_lm_head and not getattr(args, "cast_lm_head_to_fp32", False):
        raise ValueError("fp32_lm_head=True on an already-built GRPOTrainer whose cast_lm_head_to_fp32 is False: TRL's "
                         "fused log-prob head fixes its fp32 projection at construction. Build the trainer with "
                         "GRPOConfig(cast_lm_head_to_fp32=True), or use ParityGRPOTrainer")
    if cfg.changes_loss:
        defaults = GRPOConfig.__dataclass_fields__
        ours = {k: getattr(trainer, k) for k in ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
                                                 "vllm_importance_sampling_clip_min")
                if getattr(trainer, k) != defaults[k].default}
        if ours:
            raise ValueError(f"{', '.join(f'{k}={v!r}' for k, v in ours.items())} configures TRL's own importance "
                             "sampling, which rollout-parity's correction replaces in the same channel (the mismatch "
                             "would be corrected by one of two configurations, silently). Drop one of them")
    own_threshold = _own(trainer, "off_policy_mask_threshold")
    if cfg.off_policy_sequence_mask_delta is not None and own_threshold is not None:
        raise ValueError(f"off_policy_mask_threshold={own_threshold} together with "
                         f"off_policy_sequence_mask_delta={cfg.off_policy_sequence_mask_delta}: the shared flag is "
                         "handed to TRL as off_policy_mask_threshold; set only one")
    if trainer.loss_type == "vespo" and (cfg.rollout_importance_sampling_mode or "").startswith("sequence"):
        raise ValueError(f"rollout_importance_sampling_mode={cfg.rollout_importance_sampling_mode!r} with "
                         "loss_type='vespo': VESPO sums log(importance_sampling_ratio) over each sequence's tokens, so "
                         "a sequence weight broadcast to its tokens would count T times (TRL refuses sequence modes "
                         "for vespo too). Use token_truncate or token_mask")
    _refuse_sampling(trainer, cfg)
    for name in _PATCHED:
        current = trainer.__dict__.get(name)
        if current is not None and not getattr(current, _MARK, False):
            raise ValueError(f"{type(trainer).__name__}.{name} is already replaced on this instance by "
                             f"{getattr(current, '__qualname__', current)!r}; rollout-parity does not stack on "
                             "another patch (revert that one first)")


def apply(trainer: Any, config: CorrectionConfig | Mapping[str, Any] | None = None) -> Any:
    """Make ``trainer`` (a ``GRPOTrainer``) use rollout-parity's correction and diagnostics.

    ``config`` defaults to the trainer's ``ParityGRPOConfig`` flags. Idempotent; a different
    config replaces the previous one (validated first: a refused config leaves it in place).
    Returns the trainer.
    """
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"apply expects a trl.GRPOTrainer, got {type(trainer).__name__}")
    _check_trl(trainer)
    cfg = _as_config(config, trainer.args)
    previous = trainer.__dict__.get(_STATE)
    if previous is not None and previous.config == cfg:
        return trainer
    _refuse(trainer, cfg)  # before any mutation: a refused config leaves the previous one in place
    revert(trainer)
    state = _State(config=cfg)
    if _needs_rollout(cfg):
        if not trainer.vllm_importance_sampling_correction:  # the channel, and TRL's pi_old recomputation
            _set_flag(trainer, state, "vllm_importance_sampling_correction", True)
        elif state.hands_weights:
            logger.info("rollout-parity: TRL's importance_sampling_ratio is replaced by rollout-parity's (%s)",
                        _describe(cfg))
        if cfg.off_policy_sequence_mask_delta is not None:
            _set_flag(trainer, state, "off_policy_mask_threshold", cfg.off_policy_sequence_mask_delta)
        _patch(trainer, "_generate", functools.partial(_checked_generate, state))
        _patch(trainer, "_generate_and_score_completions", functools.partial(_corrected_generation, state))
        _patch(trainer, "_get_per_token_logps_and_entropies", functools.partial(_observed_forward, state))
        if cfg.wants_metrics:
            _patch(trainer, "_compute_loss", functools.partial(_diagnosed_loss, state))
    state.engine_checks = _check_engine(trainer, cfg)
    trainer.__dict__[_STATE] = state
    return trainer


def _patch(trainer: Any, name: str, behaviour: Any) -> None:
    """Instance attribute wrapping the class method: ``__wrapped__`` is the original, one marker."""
    original = getattr(type(trainer), name).__get__(trainer)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return behaviour(original, *args, **kwargs)

    setattr(wrapper, _MARK, True)
    trainer.__dict__[name] = wrapper
    logger.info("rollout-parity: patched %s.%s on this trainer", type(trainer).__name__, name)


def _set_flag(trainer: Any, state: _State, name: str, value: Any) -> None:
    state.saved_flags[name] = getattr(trainer, name)
    logger.info("rollout-parity: %s: %r -> %r (revert() restores it)", name, state.saved_flags[name], value)
    setattr(trainer, name, value)


def revert(trainer: Any) -> bool:
    """Undo ``apply``: TRL's methods, flags and buffered batch values come back. False if nothing was applied.

    Safe at any point of a generation window: the slices TRL still holds in ``_buffered_inputs`` get
    TRL's own ``importance_sampling_ratio``, ``tool_mask``, ``num_items_in_batch``, sampler and old
    logprobs back, so the rest of the window trains as unpatched TRL would.
    """
    state = trainer.__dict__.pop(_STATE, None)
    if state is None:
        return False
    for name in _PATCHED:
        if getattr(trainer.__dict__.get(name), _MARK, False):
            del trainer.__dict__[name]
    for name, value in state.saved_flags.items():
        setattr(trainer, name, value)
    for batch in getattr(trainer, "_buffered_inputs", None) or []:
        _restore_trl_values(batch)
    return True


def _restore_trl_values(batch: dict) -> None:
    for key in [k for k in batch if k.startswith(_KEY)]:
        value = batch.pop(key)
        if key.startswith(_ORIGINAL):
            name = key[len(_ORIGINAL):]
            if value is None:
                batch.pop(name, None)
            else:
                batch[name] = value


# ----------------------------------------------------------------------------- the generation batch


def _checked_generate(state: _State, original: Any, prompts: list) -> tuple:
    """TRL's ``_generate``, checked before TRL's own ratio code reads its sampler logprobs."""
    result = original(prompts)
    if len(result) != 8:
        raise FrameworkAPIError(f"GRPOTrainer._generate returned {len(result)} values; the adapter expects the 8 of "
                                f"TRL {TESTED_TRL}")
    completion_ids, logprobs = result[1], result[4]
    if logprobs is None:
        raise MissingRolloutLogprobsError(f"{_describe(state.config)} needs the sampler's per-token logprobs, but the "
                                          "generator returned none (a rollout_func must return 'logprobs')")
    for ids, lps in zip(completion_ids, logprobs):  # one list per completion, aligned token by token
        if len(ids) != len(lps):
            check_shapes("completion_ids", torch.empty(1, len(ids), device="meta"),
                         sampling_logprobs=torch.empty(1, len(lps), device="meta"))
    return result


def _process_group(trainer: Any) -> Any:
    if trainer.accelerator.num_processes > 1 and torch.distributed.is_initialized():
        return torch.distributed.group.WORLD
    return None


def _all_reduce(values: torch.Tensor, group: Any, op: str = "SUM") -> torch.Tensor:
    if group is not None:
        torch.distributed.all_reduce(values, op=getattr(torch.distributed.ReduceOp, op), group=group)
    return values


def _observed_forward(state: _State, original: Any, model: Any, input_ids: Any, attention_mask: Any,
                      logits_to_keep: int, *args: Any, **kwargs: Any) -> Any:
    """TRL's log-prob forward, observed: log(kept mass) on pi_old's forward, pi_theta of the loss's forward."""
    if state.capture_old:
        state.capture_old = False  # TRL's first forward of a generation batch is pi_old (the reference's comes after)
        with _kept_mass_hook(original.__self__, model, logits_to_keep, state.kept_mass):
            result = original(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
    else:
        result = original(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
    if state.loss_logps is not None and kwargs.get("compute_entropy"):
        state.loss_logps.append(result[0].detach())
    return result


@contextlib.contextmanager
def _kept_mass_hook(trainer: Any, model: Any, logits_to_keep: int, sink: list) -> Iterator[None]:
    """While TRL's pi_old forward runs, ``log p_T - log q`` of each sampled token from the final hidden states.

    ``sampler_logprobs_from_hidden`` projects chunk by chunk in fp32 (under ZeRO-3 inside TRL's
    own gather of the head), so no (N, V) logits are held and the backbone runs once.
    """
    from trl.trainer.utils import maybe_gather_lm_head_ctx

    sampling = _refuse_sampling(trainer, trainer.__dict__[_STATE].config)
    base = trainer.accelerator.unwrap_model(model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    head = base.get_output_embeddings()

    def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        hidden = output.last_hidden_state[:, -logits_to_keep - 1:-1]
        weight, bias = head.weight, head.bias
        with maybe_gather_lm_head_ctx(weight, bias):
            full = weight.full_tensor() if hasattr(weight, "full_tensor") else weight  # FSDP2 DTensor
            lp = sampler_logprobs_from_hidden(hidden, full, ids[:, -logits_to_keep:], sampling.temperature,
                                              sampling.top_k, sampling.top_p, sampling.min_p, bias=bias)
        sink.append(lp.full - lp.processed)

    handle = base.base_model.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _corrected_generation(state: _State, original: Any, inputs: Any) -> dict:
    """TRL's generation batch, then ``compute_correction`` once, handed over through TRL's channels."""
    trainer = original.__self__
    cfg = state.config
    if _refuse_sampling(trainer, cfg).truncates and cfg.old_logprob_source != "bypass":
        state.capture_old, state.kept_mass = True, []
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    lengths = {k: len(metrics[k]) for k in _TRL_SAMPLING_METRICS if k in metrics}
    try:
        output = original(inputs)
        kept_mass = torch.cat(state.kept_mass) if state.kept_mass else None
    finally:
        state.capture_old, state.kept_mass = False, None
    completion_mask, tool_mask = output["completion_mask"], output.get("tool_mask")
    loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask
    rollout, old = output["sampling_per_token_logps"], output.get("old_per_token_logps")
    if old is None:
        raise FrameworkAPIError("TRL computed no old_per_token_logps although vllm_importance_sampling_correction is "
                                "on; the adapter is tested with TRL " + TESTED_TRL)
    if kept_mass is None:
        kept_mass = torch.zeros_like(old)
    check_shapes("old_per_token_logps", old, log_kept_mass=kept_mass)
    kept_mass = torch.where(loss_mask != 0, kept_mass, 0.0)  # +inf (outside the kept set) only where it counts
    old_corr = old - kept_mass
    bypass = cfg.old_logprob_source == "bypass"
    group = _process_group(trainer)
    out = compute_correction(cfg.replace(off_policy_sequence_mask_delta=None), old_logprobs=old_corr,
                             rollout_logprobs=rollout, response_mask=loss_mask,
                             current_logprobs=old if bypass else None, process_group=group,
                             with_metrics=cfg.wants_metrics or state.hands_weights)
    logged = {k: v for k, v in out.metrics.items() if k not in _THETA_METRICS}
    output[_KEY + "old"] = old_corr  # for the pi_theta diagnostics of each micro-step
    output[_KEY + "response_mask"] = loss_mask
    output[_KEY + "kept_mass"] = kept_mass
    if state.hands_weights:
        kept = out.mask != 0
        ratio = torch.where(kept, out.weights, torch.ones_like(out.weights)).to(old.dtype)
        _hand_over(output, "importance_sampling_ratio", ratio, trl_had_it=_trl_ratio_acts(state))
        if cfg.rollout_rejection is not None:
            keep = kept.to(completion_mask.dtype)
            _hand_over(output, "tool_mask", keep if tool_mask is None else tool_mask * keep)
            removed = _all_reduce((loss_mask != 0).sum() - kept.sum(), group)
            items = output["num_items_in_batch"]
            _hand_over(output, "num_items_in_batch", items - removed.to(items))
        if cfg.off_policy_sequence_mask_delta is not None:  # TRL's mask reads pi_behaviour from here
            behaviour = rollout + kept_mass
            _hand_over(output, "sampling_per_token_logps", behaviour.masked_fill(~behaviour.isfinite(), math.nan))
        if bypass:  # pi_old := pi_rollout; an engine's NaN / inf falls back to the recomputed pi_old (counted)
            _hand_over(output, "old_per_token_logps", torch.where(rollout.isfinite(), rollout, old))
        for name in _TRL_SAMPLING_METRICS:  # what TRL appended describes a ratio that no longer acts
            if name in metrics:
                del metrics[name][lengths.get(name, 0):]
        logged.update(_sampling_metrics(ratio, kept, out.metrics, group))
    for name, value in logged.items():
        metrics[name].append(value)
    return output


def _hand_over(output: dict, name: str, value: torch.Tensor, trl_had_it: bool = True) -> None:
    """Put ``value`` into TRL's batch under ``name``, keeping TRL's own value for ``revert``."""
    output.setdefault(_ORIGINAL + name, output.get(name) if trl_had_it else None)
    output[name] = value


def _trl_ratio_acts(state: _State) -> bool:
    """Whether unpatched TRL would apply its ratio (its flag was on before we touched it)."""
    return state.saved_flags.get("vllm_importance_sampling_correction", True)


def _sampling_metrics(ratio: torch.Tensor, kept: torch.Tensor, ours: dict, group: Any) -> dict[str, float]:
    """TRL's ``sampling/*`` names, describing the weights that act: global min / mean / max over kept tokens."""
    inf = torch.tensor(math.inf, dtype=ratio.dtype, device=ratio.device)
    sums = _all_reduce(torch.stack([(ratio * kept).sum(), kept.sum().to(ratio.dtype)]), group)
    extremes = _all_reduce(torch.stack([torch.where(kept, ratio, -inf).max(), torch.where(kept, -ratio, -inf).max()]),
                           group, "MAX")
    n, total, high, neg_low = sums[1].item(), sums[0].item(), extremes[0].item(), extremes[1].item()
    return {"sampling/sampling_logp_difference/mean": ours.get("rollout_correction/delta_abs_mean", 0.0),
            "sampling/sampling_logp_difference/max": ours.get("rollout_correction/delta_abs_max", 0.0),
            "sampling/importance_sampling_ratio/min": -neg_low if n else 1.0,
            "sampling/importance_sampling_ratio/mean": total / n if n else 1.0,
            "sampling/importance_sampling_ratio/max": high if n else 1.0}


# ----------------------------------------------------------------------------- diagnostics around TRL's loss


def _diagnosed_loss(state: _State, original: Any, model: Any, inputs: Mapping[str, Any]) -> torch.Tensor:
    """TRL's ``_compute_loss``, returned untouched, plus the diagnostics that need its pi_theta."""
    state.loss_logps = []
    try:
        loss = original(model, inputs)
        captured = state.loss_logps
    finally:
        state.loss_logps = None
    if not captured or _KEY + "old" not in inputs:
        return loss
    trainer = original.__self__
    current, old = captured[0], inputs[_KEY + "old"]
    rollout = inputs.get(_ORIGINAL + "sampling_per_token_logps", inputs["sampling_per_token_logps"])
    group = _process_group(trainer)
    # pi_theta minus the same log(kept mass): pi_theta / pi_old is TRL's PPO ratio, times r_corr the rollout one.
    out = compute_correction(state.config, old_logprobs=old, rollout_logprobs=rollout,
                             response_mask=inputs[_KEY + "response_mask"], advantages=inputs["advantages"],
                             current_logprobs=current - inputs[_KEY + "kept_mass"], process_group=group,
                             with_metrics=True)
    trl_mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
    trl_old = inputs.get("old_per_token_logps", current)
    drift = torch.where(trl_mask != 0, (trl_old - current).nan_to_num(0.0, 0.0, 0.0), torch.zeros_like(current))
    kl = _all_reduce(torch.stack([drift.sum(), (trl_mask != 0).sum().to(drift.dtype)]), group)
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    for name in _THETA_METRICS:
        metrics[name].append(out.metrics[name])
    metrics["policy/ppo_kl"].append((kl[0] / kl[1].clamp(min=1.0)).item())
    return loss


# ----------------------------------------------------------------------------- the trainer


class ParityGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with rollout-parity's correction, diagnostics and vLLM parity recipe.

    Takes the shared flags from a ``ParityGRPOConfig`` (or ``rollout_correction=`` with a plain
    ``GRPOConfig``, else ``rollout_correction_default``, which ``rollout-parity launch`` sets). In
    colocate mode the engine is built with ``vllm_parity_kwargs``; in server mode the live server
    is checked at start. ``fp32_lm_head`` turns TRL's own ``cast_lm_head_to_fp32`` on (logged).
    ``revert(trainer)`` restores TRL's own behaviour (engine and head keep their recipe).
    """

    rollout_correction_default: ClassVar[Optional[CorrectionConfig]] = None

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, *rest: Any,
                 rollout_correction: CorrectionConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if rollout_correction is None and not isinstance(args, ParityGRPOConfig):
            rollout_correction = type(self).rollout_correction_default
        cfg = _as_config(rollout_correction, args)
        if args is not None:
            if _needs_rollout(cfg) and not args.use_vllm:
                raise MissingRolloutLogprobsError(
                    f"{_describe(cfg)} needs the sampler's logprobs, but use_vllm=False: TRL keeps them and applies "
                    "importance_sampling_ratio only when it generates with vLLM")
            if cfg.fp32_lm_head and not args.cast_lm_head_to_fp32:
                logger.info("rollout-parity: cast_lm_head_to_fp32: False -> True (fp32_lm_head=True)")
                args.cast_lm_head_to_fp32 = True
        colocate = args is not None and args.use_vllm and args.vllm_mode == "colocate"
        engine = parity_vllm_engine(fp32_lm_head=cfg.fp32_lm_head) if colocate else contextlib.nullcontext({})
        with engine as built:
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self.rollout_parity_engine_kwargs = built.get("kwargs")
        apply(self, cfg)

    @property
    def rollout_correction(self) -> Optional[CorrectionConfig]:
        state = self.__dict__.get(_STATE)
        return None if state is None else state.config

    @property
    def rollout_parity_engine_checks(self) -> Optional[dict[str, bool]]:
        state = self.__dict__.get(_STATE)
        return None if state is None else state.engine_checks
