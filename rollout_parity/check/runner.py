"""Find the installed frameworks, run each one's checks, collect the reports.

A framework that is not installed is a skip, named with the extra that installs it; one that
is installed but does not import, or whose checks raise (a missing private name, an API that
moved), is an error. Either a failed check or an error makes the command exit non-zero; a
skip does not, unless ``--require`` names the framework.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

from rollout_parity import quiet, registry
from rollout_parity.check.report import CORRUPT_ENV, FrameworkReport, corrupt_target, extra_range, in_range

__all__ = ["FRAMEWORKS", "CheckOptions", "corruptible_checks", "run_check", "environment"]


@dataclass(frozen=True)
class _Spec:
    key: str
    name: str
    module: Optional[str]  # what must import; None: always there
    distributions: tuple[str, ...]
    extra: Optional[str]
    ticks: int  # progress steps the run reports
    check: str  # "module:function", called as function(report, opts, tick)


#: The core (always there), then every framework and engine of the registry, in its order.
FRAMEWORKS = (_Spec("core", "core", None, ("rollout-parity",), None, 10, "rollout_parity.check.core_checks:run"),
              *(_Spec(u.key, u.name, u.module, u.distributions, u.extra, u.check_ticks, u.check)
                for u in registry.UNITS))
_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "WANDB_MODE": "disabled"}


@dataclass
class CheckOptions:
    frameworks: tuple[str, ...] = tuple(s.key for s in FRAMEWORKS)
    require: tuple[str, ...] = ()
    nemo_rl_source: Optional[str] = None
    model: Optional[str] = None
    max_delta: Optional[float] = None  # vLLM probe; None: vllm_probe.MAX_DELTA
    gpu_memory_utilization: float = 0.3
    progress: bool = True


def corruptible_checks() -> list[str]:
    """The check names the self-test knob (``ROLLOUT_PARITY_CHECK_CORRUPT``) accepts."""
    from rollout_parity.check.core_checks import CORE_CHECKS
    from rollout_parity.check.nemo_checks import NEMO_CHECKS
    from rollout_parity.check.trl_checks import TRL_CHECKS
    from rollout_parity.check.verl_checks import VERL_CHECKS

    metrics = ("core/metrics", "trl/metrics")  # what they compare is computed before any weight exists
    return [k for k in (*CORE_CHECKS, *TRL_CHECKS, *VERL_CHECKS, *NEMO_CHECKS) if k not in metrics]


def environment() -> dict[str, str]:
    import torch

    from rollout_parity.framework_api import installed_version

    device = f"cuda ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "cpu"
    return {"rollout-parity": installed_version(("rollout-parity",)) or "?", "torch": torch.__version__,
            "python": platform.python_version(), "device": device}


def _progress(opts: CheckOptions, total: int):
    if not opts.progress:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="rollout-parity check", file=quiet.console, leave=False)


def _installed(spec: _Spec) -> bool:
    if spec.module is None:
        return True
    try:
        return importlib.util.find_spec(spec.module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules holds it without a spec
        return False


def _run_one(spec: _Spec, opts: CheckOptions, tick: Callable[[], None]) -> FrameworkReport:
    from rollout_parity.framework_api import UntestedFrameworkVersionWarning, installed_version
    from rollout_parity.engines.spec import EngineFeatureMissingError

    report = FrameworkReport(spec.key, spec.name, version=installed_version(spec.distributions),
                             tested=extra_range(spec.extra) if spec.extra else None)
    from_source = spec.key == "nemo_rl" and opts.nemo_rl_source is not None
    if not from_source and not _installed(spec):
        report.status = "skipped"
        report.reason = f"{spec.module} is not installed (pip install 'rollout-parity[{spec.extra}]')"
        if spec.key == "nemo_rl":
            report.reason = ("nemo_rl is not importable (NeMo RL is not on PyPI): pass --nemo_rl_source PATH, "
                             "a checkout of NVIDIA-NeMo/RL holding nemo_rl/")
        return report
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if spec.module is not None and not from_source:
                importlib.import_module(spec.module)
            _dispatch(spec, report, opts, tick)
        except EngineFeatureMissingError as exc:  # refused by name on this stack: nothing here can run it
            report.status = "skipped"
            report.reason = f"refused by name on this stack: {exc}"
        except Exception as exc:  # noqa: BLE001 - a framework that breaks the check is reported, not raised
            report.status = "error"
            report.reason = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            where = traceback.extract_tb(exc.__traceback__)[-1]
            report.notes.append(f"raised at {where.filename}:{where.lineno} ({where.name})")
    for w in caught:
        if issubclass(w.category, UntestedFrameworkVersionWarning) and str(w.message) not in report.notes:
            report.notes.append(str(w.message))
    report.in_range = in_range(report.version, report.tested)
    report.seconds = time.perf_counter() - t0
    return report


def _dispatch(spec: _Spec, report: FrameworkReport, opts: CheckOptions, tick: Callable[[], None]) -> None:
    module, function = spec.check.split(":")
    getattr(importlib.import_module(module), function)(report, opts, tick)


def run_check(opts: CheckOptions) -> tuple[list[FrameworkReport], float]:
    """Every selected framework's checks, in order; returns the reports and the wall time."""
    known = {s.key for s in FRAMEWORKS}
    if not opts.frameworks:
        raise ValueError("no framework left to check (--only/--skip selected none)")
    for key in (*opts.frameworks, *opts.require):
        if key not in known:
            raise ValueError(f"unknown framework {key!r}; known: {', '.join(sorted(known))}")
    target = corrupt_target()
    if target is not None and target not in corruptible_checks():
        raise ValueError(f"{CORRUPT_ENV}={target!r} names no check; one of {', '.join(corruptible_checks())}")
    for name, value in _OFFLINE.items():  # the check never downloads: tiny models are built locally
        os.environ.setdefault(name, value)
    if opts.progress and importlib.util.find_spec("transformers") is not None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar, ours: transformers' per-load bars would cut through it
    t0 = time.perf_counter()
    specs = [s for s in FRAMEWORKS if s.key in opts.frameworks]
    bar = _progress(opts, sum(s.ticks for s in specs))
    reports = []
    try:
        for spec in specs:
            if bar is not None:
                bar.set_postfix_str(spec.name)
            start = bar.n if bar is not None else 0
            with quiet.phase(spec.name) as held:  # the framework's own output: held, printed if it errors
                report = _run_one(spec, opts, bar.update if bar is not None else (lambda n=1: None))
                if report.status == "error":
                    held.show()
            if bar is not None:  # a skip, an error or a run with fewer steps still fills its share
                bar.update(max(0, start + spec.ticks - bar.n))
            if report.status == "skipped" and spec.key in opts.require:
                report.status, report.reason = "error", f"required (--require {spec.key}) but {report.reason}"
            reports.append(report)
    finally:
        if bar is not None:
            bar.close()
    return reports, time.perf_counter() - t0
