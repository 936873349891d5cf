"""TRL's config in: ``ParityGRPOConfig`` is ``GRPOConfig`` plus the shared flags (docs/flags.md).

Parsed by ``TrlParser``/``HfArgumentParser`` like any TRL config, on the command line
(``--rollout_importance_sampling_mode token_truncate``; list flags take several values or one
comma-separated value) or in a TRL YAML file; TRL's own fields keep their defaults and meaning, and
the shared fields carry the core's defaults and help text, with how each relates to TRL's own
options. Values arrive as text and are read by the core (``flag_from_text``).

A parser holding the shared flags takes them by their full names only: argparse's prefix matching
would read ``--rollout_importance_sampling_mod`` as ``--rollout_importance_sampling_mode``, so an
option that abbreviates or nearly spells a shared flag is refused in one line naming it (exit 2,
as argparse exits on a bad option); TRL's own options keep argparse's behaviour.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import MISSING, dataclass, field
from typing import Any, Mapping, Optional

from trl import GRPOConfig

from rollout_parity.adapters._patching import Patches, is_ours
from rollout_parity.adapters.trl.precision import mixed_precision_onto_config
from rollout_parity.core.config import CorrectionConfig, FlagError, closest, flag_from_text
from rollout_parity.core.ratios import LOG_RATIO_BOUND

__all__ = ["ParityGRPOConfig", "correction_config_from_args", "as_correction_config", "NO_UPPER_BOUND",
           "core_flags"]

_UPPER = "rollout_importance_sampling_threshold"
#: ``rollout_importance_sampling_threshold`` null or inf, TRL's ``vllm_importance_sampling_clip_max=None`` (no upper
#: bound: only the lower one acts), as the core takes it. The core clamps every token and sequence log-ratio to
#: +-LOG_RATIO_BOUND, so no weight it makes exceeds e^20 (4.9e8) and a cap above that never acts; the core refuses
#: null and inf for this flag.
NO_UPPER_BOUND = 1e10
assert NO_UPPER_BOUND > math.exp(LOG_RATIO_BOUND)


def core_flags(values: Mapping[str, Any]) -> dict[str, Any]:
    """The shared flags ``values`` as the core takes them: an upper IS bound of null or inf is
    :data:`NO_UPPER_BOUND`."""
    out = dict(values)
    upper = out.get(_UPPER, 0.0)
    if isinstance(upper, str):
        upper = flag_from_text(_UPPER, upper)
    if upper is None or (isinstance(upper, float) and math.isinf(upper) and upper > 0):
        mode = flag_from_text("rollout_importance_sampling_mode", out.get("rollout_importance_sampling_mode"))
        if str(mode).endswith("_truncate") and out.get("rollout_importance_sampling_threshold_lower") is None:
            raise FlagError(f"{_UPPER}: {upper} (no upper bound) with rollout_importance_sampling_mode={mode!r} needs "
                            "rollout_importance_sampling_threshold_lower: a truncation without either bound is "
                            "plain IS (TRL refuses vllm_importance_sampling_clip_max=None with clip_min=None too)")
        out[_UPPER] = NO_UPPER_BOUND
    return out

_IS_RELATION = ("TRL's own vllm_importance_sampling_mode/_clip_max/_clip_min configure the same ratio "
                "(importance_sampling_ratio): with a correction flag set, setting them too is refused")
#: How each shared flag relates to TRL's own options (shown in --help).
_TRL_RELATION = {
    "rollout_importance_sampling_mode": _IS_RELATION,
    "rollout_importance_sampling_threshold": _IS_RELATION + "; null or inf: no upper bound (TRL's "
                                             "vllm_importance_sampling_clip_max=None; the lower bound alone acts)",
    "rollout_importance_sampling_threshold_lower": _IS_RELATION,
    "rollout_rejection": "rejected tokens or sequences leave the loss mask; " + _IS_RELATION,
    "off_policy_sequence_mask_delta": "handed to TRL as its off_policy_mask_threshold: setting both is refused",
    "fp32_lm_head": "turns TRL's cast_lm_head_to_fp32 on (the trainer's head; it wins over "
                    "--cast_lm_head_to_fp32 false) and puts vLLM's head in fp32 too (hf_overrides head_dtype)",
    "old_logprob_source": "bypass: TRL's pi_old recomputation is skipped and the rollout logprobs are pi_old",
    "precision": "sets TRL's fp16/bf16, the load dtype (model_init_kwargs dtype) where unset, and the vLLM engine's "
                 "dtype (colocate; trl vllm-serve --dtype); an explicit fp16/bf16 or dtype that contradicts it is "
                 "refused",
}


def _shared_names() -> set[str]:
    names = CorrectionConfig.field_names()
    return {f"--{n}" for n in names} | {f"--{n.replace('_', '-')}" for n in names}


def _refuse_near_misses(original: Any, parser: argparse.ArgumentParser, args: Any = None, *rest: Any,
                        **kwargs: Any) -> Any:
    """``parser.parse_known_args``, after refusing an unknown option whose closest option is a shared flag."""
    argv = sys.argv[1:] if args is None else list(args)
    shared = _shared_names()
    known = [s for s in parser._option_string_actions if s.startswith("--")]  # noqa: SLF001 - argparse's own table
    for token in argv:
        option = token.split("=", 1)[0]
        if not option.startswith("--") or option in parser._option_string_actions:  # noqa: SLF001
            continue
        match = closest(option, known)
        if match in shared:
            parser.exit(2, f"{parser.prog}: unknown option {option} (did you mean {match!r}?); rollout-parity's "
                           "flags take their full names\n")
    return original(argv, *rest, **kwargs)


class _SharedFlag(argparse.Action):
    """argparse's store for a shared flag; added to a parser, it guards that parser's parsing.

    ``HfArgumentParser`` adds a dataclass field with the ``action`` of its metadata. argparse builds
    the action inside the parser's ``add_argument`` (its caller's ``self``): the one moment a field
    meets the parser it will be parsed by.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        parser = sys._getframe(1).f_locals.get("self")
        if isinstance(parser, argparse.ArgumentParser) and not is_ours(getattr(parser, "parse_known_args", None)):
            # An instance patch through the shared layer: it lives and dies with this parser.
            Patches().wrap(parser, "parse_known_args",
                           lambda original, *a, **k: _refuse_near_misses(original, parser, *a, **k),
                           dotted=f"{type(parser).__name__}.parse_known_args")

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)


def _shared_field(name: str) -> Any:
    """A dataclass field with the core's default and help text for one shared flag."""
    core = CorrectionConfig.__dataclass_fields__[name]
    relation = _TRL_RELATION.get(name)
    help_text = f"[rollout-parity] {core.metadata.get('help', '')}" + (f". TRL: {relation}" if relation else "")
    metadata: dict[str, Any] = {"help": help_text}
    if not isinstance(core.default, bool):  # one guarded field guards the parser; a bool field defaulting to
        metadata["action"] = _SharedFlag    # true (the launcher's) also gets a --no_ twin, store_false
    return field(default=core.default, metadata=metadata)


def _trl_field(name: str, note: str) -> Any:
    """TRL's own field ``name`` as GRPOConfig declares it (default, metadata), with ``note`` added to its help:
    ``--help`` then says, at TRL's option too, how it meets the shared flag that covers the same ground."""
    own = GRPOConfig.__dataclass_fields__[name]
    metadata = dict(own.metadata)
    metadata["help"] = f"{metadata.get('help', '')} [rollout-parity] {note}".strip()
    if own.default_factory is not MISSING:
        return field(default_factory=own.default_factory, metadata=metadata)
    return field(default=own.default, metadata=metadata)


_TRL_IS_NOTE = ("The shared flags rollout_importance_sampling_mode/_threshold/_threshold_lower set this same ratio; "
                "with one of them set, setting this too is refused.")


@dataclass
class ParityGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the shared rollout-parity flags (docs/flags.md)."""

    rollout_importance_sampling_mode: Optional[str] = _shared_field("rollout_importance_sampling_mode")
    rollout_importance_sampling_threshold: Optional[float] = _shared_field("rollout_importance_sampling_threshold")
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
    precision: Optional[str] = _shared_field("precision")
    weight_sync_check_interval: Optional[int] = _shared_field("weight_sync_check_interval")
    weight_sync_check_threshold: float = _shared_field("weight_sync_check_threshold")
    moe_routing_replay: bool = _shared_field("moe_routing_replay")
    rollout_sampling_replay: bool = _shared_field("rollout_sampling_replay")
    compile_correction: bool = _shared_field("compile_correction")
    # TRL's own options that the shared flags overlap: the same fields, their help saying which wins.
    vllm_importance_sampling_mode: str = _trl_field("vllm_importance_sampling_mode", _TRL_IS_NOTE)
    vllm_importance_sampling_clip_max: Optional[float] = _trl_field("vllm_importance_sampling_clip_max", _TRL_IS_NOTE)
    vllm_importance_sampling_clip_min: Optional[float] = _trl_field("vllm_importance_sampling_clip_min", _TRL_IS_NOTE)
    cast_lm_head_to_fp32: bool = _trl_field(
        "cast_lm_head_to_fp32", "--fp32_lm_head true turns this on and wins over --cast_lm_head_to_fp32 false.")

    def __post_init__(self) -> None:
        for name in CorrectionConfig.field_names():
            setattr(self, name, flag_from_text(name, getattr(self, name)))
        delta = self.off_policy_sequence_mask_delta
        if isinstance(delta, (int, float)) and not isinstance(delta, bool) and delta == 0:
            raise FlagError("off_policy_sequence_mask_delta: 0 is refused (the shared flag takes > 0: at 0 every "
                            "negative-advantage sequence with any drift, which the mismatch alone gives, is masked); "
                            "TRL's own off_policy_mask_threshold=0 works beside the flags and masks as TRL does")
        self.precision = self.correction_config().precision  # validates (the error names the flag); normalised
        if self.precision is not None:  # TRL's fp16/bf16 before its __post_init__ reads and validates them
            mixed_precision_onto_config(self, self.precision)
        super().__post_init__()

    def correction_config(self) -> CorrectionConfig:
        """The core's ``CorrectionConfig`` for these flags."""
        return CorrectionConfig(**core_flags({name: getattr(self, name) for name in CorrectionConfig.field_names()}))


def correction_config_from_args(args: Any) -> CorrectionConfig:
    """``CorrectionConfig`` from a ``ParityGRPOConfig``; the default (nothing on) otherwise."""
    return args.correction_config() if isinstance(args, ParityGRPOConfig) else CorrectionConfig()


def as_correction_config(config: CorrectionConfig | Mapping[str, Any] | None, args: Any) -> CorrectionConfig:
    """``config`` as the core's type, or the flags of ``args`` when ``config`` is None."""
    if config is None:
        return correction_config_from_args(args)
    return config if isinstance(config, CorrectionConfig) else CorrectionConfig.from_dict(
        core_flags(config) if _UPPER in config else config)
