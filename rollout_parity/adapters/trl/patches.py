"""Where the TRL adapter meets one trainer: ``apply``, ``revert`` and ``is_applied``.

Instance patches only (the trainer's own ``__dict__``, dying with it), through the shared patch
layer: TRL's ``_generate`` (checked), ``_generate_and_score_completions`` (the correction, once per
generation batch), ``_get_per_token_logps_and_entropies`` (observed) and ``_compute_loss`` (a
pass-through for diagnostics); TRL's own flags set where the channel needs them, each logged and
restored by ``revert``. Validation first, then all or nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import sys
from typing import Any, Mapping, Optional

from trl import GRPOTrainer

from rollout_parity.framework_api import FrameworkAPIError, check_framework
from rollout_parity.adapters._patching import Patches, is_ours
from rollout_parity.adapters._refusals import describe_flags, needs_rollout_logprobs
from rollout_parity.adapters.trl.config import as_correction_config
from rollout_parity.adapters.trl.diagnostics import diagnosed_loss
from rollout_parity.adapters.trl.engine import check_engine
from rollout_parity.adapters.trl.generation import KEY, ORIGINAL, checked_generate, corrected_generation, \
    observed_forward
from rollout_parity.adapters.trl.precision import refuse_trainer_precision
from rollout_parity.adapters.trl.refusals import TRL_RATIO_FIELDS, refuse_trainer
from rollout_parity.adapters.trl.routing import install_routing_replay
from rollout_parity.adapters.trl.sync import install_sync_hooks
from rollout_parity.core.config import CorrectionConfig
from rollout_parity.core.sampler import SamplerSettings

__all__ = ["TESTED_TRL", "REQUIRED_TRL_NAMES", "apply", "revert", "is_applied", "state_of"]

logger = logging.getLogger("rollout_parity.adapters.trl")

#: TRL releases this adapter is tested with (the ``trl`` extra declares the same range).
TESTED_TRL = ">=1.15,<1.17"
_PATCHED = ("_generate", "_generate_and_score_completions", "_get_per_token_logps_and_entropies", "_compute_loss")
#: Private TRL names used, checked before patching. Before the fused head (1.15) cast_lm_head_to_fp32 made fp32 params.
REQUIRED_TRL_NAMES = tuple(f"trl.trainer.grpo_trainer.GRPOTrainer.{name}" for name in _PATCHED) + (
    "trl.trainer.utils.maybe_gather_lm_head_ctx", "trl.trainer.utils.add_fused_lm_head",
    "trl.generation.vllm_generation.VLLMGeneration.sync_weights",
    "trl.generation.vllm_generation.VLLMGeneration._iter_named_params")
#: Trainer attributes (set in ``GRPOTrainer.__init__``) the adapter reads or sets.
_TRAINER_ATTRS = ("_metrics", "_buffered_inputs", "use_vllm", "loss_type", "temperature", "off_policy_mask_threshold",
                  "vllm_importance_sampling_correction", *TRL_RATIO_FIELDS)
_STATE = "_rollout_parity"


@dataclasses.dataclass
class _State:
    config: CorrectionConfig
    patches: Patches = dataclasses.field(default_factory=Patches)  # methods and TRL flags, reverted together
    engine_checks: Optional[dict[str, bool]] = None
    sampling: Optional[SamplerSettings] = None
    kept_mass: Optional[list] = None  # a list while TRL's next forward is its pi_old: (log S, outside, replayed) per chunk
    sampling_masks: Optional[list] = None  # the engine's kept sets per completion (rollout_sampling_replay)
    loss_logps: Optional[list] = None  # a list while TRL's loss runs: its pi_theta goes here
    sync_schedule: Any = None  # core.sync_check.SyncSchedule: which weight syncs are checked (sync.py)
    probe: Any = None  # core.sync_check.SyncProbe, made at the first checked sync
    sync_results: list = dataclasses.field(default_factory=list)  # one SyncCheckResult per checked sync
    moe_logged: bool = False
    routing: Any = None  # (RoutingReplay, its route table) while moe_routing_replay is on (routing.py)

    def hands_weights(self, trainer: Any) -> bool:
        """Ours (or ones) replace TRL's ratio; otherwise TRL's own acts as configured."""
        return (self.config.changes_loss or self.config.old_logprob_source == "bypass"
                or self.patches.holds(trainer, "vllm_importance_sampling_correction"))


def state_of(trainer: Any) -> Optional[_State]:
    return trainer.__dict__.get(_STATE)


def is_applied(trainer: Any) -> bool:
    """Whether ``apply`` is in effect on this trainer."""
    return _STATE in getattr(trainer, "__dict__", {})


def _check_trl(trainer: Any) -> None:
    check_framework("TRL", distributions=("trl",), tested=TESTED_TRL, extra="trl", required=REQUIRED_TRL_NAMES)
    missing = [f"GRPOTrainer.{name}" for name in _TRAINER_ATTRS if not hasattr(trainer, name)]
    if missing:
        raise FrameworkAPIError(f"rollout-parity's TRL adapter needs {', '.join(missing)} (TRL {TESTED_TRL})")


def _refuse_built(trainer: Any, cfg: CorrectionConfig) -> SamplerSettings:
    """The refusals on a built trainer (``refusals.refuse_trainer``), and no stranger's patch to stack on."""
    if cfg.fp32_lm_head and not trainer.args.cast_lm_head_to_fp32:
        raise ValueError("fp32_lm_head=True on a GRPOTrainer built with cast_lm_head_to_fp32=False: TRL's fused head "
                         "fixes its fp32 projection at construction (ParityGRPOTrainer turns it on)")
    refuse_trainer_precision(cfg, trainer)
    state = state_of(trainer)
    sampling = refuse_trainer(cfg, trainer, None if state is None else state.patches)
    for name in _PATCHED:
        current = trainer.__dict__.get(name)
        if current is not None and not is_ours(current):
            raise ValueError(f"{name} is already replaced on this trainer by "
                             f"{getattr(current, '__qualname__', current)!r}: rollout-parity does not stack on it")
    return sampling


def apply(trainer: Any, config: CorrectionConfig | Mapping[str, Any] | None = None) -> Any:
    """Make ``trainer`` (a ``GRPOTrainer``) use rollout-parity's correction and diagnostics; returns it.

    ``config`` defaults to the trainer's ``ParityGRPOConfig`` flags. Idempotent; a different config
    replaces the previous one, validated first (a refused config leaves the previous one in place).
    """
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"apply expects a trl.GRPOTrainer, got {type(trainer).__name__}")
    _check_trl(trainer)
    cfg = as_correction_config(config, trainer.args)
    previous = state_of(trainer)
    if previous is not None and previous.config == cfg:
        return trainer
    sampling = _refuse_built(trainer, cfg)  # validation first: a refused config leaves the previous one in place
    checks = check_engine(trainer, cfg)
    revert(trainer)
    state = trainer.__dict__[_STATE] = _State(config=cfg, engine_checks=checks, sampling=sampling)
    try:  # all or nothing
        install_sync_hooks(trainer, state)  # MoE layers completed after each sync; the optional sync check
        if cfg.moe_routing_replay:
            install_routing_replay(trainer, state)
        if needs_rollout_logprobs(cfg):
            if not trainer.vllm_importance_sampling_correction:  # the channel, and TRL's pi_old recomputation
                _set_flag(trainer, state, "vllm_importance_sampling_correction", True)
            elif state.hands_weights(trainer):  # TRL's default: say so where Python's logging shows it
                own = ", ".join(f"{k}={getattr(trainer, k)!r}" for k in TRL_RATIO_FIELDS)
                logger.warning("rollout-parity: TRL's own importance sampling (vllm_importance_sampling_correction="
                               "True, %s) is replaced in importance_sampling_ratio by rollout-parity's (%s); TRL's "
                               "sampling/importance_sampling_ratio/* metrics now describe ours", own,
                               describe_flags(cfg))
            if cfg.off_policy_sequence_mask_delta is not None:
                _set_flag(trainer, state, "off_policy_mask_threshold", cfg.off_policy_sequence_mask_delta)
            behaviours = {"_generate": checked_generate, "_generate_and_score_completions": corrected_generation,
                          "_get_per_token_logps_and_entropies": observed_forward, "_compute_loss": diagnosed_loss}
            for name, behaviour in behaviours.items():
                if name != "_compute_loss" or cfg.wants_metrics:
                    state.patches.wrap(trainer, name, functools.partial(behaviour, state),
                                       dotted=f"{type(trainer).__name__}.{name}")
                    logger.info("rollout-parity: patched %s.%s on this trainer", type(trainer).__name__, name)
    except BaseException:
        revert(trainer)
        raise
    if needs_rollout_logprobs(cfg):
        _announce(f"[rollout-parity] TRL adapter active in pid {os.getpid()} on {socket.gethostname()} ({_rank()}): "
                  f"{describe_flags(cfg)}")
    return trainer


_announced: list[int] = []  # the pid that printed the line (a forked child prints its own)


def _announce(line: str) -> None:
    """One visible line per process (every rank, every node) on stderr, whatever the logging setup; a
    later trainer in the same process logs it at INFO (``rollout-parity check`` builds dozens)."""
    if os.getpid() in _announced:
        logger.info("%s", line)
        return
    _announced.append(os.getpid())
    print(line, file=sys.stderr, flush=True)


def _rank() -> str:
    """This process's data-parallel rank, from torch.distributed (accelerate's state may have been reset since)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return f"rank {dist.get_rank()} of {dist.get_world_size()}"
    return f"rank {os.environ.get('RANK', '0')} of {os.environ.get('WORLD_SIZE', '1')}"


def _set_flag(trainer: Any, state: _State, name: str, value: Any) -> None:
    logger.info("rollout-parity: %s: %r -> %r (revert() restores it)", name, getattr(trainer, name), value)
    state.patches.replace(trainer, name, value)


def revert(trainer: Any) -> bool:
    """Undo ``apply`` (False if nothing was applied): TRL's methods and flags come back, and so do TRL's
    own values in the slices still buffered in a generation window (it ends as unpatched TRL trains)."""
    state = trainer.__dict__.pop(_STATE, None)
    if state is None:
        return False
    if state.routing is not None:
        state.routing[0].stop()
    state.patches.revert()
    for batch in getattr(trainer, "_buffered_inputs", None) or []:
        for key in [k for k in batch if k.startswith(KEY)]:
            value, name = batch.pop(key), key[len(ORIGINAL):]
            if key.startswith(ORIGINAL) and value is None:
                batch.pop(name, None)
            elif key.startswith(ORIGINAL):
                batch[name] = value
    return True
