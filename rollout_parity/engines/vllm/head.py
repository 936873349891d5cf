"""The fp32 head of a vLLM engine: how it is asked for on each vLLM, and read back from the engine.

The recipe asks for the head in fp32 with ``hf_overrides={"head_dtype": "float32"}`` on every
vLLM. vLLM >= 0.26 honours that key for generation models itself (``LogitsProcessor`` projects in
``model_config.head_dtype``); older releases apply it to pooling models only and run a
generation model's head in the model dtype. There, rollout-parity's vLLM plugin (entry point
``rollout_parity`` in the group ``vllm.general_plugins``, which vLLM loads in every process it
starts: the caller's, the engine core's, each worker's, ``vllm serve``'s) gives every
``LogitsProcessor`` built under a config asking for it an fp32 projection
(``rollout_parity.adapters.vllm``).

What the engine *runs* is read from the processes that run the model: the plugin also adds the
worker method :data:`HEAD_REPORT_RPC`, which vLLM's own ``collective_rpc`` calls in every worker
(in-process, engine-core process, multiprocess or Ray workers alike). It projects a probe of
hidden states through the model's own ``logits_processor`` and ``lm_head`` and compares the
logits with an fp64 product: the head held is the one measured there, never a patch seen in the
caller's process.

Torch-free and vLLM-free (the installed version and entry points come from ``importlib.metadata``;
engines are duck-typed), like the rest of ``core``.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
from typing import Any, Optional

from .features import VLLM_FEATURES

__all__ = [
    "HEAD_REPORT_RPC",
    "PLUGIN_GROUP",
    "PLUGIN_NAME",
    "FIRST_NATIVE_HEAD_DTYPE",
    "asks_fp32_head",
    "fp32_head_plugin_problem",
    "head_reports",
    "head_reports_async",
    "summarize_head",
]

#: The worker method the plugin adds (``WorkerWrapperBase.rollout_parity_head_report``).
HEAD_REPORT_RPC = "rollout_parity_head_report"
#: vLLM loads the entry points of this group in every process it starts.
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "rollout_parity"
#: The first vLLM whose ``LogitsProcessor`` honours ``head_dtype`` for generation models (read in
#: the sources: 0.25.1 falls back to the model dtype with a warning, 0.26.0 adds ``_apply_head``);
#: the release table ``engines/vllm/features.py`` holds it.
FIRST_NATIVE_HEAD_DTYPE = VLLM_FEATURES["head_dtype"].since
_FLOAT32_NAMES = ("float32", "fp32", "float", "torch.float32")
_RPC_TIMEOUT_S = 300


def asks_fp32_head(value: Any) -> bool:
    """Whether an ``hf_overrides["head_dtype"]`` / ``hf_config.head_dtype`` value asks for fp32."""
    return value is not None and str(value).lower() in _FLOAT32_NAMES


def fp32_head_plugin_problem() -> Optional[str]:
    """Why vLLM processes started from this environment would *not* load the plugin, or None.

    Checks the installed entry point and vLLM's ``VLLM_PLUGINS`` allow-list (comma-separated names;
    unset loads every plugin; vLLM reads it the same way).
    """
    found = [ep for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    if not found:
        return (f"is not installed here (no entry point {PLUGIN_NAME!r} in the group {PLUGIN_GROUP!r}: "
                "install rollout-parity with pip, not from a bare source tree)")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        return f"is excluded by VLLM_PLUGINS={allowed!r} (add {PLUGIN_NAME!r} to it)"
    return None


def _rpc_target(engine: Any) -> Any:
    """The object whose ``collective_rpc`` reaches the workers (``LLM``, ``LLMEngine``, ``AsyncLLM``)."""
    for target in (engine, getattr(engine, "llm_engine", None), getattr(engine, "engine", None),
                   getattr(engine, "engine_client", None)):
        if target is not None and callable(getattr(target, "collective_rpc", None)):
            return target
    return None


def _unasked(engine: Any) -> str:
    return (f"the engine's processes cannot be asked: {type(engine).__name__} has no collective_rpc "
            "(pass the live vllm.LLM, LLMEngine or AsyncLLM, not its config)")


def _failed(exc: BaseException) -> str:
    return (f"the engine's processes could not run {HEAD_REPORT_RPC} ({type(exc).__name__}: "
            f"{str(exc)[:300]}): rollout-parity's vLLM plugin is not loaded there (rollout-parity missing "
            "from the engine's environment, or VLLM_PLUGINS excluding 'rollout_parity')")


def head_reports(engine: Any) -> tuple[Optional[list], str]:
    """``(reports, "")`` from every worker of a synchronous engine, or ``(None, why not)``.

    An ``AsyncLLM`` (whose ``collective_rpc`` is a coroutine) is a ``TypeError``: use
    :func:`head_reports_async` (``verify_engine_async``) from its event loop.
    """
    target = _rpc_target(engine)
    if target is None:
        return None, _unasked(engine)
    if inspect.iscoroutinefunction(target.collective_rpc):
        raise TypeError(f"{type(engine).__name__}.collective_rpc is a coroutine: in its event loop, "
                        "`await verify_engine_async(engine, ...)` reads the head from the engine's processes")
    try:
        return list(target.collective_rpc(HEAD_REPORT_RPC, timeout=_RPC_TIMEOUT_S)), ""
    except Exception as exc:  # noqa: BLE001 - a worker's failure comes back as whatever the client raises
        return None, _failed(exc)


async def head_reports_async(engine: Any) -> tuple[Optional[list], str]:
    """:func:`head_reports` for an ``AsyncLLM`` (or any engine), awaited in its event loop."""
    target = _rpc_target(engine)
    if target is None:
        return None, _unasked(engine)
    try:
        result = target.collective_rpc(HEAD_REPORT_RPC, timeout=_RPC_TIMEOUT_S)
        if inspect.isawaitable(result):
            result = await result
        return list(result), ""
    except Exception as exc:  # noqa: BLE001
        return None, _failed(exc)


def summarize_head(reports: Optional[list], why_not: str) -> str:
    """One string for ``describe_engine``: the dtype every measuring worker ran its head in.

    ``"float32"`` only when at least one worker measured its head and every one that did measured
    fp32; otherwise what was measured, or ``unknown (why)``.
    """
    if reports is None:
        return f"unknown ({why_not})"
    measured = [r for r in reports if isinstance(r, dict) and r.get("head_dtype")]
    if not measured:
        notes = "; ".join(str(r.get("note", r)) if isinstance(r, dict) else str(r) for r in reports)
        return f"unknown (no worker measured its head: {notes or 'no workers'})"
    kinds = sorted({r["head_dtype"] for r in measured})
    if len(kinds) > 1:
        return "mixed: " + ", ".join(f"pid {r.get('pid')}: {r['head_dtype']}" for r in measured)
    return kinds[0]
