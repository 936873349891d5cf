"""A tiny Mixture-of-Experts causal LM built locally (Qwen3-MoE or Qwen2-MoE), for the MoE tests.

Same conventions as :func:`rollout_parity.testing.tiny_model.build_tiny_model`: the local BPE
tokenizer (no download), every parameter re-drawn from a seeded generator, embeddings and
blocks with std ``embed_std`` and ``block_std`` (HF's 0.02: every block, the experts included,
moves the normalised residual stream, so scrambled experts show in the logits), and an untied
head with std ``logit_std / sqrt(hidden)`` so that logits have std ~``logit_std`` (a peaked head:
a MoE with a flat head hides an expert mix-up, issue 26). The router is drawn with std ``router_std / sqrt(hidden)``, so router logits
have std ~``router_std`` and routing is decided by margins of that size, not by noise.
``head_dim`` is 32 (vLLM's CPU backend needs >= 32). transformers 5 keeps the experts fused
(``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``); ``save_pretrained`` writes the
per-expert checkpoint layout. Cached under a content key like the dense model.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from rollout_parity.testing.tiny_model import _content_key, _is_cached, _save, build_tiny_tokenizer, \
    default_cache_dir, EOS_TOKEN, PAD_TOKEN

__all__ = ["build_tiny_moe_model"]

_ARCHS = ("qwen3_moe", "qwen2_moe")


def build_tiny_moe_model(
    path: str | os.PathLike | None = None,
    arch: str = "qwen3_moe",
    seed: int = 0,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_experts: int = 4,
    experts_per_token: int = 2,
    moe_intermediate_size: int = 64,
    norm_topk_prob: bool = True,
    vocab_size: int = 512,
    logit_std: float = 2.0,
    block_std: float = 0.02,
    embed_std: float = 0.02,
    router_std: float = 1.0,
    router_aux_loss_coef: float = 0.01,
    dtype: str = "float32",
) -> str:
    """Build (or reuse) a tiny MoE causal LM plus tokenizer in ``path``; return the path as str.

    Qwen3-MoE by default (4 experts, 2 per token, ``norm_topk_prob``); ``arch="qwen2_moe"`` adds
    Qwen2-MoE's shared expert. ``path=None``: ``$ROLLOUT_PARITY_CACHE/tiny-models/<arch>-<key>``.
    """
    import torch

    if arch not in _ARCHS:
        raise ValueError(f"arch must be one of {_ARCHS}, got {arch!r}")
    if hidden_size % num_heads or hidden_size // num_heads < 32:
        raise ValueError(f"head_dim = hidden_size/num_heads must be an integer >= 32 (vLLM CPU), got "
                         f"{hidden_size}/{num_heads}")
    params = dict(kind="moe", arch=arch, seed=seed, hidden_size=hidden_size, num_layers=num_layers,
                  num_heads=num_heads, num_kv_heads=num_kv_heads, num_experts=num_experts,
                  experts_per_token=experts_per_token, moe_intermediate_size=moe_intermediate_size,
                  norm_topk_prob=norm_topk_prob, vocab_size=vocab_size, logit_std=logit_std, block_std=block_std,
                  embed_std=embed_std, router_std=router_std, router_aux_loss_coef=router_aux_loss_coef, dtype=dtype)
    key = _content_key(params)
    out = Path(path) if path is not None else default_cache_dir() / f"{arch}-{key}"
    if _is_cached(out, key):
        return str(out)

    tokenizer = build_tiny_tokenizer(vocab_size)
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * moe_intermediate_size,
        moe_intermediate_size=moe_intermediate_size, num_experts=num_experts, num_experts_per_tok=experts_per_token,
        norm_topk_prob=norm_topk_prob, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=1024, decoder_sparse_step=1,
        router_aux_loss_coef=router_aux_loss_coef, tie_word_embeddings=False, rms_norm_eps=1e-6,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN), bos_token_id=None,
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    )
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig as Config, Qwen3MoeForCausalLM as Model

        common["head_dim"] = hidden_size // num_heads
    else:
        from transformers import Qwen2MoeConfig as Config, Qwen2MoeForCausalLM as Model

        common["shared_expert_intermediate_size"] = moe_intermediate_size
    torch.manual_seed(seed)
    model = Model(Config(**common)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
            elif p is head:
                p.copy_(torch.randn(p.shape, generator=gen) * (logit_std / math.sqrt(hidden_size)))
            elif p is emb:
                p.copy_(torch.randn(p.shape, generator=gen) * embed_std)
            elif name.endswith("mlp.gate.weight"):  # the router (E, H)
                p.copy_(torch.randn(p.shape, generator=gen) * (router_std / math.sqrt(hidden_size)))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * block_std)
            else:  # biases
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return _save(model, tokenizer, out, key, params, dtype)
