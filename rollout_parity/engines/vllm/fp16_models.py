"""The model types vLLM refuses in float16, read from the installed vLLM: the ``precision=fp16`` flag refused by
name for them before anything loads (the adapters) and the doctor's fp16 rows skipped (``doctor/precision.py``).

vLLM checks a model's top-level ``model_type`` against ``vllm.config.model._FLOAT16_NOT_SUPPORTED_MODELS``
(``_check_valid_dtype``: "The model type ... does not support float16") when the engine is built, minutes into
a run; the same table read here answers at start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

from rollout_parity.core.config import FlagError

__all__ = ["FLOAT16_REFUSED_FALLBACK", "float16_refusals", "model_type_of", "refuse_fp16_model"]

#: vLLM 0.31's ``vllm/config/model.py`` ``_FLOAT16_NOT_SUPPORTED_MODELS`` (model_type -> reason), for a vLLM
#: without that name (or none installed here, the engine elsewhere).
FLOAT16_REFUSED_FALLBACK: dict[str, str] = {
    "gemma2": "Numerical instability. Please use bfloat16 or float32 instead.",
    "gemma3": "Numerical instability. Please use bfloat16 or float32 instead.",
    "gemma3_text": "Numerical instability. Please use bfloat16 or float32 instead.",
    "glm4": "Numerical instability. Please use bfloat16 or float32 instead.",
}


def float16_refusals() -> tuple[dict[str, str], str]:
    """vLLM's table of model types it refuses in float16, and where it came from."""
    try:
        from vllm.config.model import _FLOAT16_NOT_SUPPORTED_MODELS as table
    except ImportError:  # no vLLM here, or one without the table by that name
        return dict(FLOAT16_REFUSED_FALLBACK), "vLLM 0.31's table (the installed vLLM has none by that name)"
    return dict(table), "vllm.config.model._FLOAT16_NOT_SUPPORTED_MODELS"


def model_type_of(model: Any) -> Optional[str]:
    """The top-level ``model_type`` of a checkpoint directory, a config object or a model (None when unknown:
    a hub name that is not on this machine is answered by vLLM itself when the engine is built)."""
    config = getattr(model, "config", model)
    if not isinstance(config, (str, Path)):
        return getattr(config, "model_type", None)
    path = Path(config) / "config.json"
    try:
        return json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def refuse_fp16_model(model: Any, where: str, table: Optional[Mapping[str, str]] = None) -> None:
    """Raise ``FlagError`` naming the model type and vLLM's reason when ``precision=fp16`` meets a model vLLM
    refuses in float16; ``where`` names the setting that carries the model (``actor_rollout_ref.model.path``)."""
    model_type = model_type_of(model)
    table = float16_refusals()[0] if table is None else table
    if model_type in table:
        raise FlagError(f"precision: 'fp16' with {where} of model type {model_type!r}, which vLLM refuses in float16 "
                        f"({table[model_type]}); keep precision bf16 (or null) for this model")
