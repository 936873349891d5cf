"""vLLM adapter: the fp32 head in every engine process, and a way to read it back.

The recipe asks for an fp32 head with ``hf_overrides={"head_dtype": "float32"}`` on every vLLM.
vLLM >= 0.26 honours it itself. On 0.20-0.25, which run a generation model's head in the model
dtype, the plugin (entry point ``rollout_parity`` in ``vllm.general_plugins``, ``plugin.py``) gives
the head an fp32 projection in each process that builds a model for a config asking for it.
On every vLLM the plugin adds the worker method through which ``verify_engine`` measures the
head in the engine's own processes (``head_report.py``).

Rooms: ``fp32_head`` (the fp32 projection; on request per engine, or for every engine of this
process), ``head_report`` (the measurement in a worker), ``plugin`` (the entry point).
docs/vllm_parity.md, "The fp32 head in every engine process".
"""

from rollout_parity.adapters.vllm.fp32_head import (
    apply_fp32_head_on_request,
    apply_vllm_fp32_logits_patch,
    fp32_logits,
    is_fp32_head_on_request,
    is_vllm_fp32_logits_patched,
    revert_fp32_head_on_request,
    revert_vllm_fp32_logits_patch,
)
from rollout_parity.adapters.vllm.head_report import head_report, install_head_report, revert_head_report
from rollout_parity.adapters.vllm.plugin import register

__all__ = [
    "apply_vllm_fp32_logits_patch",
    "revert_vllm_fp32_logits_patch",
    "is_vllm_fp32_logits_patched",
    "apply_fp32_head_on_request",
    "revert_fp32_head_on_request",
    "is_fp32_head_on_request",
    "fp32_logits",
    "head_report",
    "install_head_report",
    "revert_head_report",
    "register",
]
