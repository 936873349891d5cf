"""What a vLLM worker's head computes, measured in the worker's own process.

``verify_engine`` calls ``collective_rpc("rollout_parity_head_report")``; vLLM runs it in every
worker (the caller's process for an in-process engine, the engine-core process, multiprocess or
Ray workers) as a method of its ``WorkerWrapperBase``, which :func:`install_head_report` adds.

The measurement: 4 rows of hidden states in the head's dtype go through the model's own
``logits_processor(lm_head, hidden)`` (the path every decoding step takes, whatever put an fp32
projection there); the first 256 vocabulary rows of this rank's shard are compared with the same
product in fp64 (soft cap and scale applied as vLLM does). An fp32 projection of bf16/fp16 inputs
is within ~1e-7 of fp64 relative to the largest logit; one in the model dtype is rounded to it
(bf16: ~2e-3, fp16: ~2e-4). The report says ``float32`` when the logits come back in fp32 within
:data:`FP32_TOLERANCE`, else the dtype the product was rounded to.
"""

from __future__ import annotations

import os
from typing import Any

from rollout_parity.adapters._patching import Patches, is_ours, mark
from rollout_parity.adapters.vllm.fp32_head import FP32_HEAD_ATTR
from rollout_parity.engines.vllm.head import HEAD_REPORT_RPC

__all__ = ["FP32_TOLERANCE", "head_report", "install_head_report", "revert_head_report", "has_head_report"]

#: Largest |logit - fp64 logit| / max |fp64 logit| still called fp32 (10x below fp16's rounding).
FP32_TOLERANCE = 2e-5
_PROBE_ROWS, _PROBE_VOCAB = 4, 256
_WORKER_BASE = "vllm.v1.worker.worker_base"
_patches = Patches()


def _model(wrapper: Any) -> Any:
    worker = getattr(wrapper, "worker", None) or wrapper
    model = worker.get_model()
    return model.unwrap() if hasattr(model, "unwrap") and not hasattr(model, "logits_processor") else model


def _mechanism(processor: Any) -> str:
    import torch

    if getattr(processor, "head_dtype", None) == torch.float32:
        return "vLLM head_dtype"
    if getattr(processor, FP32_HEAD_ATTR, False):
        return "rollout-parity plugin (hf_overrides head_dtype=float32)"
    if is_ours(getattr(type(processor), "_get_logits", None)):
        return "rollout-parity in-process patch"
    return "none"


def head_report(wrapper: Any) -> dict[str, Any]:
    """Run by ``collective_rpc`` in a worker: ``{pid, head_dtype, max_rel_err, logits_dtype, mechanism, note}``."""
    import torch
    import vllm

    report: dict[str, Any] = {"pid": os.getpid(), "vllm": vllm.__version__, "head_dtype": None,
                              "max_rel_err": None, "logits_dtype": None, "mechanism": None, "note": ""}
    try:
        model = _model(wrapper)
    except Exception as exc:  # noqa: BLE001 - a worker without a model (yet) says why
        report["note"] = f"no model on this worker: {type(exc).__name__}: {exc}"
        return report
    processor, head = getattr(model, "logits_processor", None), getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if processor is None or weight is None or not torch.is_floating_point(weight) or weight.numel() == 0:
        report["note"] = (f"{type(model).__name__} has no logits_processor with an unquantised lm_head weight "
                          "on this worker (a pipeline stage without the head, or a quantised head)")
        return report
    report["mechanism"] = _mechanism(processor)
    shard = getattr(head, "shard_indices", None)
    start = int(getattr(shard, "org_vocab_start_index", 0))
    rows = min(_PROBE_VOCAB, int(getattr(shard, "num_org_elements", weight.shape[0])))
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(_PROBE_ROWS, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
    try:
        with torch.no_grad():
            logits = processor(head, hidden)
    except Exception as exc:  # noqa: BLE001
        report["note"] = f"the head did not run on a probe: {type(exc).__name__}: {exc}"
        return report
    if logits is None:
        report["note"] = "this rank's logits are gathered on another rank"
        return report
    with torch.no_grad():
        ref = hidden.double() @ weight[:rows].double().T
        if getattr(processor, "soft_cap", None) is not None:
            ref = torch.tanh(ref / processor.soft_cap) * processor.soft_cap
        ref = ref * float(getattr(processor, "scale", 1.0))
        got = logits[..., start:start + rows].double()
        err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    report.update(max_rel_err=err, logits_dtype=str(logits.dtype).replace("torch.", ""))
    fp32 = logits.dtype == torch.float32 and err <= FP32_TOLERANCE
    report["head_dtype"] = "float32" if fp32 else str(weight.dtype).replace("torch.", "")
    return report


def has_head_report() -> bool:
    import importlib

    return is_ours(getattr(importlib.import_module(_WORKER_BASE).WorkerWrapperBase, HEAD_REPORT_RPC, None))


def install_head_report() -> bool:
    """Add the worker method ``rollout_parity_head_report`` (idempotent). True if newly added."""
    import importlib

    owner = importlib.import_module(_WORKER_BASE).WorkerWrapperBase
    current = getattr(owner, HEAD_REPORT_RPC, None)
    if is_ours(current):
        return False
    if current is not None:
        raise RuntimeError(f"{_WORKER_BASE}.WorkerWrapperBase.{HEAD_REPORT_RPC} exists and is not rollout-parity's")
    _patches.replace(owner, HEAD_REPORT_RPC, mark(head_report))
    return True


def revert_head_report() -> bool:
    """Remove the worker method again. True if something was removed."""
    if not len(_patches):
        return False
    _patches.revert()
    return True
