"""The actor side, inside verl's FSDP engine: the fp32 head and the sampler-aware pi_old pass.

``fp32_lm_head`` puts ``apply_fp32_lm_head`` on the actor model right after verl's
``FSDPEngine._build_module`` loads it, before LoRA, QAT or FSDP wrap it. With a truncating
sampler, the actor's pi_old pass (``FSDPEngineWithLMHead.forward_step`` with entropy, verl's V1
trainer asks for it there only) also computes pi_old as vLLM's sampler sees it, into
:data:`PROCESSED_FIELD`: one chunked fp32 pass, no (N, V) fp32 logits, run *inside* the head's
forward (a forward hook that runs before FSDP's own), so that it reads

* the head weight the forward used: under FSDP2 mixed precision the unsharded ``param_dtype``
  (bf16) weight on the compute device, never the fp32 sharded master, and no all-gather of its
  own (the fp32 head's semantics: fp32 compute on bf16(W)); with FSDP2's ``offload_policy`` the
  sharded parameters live on the CPU, the unsharded one where the forward ran;
* the hidden states and the labels of this rank's rows: verl's own ``input_ids_rmpad_rolled``
  from ``prepare_model_inputs``, so under Ulysses sequence parallelism each rank scores its
  slice, and the result is gathered and unpadded across the sequence-parallel group as verl
  gathers its own ``log_probs``.

docs/verl_pi_old.md, "Sampler-aware ratios", and docs/verl_plugin.md, "How the adapter plugs in" (the fp32
lm_head).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Optional

import torch

from rollout_parity.adapters.verl.driver import OUTSIDE_FIELD, PROCESSED_FIELD
from rollout_parity.adapters.verl.flags import active_config, active_sampler
from rollout_parity.core.sampler import SamplerSettings, sampler_logprobs_from_hidden

__all__ = ["fp32_head_after_build", "forward_step_with_sampler_pass", "inputs_for_sampler_pass"]

logger = logging.getLogger(__name__)
_PASS = "_rollout_parity_sampler_pass"  # on verl's engine, during one pi_old micro-batch


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


@dataclasses.dataclass
class _SamplerPass:
    """One micro-batch's pass: what verl hands over before the forward, and this rank's result."""

    sampler: SamplerSettings
    temperature: float
    remove_padding: bool
    offsets: torch.Tensor  # the packed sequences' boundaries (verl's nested input_ids)
    output_args: Optional[dict] = None  # prepare_model_inputs' labels and pads, this rank's slice
    calls: int = 0
    rows: Optional[torch.Tensor] = None  # (n, 2): processed pi_old, outside-kept-set flag


def _temperature(micro_batch: Any) -> float:
    temperature = micro_batch["temperature"]
    if torch.is_tensor(temperature):
        if temperature.numel() > 1 and not bool((temperature == temperature.flatten()[0]).all()):
            raise ValueError("sampler-aware pi_old: per-sample temperatures are not supported")
        temperature = temperature.flatten()[0].item()
    return float(temperature)


def inputs_for_sampler_pass(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """verl's ``prepare_model_inputs``; during a pi_old pass, its labels are kept for the head's hook."""
    model_inputs, output_args = original(self, *args, **kwargs)
    state = self.__dict__.get(_PASS)
    if state is not None:
        state.output_args = output_args
    return model_inputs, output_args


def forward_step_with_sampler_pass(original: Callable, self: Any, micro_batch: Any, loss_function: Any,
                                   forward_only: bool) -> Any:
    """verl's ``forward_step``; on pi_old's pass also the processed pi_old of a truncating sampler."""
    sampler = active_sampler()
    if sampler is None or loss_function is not None or not forward_only \
            or not _non_tensor(micro_batch, "calculate_entropy", False):
        # Only pi_old's pass: verl's V1 trainer asks for entropy there and nowhere else
        # (the reference pass, the critic and the update never set calculate_entropy here).
        return original(self, micro_batch, loss_function, forward_only)
    state = _SamplerPass(sampler, _temperature(micro_batch), bool(_non_tensor(micro_batch, "use_remove_padding", True)),
                         micro_batch["input_ids"].offsets())
    # prepend: before FSDP's post-forward hook reshards the head (its unsharded weight is the one used)
    handle = _output_head(self.module).register_forward_hook(functools.partial(_head_pass, state), prepend=True)
    self.__dict__[_PASS] = state
    try:
        loss, output = original(self, micro_batch, loss_function, forward_only)
    finally:
        handle.remove()
        self.__dict__.pop(_PASS, None)
    if state.output_args is None:
        raise RuntimeError("sampler-aware pi_old: verl's prepare_model_inputs handed over no labels (an engine that "
                           "builds its model inputs itself?)")
    if state.calls != 1 or state.rows is None:
        raise RuntimeError(f"sampler-aware pi_old: expected one lm_head call per micro-batch, saw {state.calls}")
    rows = _gathered(self, state)
    offsets = state.offsets.to(rows.device)
    output["model_output"][PROCESSED_FIELD] = torch.nested.nested_tensor_from_jagged(rows[:, 0].contiguous(), offsets)
    output["model_output"][OUTSIDE_FIELD] = torch.nested.nested_tensor_from_jagged(rows[:, 1].contiguous(), offsets)
    return loss, output


def _head_pass(state: _SamplerPass, head: torch.nn.Module, args: tuple, out: Any) -> None:
    """Forward hook on the lm_head: pi_old processed as vLLM's sampler, for this rank's rows, and 1.0 where the
    recomputed kept set missed the token (the boundary rule, ``core/sampler.py``)."""
    state.calls += 1
    if state.calls > 1 or state.output_args is None:
        return  # reported after the forward (a second call) or never seen (no labels: not verl's forward)
    hidden = args[0].detach()
    labels = state.output_args["input_ids_rmpad_rolled"]
    if state.remove_padding:  # (1, rows, H): this rank's packed rows (its sequence-parallel slice), pads included
        hidden = hidden.reshape(-1, hidden.shape[-1])
    else:  # (bsz, max_len, H): the valid positions of each row, packed as verl packs its logits
        lengths = state.offsets.diff().tolist()
        hidden = torch.cat([hidden[i, :n] for i, n in enumerate(lengths)])
    if labels.shape[0] != hidden.shape[0]:
        raise RuntimeError(f"sampler-aware pi_old: verl's labels {tuple(labels.shape)} do not match the head's input "
                           f"{tuple(hidden.shape)}")
    weight = head.weight  # inside the forward: what F.linear used (FSDP's unsharded param_dtype weight)
    bias = getattr(head, "bias", None)
    if hasattr(weight, "full_tensor"):  # a head computed as a DTensor (no FSDP unshard): its full weight
        weight, bias = weight.full_tensor(), None if bias is None else bias.full_tensor()
    sampler = state.sampler
    out = sampler_logprobs_from_hidden(hidden, weight.detach(), labels.to(hidden.device), state.temperature,
                                       sampler.top_k, sampler.top_p, sampler.min_p,
                                       bias=None if bias is None else bias.detach())
    state.rows = torch.stack([out.processed, out.outside_mask.to(out.processed.dtype)], dim=-1)


def _gathered(engine: Any, state: _SamplerPass) -> torch.Tensor:
    """This rank's rows -> every packed position of the micro-batch, as verl gathers its ``log_probs``."""
    rows = state.rows
    if state.remove_padding:
        pad = int(state.output_args.get("pad_size", 0) or 0)  # sequence-parallel and static pads, at the tail
        if getattr(engine, "use_ulysses_sp", False):
            from verl.utils.ulysses import gather_outputs_and_unpad

            rows = gather_outputs_and_unpad(rows, gather_dim=0, unpad_dim=0, padding_size=pad)
        elif pad:
            rows = rows[:-pad]
    total = int(state.offsets[-1])
    if rows.shape[0] != total:
        raise RuntimeError(f"sampler-aware pi_old: {rows.shape[0]} scored positions for {total} tokens")
    return rows
