"""The engine side of a weight sync into vLLM's fused-MoE layers (duck-typed: never imports vLLM).

vLLM keeps a fused-MoE layer's experts (``w13_weight``, ``w2_weight``) in its kernel's layout, made
by the layer's post-load processing (``UnquantizedFusedMoEMethod.process_weights_after_loading``).
A weight sync writes checkpoint-layout tensors into those buffers:

* TRL's colocated ``sync_weights`` calls the model's ``load_weights`` and no post-load processing;
* verl (``update_weights_from_ipc``) and vLLM's own ``reload_weights`` re-run it afterwards.

What that processing does, and whether a re-run completes a weight update, depends on the backend and
the vLLM release (read from each release's source; the CPU kinds measured, docs/moe.md):

=====================  ============  ==============================================================
kind                   vLLM          after the first load
=====================  ============  ==============================================================
``cpu-prepack-once``   0.28 - 0.32   ``CPUUnquantizedExperts`` (``moe_kernel.fused_experts``) prepack
                                     both tensors for the grouped GEMM, but ``_setup_kernel`` runs it
                                     on the first load only (``if not is_weight_update``): every later
                                     load, re-run or not, leaves unpacked values the kernel reads as
                                     packed
``cpu-rebuilt``        0.20 - 0.27   the method's own CPU branch rebuilds ``quant_method.cpu_fused_moe``
                                     (``CPUFusedMOE`` / ``SGLFusedMOE``) and repacks in place on every
                                     call: a re-run completes a load
``converted``          0.20 - 0.32   GPU Triton / FlashInfer CUTLASS / AITER: ``_setup_kernel`` converts
                                     (identity, swapped halves, shuffled) and copies on every call: a
                                     re-run completes a load (source read, not run: no GPU here)
=====================  ============  ==============================================================

:func:`finish_moe_weight_load` completes a load into the layers of a known kind. Any other layer (an
unquantized backend not listed, such as FlashInfer TRT-LLM, XPU, TPU or out-of-tree; CPU experts
with a padded intermediate size; a layer class this module has never seen) is left untouched and
never reported as done: a warning names it once, and the weight-sync check is what verifies it.

The names a sync may use differ too. transformers 5 keeps a MoE's experts fused (``mlp.experts.gate_up_proj``
(E, 2I, H)); checkpoints keep one tensor per expert. From vLLM 0.25 the MoE models' loaders (Qwen2-MoE,
Qwen3-MoE, Mixtral) hand both to ``RoutedExperts.load_weights``, which reads the fused names
(``include_fused``); 0.20 and 0.24 match per-expert names only and skip fused ones without a word, leaving
the old experts in place (:func:`vllm_reads_fused_experts`; the TRL adapter sends per-expert names there).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Optional

import torch

__all__ = ["CPU_PREPACK_ONCE", "CPU_REBUILT", "CONVERTED", "FUSED_EXPERTS_READ_FROM", "fused_moe_layers",
           "moe_layer_kind", "record_moe_layers", "finish_moe_weight_load", "vllm_reads_fused_experts"]

logger = logging.getLogger(__name__)

CPU_PREPACK_ONCE = "cpu-prepack-once"
CPU_REBUILT = "cpu-rebuilt"
CONVERTED = "converted"

_FINGERPRINT = "_rollout_parity_moe_fingerprint"  # samples of w13/w2 right after the layer was processed
_WARNED = "_rollout_parity_moe_warned"
_SAMPLES = 4096

_UNQUANTIZED = "UnquantizedFusedMoEMethod"
_CPU_EXPERTS = "CPUUnquantizedExperts"
_CPU_REBUILT_CLASSES = {"CPUFusedMOE", "SGLFusedMOE"}
#: GPU backends whose ``_setup_kernel`` converts the loaded tensors on every call (vLLM 0.20-0.32 source).
_CONVERTED_BACKENDS = {"TRITON", "BATCHED_TRITON", "FLASHINFER_CUTLASS", "AITER"}


#: The first vLLM release whose MoE loaders read transformers 5's fused expert tensors under their own names.
FUSED_EXPERTS_READ_FROM = "0.25.0"


def vllm_reads_fused_experts(version: Optional[str] = None) -> bool:
    """Whether vLLM ``version`` (default: the installed one; none installed: assume a current one) loads fused
    expert tensors (``mlp.experts.gate_up_proj``) under the trainer's names."""
    from rollout_parity.engines.vllm.features import installed_vllm_version, parse_vllm_version

    version = version or installed_vllm_version()
    return version is None or parse_vllm_version(version) >= parse_vllm_version(FUSED_EXPERTS_READ_FROM)


def _class_names(obj: Any) -> set[str]:
    return {cls.__name__ for cls in type(obj).__mro__}


def fused_moe_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, layer)`` for every vLLM fused-MoE expert layer (one holding ``w13_weight``, ``w2_weight``
    and a ``quant_method``)."""
    for name, module in model.named_modules():
        if hasattr(module, "w13_weight") and hasattr(module, "w2_weight") and \
                getattr(module, "quant_method", None) is not None:
            yield name, module


def _fused_experts(quant_method: Any) -> Any:
    return getattr(getattr(quant_method, "moe_kernel", None), "fused_experts", None)


def _backend(quant_method: Any) -> Optional[str]:
    backend = getattr(quant_method, "unquantized_backend", None)
    return getattr(backend, "name", None)


def _cpu_experts_padded(experts: Any) -> bool:
    """vLLM pads a CPU expert's intermediate size to its kernel's alignment (0.28+); re-running that pad on
    padded tensors is not what the kernel expects, so such layers are left to vLLM."""
    config, pad = getattr(experts, "moe_config", None), getattr(experts, "_padded_intermediate_size", None)
    size = getattr(config, "intermediate_size_per_partition", None)
    return size is not None and pad is not None and pad(config) != size


def moe_layer_kind(layer: torch.nn.Module) -> Optional[str]:
    """The layer's kind (:data:`CPU_PREPACK_ONCE`, :data:`CPU_REBUILT`, :data:`CONVERTED`), or None: a layer
    :func:`finish_moe_weight_load` does not know how to complete. Quantized layers are None too."""
    method = layer.quant_method
    if _UNQUANTIZED not in _class_names(method):
        return None
    experts = _fused_experts(method)
    if experts is not None and _CPU_EXPERTS in _class_names(experts):
        return None if _cpu_experts_padded(experts) else CPU_PREPACK_ONCE
    cpu_moe = getattr(method, "cpu_fused_moe", None)
    if cpu_moe is not None and _class_names(cpu_moe) & _CPU_REBUILT_CLASSES:
        # vLLM's torch fallback with oneDNN (Arm) moves the experts into handles and empties the weights
        return CPU_REBUILT if layer.w13_weight.numel() and layer.w2_weight.numel() else None
    if experts is not None and _backend(method) in _CONVERTED_BACKENDS:
        return CONVERTED
    return None


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


def _warn_unknown(name: str, layer: torch.nn.Module) -> None:
    if getattr(layer, _WARNED, False):
        return
    setattr(layer, _WARNED, True)
    method = layer.quant_method
    logger.warning(
        "rollout-parity: %s (%s, backend %s, experts %s) is a fused-MoE layer whose post-load step rollout-parity "
        "does not know: a weight sync into it is not completed here and may leave its experts in the wrong layout; "
        "set weight_sync_check_interval to verify the engine after each sync (docs/moe.md)", name,
        type(method).__name__, _backend(method), type(_fused_experts(method)).__name__)


def record_moe_layers(model: torch.nn.Module) -> int:
    """Fingerprint every known fused-MoE layer that has none yet, as it is before a sync (processed by vLLM).

    Call it before each load (the adapters do): :func:`finish_moe_weight_load` then leaves a layer the load did
    not write alone from the first sync on, instead of processing its processed weights again. Returns the
    number of layers recorded."""
    recorded = 0
    with torch.no_grad():
        for _, layer in fused_moe_layers(model):
            if getattr(layer, _FINGERPRINT, None) is None and moe_layer_kind(layer) is not None:
                setattr(layer, _FINGERPRINT, _fingerprint(layer))
                recorded += 1
    return recorded


def finish_moe_weight_load(model: torch.nn.Module, *, post_processed: bool) -> list[str]:
    """Put the expert weights a sync just wrote into each fused-MoE layer into its kernel's layout.

    Call it after each load. ``post_processed=False`` (TRL's colocated sync: a raw ``load_weights``): vLLM's
    own per-layer ``quant_method.process_weights_after_loading`` (what vLLM's reload runs), then, for
    :data:`CPU_PREPACK_ONCE`, the experts' prepack vLLM skips. ``post_processed=True`` (verl, ``reload_weights``:
    vLLM's processing already ran): the prepack only, where vLLM skipped it.

    The steps are not idempotent (prepacking prepacked weights scrambles them) and vLLM's loaders write
    through ``.data``, which no version counter sees, so each processed layer keeps a fingerprint (evenly
    spaced samples of both tensors): a layer whose tensors still match it was not written since and is left
    alone (a second call, or a sync that skipped a layer, is safe; from the first sync on where
    :func:`record_moe_layers` ran before the load, else from the second). A layer of no known kind
    (:func:`moe_layer_kind`) is left untouched and warned about once; a quantized one raises (its raw load
    cannot be completed here).

    Returns the names of the layers this call completed: only layers it ran a step on, none it left as
    they were (with ``post_processed=True`` a :data:`CPU_REBUILT` or :data:`CONVERTED` layer needs nothing).
    """
    layers = [(name, layer, moe_layer_kind(layer)) for name, layer in fused_moe_layers(model)]
    for name, layer, _ in layers:
        if _UNQUANTIZED not in _class_names(layer.quant_method):
            raise NotImplementedError(
                f"{name}: a raw weight load into a {type(layer.quant_method).__name__} MoE layer cannot be completed "
                "here (only unquantized fused-MoE layers); use the engine's own quantized reload path")
    done = []
    with torch.no_grad():
        for name, layer, kind in layers:
            if kind is None:
                _warn_unknown(name, layer)
                continue
            if _unchanged(layer):
                continue
            ran = False
            if not post_processed:
                layer.quant_method.process_weights_after_loading(layer)
                ran = True
            if kind == CPU_PREPACK_ONCE:  # vLLM 0.28-0.32 skip this on every load after the first
                _fused_experts(layer.quant_method).process_weights_after_loading(layer)
                ran = True
            setattr(layer, _FINGERPRINT, _fingerprint(layer))
            if ran:
                done.append(name)
    return done
