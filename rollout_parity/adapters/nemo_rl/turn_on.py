"""Turn the NeMo RL adapter on from a recipe's ``loss_fn`` block, and off again.

``apply()`` is what ``rollout-parity launch examples/run_grpo.py --config recipe.yaml`` does before
NeMo RL's script runs (``launched()`` around it):

* it registers the OmegaConf resolver ``rollout_parity``, so the recipe's guard
  ``loss_fn.rollout_parity: ${rollout_parity:}`` resolves. Without the hook, NeMo RL's own
  ``OmegaConf.to_container(config, resolve=True)`` stops at config load on that line: a recipe
  carrying our block never trains uncorrected by accident;
* through the shared patch layer (``_patching.ModulePatcher``) it wraps the name
  ``nemo_rl.algorithms.grpo.ClippedPGLossFn``, which ``grpo.setup()`` calls: a block carrying our
  keys builds ``RolloutParityLossFn``, any other block NeMo RL's own class, untouched;
* it guards ``ClippedPGLossFn.__init__``: any other code building NeMo RL's loss from a block
  carrying our keys (PPO, the single-controller setup, a custom launcher) fails loudly;
* it wraps ``nemo_rl.algorithms.grpo.setup``, which sets ``policy.precision`` and the generation's dtype
  from the block's ``precision`` (or warns when they differ without it) before any worker reads them,
  and ``nemo_rl.utils.config.parse_hydra_overrides``, whose keys are the user's explicit choices
  (``precision.py``).

``revert()`` undoes all of it; ``is_applied()``. docs/nemo_rl.md, "Turning it on".
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from rollout_parity.adapters._patching import ModulePatcher, PatchPoint
from rollout_parity.adapters.nemo_rl import precision as _precision
from rollout_parity.adapters.nemo_rl.translate import BLOCK_KEY, RESOLVER, carries_block
from rollout_parity.adapters.nemo_rl.versions import DISTRIBUTIONS, TESTED_RANGE

__all__ = ["apply", "revert", "is_applied", "launched", "launch", "built", "targets_nemo_rl", "GRPO_SETUP_NAME"]

logger = logging.getLogger(__name__)
#: The name NeMo RL's ``grpo.setup()`` constructs its loss through (v0.7.0 and main).
GRPO_SETUP_NAME = "nemo_rl.algorithms.grpo.ClippedPGLossFn"
_built: list[str] = []  # repr of every RolloutParityLossFn the hook built, for the launcher's exit note


def _build_ours(original: Any, loss_config: Any, *args: Any, **kwargs: Any) -> Any:
    """At ``grpo.ClippedPGLossFn(loss_config, ...)``: ours for a block carrying our keys."""
    if not carries_block(loss_config):
        return original(loss_config, *args, **kwargs)
    from rollout_parity.adapters.nemo_rl.handover import RolloutParityLossFn

    loss_fn = RolloutParityLossFn.from_nemo_config(loss_config, *args, **kwargs)
    _built.append(repr(loss_fn))
    logger.info("rollout-parity: NeMo RL's grpo.setup() builds %r", loss_fn)
    return loss_fn


def _refuse_our_block(original: Any, self: Any, cfg: Any, *args: Any, **kwargs: Any) -> Any:
    """At ``ClippedPGLossFn.__init__``: a block carrying our keys never reaches NeMo RL's own loss."""
    if carries_block(cfg):
        caller = sys._getframe(2)
        raise RuntimeError(
            f"NeMo RL's ClippedPGLossFn is being built from a loss_fn carrying loss_fn.{BLOCK_KEY} at "
            f"{caller.f_code.co_filename}:{caller.f_lineno} ({caller.f_code.co_name}), which rollout-parity does "
            f"not redirect (it redirects {GRPO_SETUP_NAME}, the name grpo.setup() uses): that loss would train "
            "without the correction. Build RolloutParityLossFn.from_nemo_config(loss_fn) there, or remove the block")
    return original(self, cfg, *args, **kwargs)


def _setup_with_precision(original: Any, master_config: Any, *args: Any, **kwargs: Any) -> Any:
    """At ``grpo.setup(master_config, ...)``: the precision flag applied to the config before NeMo RL reads it."""
    _precision.configure_precision(master_config)
    return original(master_config, *args, **kwargs)


_PATCHER = ModulePatcher(
    "NeMo RL",
    (PatchPoint("nemo_rl.algorithms.loss.loss_functions", "ClippedPGLossFn.__init__", _refuse_our_block,
                eager=True),
     PatchPoint("nemo_rl.algorithms.grpo", "ClippedPGLossFn", _build_ours),
     PatchPoint("nemo_rl.algorithms.grpo", "setup", _setup_with_precision),
     PatchPoint("nemo_rl.utils.config", "parse_hydra_overrides", _precision.record_command_line)),
    distributions=DISTRIBUTIONS, tested=TESTED_RANGE, extra="nemo-rl")


def _resolve_guard(*args: Any) -> str:
    from rollout_parity import __version__

    return f"rollout-parity {__version__}"


def apply() -> None:
    """Turn the hook on (idempotent): the guard's resolver, the ``grpo.setup()`` name, the guard."""
    from omegaconf import OmegaConf

    from rollout_parity.adapters.nemo_rl.versions import nemo_loss_names

    nemo_loss_names()  # NeMo RL missing: the ImportError naming the extra, before anything changes
    was_applied = is_applied()
    if not was_applied:
        _built.clear()
        _precision._command_line.clear()
    _PATCHER.apply()
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, _resolve_guard)
    if not was_applied:
        logger.info("rollout-parity: NeMo RL hook on: a loss_fn with %s builds RolloutParityLossFn at %s",
                    BLOCK_KEY, GRPO_SETUP_NAME)


def revert() -> None:
    """Every patched name back, and the resolver gone (a recipe with the guard stops again)."""
    from omegaconf import OmegaConf

    _PATCHER.revert()
    if OmegaConf.has_resolver(RESOLVER):
        OmegaConf.clear_resolver(RESOLVER)


def is_applied() -> bool:
    from omegaconf import OmegaConf

    return _PATCHER.is_applied() and OmegaConf.has_resolver(RESOLVER)


def built() -> list[str]:
    """What the hook built since it was applied (``repr`` of each ``RolloutParityLossFn``)."""
    return list(_built)


@contextlib.contextmanager
def launched() -> Iterator[None]:
    """The hook on for the duration of a NeMo RL script (``rollout-parity launch``)."""
    apply()
    try:
        yield
    finally:
        revert()


_IMPORTS_NEMO_RL = re.compile(r"^\s*(from|import)\s+nemo_rl\b", re.MULTILINE)


def targets_nemo_rl(script: Optional[str] = None, module: Optional[str] = None) -> bool:
    """Whether a script (or ``-m`` module) imports NeMo RL, read without running it."""
    path: Optional[str] = script
    if module is not None:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return module.split(".")[0] == "nemo_rl"
        if module.split(".")[0] == "nemo_rl":
            return True
        path = spec.origin if spec is not None else None
    if not path or not Path(path).is_file():
        return False
    try:
        return bool(_IMPORTS_NEMO_RL.search(Path(path).read_text(errors="replace")))
    except OSError:
        return False


def launch(run: Callable[[], int], flags_given: Sequence[str] = ()) -> int:
    """``rollout-parity launch`` for a NeMo RL script: ``run()`` with the hook on; its exit code.

    NeMo RL reads the shared flags from the recipe, so flags on the launcher's command line are
    refused (2) rather than silently dropped."""
    if flags_given:
        print("rollout-parity launch: a NeMo RL script takes the shared flags from its recipe's "
              f"loss_fn.{BLOCK_KEY} (configs/nemo_rl_loss.yaml), not from the command line: "
              + ", ".join(flags_given), file=sys.stderr)
        return 2
    with launched():
        code = run()
    if code == 0 and not _built:
        print(f"rollout-parity launch: no loss_fn carried {BLOCK_KEY}, so NeMo RL's own loss ran unchanged",
              file=sys.stderr)
    return code
