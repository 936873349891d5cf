"""The actor side, inside verl's FSDP engine: the fp32 head and the sampler-aware pi_old pass.

``fp32_lm_head`` puts ``apply_fp32_lm_head`` on the actor model right after verl's
``FSDPEngine._build_module`` loads it, before LoRA, QAT or FSDP wrap it. With a truncating
sampler, the actor's pi_old pass (``FSDPEngineWithLMHead.forward_step`` with entropy, verl's V1
trainer asks for it there only) also computes pi_old as vLLM's sampler sees it, from the head's
input hidden states, one chunked fp32 pass, no (N, V) fp32 logits, into :data:`PROCESSED_FIELD`.
docs/verl.md, "Sampler-aware ratios" and "How it plugs in" (the fp32 lm_head).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from rollout_parity.adapters.verl.driver import OUTSIDE_FIELD, PROCESSED_FIELD
from rollout_parity.adapters.verl.flags import active_config, active_sampler
from rollout_parity.core.sampler import SamplerSettings, sampler_logprobs_from_hidden

__all__ = ["fp32_head_after_build", "forward_step_with_sampler_pass"]

logger = logging.getLogger(__name__)


def fp32_head_after_build(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """verl's ``FSDPEngine._build_module``, then the fp32 head on the language model it built."""
    module = original(self, *args, **kwargs)
    cfg = active_config()
    if cfg is not None and cfg.fp32_lm_head and getattr(self.model_config, "model_type", None) == "language_model":
        from rollout_parity.core.fp32_head import apply_fp32_lm_head

        apply_fp32_lm_head(module)
        logger.info("rollout-parity: fp32 lm_head applied to the actor model before FSDP wrapping")
    return module


def _non_tensor(data: Any, key: str, default: Any) -> Any:
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


def _output_head(module: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(module, "_fsdp_wrapped_module", module)
    getter = getattr(inner, "get_output_embeddings", None)
    head = getter() if getter is not None else None
    if head is None or not hasattr(head, "weight"):
        raise RuntimeError(f"sampler-aware pi_old: {type(inner).__name__} has no lm_head with a weight")
    return head


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def forward_step_with_sampler_pass(original: Callable, self: Any, micro_batch: Any, loss_function: Any,
                                   forward_only: bool) -> Any:
    """verl's ``forward_step``; on pi_old's pass also the processed pi_old of a truncating sampler."""
    sampler = active_sampler()
    if sampler is None or loss_function is not None or not forward_only \
            or not _non_tensor(micro_batch, "calculate_entropy", False):
        # Only pi_old's pass: verl's V1 trainer asks for entropy there and nowhere else
        # (the reference pass, the critic and the update never set calculate_entropy here).
        return original(self, micro_batch, loss_function, forward_only)
    captured: list[torch.Tensor] = []
    head = _output_head(self.module)
    handle = head.register_forward_hook(lambda mod, args, out: captured.append(args[0].detach()))
    try:
        loss, output = original(self, micro_batch, loss_function, forward_only)
    finally:
        handle.remove()
    processed, outside = _processed_from_hidden(micro_batch, captured, head, sampler)
    output["model_output"][PROCESSED_FIELD] = processed
    output["model_output"][OUTSIDE_FIELD] = outside
    return loss, output


def _processed_from_hidden(micro_batch: Any, captured: list, head: torch.nn.Module,
                           sampler: SamplerSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """pi_old processed as vLLM's sampler, at every position of the packed sequences (nested), and 1.0
    where the recomputed kept set missed the token (the boundary rule, ``core/sampler.py``)."""
    if len(captured) != 1:
        raise RuntimeError(f"sampler-aware pi_old: expected one lm_head call per micro-batch, saw {len(captured)}")
    input_ids = micro_batch["input_ids"]
    offsets = input_ids.offsets()
    total = int(offsets[-1])
    hidden = captured[0]
    if _non_tensor(micro_batch, "use_remove_padding", True):
        hidden = hidden.reshape(-1, hidden.shape[-1])[:total]  # (1, nnz + pad, H) -> (nnz, H)
    else:  # (bsz, max_len, H): the valid positions of each row, packed as verl packs its logits
        lengths = offsets.diff().tolist()
        hidden = torch.cat([hidden[i, :n] for i, n in enumerate(lengths)])
    # verl's labels: the packed ids rolled by one (the last position's label is never used)
    labels = torch.roll(input_ids.values(), shifts=-1, dims=0)
    temperature = micro_batch["temperature"]
    if torch.is_tensor(temperature):
        if temperature.numel() > 1 and not bool((temperature == temperature.flatten()[0]).all()):
            raise ValueError("sampler-aware pi_old: per-sample temperatures are not supported")
        temperature = float(temperature.flatten()[0])
    weight = _full_tensor(head.weight)
    bias = None if getattr(head, "bias", None) is None else _full_tensor(head.bias)
    with torch.autocast(device_type=hidden.device.type, enabled=False):  # the fp32 head pass stays fp32
        out = sampler_logprobs_from_hidden(hidden, weight, labels, float(temperature), sampler.top_k,
                                           sampler.top_p, sampler.min_p, bias=bias)
    return (torch.nested.nested_tensor_from_jagged(out.processed, offsets),
            torch.nested.nested_tensor_from_jagged(out.outside_mask.to(out.processed.dtype), offsets))
