"""fp32 lm_head on the trainer: the model's final projection computed in float32.

Why: the RL update consumes token logprobs directly, so the precision of the last matmul is
part of the correctness surface; PipelineRL needed the fp32 head on both trainer and vLLM to
reach parity (../shared/seeds/pipelinerl-vllm-v1-parity.txt, "The Remaining Gap: fp32
lm_head"; MiniMax-M1 and ScaleRL do the same).

What ``apply_fp32_lm_head(model)`` does to the module ``model.get_output_embeddings()``
(usually ``lm_head``, an ``nn.Linear``):

* its forward computes ``x W^T + b`` in fp32 with autocast disabled (float64 stays float64), so
  logits are **returned in fp32** whatever the model dtype: in exact fp32 whatever the caller's
  TF32 settings, forward and backward, and without a whole fp32 copy of a bf16 W (a bf16 GEMM
  with fp32 output on a GPU, one upcast eighth of the vocabulary at a time elsewhere:
  :mod:`rollout_parity.core.head_matmul`), the same numbers as ``F.linear(x.float(), W.float(),
  b.float())``;
* the parameters are not touched: they keep their dtype, their identity and their sharding.
  A tied embedding therefore keeps working (one shared Parameter, gradients from both uses)
  and the input embedding's output keeps the model dtype: only the head's output is fp32;
* the patch replaces the *instance* ``forward`` only, so the module is still called through
  ``nn.Module.__call__`` and every hook fires: under DeepSpeed ZeRO-3 the partitioned weight
  is gathered by ZeRO's pre-forward hook before our forward reads ``self.weight``;
* the original forward is kept on the module and the module is marked; applying twice is a
  no-op; ``revert_fp32_lm_head`` restores the original, so logits are bit-identical to before.

Refused with a clear error: a PEFT-wrapped head (LoRA on lm_head, ``modules_to_save``) whose
forward is not a plain linear (detected by class, without importing peft), a head that is
not an ``nn.Linear`` with the stock forward, non-floating weights (quantised heads), and a
forward already replaced by someone else.  An accelerate hook (``_hf_hook``/``_old_forward``,
e.g. ``device_map`` offload) is supported: its ``_old_forward`` is the one patched.
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .head_matmul import HeadProjector, exact_fp32_matmul

__all__ = ["apply_fp32_lm_head", "revert_fp32_lm_head", "is_fp32_lm_head"]

_MARK = "_rollout_parity_fp32_head"
_ORIGINAL = "_rollout_parity_fp32_head_original"  # (attribute name, original or None)
_PEFT_CLASS_NAMES = {
    "BaseTunerLayer",
    "LoraLayer",
    "ModulesToSaveWrapper",
    "AuxiliaryTrainingWrapper",
    "TrainableTokensWrapper",
}


class _Fp32Linear(torch.autograd.Function):
    """``x W^T + b`` in the compute dtype (fp32, or float64), exact, W never copied whole: the saved tensors are the
    inputs themselves (a bf16 W stays bf16), and the backward upcasts W again one tile at a time."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        cdtype = torch.promote_types(weight.dtype, torch.float32)
        x2 = x.reshape(-1, x.shape[-1])
        # made in its final shape: a view returned from here may not be changed in place (verl 0.8 divides
        # the logits by the temperature in place)
        out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=cdtype, device=x.device)
        with exact_fp32_matmul(), torch.autocast(device_type=x.device.type, enabled=False):
            head = HeadProjector(weight, bias, 1.0, x.dtype, cdtype, x2.shape[0], tile=_tile(weight))
            head.logits_into(out.view(-1, weight.shape[0]), x2)
        ctx.save_for_backward(x, weight, bias)
        ctx.cdtype = cdtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        cdtype = ctx.cdtype
        g = grad_out.reshape(-1, weight.shape[0]).to(cdtype)
        grad_x = grad_w = grad_b = None
        with exact_fp32_matmul(), torch.autocast(device_type=x.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                head = HeadProjector(weight, None, 1.0, cdtype, cdtype, g.shape[0], tile=_tile(weight))
                grad_x = head.grad_hidden_into(torch.empty(g.shape[0], weight.shape[1], dtype=cdtype,
                                                           device=g.device), g)
                grad_x = grad_x.reshape(x.shape).to(x.dtype)
            if ctx.needs_input_grad[1]:
                grad_w = torch.mm(g.t(), x.reshape(-1, x.shape[-1]).to(cdtype)).to(weight.dtype)
            if bias is not None and ctx.needs_input_grad[2]:
                grad_b = g.sum(0).to(bias.dtype)
        return grad_x, grad_w, grad_b


def _tile(weight: torch.Tensor) -> int:
    """Rows of W upcast at once: an eighth of the head (at least 256 rows)."""
    return max(256, -(-weight.shape[0] // 8))


def _fp32_linear_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return _Fp32Linear.apply(input, self.weight, self.bias)


def _peft_reason(module: nn.Module) -> str | None:
    for cls in type(module).__mro__:
        if cls.__module__.split(".")[0] == "peft" or cls.__name__ in _PEFT_CLASS_NAMES:
            return f"{cls.__module__}.{cls.__name__}"
    if "peft" in sys.modules:  # only if the user already imported it
        peft = sys.modules["peft"]
        for name in ("tuners.tuners_utils.BaseTunerLayer", "utils.other.ModulesToSaveWrapper"):
            obj = peft
            try:
                for part in name.split("."):
                    obj = getattr(obj, part)
            except AttributeError:
                continue
            if isinstance(obj, type) and isinstance(module, obj):
                return f"peft.{name}"
    return None


def _output_head(model: nn.Module) -> nn.Module:
    getter = getattr(model, "get_output_embeddings", None)
    if getter is None:
        if isinstance(model, nn.Linear):
            return model
        raise TypeError(
            f"{type(model).__name__} has no get_output_embeddings(); pass a transformers "
            "PreTrainedModel (or the head nn.Linear itself)"
        )
    head = getter()
    if head is None:
        raise ValueError(
            f"{type(model).__name__}.get_output_embeddings() returned None: the model has no "
            "output projection to run in fp32"
        )
    return head


def _check_patchable(head: nn.Module) -> None:
    reason = _peft_reason(head)
    if reason is not None:
        raise TypeError(
            f"fp32_lm_head: the output head is wrapped by PEFT ({reason}); its forward adds "
            "adapter terms that a plain fp32 linear would drop. Apply the fp32 head before "
            "wrapping with PEFT and keep lm_head out of target_modules/modules_to_save, or "
            "merge the adapter first (merge_and_unload)."
        )
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        raise TypeError(
            f"fp32_lm_head: the output head is {type(head).__module__}.{type(head).__name__}; "
            "only an nn.Linear with the stock forward can be patched"
        )
    if not head.weight.is_floating_point():
        raise TypeError(
            f"fp32_lm_head: head weight has dtype {head.weight.dtype} (quantised?); "
            "an fp32 head needs a floating-point weight"
        )


def is_fp32_lm_head(model: nn.Module) -> bool:
    """True when ``apply_fp32_lm_head`` is in effect on the model's output head."""
    return bool(getattr(_output_head(model), _MARK, False))


def apply_fp32_lm_head(model: nn.Module) -> nn.Module:
    """Run ``model.get_output_embeddings()`` in fp32 (see the module docstring). Idempotent.

    Returns ``model``.  Raises TypeError for PEFT-wrapped, non-Linear or quantised heads.
    """
    head = _output_head(model)
    if getattr(head, _MARK, False):
        return model
    _check_patchable(head)
    if hasattr(head, "_hf_hook") and "_old_forward" in head.__dict__:
        # accelerate: forward is its hook wrapper, which calls _old_forward.
        attr, original = "_old_forward", head.__dict__["_old_forward"]
    elif "forward" in head.__dict__:
        raise RuntimeError(
            f"fp32_lm_head: {type(head).__name__}.forward is already replaced on the instance "
            f"({head.__dict__['forward']!r}); refusing to stack patches"
        )
    else:
        attr, original = "forward", None
    setattr(head, _ORIGINAL, (attr, original))
    setattr(head, attr, types.MethodType(_fp32_linear_forward, head))
    setattr(head, _MARK, True)
    return model


def revert_fp32_lm_head(model: nn.Module) -> nn.Module:
    """Undo ``apply_fp32_lm_head``: the original forward is back, logits bit-identical.

    A no-op on a model that is not patched.  Returns ``model``.
    """
    head = _output_head(model)
    if not getattr(head, _MARK, False):
        return model
    attr, original = getattr(head, _ORIGINAL)
    if original is None:
        del head.__dict__[attr]
    else:
        setattr(head, attr, original)
    delattr(head, _ORIGINAL)
    delattr(head, _MARK)
    return model
