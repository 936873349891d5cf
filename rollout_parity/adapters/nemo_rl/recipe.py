"""The vLLM parity recipe placed where NeMo RL reads it (``policy.generation``), and the check of
``vllm_kwargs`` against the keywords NeMo RL passes to ``vllm.LLM`` itself. docs/nemo_rl_vllm.md,
"The vLLM recipe", says why each key sits where it does.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from rollout_parity.adapters.nemo_rl.versions import NEMO_RL_VERSION

__all__ = ["NEMO_RL_FIXED_LLM_KWARGS", "NEMO_RL_FP32_HEAD_REFUSAL", "nemo_rl_generation_config",
           "check_nemo_rl_vllm_kwargs"]

#: Why ``fp32_lm_head`` is refused on NeMo RL (docs/nemo_rl_vllm.md, "The fp32 head").
NEMO_RL_FP32_HEAD_REFUSAL = (
    "fp32_lm_head=True cannot be served on NeMo RL: its trainer computes pi_old and pi_theta with the head in "
    "policy.precision (bf16 in its recipes), and NeMo RL has no setting that changes that for a causal LM. The "
    "DTensor policy worker runs the model under torch.autocast(dtype=policy.precision) and FSDP2's "
    "MixedPrecisionPolicy(param_dtype=policy.precision) (models/policy/workers/dtensor_policy_worker.py, "
    "models/dtensor/parallelize.py), the v2 worker under that policy (models/automodel/setup.py; Automodel's "
    "dtensor_cfg.moe_parallelizer.lm_head_precision covers its own MoE models only), and rollout-parity's code "
    "reaches no policy worker before its first pi_old pass. vLLM's side alone (hf_overrides head_dtype) would "
    "move pi_rollout away from that pi_old: leave "
    "fp32_lm_head off on NeMo RL")

# What NeMo RL v0.7's vllm_worker.py passes to vllm.LLM itself: the same key in vllm_kwargs
# is a duplicate keyword (TypeError). Main passes the same minus logprobs_mode.
NEMO_RL_FIXED_LLM_KWARGS = (
    "model", "served_model_name", "load_format", "skip_tokenizer_init", "tensor_parallel_size",
    "pipeline_parallel_size", "enable_expert_parallel", "gpu_memory_utilization",
    "enable_prefix_caching", "dtype", "seed", "enforce_eager", "max_model_len",
    "trust_remote_code", "worker_extension_cls", "enable_sleep_mode", "disable_log_stats",
    "logprobs_mode",
)


def nemo_rl_generation_config(fp32_lm_head: bool = False, prefix_cache_policy: str = "off",
                              precision: Optional[str] = None, **vllm_kwargs: Any) -> dict:
    """The vLLM parity recipe placed where NeMo RL reads it (v0.7.0 and main).

    Returns ``{"policy": {"generation": {"vllm_cfg": {...}, "vllm_kwargs": {...}},
    "hf_config_overrides": {...}}}`` to merge into a NeMo RL config. NeMo RL's
    ``vllm_worker.py`` passes ``enable_prefix_caching=<vllm_cfg.enable_prefix_caching>`` (and,
    at v0.7, ``logprobs_mode="processed_logprobs"``) to ``vllm.LLM`` itself, so the same keys
    inside ``vllm_kwargs`` would be duplicate keywords (a TypeError at engine start). Main no
    longer fixes ``logprobs_mode``: it passes ``vllm_cfg.logprobs_mode`` when set and leaves
    vLLM's default (raw logprobs) otherwise. So ``logprobs_mode`` and prefix caching go to
    ``vllm_cfg`` (v0.7 ignores ``vllm_cfg.logprobs_mode`` and fixes the same value);
    ``hf_overrides`` go to ``policy.hf_config_overrides`` (``grpo.py`` overwrites
    ``vllm_kwargs["hf_overrides"]`` with it); everything else (``async_scheduling``) is
    ``policy.generation.vllm_kwargs``. ``fp32_lm_head=True`` raises ``ValueError``
    (:data:`NEMO_RL_FP32_HEAD_REFUSAL`): NeMo RL's trainer head stays bf16.

    ``precision`` (the ``precision`` flag) adds ``policy.precision`` and ``policy.generation.vllm_cfg.precision``,
    both in NeMo RL's spelling (``float16``): NeMo RL passes ``vllm_cfg.precision`` to ``vllm.LLM`` as ``dtype``
    itself, so the recipe's ``dtype`` goes there, never into ``vllm_kwargs``. With the flag in the recipe's
    ``loss_fn.rollout_correction`` the hook writes the same two keys at ``grpo.setup()`` (``precision.py``).
    """
    from rollout_parity.engines.vllm.recipe import vllm_parity_kwargs

    if fp32_lm_head:
        raise ValueError(NEMO_RL_FP32_HEAD_REFUSAL)
    recipe = dict(vllm_parity_kwargs(fp32_lm_head=fp32_lm_head, prefix_cache_policy=prefix_cache_policy,
                                     precision=precision, **vllm_kwargs))
    logprobs_mode = recipe.pop("logprobs_mode", "processed_logprobs")
    if logprobs_mode != "processed_logprobs":
        raise ValueError(f"logprobs_mode={logprobs_mode!r}: NeMo RL {NEMO_RL_VERSION} always "
                         "uses processed_logprobs")
    vllm_cfg = {"enable_prefix_caching": bool(recipe.pop("enable_prefix_caching")),
                "logprobs_mode": logprobs_mode}
    dtype = recipe.pop("dtype") if precision is not None else None  # a bare dtype kwarg: refused below
    if dtype is not None:
        vllm_cfg["precision"] = dtype
    hf_overrides = dict(recipe.pop("hf_overrides", None) or {})
    check_nemo_rl_vllm_kwargs(recipe)
    policy: dict[str, Any] = {"generation": {"vllm_cfg": vllm_cfg, "vllm_kwargs": recipe}}
    if dtype is not None:
        policy["precision"] = dtype
    if hf_overrides:
        policy["hf_config_overrides"] = hf_overrides
    return {"policy": policy}


def check_nemo_rl_vllm_kwargs(vllm_kwargs: Mapping[str, Any]) -> None:
    """Refuse ``policy.generation.vllm_kwargs`` keys NeMo RL already passes to vLLM itself."""
    clash = sorted(set(vllm_kwargs) & set(NEMO_RL_FIXED_LLM_KWARGS))
    if clash:
        raise ValueError(
            f"policy.generation.vllm_kwargs has {clash}, which NeMo RL {NEMO_RL_VERSION} passes to "
            "vllm.LLM itself (a duplicate keyword at engine start); set enable_prefix_caching "
            "and logprobs_mode in policy.generation.vllm_cfg")
