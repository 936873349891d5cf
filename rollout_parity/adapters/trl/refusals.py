"""What the flags cannot mean in a TRL run, refused by name before anything is built or patched.

:func:`refuse` reads TRL's own field names from either the ``GRPOConfig`` (``ParityGRPOTrainer``
checks it before ``GRPOTrainer.__init__`` builds the model and the vLLM engine) or a built trainer
(``apply`` on a plain ``GRPOTrainer``); the framework-independent rules are ``adapters/_refusals.py``.
docs/trl_refusals.md, "Refused, by name".
"""

from __future__ import annotations

from typing import Any, Optional

from trl import GRPOConfig

from rollout_parity.adapters._refusals import active_penalties, describe_flags, head_modifiers, \
    needs_rollout_logprobs, refuse_unmatched_sampler
from rollout_parity.adapters.trl.routing import refuse_routing_replay
from rollout_parity.core.config import CorrectionConfig
from rollout_parity.core.sampler import SamplerSettings
from rollout_parity.engines.vllm.refusals import refuse_missing_vllm_features, refuse_out_of_process_cpu_worker

__all__ = ["MissingRolloutLogprobsError", "TRL_RATIO_FIELDS", "trl_ratio_as_flags", "sampling_settings",
           "refuse_without_vllm", "refuse", "refuse_trainer"]

#: TRL's own importance-sampling settings (``GRPOConfig``), which our weights replace in the same channel.
TRL_RATIO_FIELDS = ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
                    "vllm_importance_sampling_clip_min")


def trl_ratio_as_flags(mode: str, clip_max: Optional[float], clip_min: Optional[float]) -> dict[str, Any]:
    """The shared flags that give TRL's own ratio (``vllm_importance_sampling_mode`` / ``_clip_max`` / ``_clip_min``):
    its weights and masks (docs/trl_own_correction.md, "TRL's own correction, as our flags"). ``clip_max=None`` is
    an upper bound of null (none)."""
    flags: dict[str, Any] = {"rollout_importance_sampling_mode": mode,
                             "rollout_importance_sampling_threshold": clip_max,
                             "rollout_importance_sampling_threshold_lower": clip_min}
    if mode.startswith("sequence"):  # TRL: exp of the sum of token log-ratios; masked sequences keep rho_seq
        flags["rollout_importance_sampling_sequence_reduction"] = "product"
        if mode == "sequence_mask":
            flags["rollout_importance_sampling_sequence_mask_weight"] = "sequence"
    return flags


class MissingRolloutLogprobsError(ValueError):
    """A correction is configured but the trainer has no sampler logprobs to correct against."""


def sampling_settings(source: Any, fallback_kwargs: Any = None) -> tuple[SamplerSettings, dict[str, Any]]:
    """vLLM's sampler where TRL takes it (``generation_kwargs`` over the fields), and its active penalties.

    ``source`` is TRL's ``vllm_generation`` (a built trainer) or the ``GRPOConfig``: both carry
    ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty`` and ``generation_kwargs``.
    """
    kwargs = dict(getattr(source, "generation_kwargs", None) or fallback_kwargs or {})

    def get(name: str, default: Any = None) -> Any:
        value = kwargs.get(name, getattr(source, name, None))
        return default if value is None else value

    settings = SamplerSettings(temperature=get("temperature", 1.0), top_k=get("top_k"), top_p=get("top_p", 1.0),
                               min_p=get("min_p", 0.0))
    return settings, active_penalties(get)


def refuse_without_vllm(cfg: CorrectionConfig, use_vllm: bool) -> None:
    if needs_rollout_logprobs(cfg) and not use_vllm:
        raise MissingRolloutLogprobsError(
            f"{describe_flags(cfg)} needs the sampler's per-token logprobs, but use_vllm=False: TRL keeps them, "
            "recomputes pi_old and applies importance_sampling_ratio only when it generates with vLLM")


def refuse(cfg: CorrectionConfig, flags: Any, sampling: Any, *, model_config: Any,
           off_policy_mask_threshold: Optional[float]) -> SamplerSettings:
    """Raise ``ValueError`` naming the option for what cannot be expressed; return the sampler settings.

    ``flags`` carries TRL's own fields (``use_vllm``, ``loss_type``, ``temperature``, the IS fields);
    ``sampling`` its sampler (see :func:`sampling_settings`); ``off_policy_mask_threshold`` is the
    user's own TRL value (not the one ``apply`` may have set from our flag).
    """
    refuse_without_vllm(cfg, flags.use_vllm)
    refuse_routing_replay(cfg, flags, model_config)
    own_ratio = {k: getattr(flags, k) for k in TRL_RATIO_FIELDS
                 if getattr(flags, k) != GRPOConfig.__dataclass_fields__[k].default}
    if flags.loss_type == "vespo" and own_ratio.get("vllm_importance_sampling_mode") in ("token_truncate", "token_mask"):
        del own_ratio["vllm_importance_sampling_mode"]  # TRL's constructor demands a token mode for vespo
    if cfg.changes_loss and own_ratio:
        same = trl_ratio_as_flags(*(getattr(flags, k) for k in TRL_RATIO_FIELDS))
        raise ValueError(f"{', '.join(f'{k}={v!r}' for k, v in own_ratio.items())} configures TRL's own importance "
                         f"sampling, which rollout-parity's correction ({describe_flags(cfg)}) replaces in the same "
                         "channel: set only one of the two (TRL's ratio as rollout-parity's flags: "
                         f"{', '.join(f'{k}={v!r}' for k, v in same.items())})")
    if cfg.off_policy_sequence_mask_delta is not None and off_policy_mask_threshold is not None:
        raise ValueError(f"off_policy_mask_threshold={off_policy_mask_threshold} and off_policy_sequence_mask_delta="
                         f"{cfg.off_policy_sequence_mask_delta}: the shared flag is handed to TRL as that threshold")
    if flags.loss_type == "vespo" and (cfg.rollout_importance_sampling_mode or "").startswith("sequence"):
        raise ValueError(f"rollout_importance_sampling_mode={cfg.rollout_importance_sampling_mode!r} with loss_type="
                         "'vespo': VESPO sums log(importance_sampling_ratio) over the tokens, so a sequence weight "
                         "would count once per token (TRL refuses sequence modes for vespo too)")
    if cfg.rollout_sampling_replay:
        mode = getattr(flags, "vllm_mode", None)
        if mode != "colocate":
            raise ValueError(f"rollout_sampling_replay=True with vllm_mode={mode!r}: trl vllm-serve returns no "
                             "sampling masks; replay needs the colocated engine (vllm_mode='colocate')")
        tp = getattr(flags, "vllm_tensor_parallel_size", None) or getattr(flags, "tensor_parallel_size", 1) or 1
        if int(tp) > 1:
            raise ValueError(f"rollout_sampling_replay=True with vllm_tensor_parallel_size={tp}: the kept sets are "
                             "matched to completions on one engine per rank (tensor parallel size 1)")
        if getattr(flags, "tools", None) or getattr(flags, "rollout_func", None):
            raise ValueError("rollout_sampling_replay=True with tools or a rollout_func: tool output interleaves "
                             "with the sampled tokens, so vLLM's per-token kept sets no longer line up")
    if flags.use_vllm and getattr(flags, "vllm_mode", None) == "colocate":
        refuse_missing_vllm_features(cfg)  # the colocated engine runs the vLLM installed here
        refuse_out_of_process_cpu_worker("TRL's colocated weight sync (VLLMGeneration.sync_weights)")
    settings, penalties = sampling_settings(sampling, getattr(flags, "generation_kwargs", None))
    refuse_unmatched_sampler(cfg, settings, penalties=penalties, trainer_temperature=flags.temperature,
                             modifiers=head_modifiers(model_config) if settings.truncates else {})
    return settings


def refuse_trainer(cfg: CorrectionConfig, trainer: Any, patches: Any = None) -> SamplerSettings:
    """:func:`refuse` on a built trainer: its own flags (as TRL set them, before ``patches``), its engine's
    sampler, its model's head."""
    name = "off_policy_mask_threshold"
    own = patches.previous(trainer, name) if patches is not None and patches.holds(trainer, name) \
        else getattr(trainer, name)
    return refuse(cfg, trainer, getattr(trainer, "vllm_generation", None) or trainer,
                  model_config=trainer.accelerator.unwrap_model(trainer.model).config, off_policy_mask_threshold=own)
