"""TRL adapter: the shared flags of DESIGN.md in TRL's ``GRPOTrainer``, through TRL's own loss.

TRL 1.15/1.16 (``trl/trainer/grpo_trainer.py``): ``_generate_and_score_completions`` builds a
generation batch with the sampler's logprobs, pi_old (``old_per_token_logps``, recomputed whenever
``use_vllm and vllm_importance_sampling_correction``: the decoupled pi_old), ``completion_mask`` (also
the attention mask), the loss-only ``tool_mask``, ``num_items_in_batch`` and its own
``importance_sampling_ratio``, reused for ``steps_per_generation`` x ``num_iterations`` micro-steps.
``_compute_loss`` runs every ``loss_type``, ``beta``, ``delta``, GSPO, entropy masking and bonus, the
MoE router loss and ``off_policy_mask_threshold`` over ``completion_mask * tool_mask``, and multiplies
the policy loss by ``importance_sampling_ratio`` when that flag is on (vespo folds it in).

Here ``compute_correction`` runs once per generation batch and TRL's loss gets it through its own
channels: the (B, T) weights as ``importance_sampling_ratio`` (1 off the loss, so vespo's log-sum sees
kept tokens only); rejected tokens out of ``tool_mask`` (never ``completion_mask``) and of
``num_items_in_batch`` (TRL's rule for a token out of the loss); ``off_policy_sequence_mask_delta`` as
TRL's own ``off_policy_mask_threshold``, which needs pi_theta of each micro-step (TRL's semantics: it
multiplies the loss, its sequences stay in the bnpo/dapo token counts, its drift is averaged over the
tokens left after rejection).

r_corr is sampler-aware: with top_k / top_p / min_p (from ``vllm_generation`` and
``generation_kwargs``, where TRL takes them) vLLM's processed logprobs are renormalised over the kept
set, TRL's pi_old is not. A hook on TRL's own pi_old forward hands its hidden states to
``sampler_logprobs_from_hidden`` (chunked fp32 head, no (N, V) logits, no extra backbone pass): r_corr
uses ``pi_old - log S`` (S: the kept mass), the PPO ratio keeps TRL's full-vocabulary logprobs.
Refused by name: bypass with a truncating sampler, logit-scaled or soft-capped heads, a
``generation_kwargs`` temperature other than TRL's, sampler penalties.

Diagnostics: ``rollout_correction/*`` per generation batch, all-reduced over data-parallel ranks; those
needing pi_theta (C(r) split, off-policy fraction, ``policy/ppo_kl``) from a pass-through around
``_compute_loss`` that returns TRL's loss untouched. While our weights are in TRL's channel its
``sampling/*`` metrics describe them; its ``clip_ratio/*`` stay.
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
from rollout_parity.core.sampler import kept_mass_metrics, sampler_logprobs_from_hidden

__all__ = ["ParityGRPOConfig", "ParityGRPOTrainer", "MissingRolloutLogprobsError", "apply", "revert", "is_applied",
           "correction_config_from_args", "parity_vllm_engine", "server_command", "TESTED_TRL", "REQUIRED_TRL_NAMES"]

logger = logging.getLogger(__name__)

#: TRL releases this adapter is tested with (the ``trl`` extra declares the same range).
TESTED_TRL = ">=1.15,<1.17"
_PATCHED = ("_generate", "_generate_and_score_completions", "_get_per_token_logps_and_entropies", "_compute_loss")
#: Private TRL names used, checked before patching. Before the fused head (1.15) cast_lm_head_to_fp32 made fp32 params.
REQUIRED_TRL_NAMES = tuple(f"trl.trainer.grpo_trainer.GRPOTrainer.{name}" for name in _PATCHED) + (
    "trl.trainer.utils.maybe_gather_lm_head_ctx", "trl.trainer.utils.add_fused_lm_head")
_TRL_RATIO_FIELDS = ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
                     "vllm_importance_sampling_clip_min")
#: Trainer attributes (set in ``GRPOTrainer.__init__``) the adapter reads or sets.
_TRAINER_ATTRS = ("_metrics", "_buffered_inputs", "use_vllm", "loss_type", "temperature", "off_policy_mask_threshold",
                  "vllm_importance_sampling_correction", *_TRL_RATIO_FIELDS)
_MARK, _STATE = "__rollout_parity_patch__", "_rollout_parity"
_KEY = "rollout_parity/"  # our per-row tensors in TRL's batch dict (split and shuffled with it)
_ORIGINAL = _KEY + "trl/"  # TRL's own value of a key we replaced (None: TRL had none)
_TRL_SAMPLING_METRICS = tuple(f"sampling/{k}" for k in (
    "sampling_logp_difference/mean", "sampling_logp_difference/max", "importance_sampling_ratio/min",
    "importance_sampling_ratio/mean", "importance_sampling_ratio/max"))
_THETA_METRICS = tuple(f"rollout_correction/{k}" for k in (
    "loss_contrib_pos", "loss_contrib_neg", "loss_contrib_rollout_pos", "loss_contrib_rollout_neg",
    "off_policy_masked_frac"))
_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "bad_words",
              "allowed_token_ids", "min_tokens")
#: Head modifiers TRL's fused head knows; a plain linear head (what we renormalise) has none.
_HEAD_MODIFIERS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                   "logits_scaling")


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


def _items(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def _describe(cfg: CorrectionConfig) -> str:
    """The flags that differ from their defaults, as ``name=value`` (for messages)."""
    default = CorrectionConfig().to_dict()
    return _items({k: v for k, v in cfg.to_dict().items() if v != default[k]}) or "defaults"


# ----------------------------------------------------------------------------- vLLM parity


@contextlib.contextmanager
def parity_vllm_engine(fp32_lm_head: bool = False, prefix_cache_policy: str = "off") -> Iterator[dict]:
    """Build TRL's colocated ``vllm.LLM`` with the parity recipe while the block runs.

    Wraps the ``LLM`` global of ``trl.generation.vllm_generation``: TRL's kwargs plus
    ``vllm_parity_kwargs`` (the recipe wins, ``hf_overrides`` merge). Yields a dict that gets the
    final kwargs under ``"kwargs"``.
    """
    from trl.generation import vllm_generation

    from rollout_parity.core.vllm_recipe import vllm_parity_kwargs

    built: dict[str, Any] = {}
    original = getattr(vllm_generation, "LLM", None)
    if original is None or getattr(original, _MARK, False):  # no vLLM (TRL raises its own error), or nested
        yield built
        return
    recipe = vllm_parity_kwargs(fp32_lm_head=fp32_lm_head, prefix_cache_policy=prefix_cache_policy)

    def llm_with_parity_recipe(*args: Any, **kwargs: Any) -> Any:
        merged = {**kwargs, **recipe}
        if "hf_overrides" in recipe:
            merged["hf_overrides"] = {**(kwargs.get("hf_overrides") or {}), **recipe["hf_overrides"]}
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
    """The ``trl vllm-serve`` command that serves ``model`` with the parity recipe (TRL forwards
    what it does not know to ``vllm serve``; it adds ``--logprobs-mode processed_logprobs`` itself)."""
    from rollout_parity.core.vllm_recipe import vllm_serve_flags

    flags = vllm_serve_flags(fp32_lm_head, prefix_cache_policy, style="trl")
    return shlex.join(["trl", "vllm-serve", "--model", str(model), *flags, *(extra_args or [])])


def _check_engine(trainer: Any, cfg: CorrectionConfig) -> Optional[dict[str, bool]]:
    """TRL's vLLM (colocated, or a server via TRL's client) against the recipe: warn; raise for raw logprobs."""
    generation, mode = getattr(trainer, "vllm_generation", None), getattr(trainer, "vllm_mode", None)
    if not trainer.use_vllm or generation is None or not trainer.accelerator.is_main_process:
        return None
    try:
        if mode == "server":
            client = generation.vllm_client
            info = client.get_server_info() if hasattr(client, "get_server_info") else client._get(  # TRL 1.15
                f"{client.base_url}/server_info", params={"config_format": "json"})["vllm_config"]
            model = info["model_config"]
            head = model.get("head_dtype") or (model.get("hf_overrides") or {}).get("head_dtype") or model["dtype"]
            checks = {"logprobs_mode": model.get("logprobs_mode") == "processed_logprobs",
                      "async_scheduling_off": not info["scheduler_config"].get("async_scheduling"),
                      "prefix_caching_off": not info["cache_config"].get("enable_prefix_caching")}
            if cfg.fp32_lm_head:
                checks["fp32_lm_head"] = str(head).replace("torch.", "") in ("float32", "fp32")
        else:
            from rollout_parity.core.vllm_recipe import verify_engine

            checks = verify_engine(generation.llm, fp32_lm_head=cfg.fp32_lm_head)
    except Exception as exc:  # noqa: BLE001 - e.g. a server without /server_info: say so, do not guess
        logger.warning("rollout-parity: could not read TRL's vLLM %s configuration (%s): recipe unverified", mode, exc)
        return None
    failed = [k for k, ok in checks.items() if not ok]
    if "logprobs_mode" in failed and _needs_rollout(cfg):
        raise ValueError(f"TRL's vLLM {mode} engine returns raw logprobs, not processed_logprobs: r_corr would carry "
                         "the sampler's temperature and truncation as mismatch (--logprobs-mode processed_logprobs)")
    if failed:
        logger.warning("rollout-parity: TRL's vLLM %s engine misses the parity recipe (%s); use ParityGRPOTrainer "
                       "(colocate) or serve with: %s", mode, ", ".join(failed),
                       server_command(trainer.model.name_or_path, fp32_lm_head=cfg.fp32_lm_head))
    return checks


@dataclass(frozen=True)
class _Sampling:
    temperature: float
    top_k: Optional[int]
    top_p: float
    min_p: float

    @property
    def truncates(self) -> bool:
        return self.top_k is not None or self.top_p < 1.0 or self.min_p > 0.0


def _sampling(trainer: Any, cfg: CorrectionConfig) -> _Sampling:
    """vLLM's sampling parameters where TRL takes them (``vllm_generation``, then ``generation_kwargs``), checked."""
    source = getattr(trainer, "vllm_generation", None) or trainer
    kwargs = dict(getattr(source, "generation_kwargs", None) or getattr(trainer.args, "generation_kwargs", None) or {})

    def get(name: str, default: Any) -> Any:
        value = kwargs.get(name, getattr(source, name, None))
        return default if value is None else value

    sampling = _Sampling(float(get("temperature", 1.0)), get("top_k", 0) if get("top_k", 0) > 0 else None,
                         float(get("top_p", 1.0)), float(get("min_p", 0.0)))
    penalties = {k: v for k in _PENALTIES if (v := get(k, None)) not in (None, 1.0, 0.0, 0, [], {})}
    what = f"top_k={sampling.top_k}, top_p={sampling.top_p}, min_p={sampling.min_p}"
    if not _needs_rollout(cfg):
        return sampling
    if sampling.temperature != float(trainer.temperature):
        raise ValueError(f"generation_kwargs temperature={sampling.temperature} but temperature={trainer.temperature}, "
                         "which TRL's trainer log-probs use: r_corr would compare two temperatures")
    if penalties and cfg.changes_loss:
        raise ValueError(f"{_items(penalties)}: vLLM's processed logprobs include sampler penalties no trainer "
                         "log-prob reproduces, so r_corr would correct them as mismatch (metrics alone may measure it)")
    if sampling.truncates and cfg.old_logprob_source == "bypass":
        raise ValueError(f"old_logprob_source='bypass' with a truncating sampler ({what}): pi_old would be vLLM's "
                         "renormalised logprobs and pi_theta TRL's full-vocabulary ones, a log(kept mass) bias in "
                         "every PPO ratio. Use old_logprob_source='recompute' (sampler-aware r_corr)")
    text = trainer.accelerator.unwrap_model(trainer.model).config.get_text_config()
    modifiers = {k: getattr(text, k) for k in _HEAD_MODIFIERS if getattr(text, k, None) not in (None, 1, 1.0)}
    if sampling.truncates and modifiers:
        raise ValueError(f"{what} with a head that has {_items(modifiers)}: the sampler-aware r_corr renormalises "
                         "a plain linear head's logits, not scaled or soft-capped ones")
    return sampling


# ----------------------------------------------------------------------------- apply / revert


@dataclass
class _State:
    config: CorrectionConfig
    saved_flags: dict[str, Any] = dataclasses.field(default_factory=dict)  # trainer attribute -> its old value
    engine_checks: Optional[dict[str, bool]] = None
    kept_mass: Optional[list] = None  # a list while TRL's next forward is its pi_old: log S per chunk goes here
    sampling: Optional[_Sampling] = None
    loss_logps: Optional[list] = None  # a list while TRL's loss runs: its pi_theta goes here

    @property
    def hands_weights(self) -> bool:  # ours (or ones) replace TRL's ratio; else TRL's acts as configured
        return (self.config.changes_loss or self.config.old_logprob_source == "bypass"
                or "vllm_importance_sampling_correction" in self.saved_flags)


def is_applied(trainer: Any) -> bool:
    """Whether ``apply`` is in effect on this trainer."""
    return _STATE in getattr(trainer, "__dict__", {})


def _check_trl(trainer: Any) -> None:
    check_framework("TRL", distributions=("trl",), tested=TESTED_TRL, extra="trl", required=REQUIRED_TRL_NAMES)
    missing = [f"GRPOTrainer.{name}" for name in _TRAINER_ATTRS if not hasattr(trainer, name)]
    if missing:
        raise FrameworkAPIError(f"rollout-parity's TRL adapter needs {', '.join(missing)} (TRL {TESTED_TRL})")


def _own(trainer: Any, name: str) -> Any:
    """TRL's own value of a trainer attribute, even while ``apply`` has set it."""
    state = trainer.__dict__.get(_STATE)
    return state.saved_flags[name] if state is not None and name in state.saved_flags else getattr(trainer, name)


def _refuse_without_vllm(cfg: CorrectionConfig, use_vllm: bool) -> None:
    if _needs_rollout(cfg) and not use_vllm:
        raise MissingRolloutLogprobsError(
            f"{_describe(cfg)} needs the sampler's per-token logprobs, but use_vllm=False: TRL keeps them, recomputes "
            "pi_old and applies importance_sampling_ratio only when it generates with vLLM")


def _refuse(trainer: Any, cfg: CorrectionConfig) -> None:
    """Everything that can not be expressed through TRL's channels, by name, before any mutation."""
    _refuse_without_vllm(cfg, trainer.use_vllm)
    if cfg.fp32_lm_head and not trainer.args.cast_lm_head_to_fp32:
        raise ValueError("fp32_lm_head=True on a GRPOTrainer built with cast_lm_head_to_fp32=False: TRL's fused head "
                         "fixes its fp32 projection at construction (ParityGRPOTrainer turns it on)")
    own_ratio = {k: getattr(trainer, k) for k in _TRL_RATIO_FIELDS
                 if getattr(trainer, k) != GRPOConfig.__dataclass_fields__[k].default}
    if cfg.changes_loss and own_ratio:
        raise ValueError(f"{_items(own_ratio)} configures TRL's own importance sampling, which rollout-parity's "
                         f"correction ({_describe(cfg)}) replaces in the same channel: set only one of the two")
    threshold = _own(trainer, "off_policy_mask_threshold")
    if cfg.off_policy_sequence_mask_delta is not None and threshold is not None:
        raise ValueError(f"off_policy_mask_threshold={threshold} and off_policy_sequence_mask_delta="
                         f"{cfg.off_policy_sequence_mask_delta}: the shared flag is handed to TRL as that threshold")
    if trainer.loss_type == "vespo" and (cfg.rollout_importance_sampling_mode or "").startswith("sequence"):
        raise ValueError(f"rollout_importance_sampling_mode={cfg.rollout_importance_sampling_mode!r} with loss_type="
                         "'vespo': VESPO sums log(importance_sampling_ratio) over the tokens, so a sequence weight "
                         "would count once per token (TRL refuses sequence modes for vespo too)")
    _sampling(trainer, cfg)
    for name in _PATCHED:
        current = trainer.__dict__.get(name)
        if current is not None and not getattr(current, _MARK, False):
            raise ValueError(f"{name} is already replaced on this trainer by "
                             f"{getattr(current, '__qualname__', current)!r}: rollout-parity does not stack on it")


def apply(trainer: Any, config: CorrectionConfig | Mapping[str, Any] | None = None) -> Any:
    """Make ``trainer`` (a ``GRPOTrainer``) use rollout-parity's correction and diagnostics; returns it.

    ``config`` defaults to the trainer's ``ParityGRPOConfig`` flags. Idempotent; a different config
    replaces the previous one, validated first (a refused config leaves the previous one in place).
    """
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"apply expects a trl.GRPOTrainer, got {type(trainer).__name__}")
    _check_trl(trainer)
    cfg = _as_config(config, trainer.args)
    previous = trainer.__dict__.get(_STATE)
    if previous is not None and previous.config == cfg:
        return trainer
    _refuse(trainer, cfg)  # validation first: a refused config leaves the previous one in place
    checks = _check_engine(trainer, cfg)
    revert(trainer)
    state = trainer.__dict__[_STATE] = _State(config=cfg, engine_checks=checks)
    try:  # all or nothing
        if _needs_rollout(cfg):
            if not trainer.vllm_importance_sampling_correction:  # the channel, and TRL's pi_old recomputation
                _set_flag(trainer, state, "vllm_importance_sampling_correction", True)
            elif state.hands_weights:
                logger.info("rollout-parity: TRL's importance_sampling_ratio is replaced by ours (%s)", _describe(cfg))
            if cfg.off_policy_sequence_mask_delta is not None:
                _set_flag(trainer, state, "off_policy_mask_threshold", cfg.off_policy_sequence_mask_delta)
            _patch(trainer, "_generate", functools.partial(_checked_generate, state))
            _patch(trainer, "_generate_and_score_completions", functools.partial(_corrected_generation, state))
            _patch(trainer, "_get_per_token_logps_and_entropies", functools.partial(_observed_forward, state))
            if cfg.wants_metrics:
                _patch(trainer, "_compute_loss", functools.partial(_diagnosed_loss, state))
    except BaseException:
        revert(trainer)
        raise
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
    """Undo ``apply`` (False if nothing was applied): TRL's methods and flags come back, and so do TRL's
    own values in the slices still buffered in a generation window (it ends as unpatched TRL trains)."""
    state = trainer.__dict__.pop(_STATE, None)
    if state is None:
        return False
    for name in _PATCHED:
        if getattr(trainer.__dict__.get(name), _MARK, False):
            del trainer.__dict__[name]
    for name, value in state.saved_flags.items():
        setattr(trainer, name, value)
    for batch in getattr(trainer, "_buffered_inputs", None) or []:
        for key in [k for k in batch if k.startswith(_KEY)]:
            value, name = batch.pop(key), key[len(_ORIGINAL):]
            if key.startswith(_ORIGINAL) and value is None:
                batch.pop(name, None)
            elif key.startswith(_ORIGINAL):
                batch[name] = value
    return True


# ----------------------------------------------------------------------------- the generation batch


def _checked_generate(state: _State, original: Any, prompts: list) -> tuple:
    """TRL's ``_generate``, checked before TRL's own ratio code reads its sampler logprobs."""
    result = original(prompts)
    completion_ids, logprobs = result[1], result[4]  # TRL 1.15-1.16: (prompt_ids, completion_ids, tool_mask, ..)
    if logprobs is None:
        raise MissingRolloutLogprobsError(f"{_describe(state.config)} needs the sampler's per-token logprobs, but the "
                                          "generator returned none (a rollout_func must return 'logprobs')")
    for ids, lps in zip(completion_ids, logprobs):  # one list per completion, aligned token by token
        if len(ids) != len(lps):
            check_shapes("completion_ids", torch.empty(1, len(ids), device="meta"),
                         sampling_logprobs=torch.empty(1, len(lps), device="meta"))
    return result


def _process_group(trainer: Any) -> Any:
    distributed = trainer.accelerator.num_processes > 1 and torch.distributed.is_initialized()
    return torch.distributed.group.WORLD if distributed else None


def _all_reduce(values: torch.Tensor, group: Any, op: str = "SUM") -> torch.Tensor:
    if group is not None:
        torch.distributed.all_reduce(values, op=getattr(torch.distributed.ReduceOp, op), group=group)
    return values


def _observed_forward(state: _State, original: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
    """TRL's log-prob forward, observed: log S on its pi_old forward, pi_theta on the loss's forward."""
    first = state.kept_mass is not None and not state.kept_mass  # TRL's first forward of a batch is pi_old's
    with _kept_mass_hook(original.__self__, model, args[2], state) if first else contextlib.nullcontext():
        result = original(model, *args, **kwargs)  # args: input_ids, attention_mask, logits_to_keep, ...
    if state.loss_logps is not None and kwargs.get("compute_entropy"):
        state.loss_logps.append(result[0].detach())
    return result


@contextlib.contextmanager
def _kept_mass_hook(trainer: Any, model: Any, logits_to_keep: int, state: _State) -> Iterator[None]:
    """While TRL's pi_old forward runs, ``log S = log p_T - log q`` per sampled token from its hidden states
    (fp32, chunked, inside TRL's own ZeRO-3 gather of the head). +inf: outside the trainer's kept set."""
    from trl.trainer.utils import maybe_gather_lm_head_ctx

    base = trainer.accelerator.unwrap_model(model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    head = base.get_output_embeddings()

    def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        ids = (kwargs["input_ids"] if "input_ids" in kwargs else args[0])[:, -logits_to_keep:]
        with maybe_gather_lm_head_ctx(head.weight, head.bias):
            weight = head.weight.full_tensor() if hasattr(head.weight, "full_tensor") else head.weight  # FSDP2
            lp = sampler_logprobs_from_hidden(output.last_hidden_state[:, -logits_to_keep - 1:-1], weight, ids,
                                              *dataclasses.astuple(state.sampling), bias=head.bias)
        state.kept_mass.append(lp.full - lp.processed)

    handle = base.base_model.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _corrected_generation(state: _State, original: Any, inputs: Any) -> dict:
    """TRL's generation batch, then ``compute_correction`` once, handed over through TRL's channels."""
    trainer, cfg = original.__self__, state.config
    bypass = cfg.old_logprob_source == "bypass"
    state.sampling = _sampling(trainer, cfg)
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    lengths = {k: len(metrics[k]) for k in _TRL_SAMPLING_METRICS if k in metrics}
    state.kept_mass = [] if state.sampling.truncates and not bypass else None
    try:
        output = original(inputs)
        captured = state.kept_mass
    finally:
        state.kept_mass = None
    if captured == []:
        raise FrameworkAPIError(f"no hidden states seen in TRL's pi_old forward; tested with TRL {TESTED_TRL}")
    completion_mask, tool_mask = output["completion_mask"], output.get("tool_mask")
    loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask
    rollout, old = output["sampling_per_token_logps"], output.get("old_per_token_logps")
    if old is None:
        raise FrameworkAPIError(f"TRL computed no old_per_token_logps; tested with TRL {TESTED_TRL}")
    kept_mass = torch.cat(captured) if captured else torch.zeros_like(old)
    check_shapes("old_per_token_logps", old, log_kept_mass=kept_mass)
    kept_mass = torch.where(loss_mask != 0, kept_mass, 0.0)
    processed_old = old - kept_mass  # the trainer's pi_old as vLLM's sampler sees it (-inf outside the kept set)
    group = _process_group(trainer)
    out = compute_correction(cfg.replace(off_policy_sequence_mask_delta=None), old_logprobs=processed_old,
                             rollout_logprobs=rollout, response_mask=loss_mask, process_group=group,
                             current_logprobs=old if bypass else None,  # pi_theta is pi_old at generation time
                             with_metrics=cfg.wants_metrics or state.hands_weights)
    output.update({_KEY + "old": processed_old, _KEY + "response_mask": loss_mask, _KEY + "kept_mass": kept_mass})
    logged = {k: v for k, v in out.metrics.items() if k not in _THETA_METRICS}
    if captured:
        logged.update(kept_mass_metrics(kept_mass, loss_mask, group))
    if state.hands_weights:
        kept = out.mask != 0
        ratio = torch.where(kept, out.weights, torch.ones_like(out.weights)).to(old.dtype)
        _hand_over(output, "importance_sampling_ratio", ratio,
                   trl_had_it=state.saved_flags.get("vllm_importance_sampling_correction", True))
        if cfg.rollout_rejection is not None:
            _hand_over(output, "tool_mask", kept.to(completion_mask.dtype) * (1 if tool_mask is None else tool_mask))
            removed = _all_reduce((loss_mask != 0).sum() - kept.sum(), group)
            _hand_over(output, "num_items_in_batch", output["num_items_in_batch"] - removed)
        if cfg.off_policy_sequence_mask_delta is not None:  # TRL's mask reads pi_behaviour here, as log p_T
            behaviour = rollout + kept_mass
            _hand_over(output, "sampling_per_token_logps", behaviour.masked_fill(~behaviour.isfinite(), math.nan))
        if bypass:  # pi_old := pi_rollout; an engine's NaN / inf falls back to the recomputed pi_old (counted)
            _hand_over(output, "old_per_token_logps", torch.where(rollout.isfinite(), rollout, old))
        for name in _TRL_SAMPLING_METRICS:  # TRL's describe a ratio that no longer acts
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


def _sampling_metrics(ratio: torch.Tensor, kept: torch.Tensor, ours: dict, group: Any) -> dict[str, float]:
    """TRL's ``sampling/*`` names, describing the weights that act: global min / mean / max over kept tokens."""
    sums = _all_reduce(torch.stack([(ratio * kept).sum(), kept.sum().to(ratio.dtype)]), group)
    top = _all_reduce(torch.stack([ratio, -ratio]).masked_fill(~kept, -math.inf).flatten(1).amax(1), group, "MAX")
    (total, n), (high, neg_low) = sums.tolist(), top.tolist()
    return {"sampling/sampling_logp_difference/mean": ours.get("rollout_correction/delta_abs_mean", 0.0),
            "sampling/sampling_logp_difference/max": ours.get("rollout_correction/delta_abs_max", 0.0),
            "sampling/importance_sampling_ratio/min": -neg_low if n else 1.0,
            "sampling/importance_sampling_ratio/mean": total / n if n else 1.0,
            "sampling/importance_sampling_ratio/max": high if n else 1.0}


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
    in_loss = (inputs["completion_mask"] * inputs.get("tool_mask", 1)) != 0  # TRL's loss tokens
    drift = (inputs["old_per_token_logps"] - current).nan_to_num(0.0, 0.0, 0.0) * in_loss
    kl = _all_reduce(torch.stack([drift.sum(), in_loss.sum().to(drift.dtype)]), group)
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    for name in _THETA_METRICS:
        metrics[name].append(out.metrics[name])
    metrics["policy/ppo_kl"].append((kl[0] / kl[1].clamp(min=1.0)).item())
    return loss


# ----------------------------------------------------------------------------- the trainer


class ParityGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with rollout-parity's correction, diagnostics and vLLM parity recipe.

    The shared flags come from a ``ParityGRPOConfig``, else ``rollout_correction=``, else
    ``rollout_correction_default`` (set by ``rollout-parity launch``). The colocated engine is built
    with ``vllm_parity_kwargs``; a server is checked at start. ``fp32_lm_head`` turns TRL's own
    ``cast_lm_head_to_fp32`` on (logged). ``revert`` leaves engine and head with their recipe.
    """

    rollout_correction_default: ClassVar[Optional[CorrectionConfig]] = None

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, *rest: Any,
                 rollout_correction: CorrectionConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if rollout_correction is None and not isinstance(args, ParityGRPOConfig):
            rollout_correction = type(self).rollout_correction_default
        cfg = _as_config(rollout_correction, args)
        if args is not None:
            _refuse_without_vllm(cfg, args.use_vllm)  # before an engine is built
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
        return getattr(self.__dict__.get(_STATE), "config", None)

    @property
    def rollout_parity_engine_checks(self) -> Optional[dict[str, bool]]:
        return getattr(self.__dict__.get(_STATE), "engine_checks", None)
