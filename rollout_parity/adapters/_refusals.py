"""Refusals that hold whatever framework runs the loss: what r_corr cannot be made to mean.

vLLM's processed logprobs are the distribution it sampled from; the trainer reproduces it only
for temperature, top-k, top-p and min-p (``core/sampler.py``). Each adapter reads its framework's
sampler settings, penalties and model config and hands them here, before anything is patched.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from rollout_parity.core.config import CorrectionConfig
from rollout_parity.core.sampler import SamplerSettings

__all__ = ["SAMPLER_PENALTIES", "HEAD_MODIFIERS", "ENGINE_SIDE_FLAGS", "needs_rollout_logprobs", "active_penalties",
           "head_modifiers", "refuse_unmatched_sampler", "refuse_replay", "refuse_engine_side_flags", "describe_flags"]

#: vLLM ``SamplingParams`` that change its processed logprobs in ways no trainer log-prob reproduces.
SAMPLER_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "bad_words",
                     "allowed_token_ids", "min_tokens")
#: Model-config fields that scale or soft-cap the head's logits: the kept set is then not a plain linear head's.
HEAD_MODIFIERS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                  "logits_scaling")
_NEUTRAL = (None, 1, 1.0, 0, 0.0, [], {}, ())
#: Flags that act on the framework's weight sync or its model's routers, not on the loss (docs/moe.md).
ENGINE_SIDE_FLAGS = ("weight_sync_check_interval", "moe_routing_replay")


def _items(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def describe_flags(cfg: CorrectionConfig) -> str:
    """The flags that differ from their defaults, as ``name=value`` (for messages)."""
    default = CorrectionConfig().to_dict()
    return _items({k: v for k, v in cfg.to_dict().items() if v != default[k]}) or "defaults"


def needs_rollout_logprobs(cfg: CorrectionConfig) -> bool:
    """The flags read the sampler's logprobs (a correction, diagnostics, or pi_old := pi_rollout)."""
    return cfg.wants_metrics or cfg.old_logprob_source == "bypass"


def active_penalties(get: Callable[[str], Any]) -> dict[str, Any]:
    """The sampler penalties ``get(name)`` reports at a non-neutral value."""
    return {name: value for name in SAMPLER_PENALTIES if (value := get(name)) not in _NEUTRAL}


def head_modifiers(model_config: Any) -> dict[str, Any]:
    """The head modifiers a Hugging Face config (or its text config) sets at a non-neutral value."""
    if model_config is None:
        return {}
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    get = text.get if isinstance(text, Mapping) else (lambda k, d=None: getattr(text, k, d))
    return {name: value for name in HEAD_MODIFIERS if (value := get(name, None)) not in _NEUTRAL}


def refuse_unmatched_sampler(cfg: CorrectionConfig, sampler: SamplerSettings, *,
                             penalties: Mapping[str, Any] = {}, modifiers: Mapping[str, Any] = {},
                             trainer_temperature: Optional[float] = None) -> None:
    """Raise ``ValueError`` naming the setting when the trainer cannot reproduce vLLM's processed logprobs.

    Only when the flags read the sampler's logprobs: a trainer temperature other than the sampler's,
    sampler penalties (when the flags change the loss; diagnostics alone may measure them), and a
    truncating sampler over a scaled or soft-capped head. And :func:`refuse_replay`.
    """
    refuse_replay(cfg, sampler)
    if not needs_rollout_logprobs(cfg):
        return
    if trainer_temperature is not None and float(trainer_temperature) != sampler.temperature:
        raise ValueError(f"the sampler's temperature={sampler.temperature} but the trainer's log-probs use "
                         f"temperature={trainer_temperature}: r_corr would compare two temperatures")
    if penalties and cfg.changes_loss:
        raise ValueError(f"{_items(penalties)}: vLLM's processed logprobs include sampler penalties no trainer "
                         "log-prob reproduces, so r_corr would correct them as mismatch (metrics alone may measure it)")
    if sampler.truncates and modifiers:
        raise ValueError(f"top_k={sampler.top_k}, top_p={sampler.top_p}, min_p={sampler.min_p} with a head that has "
                         f"{_items(modifiers)}: the sampler-aware r_corr renormalises a plain linear head's logits, "
                         "not scaled or soft-capped ones")


def refuse_engine_side_flags(cfg: CorrectionConfig, where: str) -> None:
    """For an adapter that reaches only the loss (``where`` says which, e.g. NeMo RL's loss function): the
    weight-sync check and routing replay need a hook on the framework's sync or its routers, so a set flag
    is refused by name instead of being dropped."""
    for flag in ENGINE_SIDE_FLAGS:
        if getattr(cfg, flag):
            raise ValueError(f"{flag}={getattr(cfg, flag)!r}: {where} has no hook on the weight sync or the model's "
                             "routers, where this flag acts (TRL and verl have them: docs/moe.md)")


def refuse_replay(cfg: CorrectionConfig, sampler: SamplerSettings) -> None:
    """``rollout_sampling_replay`` needs what vLLM needs to return kept sets (``vllm/v1/engine/input_processor.py``)."""
    if not cfg.rollout_sampling_replay:
        return
    if not needs_rollout_logprobs(cfg):
        raise ValueError(f"rollout_sampling_replay=True with {describe_flags(cfg)}: nothing reads the sampler's "
                         "logprobs, so no pi_old is renormalised over its kept sets")
    if sampler.temperature < 1e-5:
        raise ValueError("rollout_sampling_replay=True with greedy sampling (temperature 0): vLLM replays only "
                         "temperature > 0, and greedy has no kept set to replay")
    if sampler.top_k is None:
        raise ValueError(f"rollout_sampling_replay=True with top_k={sampler.top_k}: vLLM returns kept sets only for "
                         "requests with top_k > 0, which bounds each set's size; set a top_k of at most 2,048 (vLLM's "
                         "compact width; a larger one, the vocabulary size included, can send the whole vocabulary "
                         "back per token: docs/fp32_and_sampler_replay.md, 'Sampling replay')")
