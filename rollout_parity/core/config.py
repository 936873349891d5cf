"""``CorrectionConfig``: the shared flags (docs/flags.md), validated at construction.

Every adapter takes exactly these names with exactly this meaning; the names follow
ms-swift (../shared/seeds/ms-swift-rollout-importance-sampling.txt), the rejection options
follow verl's ``rollout_rs`` (paper §4.2, ../shared/seeds/tim-diagnosis-paper.txt).

A bad value raises ``ValueError`` naming the flag, at construction, never later in a
training step.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from .precision import normalize_precision

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SEQUENCE_REDUCTIONS = ("geometric_mean", "product")
SEQUENCE_MASK_WEIGHTS = ("token", "sequence")
OLD_LOGPROB_SOURCES = ("recompute", "bypass")
REJECTION_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)

__all__ = [
    "CorrectionConfig", "RejectionRule", "FlagError", "refuse_unknown", "closest", "did_you_mean", "IS_MODES", "SEQUENCE_REDUCTIONS", "SEQUENCE_MASK_WEIGHTS", "OLD_LOGPROB_SOURCES",
    "REJECTION_OPTIONS", "LIST_FLAGS", "parse_rejection", "flag_from_text", "configs_dir",
]

ThresholdSpec = Union[float, str, Sequence[float]]
#: Default of ``weight_sync_check_threshold`` (trimmed mean |delta logprob| on the sync probe);
#: docs/moe_sync_check.md, "The sync check", gives the healthy and broken levels it sits between.
WEIGHT_SYNC_CHECK_THRESHOLD = 0.05
#: Flags that take a list (a comma-separated string on a command line).
LIST_FLAGS = ("rollout_rejection", "rollout_rejection_threshold")
_NULL_TEXT = ("", "none", "null")


@dataclass(frozen=True)
class RejectionRule:
    """One parsed rejection option: where it looks, which estimator, which bounds.

    ``level`` is ``token``, ``seq_sum``, ``seq_mean`` or ``seq_max``; ``estimator`` is
    ``k1``, ``k2`` or ``k3``. K2/K3 keep a statistic ``<= upper``. K1 is signed, so it
    takes a ratio range and keeps ``log(lower) <= statistic <= log(upper)`` (verl's form).
    """

    option: str
    level: str
    estimator: str
    upper: float
    lower: Optional[float] = None


class FlagError(ValueError):
    """A shared flag that is unknown or has a bad value; the message names the flag and the fix.

    A ``ValueError``, so callers catching that keep working; the command lines print it as one line
    without a traceback (``rollout-parity launch``, verl's Hydra ``main``).
    """


def _flag_error(flag: str, message: str) -> FlagError:
    return FlagError(f"{flag}: {message}")


def closest(name: str, known: Iterable[str]) -> Optional[str]:
    """The known name a misspelt ``name`` most likely means (difflib, cutoff 0.75), else None.

    A name that starts exactly one known name (what argparse would take as an abbreviation) means that one.
    """
    known = list(dict.fromkeys(known))
    starts = [k for k in known if k.startswith(name) and k != name]
    close = starts if len(starts) == 1 else difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return close[0] if close else None


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"did you mean 'x'?"`` for :func:`closest`, else ``""``."""
    match = closest(name, known)
    return f"did you mean {match!r}?" if match else ""


def refuse_unknown(keys: Iterable[str], known: Iterable[str], *, where: str = "") -> None:
    """Raise :class:`FlagError` for keys not in ``known``: one line, a "did you mean" for each near miss.

    ``where`` prefixes each key as the user wrote it (``"rollout_parity."`` for verl's block).
    """
    known = list(known)
    unknown = [k for k in keys if k not in known]
    if not unknown:
        return
    parts = []
    for key in unknown:
        match = closest(str(key), known)
        parts.append(f"{where}{key}" + (f" (did you mean {where + match!r}?)" if match else ""))
    listed = "" if all("did you mean" in p for p in parts) else f"; the flags are {', '.join(known)}"
    raise FlagError(f"unknown flag{'s' if len(parts) > 1 else ''} {', '.join(parts)}{listed}")


#: The fix for a K1 range that YAML or Hydra read as a number.
_K1_QUOTING = ("YAML and Hydra read an unquoted lo_hi such as 0.9_1 as the number 0.91 ('_' groups digits): "
               "quote it ('0.9_1.1') or write the pair [0.9, 1.1]")


def _parse_k1_range(option: str, spec: Any) -> tuple[float, float]:
    """A K1 option's ratio range ``(lo, hi)``: ``hi`` > 1 (meaning [1/hi, hi]), ``'lo_hi'`` or ``[lo, hi]``.

    The range must hold 1 strictly inside: a sequence with no mismatch has K1 = 0, a ratio of 1, and
    a range without it rejects healthy data. So a single value must be > 1, which also catches the
    number YAML and Hydra make of an unquoted ``0.9_1`` (0.91: any ``lo_hi`` with ``lo`` < 1 written
    ``0.…`` reads as a number below 1).
    """
    flag = "rollout_rejection_threshold"
    if isinstance(spec, str):
        parts = spec.strip().split("_")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise _flag_error(flag, f"{option} threshold {spec!r} is not 'hi' or 'lo_hi'") from None
    elif isinstance(spec, (list, tuple)):
        try:
            values = [float(v) for v in spec]
        except (TypeError, ValueError):
            raise _flag_error(flag, f"{option} takes a pair of numbers [lo, hi], got {spec!r}") from None
    elif isinstance(spec, bool) or not isinstance(spec, (int, float)):
        raise _flag_error(flag, f"{option} threshold {spec!r} is not a number, 'lo_hi' or [lo, hi]")
    else:
        values = [float(spec)]
    if any(math.isnan(v) or math.isinf(v) for v in values):
        raise _flag_error(flag, f"{option} ratio bounds must be finite, got {spec!r}")
    if len(values) == 1:
        hi = values[0]
        if not hi > 1:
            raise _flag_error(flag, f"{option} takes hi > 1 (the ratio range [1/hi, hi]), 'lo_hi' or [lo, hi] "
                                    f"with lo < 1 < hi; got {spec!r}. If you meant a range: {_K1_QUOTING}")
        return 1.0 / hi, hi
    if len(values) != 2:
        raise _flag_error(flag, f"{option} takes hi > 1, 'lo_hi' or a pair [lo, hi], got {spec!r}")
    lo, hi = values
    if not 0 < lo < 1 < hi:
        raise _flag_error(flag, f"{option} needs 0 < lo < 1 < hi, got {spec!r}: a range without 1 strictly "
                                "inside rejects sequences that have no mismatch at all (K1 = 0, ratio 1) or "
                                "the slightest one")
    return lo, hi


def _parse_upper(option: str, spec: Any) -> float:
    flag = "rollout_rejection_threshold"
    if isinstance(spec, (list, tuple)) or (isinstance(spec, str) and "_" in spec):
        raise _flag_error(flag, f"{option} takes one upper bound, got a range {spec!r}")
    try:
        value = float(spec)
    except (TypeError, ValueError):
        raise _flag_error(flag, f"{option} threshold {spec!r} is not a number") from None
    if not value > 0 or math.isnan(value):
        raise _flag_error(flag, f"{option} threshold must be > 0, got {spec!r}")
    return value


def parse_rejection(options: Sequence[str], thresholds: Any) -> tuple[RejectionRule, ...]:
    """Parse ``rollout_rejection`` and ``rollout_rejection_threshold`` into rules.

    ``thresholds`` is one value shared by every option or a list with one per option; a
    K1 option's value is ``hi``, ``"lo_hi"`` or a pair ``[lo, hi]``.
    """
    if thresholds is None:
        raise _flag_error("rollout_rejection_threshold", f"required when rollout_rejection={list(options)}")
    if isinstance(thresholds, str) and "," in thresholds:
        thresholds = [t.strip() for t in thresholds.split(",")]
    per_option: list[Any]
    if isinstance(thresholds, (list, tuple)):
        thresholds = list(thresholds)
        single_pair = (
            len(options) == 1 and len(thresholds) == 2 and options[0].endswith("k1")
            and all(isinstance(t, (int, float)) for t in thresholds)
        )
        if single_pair:
            per_option = [thresholds]
        elif len(thresholds) == 1:
            per_option = thresholds * len(options)
        elif len(thresholds) == len(options):
            per_option = thresholds
        else:
            raise _flag_error(
                "rollout_rejection_threshold",
                f"got {len(thresholds)} thresholds for {len(options)} options {list(options)}; "
                "give one shared value or one per option",
            )
    else:
        per_option = [thresholds] * len(options)

    rules = []
    for option, spec in zip(options, per_option):
        level, estimator = option.rsplit("_", 1)
        if estimator == "k1":
            lo, hi = _parse_k1_range(option, spec)
            rules.append(RejectionRule(option, level, estimator, upper=hi, lower=lo))
        else:
            rules.append(RejectionRule(option, level, estimator, upper=_parse_upper(option, spec)))
    return tuple(rules)


def _number_or_text(text: str) -> Any:
    if "_" in text:  # a K1 range such as '0.5_2' (float() would read it as 0.52: digit grouping)
        return text
    try:
        return float(text)
    except ValueError:
        return text  # a mode name, or a K1 range such as '0.5_2.0'


def flag_from_text(name: str, raw: Any) -> Any:
    """One flag's value as a command line or a string-typed config field gives it, in the core's types.

    ``null``/``none``/empty is None; ``true``/``false`` are bools; list flags take a comma-separated
    string or a list of such strings (rejection options stay strings, thresholds become numbers
    where numeric, and a single threshold is a scalar); any other flag becomes a number where numeric
    (``'0.001'``) and stays a string otherwise (modes, K1 ranges such as ``'0.5_2.0'``). Values that
    are not strings pass through. Used by ``rollout-parity launch`` and TRL's ``ParityGRPOConfig``.
    """
    if isinstance(raw, str):
        text = raw.strip()
        if text.lower() in _NULL_TEXT:
            return None
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        if name not in LIST_FLAGS:
            return _number_or_text(text)
        raw = [text]
    if name not in LIST_FLAGS or not isinstance(raw, (list, tuple)):
        return raw
    items = [part.strip() if isinstance(part, str) else part
             for item in raw for part in (item.split(",") if isinstance(item, str) else [item])]
    items = [item for item in items if not (isinstance(item, str) and item.lower() in _NULL_TEXT)]
    if not items:
        return None
    if name == "rollout_rejection":
        return [str(item) for item in items]
    items = [_number_or_text(item) if isinstance(item, str) else item for item in items]
    return items[0] if len(items) == 1 else items


def configs_dir() -> Path:
    """Where the YAML recipes live: ``$ROLLOUT_PARITY_CONFIGS``, else the package's ``configs``.

    ``rollout_parity/configs`` links to the repository's top-level ``configs/`` and is
    shipped as package data, so a wheel install finds the same files as a checkout.
    """
    env = os.environ.get("ROLLOUT_PARITY_CONFIGS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1] / "configs"


@dataclass(frozen=True)
class CorrectionConfig:
    """The shared correction flags (docs/flags.md).

    Notation: ``r_corr,t = π_old^train / π_rollout`` per token. The field docs give each
    flag's exact meaning; ``compute_correction`` implements it.
    """

    rollout_importance_sampling_mode: Optional[str] = field(
        default=None, metadata={"help": "null | token_truncate | token_mask | sequence_truncate | sequence_mask"})
    rollout_importance_sampling_threshold: float = field(
        default=2.0, metadata={"help": "upper bound C > 0 of the IS weight"})
    rollout_importance_sampling_threshold_lower: Optional[float] = field(
        default=None, metadata={"help": "lower bound (< C) of the IS weight, or null"})
    rollout_importance_sampling_sequence_reduction: str = field(
        default="geometric_mean", metadata={"help": "geometric_mean (ms-swift) | product (TRL, verl)"})
    rollout_importance_sampling_sequence_mask_weight: str = field(
        default="token", metadata={"help": "weight of kept tokens under sequence_mask: token (r_corr,t) | sequence (rho_seq)"})
    rollout_rejection: Optional[tuple[str, ...]] = field(
        default=None, metadata={"help": "null or a list of token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3"})
    rollout_rejection_threshold: Optional[Any] = field(
        default=None, metadata={"help": "one value or one per rejection option; a K1 option takes hi > 1 (the ratio "
                                  "range [1/hi, hi]), 'lo_hi' or [lo, hi] with lo < 1 < hi (quote 'lo_hi' in YAML)"})
    off_policy_sequence_mask_delta: Optional[float] = field(
        default=None, metadata={"help": "mask a sequence when mean(log pi_behaviour - log pi_theta) > delta and A < 0"})
    old_logprob_source: str = field(
        default="recompute", metadata={"help": "recompute (trainer re-evaluates pi_old) | bypass (rollout logprobs are pi_old)"})
    log_rollout_offpolicy_metrics: bool = field(
        default=False, metadata={"help": "log the diagnostics without changing the loss"})
    fp32_lm_head: bool = field(default=False, metadata={"help": "final projection in fp32 on trainer and vLLM"})
    precision: Optional[str] = field(
        default=None, metadata={"help": "null (each side as the framework sets it) | bf16 | fp16 | fp32: the compute "
                                        "dtype of the rollout engine and the trainer, written to both together"})
    weight_sync_check_interval: Optional[int] = field(
        default=None, metadata={"help": "check every N-th weight sync (the first included) by scoring a fixed probe "
                                         "on the engine and the trainer; null or 0: off"})
    weight_sync_check_threshold: float = field(
        default=WEIGHT_SYNC_CHECK_THRESHOLD, metadata={"help": "trimmed mean |delta logprob| on the sync probe (the "
                                                                "largest 1/16 of the gaps left out) above which a "
                                                                "checked sync is an error"})
    moe_routing_replay: bool = field(
        default=False, metadata={"help": "MoE: the trainer's pi_old and pi_theta forwards route each token through "
                                         "the experts the engine routed it to (R3)"})
    rollout_sampling_replay: bool = field(
        default=False, metadata={"help": "vLLM returns each token's kept set (return_sampling_mask, Model Runner V2; "
                                         "needs top_k > 0) and pi_old is renormalised over exactly it"})
    compile_correction: bool = field(
        default=False, metadata={"help": "run the correction's token pass and diagnostics through torch.compile "
                                         "(fused kernels; the first step compiles them)"})

    def __post_init__(self) -> None:
        mode = self.rollout_importance_sampling_mode
        if mode in ("", "none", "None", "null"):
            object.__setattr__(self, "rollout_importance_sampling_mode", None)
            mode = None
        if mode is not None and mode not in IS_MODES:
            raise _flag_error("rollout_importance_sampling_mode", f"unknown mode {mode!r}; expected null or one of {IS_MODES}")

        upper = self._number("rollout_importance_sampling_threshold", self.rollout_importance_sampling_threshold)
        if not upper > 0:
            raise _flag_error("rollout_importance_sampling_threshold", f"must be > 0, got {upper}")
        lower = self.rollout_importance_sampling_threshold_lower
        if lower is not None:
            lower = self._number("rollout_importance_sampling_threshold_lower", lower)
            if lower < 0:
                raise _flag_error("rollout_importance_sampling_threshold_lower", f"must be >= 0 or null, got {lower}")
            if not lower < upper:
                raise _flag_error(
                    "rollout_importance_sampling_threshold_lower",
                    f"must be < rollout_importance_sampling_threshold ({upper}), got {lower}",
                )
        object.__setattr__(self, "rollout_importance_sampling_threshold", upper)
        object.__setattr__(self, "rollout_importance_sampling_threshold_lower", lower)

        self._choice("rollout_importance_sampling_sequence_reduction", SEQUENCE_REDUCTIONS)
        self._choice("rollout_importance_sampling_sequence_mask_weight", SEQUENCE_MASK_WEIGHTS)
        self._choice("old_logprob_source", OLD_LOGPROB_SOURCES)

        rejection = self.rollout_rejection
        if isinstance(rejection, str):
            rejection = [r.strip() for r in rejection.split(",") if r.strip()]
        if rejection is not None:
            rejection = tuple(str(r) for r in rejection)
            if not rejection:
                rejection = None
        if rejection is not None:
            unknown = [r for r in rejection if r not in REJECTION_OPTIONS]
            if unknown:
                raise _flag_error("rollout_rejection", f"unknown option(s) {unknown}; expected from {REJECTION_OPTIONS}")
            if len(set(rejection)) != len(rejection):
                raise _flag_error("rollout_rejection", f"an option appears twice in {list(rejection)}")
            threshold = self.rollout_rejection_threshold
            if isinstance(threshold, list):
                threshold = tuple(tuple(t) if isinstance(t, list) else t for t in threshold)
                object.__setattr__(self, "rollout_rejection_threshold", threshold)
            parse_rejection(rejection, threshold)
        elif self.rollout_rejection_threshold is not None:
            raise _flag_error("rollout_rejection_threshold", "set but rollout_rejection is null")
        object.__setattr__(self, "rollout_rejection", rejection)

        delta = self.off_policy_sequence_mask_delta
        if delta is not None:
            delta = self._number("off_policy_sequence_mask_delta", delta)
            if not delta > 0:
                raise _flag_error("off_policy_sequence_mask_delta", f"must be > 0 or null, got {delta}")
            object.__setattr__(self, "off_policy_sequence_mask_delta", delta)

        if self.old_logprob_source == "bypass" and mode is not None:
            raise _flag_error(
                "rollout_importance_sampling_mode",
                f"{mode!r} conflicts with old_logprob_source='bypass': pi_old is then pi_rollout, the PPO ratio "
                "already is pi_theta/pi_rollout and no r_corr exists (an IS weight would count the mismatch twice)",
            )
        interval = self.weight_sync_check_interval
        if interval is not None:
            whole = not isinstance(interval, bool) and float(self._number("weight_sync_check_interval", interval)).is_integer()
            if not whole:
                raise _flag_error("weight_sync_check_interval", f"must be a whole number >= 0 or null, got {interval!r}")
            interval = int(interval)
            if interval < 0:
                raise _flag_error("weight_sync_check_interval", f"must be >= 0 or null, got {interval}")
            object.__setattr__(self, "weight_sync_check_interval", interval or None)
        sync_threshold = self._number("weight_sync_check_threshold", self.weight_sync_check_threshold)
        if not sync_threshold > 0:
            raise _flag_error("weight_sync_check_threshold", f"must be > 0, got {sync_threshold}")
        object.__setattr__(self, "weight_sync_check_threshold", sync_threshold)
        try:
            object.__setattr__(self, "precision", normalize_precision(self.precision))
        except ValueError as exc:
            raise _flag_error("precision", str(exc).split(": ", 1)[1]) from None
        for flag in ("log_rollout_offpolicy_metrics", "fp32_lm_head", "moe_routing_replay", "rollout_sampling_replay",
                     "compile_correction"):
            if not isinstance(getattr(self, flag), bool):
                raise _flag_error(flag, f"must be a bool, got {getattr(self, flag)!r}")

    @staticmethod
    def _number(flag: str, value: Any) -> float:
        if isinstance(value, bool):
            raise _flag_error(flag, f"must be a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise _flag_error(flag, f"must be a number, got {value!r}") from None
        if math.isnan(number) or math.isinf(number):
            raise _flag_error(flag, f"must be finite, got {value!r}")
        return number

    def _choice(self, flag: str, allowed: Iterable[str]) -> None:
        value = getattr(self, flag)
        if value not in allowed:
            raise _flag_error(flag, f"unknown value {value!r}; expected one of {tuple(allowed)}")

    # ------------------------------------------------------------------ derived views
    @property
    def rejection_rules(self) -> tuple[RejectionRule, ...]:
        if self.rollout_rejection is None:
            return ()
        return parse_rejection(self.rollout_rejection, self.rollout_rejection_threshold)

    @property
    def changes_loss(self) -> bool:
        """True when any flag changes weights or masks (not only diagnostics)."""
        return (
            self.rollout_importance_sampling_mode is not None
            or self.rollout_rejection is not None
            or self.off_policy_sequence_mask_delta is not None
        )

    @property
    def wants_metrics(self) -> bool:
        """Diagnostics are logged whenever a correction acts or when asked for (ms-swift)."""
        return self.changes_loss or self.log_rollout_offpolicy_metrics

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> "CorrectionConfig":
        """Build from a plain mapping (YAML, OmegaConf, a framework's config block).

        Unknown keys are a :class:`FlagError` naming them, with the closest flag: a misspelt flag
        must not be dropped.
        """
        if data is None:
            return cls()
        if hasattr(data, "_metadata") and hasattr(data, "_content"):  # an OmegaConf node
            from omegaconf import OmegaConf

            data = OmegaConf.to_container(data, resolve=True)
        data = dict(data)
        refuse_unknown(data, cls.field_names())
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["rollout_rejection"] is not None:
            out["rollout_rejection"] = list(out["rollout_rejection"])
        threshold = out["rollout_rejection_threshold"]
        if isinstance(threshold, tuple):
            out["rollout_rejection_threshold"] = [list(t) if isinstance(t, tuple) else t for t in threshold]
        return out

    def replace(self, **changes: Any) -> "CorrectionConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def available_presets(cls) -> list[str]:
        directory = configs_dir() / "presets"
        return sorted(p.stem for p in directory.glob("*.yaml"))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "CorrectionConfig":
        """Load ``configs/presets/<name>.yaml`` through OmegaConf; keyword overrides win."""
        from omegaconf import OmegaConf

        path = configs_dir() / "presets" / f"{name}.yaml"
        if not path.is_file():
            hint = did_you_mean(name, cls.available_presets())
            raise FlagError(f"preset: unknown preset {name!r}{' (' + hint + ')' if hint else ''}; "
                            f"available: {cls.available_presets()}")
        node = OmegaConf.load(path)
        data = OmegaConf.to_container(node, resolve=True)
        if not isinstance(data, dict):
            raise ValueError(f"preset {name!r} ({path}) is not a mapping")
        data.pop("description", None)
        data.update(overrides)
        return cls.from_dict(data)
