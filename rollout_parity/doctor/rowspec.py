"""What a doctor row is, and the rows one engine measures (its ``doctor/engine_<key>.py`` holds the table)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["RowSpec", "EngineRows"]


@dataclass(frozen=True)
class RowSpec:
    name: str
    label: str
    config: str  # the measured configuration (engine, prefix-cache policy, sampling); rows may share one
    trainer_fp32_head: bool
    trainer_view: str  # "processed" (sampler_logprobs) or "full" (full-vocabulary log_softmax)
    how: str
    trainer_precision: str = "bf16"  # the trainer model's dtype (core/precision.py): bf16 or fp16


@dataclass(frozen=True)
class EngineRows:
    """One engine's rows for the doctor.

    key:            the engine's registry key (``--engine``)
    rows:           every row it can measure, by name
    default_rows:   what runs without ``--rows``
    configs:        measured configurations: name -> (engine key, prefix-cache policy across updates, sampling kind)
    parity_rows:    the rows at parity, whose data the advice must not reject
    steps:          the recipe steps the advice judges: (what, row before, row after)
    kwargs:         engine key -> the engine's constructor kwargs (the recipe under test; sizing apart)
    precision_rows: the p/* rows (skipped together when the engine refuses the model in float16)
    """

    key: str
    rows: Mapping[str, RowSpec]
    default_rows: tuple[str, ...]
    configs: Mapping[str, tuple[str, str, str]]
    parity_rows: tuple[str, ...]
    steps: tuple[tuple[str, str, str], ...]
    kwargs: Callable[[str], dict[str, Any]]
    precision_rows: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in (*self.default_rows, *self.parity_rows, *self.precision_rows):
            if name not in self.rows:
                raise ValueError(f"EngineRows {self.key!r}: row {name!r} is not in its table")
        for spec in self.rows.values():
            if spec.config not in self.configs:
                raise ValueError(f"EngineRows {self.key!r}: row {spec.name!r} measures unknown config {spec.config!r}")
