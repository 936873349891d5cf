"""The flags of a verl run and how they reach every process of it.

The driver validates the ``rollout_parity`` block (``config.py``) and makes it the active flags:
two environment variables, written into this process and into the Ray job's ``runtime_env``
before verl's ``run_ppo`` calls ``ray.init``, so every actor on every node reads the same flags.
The wrappers read :func:`active_config` and pass straight through while it is None.
docs/verl_plugin.md, "How the adapter plugs in", and docs/verl_ray.md, "verl on a Ray cluster".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import sys
import traceback
from typing import Any, Callable, Iterator, Optional

from rollout_parity.core.config import CorrectionConfig
from rollout_parity.core.sampler import SamplerSettings

__all__ = ["CONFIG_KEY", "ENV_CONFIG", "ENV_SAMPLER", "ENV_MODULES", "MODULE", "carried_env", "set_active_config",
           "active_config", "active_sampler", "require_config", "with_module", "check_ray_carries",
           "loud_import_failure", "announce"]

logger = logging.getLogger(__name__)

CONFIG_KEY = "rollout_parity"  # the block of verl's config: +rollout_parity.<flag>=...
ENV_CONFIG = "ROLLOUT_PARITY_VERL_CONFIG"
ENV_SAMPLER = "ROLLOUT_PARITY_VERL_SAMPLER"
ENV_MODULES = "VERL_USE_EXTERNAL_MODULES"  # verl imports these modules at ``import verl``
MODULE = "rollout_parity.adapters.verl"


def carried_env(cfg: Optional[CorrectionConfig], sampler: Optional[SamplerSettings] = None) -> dict[str, Optional[str]]:
    """The environment every process of the run needs (None: must be absent); the one JSON encoding."""
    return {ENV_CONFIG: None if cfg is None else json.dumps(cfg.to_dict(), sort_keys=True),
            ENV_SAMPLER: json.dumps(sampler.to_dict(), sort_keys=True)
            if cfg is not None and sampler is not None and sampler.truncates else None}


def set_active_config(cfg: Optional[CorrectionConfig], sampler: Optional[SamplerSettings] = None) -> None:
    """Make ``cfg`` (and the rollout's truncating sampler) the flags of this process and of Ray actors it starts."""
    for key, value in carried_env(cfg, sampler).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


_parsed: dict[str, tuple[Optional[str], Any]] = {}


def _from_env(name: str, parse: Callable[[dict], Any]) -> Any:
    raw = os.environ.get(name)
    if name not in _parsed or _parsed[name][0] != raw:
        _parsed[name] = (raw, None if not raw else parse(json.loads(raw)))
    return _parsed[name][1]


def active_config() -> Optional[CorrectionConfig]:
    """The flags set by ``configure_verl`` (``ROLLOUT_PARITY_VERL_CONFIG``), or None."""
    return _from_env(ENV_CONFIG, CorrectionConfig.from_dict)


def active_sampler() -> Optional[SamplerSettings]:
    """The rollout's sampler while it truncates (processed and full logprobs differ), else None."""
    if active_config() is None:
        return None
    return _from_env(ENV_SAMPLER, lambda d: SamplerSettings(**d))


def require_config(where: str) -> CorrectionConfig:
    cfg = active_config()
    if cfg is None:  # pragma: no cover - the wrappers pass through without flags
        raise RuntimeError(f"{where}: no rollout-parity flags in this process (env {ENV_CONFIG} is empty)")
    return cfg


def with_module(modules: str) -> str:
    """``VERL_USE_EXTERNAL_MODULES`` with this adapter in it (once)."""
    names = [m for m in str(modules).split(",") if m]
    return ",".join(names if MODULE in names else names + [MODULE])


def check_ray_carries(carried: dict[str, Optional[str]]) -> None:
    """Refuse when Ray already runs without these flags: they would never reach verl's workers.

    A variable set in a running process reaches no Ray actor; only the job's ``runtime_env`` does.
    So configuring after ``ray.init`` works only where the job already carries these very flags
    (verl 0.8's main_ppo re-validates inside its TaskRunner).
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return  # verl's run_ppo starts Ray with the runtime_env configure_verl wrote
    job = dict(ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    wrong = sorted(k for k, v in carried.items() if job.get(k) != v)
    if wrong:
        raise RuntimeError(
            f"rollout-parity: Ray is already initialized and its job environment lacks (or differs in) {wrong}, "
            "so the validated flags would not reach verl's Ray workers. Configure before ray.init: let verl's "
            "main_ppo/run_ppo start Ray, or start it with "
            "ray.init(runtime_env=OmegaConf.to_container(config.ray_kwargs.ray_init.runtime_env)) after "
            "rollout_parity.adapters.verl.configure_verl(config)")


def _requested_here() -> Optional[str]:
    """Why this process must run with the adapter: its Ray job carries the flags, or its command line sets them."""
    if os.environ.get(ENV_CONFIG):
        return f"it is a process of a Ray job configured with rollout-parity's flags ({ENV_CONFIG} is set)"
    overrides = [a for a in sys.argv[1:] if re.match(rf"^[+~]*{CONFIG_KEY}[.=]", a)]
    if overrides:
        return f"its command line sets {', '.join(overrides)}"
    return None


def _where() -> str:
    node = ""
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            node = f", Ray node {ray.get_runtime_context().get_node_id()}"
    except Exception:  # noqa: BLE001 - the node id is a courtesy
        pass
    return f"pid {os.getpid()} on {socket.gethostname()}{node}"


@contextlib.contextmanager
def loud_import_failure() -> Iterator[None]:
    """Make a failed import of the adapter loud, wherever verl imports it.

    verl >= 0.9 imports ``verl.plugins`` entry points at ``import verl`` and logs a failure only at
    DEBUG: the ``+rollout_parity.*`` overrides would then be ignored and the run train uncorrected.
    Where this process is asked to run with the flags, the failure ends it (``SystemExit``, which
    verl's ``except Exception`` does not swallow) naming the cause and the fix; elsewhere it is a
    warning, and the import error goes on to verl.
    """
    try:
        yield
    except Exception as exc:
        what = (f"rollout-parity's verl adapter ({MODULE}) failed to import in {_where()}: "
                f"{type(exc).__name__}: {exc}")
        fix = ("Fix the cause above in this Python environment, on every node of the Ray cluster: "
               "pip install 'rollout-parity[verl]' beside the verl it supports (docs/verl.md)")
        reason = _requested_here()
        if reason is None:
            logger.warning("%s. verl runs without it (no +%s.* overrides here). %s", what, CONFIG_KEY, fix)
            raise
        traceback.print_exc()
        raise SystemExit(f"[rollout-parity] ERROR: {what}. This process must run with it: {reason}; without it "
                         f"verl ignores the flags and trains uncorrected. {fix}") from exc


def announce() -> None:
    """One line from every process that carries the flags: the adapter is applied here (pid, host, Ray node).

    The driver prints ``verl configured`` instead; Ray forwards each worker's line to the job's log,
    so the lines ``verl adapter active`` in that log list the processes of every node.
    """
    cfg = active_config()
    if cfg is None:
        return
    from rollout_parity.adapters._refusals import describe_flags

    print(f"[rollout-parity] verl adapter active in {_where()}: {describe_flags(cfg)}", flush=True)
