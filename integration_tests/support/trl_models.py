"""Tiny local models for the TRL tests that the shared builder does not make: a Qwen2-MoE.

TRL turns its MoE router loss on by itself for every model whose config carries
``router_aux_loss_coef`` (``GRPOTrainer.__init__``: ``aux_loss_enabled``), so a MoE model is
the only honest way to check that the adapter leaves that term to TRL. Built from the same
local tokenizer as ``rollout_parity.testing.tiny_model`` (no download), saved once under the
tiny-model cache with a content key.
"""

from __future__ import annotations

import json
from pathlib import Path

from rollout_parity.testing.tiny_model import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    build_tiny_tokenizer,
    default_cache_dir,
)

__all__ = ["build_tiny_moe_model"]

_KEY = "qwen2moe-v1"


def build_tiny_moe_model(dtype: str = "float32") -> str:
    """A 2-layer Qwen2-MoE (4 experts, top-2, router_aux_loss_coef=0.01); returns its path."""
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    out = default_cache_dir() / f"{_KEY}-{dtype}"
    key_file = out / "rollout_parity_tiny_model.json"
    if key_file.is_file() and json.loads(key_file.read_text()).get("key") == _KEY:
        return str(out)
    tokenizer = build_tiny_tokenizer(512)
    config = Qwen2MoeConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, decoder_sparse_step=1,
        router_aux_loss_coef=0.01, tie_word_embeddings=False, rms_norm_eps=1e-6,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN), bos_token_id=None,
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    )
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(config)
    with torch.no_grad():  # logits with std ~2, as the dense tiny model, so sampling is neither flat nor greedy
        model.get_output_embeddings().weight.normal_(0.0, 2.0 / 128**0.5)
    model = model.to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(Path(out))
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    key_file.write_text(json.dumps({"key": _KEY}))
    return str(out)
