"""verl's config in, verl's config out: the ``rollout_parity`` block validated, refused or translated.

:func:`configure_verl` runs on the driver before Ray starts (from verl's ``auto_set_device`` and
``validate_config``, see ``patches.py``). It reads the block, refuses by name what verl cannot
express, writes the rollout engine's parity recipe (``engine.py``) and the flags' transport into verl's config (each change
logged as ``key: old -> new``), and makes the flags active. docs/verl.md lists every change and
every refusal.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from rollout_parity.framework_api import check_framework
from rollout_parity.adapters._refusals import active_penalties, head_modifiers, needs_rollout_logprobs, \
    refuse_unmatched_sampler
from rollout_parity.adapters.verl.compat import REQUIRED_VERL_NAMES, TESTED_VERL, has_v1_trainer, verl_version
from rollout_parity.adapters.verl.engine import engine_reproduces_sampler, merge_engine_recipe, refuse_engine, \
    refuse_recipe_contradictions
from rollout_parity.adapters.verl.sync import refuse_sync_flags
from rollout_parity.adapters.verl.flags import CONFIG_KEY, ENV_CONFIG, ENV_MODULES, MODULE, active_config, \
    carried_env, check_ray_carries, set_active_config, with_module
from rollout_parity.adapters.verl.precision import refuse_precision_contradictions, warn_one_sided_precision, \
    write_precision
from rollout_parity.core.config import CorrectionConfig, refuse_unknown
from rollout_parity.core.sampler import SamplerSettings

__all__ = ["select", "correction_config_from_verl", "check_no_double_correction", "sampler_from_verl",
           "configure_verl"]

logger = logging.getLogger(__name__)


def select(config: Any, key: str, default: Any = None) -> Any:
    """``config.<dotted key>`` from an OmegaConf node, a mapping or verl's dataclass configs; ``default`` if unset."""
    if isinstance(config, DictConfig):
        value = OmegaConf.select(config, key, default=default)
        return default if value is None else value
    node = config
    for part in key.split("."):
        if node is None:
            return default
        node = node.get(part, None) if hasattr(node, "get") else getattr(node, part, None)
    return default if node is None else node


def correction_config_from_verl(config: Any) -> Optional[CorrectionConfig]:
    """The ``rollout_parity`` block of a verl config as a ``CorrectionConfig`` (None if absent)."""
    block = select(config, CONFIG_KEY)
    if block is None:
        return None
    if isinstance(block, str) or not hasattr(block, "keys"):
        raise ValueError(f"{CONFIG_KEY}: expected a mapping of shared flags, got {block!r}")
    data = OmegaConf.to_container(block, resolve=True) if isinstance(block, DictConfig) else dict(block)
    refuse_unknown(data, (*CorrectionConfig.field_names(), "preset"), where=f"{CONFIG_KEY}.")
    preset = data.pop("preset", None)
    return CorrectionConfig.preset(preset, **data) if preset is not None else CorrectionConfig.from_dict(data)


def check_no_double_correction(config: Any, cfg: CorrectionConfig) -> None:
    """Raise when verl's own rollout correction would act next to ours (docs/flags.md, "Bad input")."""
    rc = select(config, "algorithm.rollout_correction")
    if rc is not None:
        own = {k: select(rc, k) for k in ("rollout_is", "rollout_rs") if select(rc, k) is not None}
        if own:
            raise ValueError(
                f"double correction: algorithm.rollout_correction has {own} and {CONFIG_KEY} is set; "
                "use one of them (set algorithm.rollout_correction.rollout_is=null rollout_rs=null, "
                f"or drop the +{CONFIG_KEY}.* overrides)")
        if select(rc, "bypass_mode", False) and cfg.old_logprob_source != "bypass":
            raise ValueError(f"algorithm.rollout_correction.bypass_mode=true contradicts {CONFIG_KEY}.old_logprob_source="
                             f"{cfg.old_logprob_source!r}; set {CONFIG_KEY}.old_logprob_source=bypass instead")
    if select(config, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla") == "bypass_mode":
        # verl's bypass loss (loss_type ppo_clip or reinforce) with our correction inside it (verl_keys.py)
        if cfg.old_logprob_source != "bypass":
            raise ValueError(
                "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode is verl's bypass loss (pi_old := "
                f"pi_rollout): set {CONFIG_KEY}.old_logprob_source=bypass with it, or keep your loss_mode")
        loss_type = select(config, "actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type", None) \
            or select(config, "algorithm.rollout_correction.loss_type", "ppo_clip")
        if loss_type not in ("ppo_clip", "reinforce"):
            raise ValueError(f"policy_loss.rollout_correction.loss_type={loss_type!r}: verl's bypass loss has "
                             "'ppo_clip' and 'reinforce'")
        rs = select(config, "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_rs", None)
        if rs is not None:
            raise ValueError(
                f"actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_rs={rs!r} with {CONFIG_KEY}: "
                f"rejection is the flags' ({CONFIG_KEY}.rollout_rejection, applied on the driver before the "
                "advantages); set it to null")


def sampler_from_verl(config: Any) -> SamplerSettings:
    """The sampler of ``actor_rollout_ref.rollout`` (verl has no min_p; a top_k of -1 or 0 is off)."""
    rollout = "actor_rollout_ref.rollout."
    return SamplerSettings(temperature=select(config, rollout + "temperature", 1.0),
                           top_k=select(config, rollout + "top_k", None), top_p=select(config, rollout + "top_p", 1.0))


def _model_config(config: Any) -> Any:
    """The actor's Hugging Face config, for the head-modifier refusal (None, with a warning, if unreadable)."""
    path = select(config, "actor_rollout_ref.model.path")
    if path is None:
        return None
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(os.path.expanduser(str(path)),
                                        trust_remote_code=bool(select(config, "actor_rollout_ref.model.trust_remote_code",
                                                                      False)))
    except Exception as exc:  # noqa: BLE001 - the check is a refusal of a rare head, never a reason to stop
        logger.warning("rollout-parity: could not read %s's config (%s): scaled or soft-capped heads unchecked",
                       path, exc)
        return None
    overrides = select(config, "actor_rollout_ref.model.override_config", {}) or {}
    for key, value in dict(overrides).items():
        setattr(hf, key, value)
    return hf


def _refuse_outside_fsdp_head_pass(config: Any, what: str) -> None:
    """Our trainer-side hooks live in verl's FSDP engine, in its unfused head pass (Ulysses slices included)."""
    strategy = select(config, "actor_rollout_ref.actor.strategy")
    if strategy not in (None, "fsdp", "fsdp2"):
        raise ValueError(f"{what}: supported with the FSDP actor (strategy fsdp/fsdp2), got strategy={strategy!r}")
    if select(config, "actor_rollout_ref.model.use_fused_kernels", False):
        raise ValueError(f"{what}: actor_rollout_ref.model.use_fused_kernels=true computes logprobs inside a fused "
                         "kernel that never calls the lm_head module; set it to false")


def _refuse(config: Any, cfg: CorrectionConfig, sampler: SamplerSettings, sampler_aware: bool) -> None:
    """What the flags cannot mean in this verl run, by name, before anything is written."""
    check_no_double_correction(config, cfg)
    refuse_precision_contradictions(config, cfg, _command_line_keys())  # precision.py
    refuse_recipe_contradictions(config, cfg, _command_line_keys())  # engine.py: engine_kwargs.<engine>
    if cfg.rollout_sampling_replay:
        raise ValueError(f"rollout_sampling_replay=true: verl {verl_version()}'s rollout servers hand its agent loop "
                         "only token ids and logprobs (TokenOutput), so the engine's per-token kept sets never reach "
                         "the actor's pi_old pass; not supported in verl yet (the boundary rule covers the recomputed "
                         "kept set)")
    rollout = select(config, "actor_rollout_ref.rollout", {})
    refuse_unmatched_sampler(cfg, sampler, penalties=active_penalties(lambda k: select(rollout, k)),
                             modifiers=head_modifiers(_model_config(config)) if sampler_aware else {})
    if cfg.fp32_lm_head:
        _refuse_outside_fsdp_head_pass(config, "fp32_lm_head")
    if sampler_aware:
        what = f"sampler-aware pi_old (rollout top_k={sampler.top_k}, top_p={sampler.top_p})"
        _refuse_outside_fsdp_head_pass(config, what)
        if select(config, "trainer.use_v1") is False:
            raise ValueError(f"{what}: trainer.use_v1=false; the processed pi_old reaches the driver through "
                             "verl's TransferQueue trainer (trainer.use_v1=true, verl's default)")
        if not has_v1_trainer():
            raise ValueError(f"{what}: needs verl's V1 trainer (verl >= 0.9); verl {verl_version()}'s main_ppo "
                             "keeps only log_probs and entropy of the actor's log-prob pass, and its main_ppo_sync "
                             "runs its PPOTrainer as __main__, where the driver hook cannot be handed the "
                             "TransferQueue batch")
    if (cfg.old_logprob_source == "bypass" and cfg.rollout_rejection is not None and not has_v1_trainer()
            and select(config, "transfer_queue.enable", False)):
        raise ValueError(
            f"old_logprob_source=bypass with rollout_rejection: on verl {verl_version()} with "
            "transfer_queue.enable=true (main_ppo_sync) the loss would keep the recomputed pi_old; the driver "
            "hook writes old_log_probs := rollout_log_probs into the TransferQueue only in verl >= 0.9's V1 "
            "trainer (main_ppo_sync runs its PPOTrainer as __main__). Use verl's main_ppo here, or verl >= 0.9")


def _node(config: DictConfig, *keys: str) -> DictConfig:
    """``config.<keys...>``, with an empty node put where a key is missing or null."""
    for key in keys:
        if config.get(key, None) is None:
            config[key] = {}
        config = config[key]
    return config


def _command_line_keys() -> set[str]:
    """The config keys the user set on the Hydra command line (empty outside ``hydra.main``)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    except Exception:  # noqa: BLE001 - no Hydra run: nothing was set on a command line
        return set()
    return {str(o).split("=", 1)[0].lstrip("+~") for o in overrides}


def _job_env_vars() -> dict[str, str]:
    """The ``env_vars`` of the Ray job this driver runs in (``ray job submit``); empty otherwise."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    try:
        return dict(((json.loads(raw) or {}).get("runtime_env") or {}).get("env_vars") or {}) if raw else {}
    except (ValueError, AttributeError):
        return {}


def _refuse_job_env(carried: dict[str, Optional[str]]) -> None:
    """What a submitted job's own environment says against the transport, by name.

    Ray refuses a key set both by the job and by the driver's ``ray.init`` ("Failed to merge the
    Job's runtime env"), so a key the job carries is left to the job (verl drops its own defaults the
    same way). That works only where the job's value is the one the run needs.
    """
    job = _job_env_vars()
    for key, value in carried.items():
        if key in job and job[key] != value:
            raise ValueError(f"the Ray job's runtime env sets {key}, which rollout-parity writes from the "
                             f"+{CONFIG_KEY}.* overrides: drop it from the job's env_vars")
    modules = job.get(ENV_MODULES)
    if modules is not None and MODULE not in modules.split(","):
        raise ValueError(
            f"the Ray job's runtime env sets {ENV_MODULES}={modules!r} without {MODULE}: every Ray process of the "
            "job reads that value (the driver cannot add to it: Ray refuses a key set twice), so processes on "
            "every node would miss the adapter. Submit the job with "
            f"--runtime-env-json '{{\"env_vars\": {{\"{ENV_MODULES}\": \"{with_module(modules)}\"}}}}'")


def _write(config: DictConfig, cfg: CorrectionConfig, carried: dict[str, Optional[str]], verl_bypass: bool) -> None:
    job = _job_env_vars()
    with open_dict(config):
        merge_engine_recipe(config, cfg)
        write_precision(config, cfg)
        config.actor_rollout_ref.rollout.calculate_log_probs = True
        model = config.actor_rollout_ref.model
        libs = model.get("external_lib", None)
        names = [] if libs is None else [libs] if isinstance(libs, str) else list(libs)
        if MODULE not in names:
            model.external_lib = MODULE if not names else names + [MODULE]
        _node(config, "algorithm")
        if config.algorithm.get("rollout_correction", None) is None:
            config.algorithm.rollout_correction = {"rollout_is": None, "rollout_rs": None}
        config.algorithm.rollout_correction.bypass_mode = verl_bypass
        env_vars = _node(config, "ray_kwargs", "ray_init", "runtime_env", "env_vars")
        for key, value in carried.items():
            if value is None or key in job:  # a key the job carries (with this value) is the job's to pass
                env_vars.pop(key, None)
            else:
                env_vars[key] = value
        # verl < 0.9 has no verl.plugins entry points: every Ray process (on every node) imports the
        # adapter at ``import verl`` only through this variable (the job's own, when it sets one).
        if ENV_MODULES in job:
            env_vars.pop(ENV_MODULES, None)
        else:
            env_vars[ENV_MODULES] = with_module(env_vars.get(ENV_MODULES, os.environ.get(ENV_MODULES, "")))
        config[CONFIG_KEY] = cfg.to_dict()


def configure_verl(config: DictConfig) -> Optional[CorrectionConfig]:
    """Validate the ``rollout_parity`` block and rewrite ``config`` in place for it.

    Returns the ``CorrectionConfig`` (None, config untouched, when there is no block). Raises
    ``ValueError`` naming the flag on a bad value, on double correction and on what cannot be
    expressed; ``FrameworkAPIError`` when the installed verl lacks a name the adapter needs;
    ``RuntimeError`` when Ray already runs without these flags. Configuring the same config
    again changes and prints nothing.
    """
    cfg = correction_config_from_verl(config)
    if cfg is None or cfg.precision is None:
        warn_one_sided_precision(config)  # a precision set on one side only: said once, never refused
    if cfg is None:
        return None
    check_framework("verl", distributions=("verl",), tested=TESTED_VERL, extra="verl", required=REQUIRED_VERL_NAMES)
    refuse_sync_flags(config, cfg)  # sync.py: the weight-sync check and MoE routing replay
    engine = refuse_engine(config, cfg)  # engine.py: the rollout engine, and what verl's path to it cannot carry
    sampler = sampler_from_verl(config)
    sampler_aware = sampler.truncates and needs_rollout_logprobs(cfg) and engine_reproduces_sampler(engine)
    _refuse(config, cfg, sampler, sampler_aware)
    # verl's own bypass skips the pi_old pass; rejection and a truncating sampler need it (docs/verl.md).
    verl_bypass = cfg.old_logprob_source == "bypass" and cfg.rollout_rejection is None and not sampler_aware
    carried = carried_env(cfg, sampler if sampler_aware else None)
    _refuse_job_env(carried)
    check_ray_carries(carried)
    before = OmegaConf.to_container(config, resolve=False)
    _write(config, cfg, carried, verl_bypass)
    repeat = active_config() == cfg
    set_active_config(cfg, sampler if sampler_aware else None)
    changes = _changed_keys(before, OmegaConf.to_container(config, resolve=False))
    if repeat and not changes:
        return cfg  # configured before (verl calls more than one of our hooks with the same config)
    # One visible line at start: verl logs a plugin that fails to import only at DEBUG, where nobody sees it.
    loss_mode = select(config, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla")
    print(f"[rollout-parity] verl configured: loss_mode={loss_mode} (unchanged), flags={carried[ENV_CONFIG]}"
          + (f", sampler-aware pi_old for top_k={sampler.top_k} top_p={sampler.top_p}" if sampler_aware else ""),
          flush=True)
    overridden = [f"{k}: {a!r} -> {b!r}" for k, a, b in changes
                  if a is not None and not k.startswith((CONFIG_KEY, "ray_kwargs."))]
    if overridden:  # a value verl (or the user's YAML) chose, replaced for the recipe: say so where it shows
        print(f"[rollout-parity] verl settings overridden: {'; '.join(overridden)}", flush=True)
    if changes:  # one line, not one per key: Hydra's default logging, which verl's main_ppo keeps, shows INFO
        logger.info("rollout-parity: verl config changed: %s", _describe_changes(changes))
    if cfg.off_policy_sequence_mask_delta is not None and cfg.old_logprob_source == "recompute":
        logger.warning("off_policy_sequence_mask_delta in verl decoupled mode: the loss does not see rollout "
                       "logprobs, so the behaviour policy of the off-policy mask is pi_old (docs/verl.md)")
    return cfg


def _describe_changes(changes: list[tuple[str, Any, Any]]) -> str:
    """``key: old -> new; ...`` for verl's own keys; the ``rollout_parity`` block, written out in full (its values
    are the flags printed above), and the Ray job's env vars (the same flags again) by name."""
    block, ray, own = f"{CONFIG_KEY}.", "ray_kwargs.", []
    for key, old, new in changes:
        if not key.startswith((block, ray)):
            own.append(f"{key}: {old!r} -> {new!r}")
    flags = [k[len(block):] for k, _, _ in changes if k.startswith(block)]
    if flags:
        own.append(f"{CONFIG_KEY}: {', '.join(flags)} filled in")
    for key, _, new in changes:
        if key.startswith(ray):
            own.append(f"{key} += {', '.join(sorted(new))}" if isinstance(new, dict) else f"{key} set")
    return "; ".join(own)


def _changed_keys(before: Any, after: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(before, dict) and isinstance(after, dict):
        out = []
        for key in sorted(set(before) | set(after), key=str):
            out += _changed_keys(before.get(key), after.get(key), f"{prefix}{key}.")
        return out
    return [] if before == after else [(prefix.rstrip("."), before, after)]
