"""The trainer side of NeMo RL v0.7's loss contract, as a test double.

From v0.7: ``models/automodel/data.py`` / ``policy/workers/dtensor_policy_worker.py``
(global counts), ``algorithms/loss/wrapper.py`` (the keyword call), ``algorithms/grpo.py``
(metric aggregation; ``grpo_train`` reads ``metrics["token_mult_prob_error"]``), and
``models/generation/vllm/vllm_worker.py`` + ``algorithms/grpo.py`` (vLLM kwargs).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType
from nemo_rl.distributed.batched_data_dict import BatchedDataDict


def global_counts(data: BatchedDataDict) -> tuple[torch.Tensor, torch.Tensor]:
    """(global_valid_seqs, global_valid_toks) for one global batch (one DP rank here)."""
    seqs = torch.sum(data["sample_mask"])
    toks = torch.sum(data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1))
    return seqs, toks


def train_step(loss_fn: Any, data: BatchedDataDict, next_token_logprobs: torch.Tensor,
               microbatch_size: int) -> tuple[torch.Tensor, dict]:
    """Microbatched loss as the policy worker runs it: sum of per-microbatch losses, each
    normalised by the global counts; metrics aggregated as grpo.py does."""
    assert loss_fn.input_type == LossInputType.LOGPROB, "a LOGPROB loss receives next_token_logprobs"
    assert isinstance(loss_fn.loss_type, LossType)
    gvs, gvt = global_counts(data)
    if loss_fn.loss_type == LossType.TOKEN_LEVEL:
        assert "token_mask" in data
    total = None
    gathered: dict[str, list] = {}
    for start in range(0, data.size, microbatch_size):
        mb = data.slice(start, start + microbatch_size)
        loss, metrics = loss_fn(data=mb, global_valid_seqs=gvs, global_valid_toks=gvt,
                                next_token_logprobs=next_token_logprobs[start:start + microbatch_size])
        assert loss.dim() == 0
        total = loss if total is None else total + loss
        for k, v in metrics.items():
            gathered.setdefault(k, []).append(v)
    return total, aggregate_metrics(gathered)


def aggregate_metrics(gathered: dict[str, list]) -> dict[str, float]:
    out = {}
    for k, v in gathered.items():
        if k in {"probs_ratio_min", "probs_ratio_clamped_min"}:
            out[k] = float(np.min(v))
        elif k in {"probs_ratio_max", "probs_ratio_clamped_max"}:
            out[k] = float(np.max(v))
        elif k in {"lr", "wd", "global_valid_seqs", "global_valid_toks"}:
            out[k] = float(np.mean(v))
        else:
            out[k] = float(np.sum(v))
    out["token_mult_prob_error"]  # grpo_train reads this key: a KeyError breaks training
    return out


# vllm_worker.py builds the engine kwargs with these passed explicitly, then **vllm_kwargs.
def llm_kwargs(generation: dict, policy: dict) -> dict:
    """The ``vllm.LLM(**kwargs)`` NeMo RL v0.7 would build from ``policy.generation``."""
    vllm_kwargs = dict(generation.get("vllm_kwargs") or {})
    vllm_kwargs["hf_overrides"] = dict(policy.get("hf_config_overrides") or {})  # grpo.py
    vllm_cfg = generation.get("vllm_cfg") or {}
    enable_prefix_caching = vllm_cfg.get("enable_prefix_caching")
    if enable_prefix_caching is None:
        enable_prefix_caching = True  # v0.7: on for compute capability >= 8 (any recent GPU)
    return dict(
        model="model", served_model_name="model", load_format="auto", skip_tokenizer_init=False,
        tensor_parallel_size=1, pipeline_parallel_size=1, enable_expert_parallel=False,
        gpu_memory_utilization=vllm_cfg.get("gpu_memory_utilization", 0.6),
        enable_prefix_caching=enable_prefix_caching, dtype="bfloat16", seed=0,
        enforce_eager=False, max_model_len=1024, trust_remote_code=True,
        worker_extension_cls="VllmInternalWorkerExtension", enable_sleep_mode=True,
        disable_log_stats=False, logprobs_mode="processed_logprobs",
        **vllm_kwargs,
    )
