"""verl adapter: the shared flags inside ``python -m verl.trainer.main_ppo``, thin.

Usage (after ``pip install rollout-parity[verl]``): add the shared flags of DESIGN.md as Hydra
overrides to an existing verl command line, e.g.
``+rollout_parity.rollout_importance_sampling_mode=token_truncate``. verl's own policy loss
(``actor_rollout_ref.actor.policy_loss.loss_mode``: vanilla, gspo, sapo, gpg, clip_cov, kl_cov,
geo_mean, dro, cispo, dppo_tv, dppo_kl, or one the user registered) runs unchanged; the
adapter only hands it our weights and masks through the two channels every verl loss already
reads, ``rollout_is_weights`` and ``response_mask`` (STYLE.md rule 3; DESIGN.md "How an
adapter meets its framework").

How it is loaded: verl >= 0.9 imports this module in every process through the package's
``verl.plugins`` entry point; verl 0.8 has no plugin entry points, so there the command line
needs ``VERL_USE_EXTERNAL_MODULES=rollout_parity.adapters.verl`` (without it verl never sees
the adapter and ignores the ``+rollout_parity.*`` overrides). The run then puts the module into
that variable of the Ray job and into ``actor_rollout_ref.model.external_lib``, so every Ray
process imports it. Importing it calls :func:`apply`, which wraps these verl names (each
wrapper is built with ``functools.wraps``, marked ``__rollout_parity_patch__``, and passes
straight through while no rollout-parity flags are set in the process):

========================================================  ==============================================
verl name (where it is looked up, too)                    what the wrapper adds
========================================================  ==============================================
``verl.utils.device.auto_set_device``                     :func:`configure_verl` (driver, before Ray starts)
``verl.utils.config.validate_config``                     :func:`configure_verl` first (again: idempotent)
``rollout_corr_helper.compute_rollout_correction_and_     the correction, once per batch, on the driver:
add_to_batch``                                            ``response_mask``, ``rollout_is_weights``
``core_algos.get_policy_loss_fn``                         the chosen loss, wrapped: bad-input handling,
                                                          the off-policy mask, policy-side metrics
``workers.utils.losses.ppo_loss``                         those metrics as exact global means
``FSDPEngine._build_module``                              ``apply_fp32_lm_head`` (``fp32_lm_head``)
``FSDPEngineWithLMHead.forward_step``                     sampler-aware pi_old in the log-prob pass
``models.transformers.monkey_patch.is_trl_available``     False when TRL lacks the value-head class
``PPOTrainer._compute_advantage`` (verl 0.9's V1          the batch's keys, so the driver hook can read
trainer)                                                  and write fields verl does not pass it
========================================================  ==============================================

The flags reach verl's Ray processes as environment variables of the Ray job, written into
``ray_kwargs.ray_init.runtime_env`` before verl's ``run_ppo`` calls ``ray.init``; configuring
after Ray started without them is refused (:func:`_check_ray_carries`).

Names verl imports at its own import time are wrapped where they are looked up as well
(``v1/trainer_base``, ``main_ppo``, ``losses``, ``engine_workers``). :func:`revert` puts every
original back. Every private name and the version are checked first (``_compat.check_framework``,
:data:`REQUIRED_VERL_NAMES`, tested range :data:`TESTED_VERL`); a name missing at patch time is a
:class:`FrameworkAPIError`, never a skipped patch.

**Decoupled mode** (``old_logprob_source: recompute``, verl's default). verl calls the driver
helper in ``_compute_advantage`` before the advantages: our hook computes ``compute_correction``
from ``old_log_probs`` and ``rollout_log_probs`` and writes the corrected ``response_mask`` and
the IS weights (``rollout_is_weights``). verl's outcome estimators (GRPO, RLOO) sum
``token_level_rewards`` without the mask and group rows by ``uid`` (verl#6362, verl#6452), so the
hook also masks those rewards and gives a fully rejected row a uid of its own: rejected tokens
and sequences leave the group baselines. The loss then multiplies by the weights and aggregates
over the mask, whatever ``loss_mode`` says.

**Bypass** (``old_logprob_source: bypass``: π_old := π_rollout, the PPO ratio is π_θ/π_rollout).
Without rejection the adapter turns on verl's own ``algorithm.rollout_correction.bypass_mode``
(no π_old pass; verl copies ``rollout_log_probs`` into ``old_log_probs``), and the diagnostics
compare the live π_θ with π_rollout per micro-batch in the loss wrapper. With rejection, the
rejection statistic must exist before the advantages, so verl's π_old pass is kept: the hook
rejects with π_θ at the start of the update (= the recomputed logprobs) against π_rollout (the
core's bypass semantics), keeps rejected rows out of the baselines as above, and then sets
``old_log_probs := rollout_log_probs`` for the loss (in the batch, or in the TransferQueue).

**Sampler-aware ratios** (verl#6240). When the rollout samples with ``top_k``/``top_p``, vLLM's
processed logprobs are renormalised over the kept set while verl's π_old is a full-vocabulary
log-softmax: r_corr would carry the log kept mass as pure bias. The actor's log-prob pass then
also computes π_old's processed view with ``sampler_logprobs_from_hidden`` (one chunked fp32 head
pass over the final hidden states, no (N, V) fp32 logits) into the field
:data:`PROCESSED_FIELD`; the driver hook uses it as the π_old of r_corr. The PPO ratio keeps
verl's full-vocabulary ``old_log_probs``.

**Refused** (by name, with the reason, at start): our flags together with verl's own
``algorithm.rollout_correction.rollout_is``/``rollout_rs`` or ``loss_mode=bypass_mode`` (the
mismatch would be corrected twice); ``fp32_lm_head`` or sampler-aware π_old outside the FSDP
actor, with fused kernels, or with Ulysses sequence parallelism (our hooks live in the FSDP
engine's unfused head pass); a vLLM engine kwarg contradicting the parity recipe. On verl 0.8
(no V1 trainer): sampler-aware π_old, and bypass with rejection under ``main_ppo_sync``
(``transfer_queue.enable=true``), whose driver step runs as ``__main__`` beyond our reach.

Math: ../shared/DESIGN.md and ``rollout_parity.core``; nothing of verl's loss is re-implemented.
docs/verl.md lists verl's semantics where the modes overlap.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import importlib.abc
import importlib.util
import json
import logging
import math
import os
import sys
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from rollout_parity.adapters._compat import FrameworkAPIError, check_framework, missing_names
from rollout_parity.core.config import CorrectionConfig
from rollout_parity.core.correction import compute_correction
from rollout_parity.core.loss import policy_loss
from rollout_parity.core.sampler import kept_mass_metrics

try:
    import verl  # noqa: F401
    from omegaconf import DictConfig, OmegaConf, open_dict
except ImportError as exc:  # pragma: no cover - exercised without verl installed
    raise ImportError(
        "rollout_parity.adapters.verl needs verl: pip install rollout-parity[verl]"
    ) from exc

__all__ = [
    "TESTED_VERL", "REQUIRED_VERL_NAMES", "PROCESSED_FIELD", "SamplerSpec",
    "apply", "revert", "is_applied", "install", "uninstall", "is_installed",
    "configure_verl", "correction_config_from_verl", "check_no_double_correction", "verl_equivalent",
    "set_active_config", "active_config", "active_sampler", "driver_correction", "with_rollout_parity",
]

logger = logging.getLogger(__name__)

#: verl releases this adapter is tested with (the ``verl`` extra declares the same range).
TESTED_VERL = ">=0.8.0,<0.10"
#: Every verl name the adapter wraps or calls, checked before a run starts (``configure_verl``).
REQUIRED_VERL_NAMES = (
    "verl.utils.device.auto_set_device",
    "verl.utils.config.validate_config",
    "verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_add_to_batch",
    "verl.trainer.ppo.core_algos.get_policy_loss_fn",
    "verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY",
    "verl.workers.utils.losses.ppo_loss",
    "verl.workers.utils.padding.response_from_nested",
    "verl.workers.utils.padding.response_to_nested",
    "verl.workers.engine.fsdp.transformer_impl.FSDPEngine._build_module",
    "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.forward_step",
    "verl.models.transformers.monkey_patch.is_trl_available",
    "verl.utils.metric.Metric",
    "verl.utils.metric.AggregationType",
)

CONFIG_KEY = "rollout_parity"
ENV_CONFIG = "ROLLOUT_PARITY_VERL_CONFIG"
ENV_SAMPLER = "ROLLOUT_PARITY_VERL_SAMPLER"
MODULE = "rollout_parity.adapters.verl"
#: The actor's log-prob pass writes π_old's sampler-processed logprobs under this batch field.
PROCESSED_FIELD = "rollout_parity_old_processed_log_probs"
_PATCH_MARK = "__rollout_parity_patch__"
_EXTRA_KEYS = ("preset",)  # keys of the rollout_parity block beyond the shared flags
# Diagnostics that need pi_theta or the advantages: the loss wrapper logs them, not the driver.
_METRICS_NEED_POLICY = ("loss_contrib_pos", "loss_contrib_neg", "loss_contrib_rollout_pos",
                        "loss_contrib_rollout_neg", "off_policy_masked_frac")


# ============================================================================= active flags

@dataclass(frozen=True)
class SamplerSpec:
    """The rollout's token filters, as verl's ``actor_rollout_ref.rollout`` sets them."""

    top_k: Optional[int] = None
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def filters(self) -> bool:
        """True when vLLM renormalises over a kept set (processed != full-vocabulary logprobs)."""
        return (self.top_k is not None and self.top_k > 0) or self.top_p < 1.0 or self.min_p > 0.0


_cache: dict[str, Any] = {}


def set_active_config(cfg: Optional[CorrectionConfig], sampler: Optional[SamplerSpec] = None) -> None:
    """Make ``cfg`` (and the rollout's filters) the flags of this process and of Ray actors started from it."""
    if cfg is None:
        os.environ.pop(ENV_CONFIG, None)
        os.environ.pop(ENV_SAMPLER, None)
        return
    os.environ[ENV_CONFIG] = json.dumps(cfg.to_dict(), sort_keys=True)
    if sampler is not None and sampler.filters:
        os.environ[ENV_SAMPLER] = json.dumps(sampler.__dict__, sort_keys=True)
    else:
        os.environ.pop(ENV_SAMPLER, None)


def _from_env(name: str, parse: Callable[[dict], Any]) -> Any:
    raw = os.environ.get(name)
    if name not in _cache or _cache[name][0] != raw:
        _cache[name] = (raw, None if not raw else parse(json.loads(raw)))
    return _cache[name][1]


def active_config() -> Optional[CorrectionConfig]:
    """The flags set by :func:`configure_verl` (``ROLLOUT_PARITY_VERL_CONFIG``), or None."""
    return _from_env(ENV_CONFIG, CorrectionConfig.from_dict)


def active_sampler() -> Optional[SamplerSpec]:
    """The rollout's token filters when they make processed and full logprobs differ, else None."""
    if active_config() is None:
        return None
    return _from_env(ENV_SAMPLER, lambda d: SamplerSpec(**d))


# ============================================================================= config (main process)

def correction_config_from_verl(config: Any) -> Optional[CorrectionConfig]:
    """The ``rollout_parity`` block of a verl config as a ``CorrectionConfig`` (None if absent)."""
    block = config.get(CONFIG_KEY, None) if hasattr(config, "get") else None
    if block is None:
        return None
    if isinstance(block, str) or not hasattr(block, "keys"):
        raise ValueError(f"{CONFIG_KEY}: expected a mapping of shared flags, got {block!r}")
    data = OmegaConf.to_container(block, resolve=True) if isinstance(block, DictConfig) else dict(block)
    preset = data.pop("preset", None)
    if preset is not None:
        return CorrectionConfig.preset(preset, **data)
    return CorrectionConfig.from_dict(data)


def _select(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, DictConfig):
        return OmegaConf.select(config, key, default=default)
    node = config
    for part in key.split("."):
        if not hasattr(node, "get"):
            return default
        node = node.get(part)
        if node is None:
            return default
    return node


def check_no_double_correction(config: Any, cfg: CorrectionConfig) -> None:
    """Raise when verl's own rollout correction would act next to ours (DESIGN.md, "Bad input")."""
    rc = _select(config, "algorithm.rollout_correction", None)
    if rc is not None:
        own = {k: rc.get(k) for k in ("rollout_is", "rollout_rs") if rc.get(k) is not None}
        if own:
            raise ValueError(
                f"double correction: algorithm.rollout_correction has {own} and {CONFIG_KEY} is set; "
                "use one of them (set algorithm.rollout_correction.rollout_is=null rollout_rs=null, "
                f"or drop the +{CONFIG_KEY}.* overrides)"
            )
        if rc.get("bypass_mode", False) and cfg.old_logprob_source != "bypass":
            raise ValueError(
                "algorithm.rollout_correction.bypass_mode=true contradicts "
                f"{CONFIG_KEY}.old_logprob_source={cfg.old_logprob_source!r}; "
                f"set {CONFIG_KEY}.old_logprob_source=bypass instead"
            )
    if _select(config, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla") == "bypass_mode":
        raise ValueError(
            "double correction: actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode is verl's own "
            f"rollout-correction loss; with {CONFIG_KEY} keep your loss_mode and use old_logprob_source=bypass"
        )


def sampler_from_verl(config: Any) -> SamplerSpec:
    """The token filters of ``actor_rollout_ref.rollout`` (verl has no min_p; -1 and 0 mean off)."""
    top_k = _select(config, "actor_rollout_ref.rollout.top_k", -1)
    top_p = _select(config, "actor_rollout_ref.rollout.top_p", 1.0)
    top_k = None if top_k is None or int(top_k) <= 0 else int(top_k)
    return SamplerSpec(top_k=top_k, top_p=1.0 if top_p is None else float(top_p), min_p=0.0)


def _needs_rollout_logprobs(cfg: CorrectionConfig) -> bool:
    return (cfg.rollout_importance_sampling_mode is not None or cfg.rollout_rejection is not None
            or cfg.log_rollout_offpolicy_metrics)


def _refuse_outside_fsdp_head_pass(config: Any, what: str) -> None:
    """Our trainer-side hooks live in verl's FSDP engine, in its unfused, unsplit head pass."""
    strategy = _select(config, "actor_rollout_ref.actor.strategy", None)
    if strategy not in (None, "fsdp", "fsdp2"):
        raise ValueError(f"{what}: supported with the FSDP actor (strategy fsdp/fsdp2), got strategy={strategy!r}")
    if _select(config, "actor_rollout_ref.model.use_fused_kernels", False):
        raise ValueError(f"{what}: actor_rollout_ref.model.use_fused_kernels=true computes logprobs inside a fused "
                         "kernel that never calls the lm_head module; set it to false")
    sp = _select(config, "actor_rollout_ref.actor.ulysses_sequence_parallel_size", 1) or 1
    if int(sp) > 1:
        raise ValueError(f"{what}: Ulysses sequence parallelism (ulysses_sequence_parallel_size={sp}) splits the "
                         "hidden states across ranks; not supported")


def _node(config: DictConfig, *keys: str) -> DictConfig:
    """``config.<keys...>``, with an empty node put where a key is missing or null."""
    for key in keys:
        if config.get(key, None) is None:
            config[key] = {}
        config = config[key]
    return config


def _merge_vllm_recipe(config: DictConfig, cfg: CorrectionConfig) -> None:
    from rollout_parity.core.vllm_recipe import vllm_parity_kwargs

    recipe = vllm_parity_kwargs(fp32_lm_head=cfg.fp32_lm_head)
    rollout = config.actor_rollout_ref.rollout
    vllm_kwargs = _node(rollout, "engine_kwargs", "vllm")
    for key, value in recipe.items():
        current = vllm_kwargs.get(key, None)
        if isinstance(value, dict):
            merged = dict(OmegaConf.to_container(current, resolve=True)) if current is not None else {}
            for k, v in value.items():
                if k in merged and merged[k] != v:
                    raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.vllm.{key}.{k}={merged[k]!r} "
                                     f"contradicts the parity recipe ({k}={v!r})")
                merged[k] = v
            vllm_kwargs[key] = merged
        else:
            if current is not None and current != value:
                raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.vllm.{key}={current!r} contradicts the "
                                 f"parity recipe ({key}={value!r})")
            vllm_kwargs[key] = value
    # verl also passes these two from its own rollout fields; keep both views equal.
    for key in ("enable_prefix_caching", "logprobs_mode"):
        if key in recipe and key in rollout:
            rollout[key] = recipe[key]


def configure_verl(config: DictConfig) -> Optional[CorrectionConfig]:
    """Validate the ``rollout_parity`` block and rewrite ``config`` in place for it.

    Returns the ``CorrectionConfig`` (None, config untouched, when there is no block). Raises
    ``ValueError`` naming the flag on a bad value, on double correction, on what cannot be
    expressed (module docstring, "Refused"), ``FrameworkAPIError`` when the installed verl
    lacks a name the adapter needs, and ``RuntimeError`` when Ray already runs without these
    flags (:func:`_check_ray_carries`). Every change to verl's config is printed as
    ``key: old -> new``; configuring the same config again changes and prints nothing.
    """
    cfg = correction_config_from_verl(config)
    if cfg is None:
        return None
    check_framework("verl", distributions=("verl",), tested=TESTED_VERL, extra="verl",
                    required=REQUIRED_VERL_NAMES)
    check_no_double_correction(config, cfg)
    sampler = sampler_from_verl(config)
    sampler_aware = sampler.filters and _needs_rollout_logprobs(cfg)
    if cfg.fp32_lm_head:
        _refuse_outside_fsdp_head_pass(config, "fp32_lm_head")
    if sampler_aware:
        what = f"sampler-aware pi_old (rollout top_k={sampler.top_k}, top_p={sampler.top_p})"
        _refuse_outside_fsdp_head_pass(config, what)
        if _select(config, "trainer.use_v1", None) is False:
            raise ValueError(f"{what}: trainer.use_v1=false; the processed pi_old reaches the driver through "
                             "verl's TransferQueue trainer (trainer.use_v1=true, verl's default)")
        if not _has_v1_trainer():
            raise ValueError(f"{what}: needs verl's V1 trainer (verl >= 0.9); verl {_verl_version()}'s main_ppo "
                             "keeps only log_probs and entropy of the actor's log-prob pass, and its main_ppo_sync "
                             "runs its PPOTrainer as __main__, where the driver hook cannot be handed the "
                             "TransferQueue batch")
    # Bypass with rejection keeps verl's pi_old pass: the rejection statistic (and with it the
    # baselines) needs the trainer's logprobs before the advantages (module docstring).
    verl_bypass = cfg.old_logprob_source == "bypass" and cfg.rollout_rejection is None
    if (cfg.old_logprob_source == "bypass" and cfg.rollout_rejection is not None and not _has_v1_trainer()
            and _select(config, "transfer_queue.enable", False)):
        raise ValueError(
            f"old_logprob_source=bypass with rollout_rejection: on verl {_verl_version()} with "
            "transfer_queue.enable=true (main_ppo_sync) the loss would keep the recomputed pi_old; the driver "
            "hook writes old_log_probs := rollout_log_probs into the TransferQueue only in verl >= 0.9's V1 "
            "trainer (main_ppo_sync runs its PPOTrainer as __main__). Use verl's main_ppo here, or verl >= 0.9")
    carried = _carried_env(cfg, sampler if sampler_aware else None)
    _check_ray_carries(carried)

    before = OmegaConf.to_container(config, resolve=False)
    with open_dict(config):
        _merge_vllm_recipe(config, cfg)
        config.actor_rollout_ref.rollout.calculate_log_probs = True
        model = config.actor_rollout_ref.model
        libs = model.get("external_lib", None)
        if libs is None:
            model.external_lib = MODULE
        else:
            names = [libs] if isinstance(libs, str) else list(libs)
            if MODULE not in names:
                model.external_lib = names + [MODULE]
        if config.get("algorithm", None) is None:
            config.algorithm = {}
        if config.algorithm.get("rollout_correction", None) is None:
            config.algorithm.rollout_correction = {"rollout_is": None, "rollout_rs": None}
        config.algorithm.rollout_correction.bypass_mode = verl_bypass
        env_vars = _node(config, "ray_kwargs", "ray_init", "runtime_env", "env_vars")
        for key in (ENV_CONFIG, ENV_SAMPLER):
            if carried[key] is None:
                env_vars.pop(key, None)
            else:
                env_vars[key] = carried[key]
        # verl < 0.9 has no verl.plugins entry points: every Ray process (on every node) imports the
        # adapter at ``import verl`` only through this variable.
        env_vars[_ENV_MODULES] = _with_module(env_vars.get(_ENV_MODULES, os.environ.get(_ENV_MODULES, "")))
        config[CONFIG_KEY] = cfg.to_dict()
    repeat = active_config() == cfg
    set_active_config(cfg, sampler if sampler_aware else None)
    changes = _changed_keys(before, OmegaConf.to_container(config, resolve=False))
    if repeat and not changes:
        return cfg  # configured before (verl calls more than one of our hooks with the same config)
    # One visible line at start: verl logs a plugin that fails to import only at DEBUG, so a
    # missing line means the adapter did not run (STYLE.md rule 11).
    print(f"[rollout-parity] verl configured: loss_mode={_select(config, 'actor_rollout_ref.actor.policy_loss.loss_mode', 'vanilla')} "
          f"(unchanged), flags={carried[ENV_CONFIG]}"
          + (f", sampler-aware pi_old for top_k={sampler.top_k} top_p={sampler.top_p}" if sampler_aware else ""),
          flush=True)
    for line in changes:
        logger.info("rollout-parity: %s", line)
    if cfg.off_policy_sequence_mask_delta is not None and cfg.old_logprob_source == "recompute":
        logger.warning("off_policy_sequence_mask_delta in verl decoupled mode: the loss does not see rollout "
                       "logprobs, so the behaviour policy of the off-policy mask is pi_old (DESIGN.md fallback)")
    return cfg


_ENV_MODULES = "VERL_USE_EXTERNAL_MODULES"


def _verl_version() -> str:
    return getattr(verl, "__version__", "?")


def _has_v1_trainer() -> bool:
    """verl >= 0.9's TransferQueue trainer (``verl.trainer.ppo.v1``), whose driver step we can reach."""
    return importlib.util.find_spec("verl.trainer.ppo.v1") is not None


def _with_module(modules: str) -> str:
    names = [m for m in str(modules).split(",") if m]
    return ",".join(names if MODULE in names else names + [MODULE])


def _carried_env(cfg: CorrectionConfig, sampler: Optional[SamplerSpec]) -> dict[str, Optional[str]]:
    """The environment every Ray process of the run needs (None: must be absent)."""
    return {ENV_CONFIG: json.dumps(cfg.to_dict(), sort_keys=True),
            ENV_SAMPLER: json.dumps(sampler.__dict__, sort_keys=True) if sampler is not None else None}


def _check_ray_carries(carried: dict[str, Optional[str]]) -> None:
    """Refuse when Ray already runs without the flags: they would never reach verl's workers.

    The flags travel as environment variables of the Ray job (``ray_kwargs.ray_init.runtime_env``,
    which verl's ``run_ppo`` hands to ``ray.init``): Ray gives them to every actor of the job on
    every node, including the actors the TaskRunner starts. A variable set in a running process
    reaches none of them. So configuring after ``ray.init`` works only where the job already
    carries these very flags (verl 0.8's main_ppo re-validates inside its TaskRunner).
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return  # verl's run_ppo starts Ray with the runtime_env written above
    job = dict(ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    wrong = sorted(k for k, v in carried.items() if job.get(k) != v)
    if wrong:
        raise RuntimeError(
            f"rollout-parity: Ray is already initialized and its job environment lacks (or differs in) {wrong}, "
            "so the validated flags would not reach verl's Ray workers. Configure before ray.init: let verl's "
            "main_ppo/run_ppo start Ray, or start it with "
            "ray.init(runtime_env=OmegaConf.to_container(config.ray_kwargs.ray_init.runtime_env)) after "
            "rollout_parity.adapters.verl.configure_verl(config)")


def _changed_keys(before: Any, after: Any, prefix: str = "") -> list[str]:
    if isinstance(before, dict) and isinstance(after, dict):
        out = []
        for key in sorted(set(before) | set(after), key=str):
            out += _changed_keys(before.get(key), after.get(key), f"{prefix}{key}.")
        return out
    return [] if before == after else [f"{prefix.rstrip('.')}: {before!r} -> {after!r}"]


def verl_equivalent(cfg: CorrectionConfig) -> dict[str, Any]:
    """verl's own ``algorithm.rollout_correction`` block with the same semantics as ``cfg``.

    Exists where the modes overlap (docs/verl.md): token TIS without a lower clamp, IcePop
    (``"lo_hi"``) for the mask modes, sequence ratios as a product, kept sequences weighted
    by ρ_seq, every rejection option. Raises ``ValueError`` naming the flag otherwise.
    """
    mode = cfg.rollout_importance_sampling_mode
    upper = cfg.rollout_importance_sampling_threshold
    lower = cfg.rollout_importance_sampling_threshold_lower
    out: dict[str, Any] = {"rollout_is": None, "rollout_is_threshold": upper, "rollout_rs": None,
                           "rollout_rs_threshold": None, "bypass_mode": cfg.old_logprob_source == "bypass",
                           "loss_type": "ppo_clip", "rollout_is_batch_normalize": False}
    if mode is not None:
        level = "token" if mode.startswith("token") else "sequence"
        if level == "sequence" and cfg.rollout_importance_sampling_sequence_reduction != "product":
            raise ValueError("rollout_importance_sampling_sequence_reduction: verl's sequence ratio is the product")
        if mode.endswith("truncate"):
            if lower is not None:
                raise ValueError("rollout_importance_sampling_threshold_lower: verl's TIS has no lower clamp")
            threshold: Any = upper
        else:
            if lower is None or not lower > 0:
                raise ValueError("rollout_importance_sampling_threshold_lower: verl's IcePop needs a lower bound > 0")
            if mode == "sequence_mask" and cfg.rollout_importance_sampling_sequence_mask_weight != "sequence":
                raise ValueError("rollout_importance_sampling_sequence_mask_weight: verl weights kept sequences "
                                 "by rho_seq ('sequence')")
            threshold = f"{lower}_{upper}"
        out.update(rollout_is=level, rollout_is_threshold=threshold)
    if cfg.rollout_rejection is not None:
        specs = []
        for rule in cfg.rejection_rules:
            specs.append(f"{rule.lower}_{rule.upper}" if rule.estimator == "k1" else f"{rule.upper}")
        out.update(rollout_rs=",".join(cfg.rollout_rejection), rollout_rs_threshold=",".join(specs))
    if cfg.off_policy_sequence_mask_delta is not None:
        raise ValueError("off_policy_sequence_mask_delta: verl's own rollout correction has no off-policy sequence mask")
    return out


def _require_config(where: str) -> CorrectionConfig:
    cfg = active_config()
    if cfg is None:  # pragma: no cover - the wrappers pass through without flags
        raise RuntimeError(f"{where}: no rollout-parity flags in this process (env {ENV_CONFIG} is empty)")
    return cfg


# ============================================================================= the loss wrapper (workers)

#: The loss wrapper leaves its metric sums here for the ``ppo_loss`` wrapper of the same micro-batch.
_loss_sums: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("rollout_parity_loss_sums", default=None)


def _sanitize_for_loss(old: torch.Tensor, current: torch.Tensor, mask: torch.Tensor):
    """DESIGN.md's bad-input rules on what the loss reads; returns ``(old, current, mask, nonfinite)``.

    π_old (the recomputed, or under bypass the rollout logprobs): a NaN or +inf is neutral
    (π_old := π_θ, ratio 1, the token still carries its policy gradient); −inf is maximal
    mismatch (the log ratio at its +20 bound). π_θ: a non-finite value on a valid token cannot
    be trained on, so that token leaves the mask (zero contribution, zero gradient); on padding
    it is zeroed. Each valid token with a non-finite input is counted once in ``nonfinite``.
    """
    valid = mask.bool()
    finite_cur = torch.isfinite(current)
    cur = torch.where(finite_cur, current, torch.zeros((), dtype=current.dtype, device=current.device))
    anchor = cur.detach().to(old.dtype)
    neutral = torch.isnan(old) | torch.isposinf(old)
    maximal = torch.isneginf(old)
    old = torch.where(neutral, anchor, torch.where(maximal, anchor - 20.0, old))
    nonfinite = valid & (neutral | maximal | ~finite_cur)
    kept = valid & finite_cur
    out_mask = kept if mask.dtype == torch.bool else kept.to(mask.dtype)
    return old, cur, out_mask, nonfinite


def _loss_side_correction(cfg: CorrectionConfig, old: torch.Tensor, current: torch.Tensor, mask: torch.Tensor,
                          advantages: torch.Tensor, bypass_in_loss: bool):
    """The part of the correction that needs π_θ or A: the off-policy mask and C(r) (paper eq. 5).

    The behaviour policy the loss can see is ``old`` (π_old in decoupled mode, DESIGN.md's
    fallback; π_rollout under bypass). Under verl's own bypass (no rejection) the diagnostics of
    π_θ against π_rollout are computed here too, per micro-batch.
    """
    if bypass_in_loss:
        side_cfg = cfg.replace(rollout_rejection=None, rollout_rejection_threshold=None)
        return compute_correction(side_cfg, rollout_logprobs=old, response_mask=mask, advantages=advantages,
                                  current_logprobs=current.detach(), with_metrics=cfg.wants_metrics)
    side_cfg = cfg.replace(rollout_importance_sampling_mode=None, rollout_rejection=None,
                           rollout_rejection_threshold=None, old_logprob_source="recompute")
    return compute_correction(side_cfg, old_logprobs=old, rollout_logprobs=old, response_mask=mask,
                              advantages=advantages, current_logprobs=current.detach(), with_metrics=cfg.wants_metrics)


def _cfg_get(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def with_rollout_parity(loss_fn: Callable, name: str = "?") -> Callable:
    """Wrap a verl ``PolicyLossFn`` (``core_algos`` signature) with the loss side of the flags.

    The wrapped loss runs unchanged on: π_old and π_θ made finite by :func:`_sanitize_for_loss`,
    ``response_mask`` narrowed by the off-policy sequence mask (and by non-finite π_θ), and
    verl's ``rollout_is_weights`` (our driver's weights) as given. Adds to its metrics the
    policy-side ones (``policy/pg_clipfrac``, ``policy/ppo_kl``, ``policy/pg_clipfrac_lower`` of
    the token ratio π_θ/π_old under verl's clip_ratio_low/high/c, ``rollout_correction/
    loss_contrib_pos/neg``, ``off_policy_masked_frac``, and ``policy/nonfinite_frac``, the valid
    tokens whose π_old or π_θ was NaN/±inf) as micro-batch means;
    the ``ppo_loss`` wrapper turns them into exact global means.
    """
    if getattr(loss_fn, "__rollout_parity_loss__", None) is not None:
        return loss_fn  # already ours

    @functools.wraps(loss_fn)
    def policy_loss_with_rollout_parity(old_log_prob, log_prob, advantages, response_mask,
                                        loss_agg_mode: str = "token-mean", config: Any = None,
                                        rollout_is_weights: Optional[torch.Tensor] = None):
        cfg = active_config()
        if cfg is None:
            return loss_fn(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                           response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
                           rollout_is_weights=rollout_is_weights)
        from rollout_parity.core.ratios import check_shapes

        check_shapes("response_mask", response_mask, old_log_prob=old_log_prob, log_prob=log_prob,
                     advantages=advantages if advantages.dim() == 2 else None, rollout_is_weights=rollout_is_weights)
        old, cur, mask, nonfinite = _sanitize_for_loss(old_log_prob, log_prob, response_mask)
        if advantages.dim() == 2:  # padding's advantage never matters, but NaN * 0 would reach verl's sums
            advantages = torch.where(response_mask.bool(), advantages, torch.zeros_like(advantages))
        bypass_in_loss = cfg.old_logprob_source == "bypass" and cfg.rollout_rejection is None
        side, side_mask = None, mask
        if cfg.off_policy_sequence_mask_delta is not None or cfg.wants_metrics:
            # the core applies its own non-finite rules to what the diagnostics read: hand it the raw pi_old
            side = _loss_side_correction(cfg, old_log_prob, cur, mask, advantages, bypass_in_loss)
            mask = side.mask
        loss, metrics = loss_fn(old_log_prob=old, log_prob=cur, advantages=advantages, response_mask=mask,
                                loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=rollout_is_weights)
        metrics = dict(metrics)
        if not bool(mask.any()) and not bool(torch.isfinite(loss)):
            # All tokens rejected or masked: verl's token-mean without a global normaliser divides
            # 0 by 0. DESIGN.md's neutral result instead: a zero loss that still backpropagates.
            loss = cur.sum() * 0.0
            metrics = {k: 0.0 if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        sums = _policy_metric_sums(cfg, old, cur, advantages, mask, side_mask, nonfinite, side, config,
                                   bypass_in_loss)
        _loss_sums.set(sums)
        metrics.update(_local_means(sums))
        return loss, metrics

    policy_loss_with_rollout_parity.__rollout_parity_loss__ = name
    setattr(policy_loss_with_rollout_parity, _PATCH_MARK, True)
    return policy_loss_with_rollout_parity


def _policy_metric_sums(cfg, old, cur, advantages, mask, side_mask, nonfinite_valid, side, config,
                        bypass_in_loss) -> dict[str, tuple[float, float, str]]:
    """The loss-side metrics as ``{name: (local sum, local count, kind)}``.

    ``kind`` says which of verl's global normalisers a sum is divided by: ``token`` or ``seq``;
    ``mean`` entries (count 1) are micro-batch means of nonlinear diagnostics (bypass in the loss
    only). ``mask`` is what the loss trained on; ``side_mask`` what the core's diagnostics read.
    """
    def count(m, seq=False):
        m = m.to(torch.float32)
        return float((m.sum(-1) > 0).sum()) if seq else float(m.sum())

    n_kept, n_side = count(mask), count(side_mask)
    clip = float(_cfg_get(config, "clip_ratio", 0.2))
    with torch.no_grad():
        _, pm = policy_loss(CorrectionConfig(), current_logprobs=cur.detach(), old_logprobs=old,
                            advantages=advantages, response_mask=mask, clip_ratio=clip,
                            clip_ratio_low=_cfg_get(config, "clip_ratio_low", None),
                            clip_ratio_high=_cfg_get(config, "clip_ratio_high", None),
                            clip_ratio_c=float(_cfg_get(config, "clip_ratio_c", 3.0)))
    sums = {k: (v * n_kept, n_kept, "token") for k, v in pm.items()}  # token means over the trained tokens
    n_valid = count(side_mask.bool() | nonfinite_valid)  # every valid token, trainable or not
    sums["policy/nonfinite_frac"] = (float(nonfinite_valid.sum()), n_valid, "token")
    if side is not None:
        for key in ("loss_contrib_pos", "loss_contrib_neg"):  # the core's: Σ C / (tokens it read)
            name = f"rollout_correction/{key}"
            if name in side.metrics:
                sums[name] = (side.metrics[name] * n_side, n_side, "token")
        sums["rollout_correction/off_policy_masked_frac"] = (
            float(side.off_policy_masked.sum()), count(side_mask, seq=True), "seq")
        if bypass_in_loss:
            for name, value in side.metrics.items():
                if name not in sums and not name.endswith(("nonfinite_frac", "off_policy_masked_frac")):
                    sums[name] = (value, 1.0, "mean")
    return sums


def _local_means(sums: dict) -> dict[str, float]:
    return {name: value / max(n, 1.0) for name, (value, n, _) in sums.items()}


def _global_means(sums: dict, global_batch_info: dict) -> dict[str, Any]:
    """verl ``Metric`` objects whose aggregation gives the global mean over the mini-batch.

    verl sums a ``SUM`` metric over micro-batches and averages it over data-parallel ranks
    (``Metric.aggregate_dp``), so a micro-batch contributes ``local_sum / N_global * dp_size``,
    exactly as verl scales its own ``pg_loss``. The normalisers are the ones verl's
    ``ppo_loss`` put in ``config.global_batch_info``: ``batch_num_tokens`` (the rollout's
    loss-mask tokens of the mini-batch, before rejection) and ``global_batch_size``.
    """
    from verl.utils.metric import AggregationType, Metric

    info = dict(global_batch_info or {})
    dp = float(info.get("dp_size") or 1)
    n_tokens, n_seqs = info.get("batch_num_tokens"), info.get("global_batch_size")
    out: dict[str, Any] = {}
    for name, (value, _, kind) in sums.items():
        if kind == "mean":
            continue
        denom = n_tokens if kind == "token" else n_seqs
        if denom is None:
            continue  # no global normaliser: the micro-batch mean stays
        denom = float(denom.item() if torch.is_tensor(denom) else denom)
        out[name] = Metric(aggregation=AggregationType.SUM, value=value / max(denom, 1.0) * dp)
    return out


def _non_tensor(data: Any, key: str, default: Any) -> Any:
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


def _wrap_get_policy_loss_fn(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_policy_loss_fn(name):
        loss_fn = original(name)
        if active_config() is None:
            return loss_fn
        return _wrapped_loss(loss_fn, name)

    return get_policy_loss_fn


@functools.lru_cache(maxsize=None)
def _wrapped_loss(loss_fn: Callable, name: str) -> Callable:
    return with_rollout_parity(loss_fn, name)


def _wrap_ppo_loss(original: Callable) -> Callable:
    @functools.wraps(original)
    def ppo_loss(config, model_output, data, dp_group=None):
        token = _loss_sums.set(None)
        try:
            loss, metrics = original(config, model_output, data, dp_group)
            sums = _loss_sums.get()
        finally:
            _loss_sums.reset(token)
        if sums is not None:
            metrics.update(_global_means(sums, getattr(config, "global_batch_info", None)))
        return loss, metrics

    return ppo_loss


# ============================================================================= the driver hook

#: The TransferQueue batch being processed by ``_compute_advantage`` (TQ trainers only).
_current_batch: contextvars.ContextVar[Any] = contextvars.ContextVar("rollout_parity_batch", default=None)


def _wrap_compute_advantage(original: Callable) -> Callable:
    @functools.wraps(original)
    def _compute_advantage(self, batch, metrics):
        token = _current_batch.set(batch)
        try:
            return original(self, batch, metrics)
        finally:
            _current_batch.reset(token)

    return _compute_advantage


def _processed_old_log_probs(batch: Any, like: torch.Tensor) -> torch.Tensor:
    """π_old's sampler-processed view, written by the actor's log-prob pass (:data:`PROCESSED_FIELD`)."""
    tensors = batch.batch
    if PROCESSED_FIELD in tensors.keys():  # a trainer that hands the worker output on in the batch itself
        value = tensors[PROCESSED_FIELD]
        if tuple(value.shape) != tuple(like.shape):
            raise ValueError(f"{PROCESSED_FIELD} has shape {tuple(value.shape)} but old_log_probs has shape "
                             f"{tuple(like.shape)}: sampler-aware pi_old supports verl's TransferQueue trainers")
        return value
    meta = _current_batch.get()
    if meta is None:
        raise RuntimeError(
            f"sampler-aware pi_old: {PROCESSED_FIELD} is not in the batch and no TransferQueue batch is in "
            "flight; the actor's log-prob pass did not run rollout-parity's hook (is "
            f"{MODULE} in actor_rollout_ref.model.external_lib?)")
    import transfer_queue as tq
    from verl.workers.utils.padding import response_from_nested

    data = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id,
                           select_fields=[PROCESSED_FIELD, "response_mask"])
    nested = response_from_nested(data[PROCESSED_FIELD], data["response_mask"])
    return torch.nested.to_padded_tensor(nested, 0.0, output_size=tuple(like.shape)).to(like.dtype)


def _write_old_log_probs(batch: Any, old: torch.Tensor) -> None:
    """Bypass with rejection: ``old_log_probs := rollout_log_probs`` for the loss (module docstring)."""
    batch.batch["old_log_probs"] = old
    meta = _current_batch.get()
    if meta is None:
        return  # legacy trainer: the batch itself travels on to the actor
    import transfer_queue as tq
    from tensordict import TensorDict
    from verl.workers.utils.padding import response_to_nested

    mask = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=["response_mask"])
    nested = response_to_nested(old, mask["response_mask"])
    tq.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id,
                    fields=TensorDict({"old_log_probs": nested}, batch_size=len(meta.keys)))


def driver_correction(batch: Any, rollout_corr_config: Any = None) -> tuple[Any, dict[str, float]]:
    """Our correction of one batch on the driver, with verl's helper's calling convention.

    ``batch`` is a ``DataProto`` with ``old_log_probs``, ``rollout_log_probs`` and
    ``response_mask``. Writes the corrected ``response_mask``, ``rollout_is_weights`` when an IS
    mode is set, keeps what rejection removed out of the GRPO/RLOO baselines, and under bypass
    with rejection sets ``old_log_probs := rollout_log_probs``. Returns ``(batch, metrics)``.
    """
    cfg = _require_config("driver_correction")
    if rollout_corr_config is not None:
        check_no_double_correction({"algorithm": {"rollout_correction": rollout_corr_config}}, cfg)
    tensors = batch.batch
    response_mask = tensors["response_mask"]
    old = tensors["old_log_probs"]
    rollout = tensors["rollout_log_probs"]
    trainer_old = _processed_old_log_probs(batch, old) if active_sampler() is not None else old
    driver_cfg = cfg.replace(off_policy_sequence_mask_delta=None)
    with torch.no_grad():
        if cfg.old_logprob_source == "bypass":
            # pi_theta at the start of the update is the recomputed pi_old: the core's bypass semantics.
            out = compute_correction(driver_cfg, rollout_logprobs=rollout, current_logprobs=trainer_old,
                                     response_mask=response_mask, with_metrics=cfg.wants_metrics)
        else:
            out = compute_correction(driver_cfg, old_logprobs=trainer_old, rollout_logprobs=rollout,
                                     response_mask=response_mask, with_metrics=cfg.wants_metrics)
    tensors["response_mask"] = out.mask
    if cfg.rollout_importance_sampling_mode is not None:
        tensors["rollout_is_weights"] = out.weights.to(torch.float32)
    if cfg.rollout_rejection is not None:
        _keep_rejected_out_of_baselines(batch, response_mask, out.mask)
    if cfg.old_logprob_source == "bypass":
        _write_old_log_probs(batch, rollout)
    metrics = {k: v for k, v in out.metrics.items() if k.split("/", 1)[-1] not in _METRICS_NEED_POLICY}
    if active_sampler() is not None:
        # log S = full - processed per token (+inf where vLLM sampled outside the trainer's kept set)
        metrics.update(kept_mass_metrics(old.float() - trainer_old.float(), response_mask))
    return batch, metrics


def _keep_rejected_out_of_baselines(batch: Any, before: torch.Tensor, after: torch.Tensor) -> None:
    """Make verl's outcome estimators ignore what rejection removed (verl#6362, verl#6452).

    verl's GRPO/RLOO sum ``token_level_rewards`` without the mask and group rows by ``uid``, so
    a masked reward token, or a fully rejected sibling, still moves the baseline of the accepted
    responses. Rewards are masked with the corrected mask, and a fully rejected row gets a uid
    of its own (it trains nothing: its mask is all zero).
    """
    tensors = batch.batch
    if "token_level_rewards" in tensors.keys():
        rewards = tensors["token_level_rewards"]
        tensors["token_level_rewards"] = rewards * after.to(rewards.dtype)
    uids = getattr(batch, "non_tensor_batch", {}).get("uid")
    if uids is not None:
        dropped = (before.bool().any(dim=-1) & ~after.bool().any(dim=-1)).tolist()
        if any(dropped):
            uids = uids.copy()
            for i, gone in enumerate(dropped):
                if gone:
                    uids[i] = f"{uids[i]}#rollout_parity_rejected_{i}"
            batch.non_tensor_batch["uid"] = uids


def _wrap_helper(original: Callable) -> Callable:
    @functools.wraps(original)
    def compute_rollout_correction_and_add_to_batch(batch, rollout_corr_config):
        if active_config() is None:
            return original(batch, rollout_corr_config)
        return driver_correction(batch, rollout_corr_config)

    return compute_rollout_correction_and_add_to_batch


def _wrap_validate(original: Callable) -> Callable:
    @functools.wraps(original)
    def validate_config(config, *args, **kwargs):
        configure_verl(config)
        return original(config, *args, **kwargs)

    return validate_config


def _wrap_auto_set_device(original: Callable) -> Callable:
    """The first verl call of every entry point with the composed config, before Ray starts.

    verl 0.9's ``main_ppo.main`` validates the config before ``run_ppo``, but verl 0.8's
    ``main_ppo`` validates only inside its Ray TaskRunner, after ``ray.init``: too late for the
    flags to ride the Ray job's environment (:func:`_check_ray_carries`). Every ``main`` of
    verl 0.8 and 0.9 (``main_ppo``, ``main_ppo_sync``, the fully-async and one-step-off-policy
    recipes) calls ``auto_set_device(config)`` first, in the driver process.
    """
    @functools.wraps(original)
    def auto_set_device(config, *args, **kwargs):
        result = original(config, *args, **kwargs)
        configure_verl(config)
        return result

    return auto_set_device


# ============================================================================= the actor (workers)

def _wrap_build_module(original: Callable) -> Callable:
    @functools.wraps(original)
    def _build_module(self, *args, **kwargs):
        module = original(self, *args, **kwargs)
        cfg = active_config()
        if cfg is not None and cfg.fp32_lm_head and getattr(self.model_config, "model_type", None) == "language_model":
            from rollout_parity.core.fp32_head import apply_fp32_lm_head

            apply_fp32_lm_head(module)
            logger.info("rollout-parity: fp32 lm_head applied to the actor model before FSDP wrapping")
        return module

    return _build_module


def _output_head(module: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(module, "_fsdp_wrapped_module", module)
    getter = getattr(inner, "get_output_embeddings", None)
    head = getter() if getter is not None else None
    if head is None or not hasattr(head, "weight"):
        raise RuntimeError(f"sampler-aware pi_old: {type(inner).__name__} has no lm_head with a weight")
    return head


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _wrap_forward_step(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward_step(self, micro_batch, loss_function, forward_only):
        sampler = active_sampler()
        if sampler is None or loss_function is not None or not forward_only \
                or not _non_tensor(micro_batch, "calculate_entropy", False):
            # Only pi_old's pass: verl's V1 trainer asks for entropy there and nowhere else
            # (the reference pass, the critic and the update never set calculate_entropy here).
            return original(self, micro_batch, loss_function, forward_only)
        captured: list[torch.Tensor] = []
        head = _output_head(self.module)
        handle = head.register_forward_hook(lambda mod, args, out: captured.append(args[0].detach()))
        try:
            loss, output = original(self, micro_batch, loss_function, forward_only)
        finally:
            handle.remove()
        output["model_output"][PROCESSED_FIELD] = _processed_from_hidden(self, micro_batch, captured, head, sampler)
        return loss, output

    return forward_step


def _processed_from_hidden(engine, micro_batch, captured, head, sampler: SamplerSpec) -> torch.Tensor:
    """π_old processed as vLLM's sampler, at every position of the packed sequences (nested)."""
    from rollout_parity.core.sampler import sampler_logprobs_from_hidden

    if len(captured) != 1:
        raise RuntimeError(f"sampler-aware pi_old: expected one lm_head call per micro-batch, saw {len(captured)}")
    input_ids = micro_batch["input_ids"]
    offsets = input_ids.offsets()
    total = int(offsets[-1])
    hidden = captured[0]
    if _non_tensor(micro_batch, "use_remove_padding", True):
        hidden = hidden.reshape(-1, hidden.shape[-1])[:total]  # (1, nnz + pad, H) -> (nnz, H)
    else:  # (bsz, max_len, H): the valid positions of each row, packed as verl packs its logits
        lengths = offsets.diff().tolist()
        hidden = torch.cat([hidden[i, :n] for i, n in enumerate(lengths)])
    # verl's labels: the packed ids rolled by one (the last position's label is never used)
    labels = torch.roll(input_ids.values(), shifts=-1, dims=0)
    temperature = micro_batch["temperature"]
    if torch.is_tensor(temperature):
        if temperature.numel() > 1 and not bool((temperature == temperature.flatten()[0]).all()):
            raise ValueError("sampler-aware pi_old: per-sample temperatures are not supported")
        temperature = float(temperature.flatten()[0])
    weight = _full_tensor(head.weight)
    bias = None if getattr(head, "bias", None) is None else _full_tensor(head.bias)
    with torch.autocast(device_type=hidden.device.type, enabled=False):  # the fp32 head pass stays fp32
        out = sampler_logprobs_from_hidden(hidden, weight, labels, float(temperature), sampler.top_k,
                                           sampler.top_p, sampler.min_p, bias=bias)
    return torch.nested.nested_tensor_from_jagged(out.processed, offsets)


# ============================================================================= TRL side by side

def _trl_has_value_head() -> bool:
    """Whether the installed TRL still ships ``AutoModelForCausalLMWithValueHead`` (TRL < 1.16)."""
    if "_trl_value_head" not in _cache:
        found = False
        for module in ("trl.experimental.ppo", "trl"):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    found = hasattr(importlib.import_module(module), "AutoModelForCausalLMWithValueHead")
            except ImportError:
                continue
            if found:
                break
        _cache["_trl_value_head"] = found
    return _cache["_trl_value_head"]


def _wrap_is_trl_available(original: Callable) -> Callable:
    """verl's ``apply_monkey_patch`` imports TRL's value-head class whenever TRL is importable.

    TRL 1.16 removed the class, so with both installed building verl's FSDP actor fails. Only
    in ``verl.models.transformers.monkey_patch`` (that one use), TRL counts as available only if
    it still has the class; verl's patch of that class's ``state_dict`` is then moot.
    """
    @functools.wraps(original)
    def is_trl_available():
        if not original():
            return False
        if _trl_has_value_head():
            return True
        if not _cache.get("_trl_logged"):
            _cache["_trl_logged"] = True
            logger.warning("rollout-parity: TRL has no AutoModelForCausalLMWithValueHead; verl's TRL value-head "
                        "patch is skipped (verl.models.transformers.monkey_patch.is_trl_available -> False)")
        return False

    return is_trl_available


# ============================================================================= patch points

@dataclass(frozen=True)
class _PatchPoint:
    """Where a verl name is defined (``module``) and where verl modules import it by name (``callers``)."""

    module: str
    attr: str  # "function" or "Class.method"
    factory: Callable[[Callable], Callable]
    callers: tuple[str, ...] = ()
    eager: bool = False  # imported at apply(); otherwise patched when (if) verl imports it
    optional: bool = False  # exists only in some verl versions / trainers: patched when its module imports

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.attr}"


_PATCH_POINTS: tuple[_PatchPoint, ...] = (
    _PatchPoint("verl.utils.device", "auto_set_device", _wrap_auto_set_device,
                callers=("verl.trainer.main_ppo", "verl.trainer.main_ppo_sync"), eager=True),
    _PatchPoint("verl.utils.config", "validate_config", _wrap_validate,
                callers=("verl.trainer.main_ppo", "verl.trainer.main_ppo_v0", "verl.trainer.main_ppo_sync"),
                eager=True),
    _PatchPoint("verl.trainer.ppo.rollout_corr_helper", "compute_rollout_correction_and_add_to_batch", _wrap_helper,
                callers=("verl.trainer.ppo.v1.trainer_base", "verl.trainer.main_ppo_sync"), eager=True),
    _PatchPoint("verl.trainer.ppo.core_algos", "get_policy_loss_fn", _wrap_get_policy_loss_fn,
                callers=("verl.workers.utils.losses", "verl.trainer.distillation.losses"), eager=True),
    _PatchPoint("verl.workers.utils.losses", "ppo_loss", _wrap_ppo_loss,
                callers=("verl.workers.engine_workers", "verl.trainer.distillation.losses")),
    _PatchPoint("verl.workers.engine.fsdp.transformer_impl", "FSDPEngine._build_module", _wrap_build_module),
    _PatchPoint("verl.workers.engine.fsdp.transformer_impl", "FSDPEngineWithLMHead.forward_step", _wrap_forward_step),
    _PatchPoint("verl.models.transformers.monkey_patch", "is_trl_available", _wrap_is_trl_available),
    # verl 0.9's V1 trainer. verl 0.8's main_ppo_sync has the same method, but ``python -m`` runs
    # that module as __main__ and Ray pickles its PPOTrainer by value: no import to patch on, so
    # what needs this hook is refused there at start (configure_verl).
    _PatchPoint("verl.trainer.ppo.v1.trainer_base", "PPOTrainer._compute_advantage", _wrap_compute_advantage,
                optional=True),
)

# (owner, name, previous value) in the order applied; revert walks it backwards.
_applied: list[tuple[Any, str, Any]] = []
# original -> wrapper, so a caller module gets the very wrapper its definition got
_wrappers: dict[int, Callable] = {}


def _owner_and_name(module: Any, attr: str) -> tuple[Any, str]:
    *path, name = attr.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _current(owner: Any, name: str) -> Any:
    return owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)


def _patch_definition(point: _PatchPoint, module: Any) -> None:
    try:
        owner, name = _owner_and_name(module, point.attr)
        current = _current(owner, name)
    except AttributeError:
        current = None
    if current is None:
        version = getattr(verl, "__version__", "?")
        raise FrameworkAPIError(
            f"rollout-parity's verl adapter needs {point.dotted}, which verl {version} does not have; "
            f"the adapter is tested with verl {TESTED_VERL} (pip install 'rollout-parity[verl]')")
    if getattr(current, _PATCH_MARK, False):
        return  # ours already (idempotent)
    if isinstance(current, types.FunctionType) and getattr(current, "__wrapped__", None) is not None:
        # someone else's functools.wraps wrapper: stacking on it would corrupt both reverts (STYLE.md rule 7)
        code = current.__code__  # functools.wraps copied verl's names onto it; its code tells whose it is
        raise RuntimeError(f"{point.dotted} is already wrapped by {code.co_name} ({code.co_filename}:"
                           f"{code.co_firstlineno}), not rollout-parity's; refusing to stack on it")
    wrapper = point.factory(current)
    setattr(wrapper, _PATCH_MARK, True)
    _wrappers[id(current)] = wrapper
    setattr(owner, name, wrapper)
    _applied.append((owner, name, current))


def _recorded(owner: Any, name: str) -> bool:
    return any(o is owner and n == name for o, n, _ in _applied)


def _patch_callers(point: _PatchPoint) -> None:
    """Give every already-imported caller module the wrapper; remember later importers for revert."""
    *_, name = point.attr.split(".")
    for caller in point.callers:
        module = sys.modules.get(caller)
        current = None if module is None else getattr(module, name, None)
        if current is None:
            continue  # not imported (yet): it will import the wrapped name
        if getattr(current, _PATCH_MARK, False):
            if not _recorded(module, name):  # imported after apply(): bound our wrapper itself
                _applied.append((module, name, current.__wrapped__))
            continue
        wrapper = _wrappers.get(id(current))
        if wrapper is not None:  # a caller holding something other than verl's definition is left alone
            setattr(module, name, wrapper)
            _applied.append((module, name, current))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies a deferred patch point right after verl imports its module for real.

    verl imports its plugins from ``verl/__init__`` (this adapter among them), before most of
    its own modules exist; the heavy ones (the FSDP engine needs the device platform, the V1
    trainer needs Ray and TransferQueue) are patched the moment they load, not imported here.
    A name missing then raises ``FrameworkAPIError`` from that import.
    """

    def __init__(self) -> None:
        self.watch: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.watch:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                original_exec = spec.loader.exec_module

                def exec_module(module, _original=original_exec, _name=fullname):
                    _original(module)
                    _on_import(_name, module)

                spec.loader.exec_module = exec_module
                return spec
        return None


_import_hook = _PatchOnImport()


def _on_import(module_name: str, module: Any) -> None:
    if not _applied and not _import_hook.watch:
        return
    for point in _PATCH_POINTS:
        if point.module == module_name:
            _patch_definition(point, module)
        if module_name in point.callers or point.module == module_name:
            _patch_callers(point)
    _import_hook.watch.discard(module_name)


def apply() -> None:
    """Wrap verl's names (module docstring table); idempotent, all or nothing.

    Checks the installed verl version first (one warning outside :data:`TESTED_VERL`). Modules
    already imported are patched now (a missing name raises ``FrameworkAPIError`` and undoes what
    this call did); the others are patched when verl imports them.
    """
    check_framework("verl", distributions=("verl",), tested=TESTED_VERL, extra="verl")
    if is_applied():
        return
    done = len(_applied)
    try:
        for point in _PATCH_POINTS:
            if point.eager or point.module in sys.modules:
                module = importlib.import_module(point.module)
                _patch_definition(point, module)
                _patch_callers(point)
            else:
                _import_hook.watch.add(point.module)
            _import_hook.watch.update(c for c in point.callers if c not in sys.modules)
    except Exception:
        while len(_applied) > done:
            owner, name, previous = _applied.pop()
            setattr(owner, name, previous)
        _import_hook.watch.clear()
        raise
    if _import_hook not in sys.meta_path:
        sys.meta_path.insert(0, _import_hook)


def revert() -> None:
    """Put every wrapped verl name back (in reverse order) and stop patching on import."""
    while _applied:
        owner, name, previous = _applied.pop()
        setattr(owner, name, previous)
    _wrappers.clear()
    _wrapped_loss.cache_clear()
    _import_hook.watch.clear()
    if _import_hook in sys.meta_path:
        sys.meta_path.remove(_import_hook)


def is_applied() -> bool:
    """True while the eager patch points carry rollout-parity's wrappers."""
    for point in _PATCH_POINTS:
        if not point.eager:
            continue
        module = sys.modules.get(point.module)
        if module is None:
            return False
        owner, name = _owner_and_name(module, point.attr)
        if not getattr(_current(owner, name), _PATCH_MARK, False):
            return False
    return True


def _deprecated(old: str, new: Callable) -> Callable:
    @functools.wraps(new)
    def alias(*args, **kwargs):
        warnings.warn(f"rollout_parity.adapters.verl.{old}() is renamed {new.__name__}(); the old name goes away "
                      "in the next release", FutureWarning, stacklevel=2)
        return new(*args, **kwargs)

    return alias


install = _deprecated("install", apply)
uninstall = _deprecated("uninstall", revert)
is_installed = _deprecated("is_installed", is_applied)

apply()
