"""The precision rows' other measurements: whether vLLM runs the model in float16, and fp16's range on it.

Qi et al., "Defeating the Training-Inference Mismatch via FP16" (2025): with the engine and the trainer
both in fp16 instead of bf16 the same weights give logprobs that agree far better (10 mantissa bits to
bf16's 7), at the price of fp16's range: its largest finite value is 65504 (``FP16_MAX``); beyond it a
value is inf, and inf - inf or 0 * inf is NaN. The rows (``p/fp16``, ``p/fp16+head``, ``p/mixed``) measure
the first; this module measures the second on the user's model, during the trainer's own forwards:

* :class:`ActivationProbe`: forward hooks on the decoder layers and the output head of a transformers
  causal LM. Per token (attention-mask positions of every forward), the largest |value| over every
  decoder layer's output (the residual stream, where LLMs carry their "massive activations"), the
  largest |logit|, and the forwards whose layer outputs or logits held inf/NaN.
* :func:`range_summary`: those as the report's numbers, against ``FP16_MAX``: the share of tokens whose
  largest activation exceeds ``FP16_MAX / SHARE_DIVISOR`` (4,094: four doublings from overflow).
* :func:`float16_refusal`: vLLM refuses some model types in float16 (its own table,
  ``vllm.config.model._FLOAT16_NOT_SUPPORTED_MODELS``, read at run time; :data:`FLOAT16_REFUSED_FALLBACK`,
  vLLM 0.31's copy, when the installed vLLM has no table of that name). The doctor then skips the p/*
  rows, naming the model type and vLLM's reason, before any engine loads.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from rollout_parity.engines.vllm.fp16_models import FLOAT16_REFUSED_FALLBACK, float16_refusals, model_type_of
from rollout_parity.core.precision import FP16_MAX

__all__ = ["FP16_MAX", "SHARE_DIVISOR", "COMFORT_DIVISOR", "FLOAT16_REFUSED_FALLBACK", "float16_refusals",
           "float16_refusal", "ActivationProbe", "range_summary", "decoder_layers"]

#: The report's share: tokens whose largest |activation| exceeds FP16_MAX / 16 (4,094).
SHARE_DIVISOR = 16
#: The verdict's comfortable headroom (``advice.py``): every |activation| and |logit| below FP16_MAX / 8 (8,188),
#: three doublings a training run's growing activations can take before fp16 overflows.
COMFORT_DIVISOR = 8


def _model_type(model_path: str) -> Optional[str]:
    """The checkpoint's top-level ``model_type`` (what vLLM's ``_check_valid_dtype`` reads)."""
    try:
        from transformers import AutoConfig

        return getattr(AutoConfig.from_pretrained(model_path), "model_type", None)
    except Exception:  # a model type this transformers does not know: read the file itself
        return model_type_of(model_path)


def float16_refusal(model_path: str, table: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A note when vLLM refuses this model's type in float16 (the p/* rows are then skipped), else None."""
    if table is None:
        table, _ = float16_refusals()
    model_type = _model_type(model_path)
    if model_type not in table:
        return None
    return (f"p/* rows skipped: vLLM refuses model type {model_type!r} in float16 ({table[model_type]}); "
            "keep bf16 for this model")


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of a transformers causal LM: the ModuleList of ``config.num_hidden_layers`` blocks."""
    import torch

    body = getattr(model, "model", None) or model.get_decoder()
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    lists = [m for m in body.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    for layers in lists:
        if count is None or len(layers) == count:
            return list(layers)
    raise ValueError(f"no ModuleList of {count} decoder layers in {type(body).__name__}")


def _first_tensor(output: Any) -> Any:
    import torch

    if torch.is_tensor(output):
        return output
    if isinstance(output, (tuple, list)) and output and torch.is_tensor(output[0]):
        return output[0]
    return getattr(output, "last_hidden_state", None)


class ActivationProbe:
    """Record, during a transformers causal LM's forwards, fp16's range on it (``with ActivationProbe(model):``).

    Per forward of the body: for every position its attention mask marks, the largest |x| over all decoder
    layers' outputs and hidden dimensions (``token_max``); whether any of those, or any logit of the output
    head, is inf/NaN. The head's largest |logit| over all its calls. The hooks read, never change, a value.
    """

    def __init__(self, model: Any):
        self.model = model
        self.token_max: list[Any] = []  # one 1-D float32 tensor per forward: the valid positions' maxima
        self.max_abs_logit = 0.0
        self.forwards = 0
        self.nonfinite_forwards = 0
        self.nonfinite_logit_calls = 0
        self.activation_dtype: Optional[str] = None
        self.seconds = 0.0  # the caller's: time spent in the forwards it scored with this model
        self._current: Any = None
        self._mask: Any = None
        self._handles: list[Any] = []

    def __enter__(self) -> "ActivationProbe":
        body = getattr(self.model, "model", None) or self.model.get_decoder()
        self._handles.append(body.register_forward_pre_hook(self._start, with_kwargs=True))
        self._handles += [layer.register_forward_hook(self._layer) for layer in decoder_layers(self.model)]
        self._handles.append(body.register_forward_hook(self._finish))
        self._handles.append(self.model.get_output_embeddings().register_forward_hook(self._logits))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _start(self, module: Any, args: tuple, kwargs: dict) -> None:
        self._current = None
        self._mask = kwargs.get("attention_mask")

    def _layer(self, module: Any, args: tuple, output: Any) -> None:
        import torch

        x = _first_tensor(output)
        if x is None:
            return
        self.activation_dtype = str(x.dtype).replace("torch.", "")
        m = x.detach().abs().amax(dim=-1).float()  # (B, T); NaN propagates
        self._current = m if self._current is None else torch.maximum(self._current, m)

    def _finish(self, module: Any, args: tuple, output: Any) -> None:
        import torch

        if self._current is None:
            return
        current = self._current
        mask = self._mask
        valid = (torch.ones_like(current, dtype=torch.bool) if mask is None or mask.dim() != 2
                 else mask.to(current.device).bool())
        values = current[valid].cpu()
        self.token_max.append(values)
        self.forwards += 1
        self.nonfinite_forwards += int(not bool(torch.isfinite(values).all()))
        self._current = self._mask = None

    def _logits(self, module: Any, args: tuple, output: Any) -> None:
        import torch

        x = _first_tensor(output)
        if x is None or x.numel() == 0:
            return
        a = x.detach().abs()
        finite = torch.isfinite(a)
        if not bool(finite.all()):
            self.nonfinite_logit_calls += 1
        if bool(finite.any()):
            self.max_abs_logit = max(self.max_abs_logit, float(a[finite].max()))

    def summary(self, dtype: str) -> dict[str, Any]:
        """:func:`range_summary` of what was recorded; ``dtype``: the model parameters' dtype."""
        import torch

        values = torch.cat(self.token_max) if self.token_max else torch.zeros(0)
        return range_summary(values, self.max_abs_logit, forwards=self.forwards,
                             nonfinite_forwards=self.nonfinite_forwards,
                             nonfinite_logit_calls=self.nonfinite_logit_calls, dtype=dtype,
                             activation_dtype=self.activation_dtype)


def range_summary(token_max: Any, max_abs_logit: float, *, forwards: int, nonfinite_forwards: int,
                  nonfinite_logit_calls: int = 0, dtype: str = "", activation_dtype: Optional[str] = None
                  ) -> dict[str, Any]:
    """fp16's range on the recorded forwards. ``token_max``: per token, its largest |activation| (1-D).

    ``max_abs_activation``: the largest finite one; ``share_above``: the share of tokens whose largest
    activation exceeds ``FP16_MAX / SHARE_DIVISOR``, counting inf/NaN ones as above; ``headroom``:
    ``FP16_MAX`` over the largest |activation| or |logit| (inf when both are 0).
    """
    import torch

    t = token_max.float().reshape(-1)
    finite = torch.isfinite(t)
    threshold = FP16_MAX / SHARE_DIVISOR
    largest = float(t[finite].max()) if bool(finite.any()) else 0.0
    biggest = max(largest, float(max_abs_logit))
    return {
        "dtype": dtype,
        "activation_dtype": activation_dtype,
        "forwards": int(forwards),
        "tokens": int(t.numel()),
        "max_abs_activation": largest,
        "max_abs_logit": float(max_abs_logit),
        "share_threshold": threshold,
        "share_above": float((~(t <= threshold)).float().mean()) if t.numel() else 0.0,
        "nonfinite_tokens": int((~finite).sum()),
        "nonfinite_forwards": int(nonfinite_forwards),
        "nonfinite_logit_calls": int(nonfinite_logit_calls),
        "headroom": FP16_MAX / biggest if biggest > 0 else math.inf,
    }
