"""A tiny causal LM and tokenizer built locally, for tests, benchmarks and the doctor.

No download: the tokenizer is a byte-level BPE trained with ``tokenizers`` on a built-in
corpus, the model is a randomly initialised Qwen2 (or Llama) saved with ``save_pretrained``.
The result is deterministic for a given set of arguments and cached under a content key,
so a second call with the same arguments returns at once.

vLLM's CPU backend needs ``head_dim >= 32``; the defaults (hidden 128, 4 heads) give 32.
Random weights with the usual 0.02 init give near-flat logits; the lm_head is re-drawn with
std ``logit_std / sqrt(hidden)`` so that logits have std about ``logit_std`` and sampled
distributions are neither flat nor one-hot (entropy ~3 nats at T=0.7).

Block matrices get std ``block_std`` (default 0.005) against unit-scale embeddings, so the
attention/MLP blocks perturb the residual stream without dominating it. This sets how much
of the vLLM-vs-transformers mismatch comes from the body's bf16 kernels rather than the head:
with the default, vLLM (fp32 head) against a bf16 trainer head gives mean |delta| ~8e-3 at
T=0.7 and fp32 on both sides ~1.3e-3 (the body's share); with ``block_std=0.02`` the body's
share grows to ~5e-3. Real models sit anywhere on that scale; the doctor measures yours.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["build_tiny_model", "build_tiny_tokenizer", "CHAT_TEMPLATE", "default_cache_dir"]

_FORMAT_VERSION = 1  # bump when the build changes, so old cache entries are not reused
_KEY_FILE = "rollout_parity_tiny_model.json"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# A ChatML template (the Qwen2 format) without a default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a an one two three four five six seven eight nine ten model policy reward token "
    "train infer sample value gradient update weight cache prefix engine batch sequence "
    "question answer what is how many plus minus times equals number because so then "
    "red green blue cat dog bird tree river stone house road city small large fast slow "
    "think step first next last result check correct wrong yes no please thanks hello world"
).split()


def default_cache_dir() -> Path:
    root = os.environ.get("ROLLOUT_PARITY_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "rollout-parity"
    )
    return Path(root) / "tiny-models"


def _corpus(n_lines: int = 3000) -> list[str]:
    """A deterministic corpus: word salad, arithmetic and chat-formatted turns."""
    import random

    rng = random.Random(1234)
    lines = []
    for i in range(n_lines):
        kind = i % 3
        if kind == 0:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 16))) + ".")
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            lines.append(f"What is {a} plus {b}? {a} + {b} = {a + b}. The answer is {a + b}.")
        else:
            q = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 8)))
            r = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
            lines.append(f"<|im_start|>user\n{q}?<|im_end|>\n<|im_start|>assistant\n{r}.<|im_end|>\n")
    return lines


def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML specials and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level BPE (need > 259)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _content_key(params: dict[str, Any]) -> str:
    blob = json.dumps({"v": _FORMAT_VERSION, **params}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_tiny_model(
    path: str | os.PathLike | None = None,
    arch: str = "qwen2",
    seed: int = 0,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    logit_std: float = 2.0,
    block_std: float = 0.005,
    tie_word_embeddings: bool = False,
    dtype: str = "bfloat16",
) -> str:
    """Build (or reuse) a tiny causal LM plus tokenizer in ``path``; return the path as str.

    ``path=None`` puts it under ``$ROLLOUT_PARITY_CACHE/tiny-models/<arch>-<key>`` (default
    ``~/.cache/rollout-parity``). An existing directory whose key file matches is reused;
    one with a different key is rebuilt in place.
    """
    import torch

    arch = arch.lower()
    if arch not in ("qwen2", "llama"):
        raise ValueError(f"arch must be 'qwen2' or 'llama', got {arch!r}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    head_dim = hidden_size // num_heads
    if head_dim < 32:
        raise ValueError(f"head_dim={head_dim} (hidden_size/num_heads): vLLM's CPU backend needs >= 32")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")

    params = dict(
        arch=arch, seed=seed, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, logit_std=logit_std, block_std=block_std,
        tie_word_embeddings=tie_word_embeddings, dtype=dtype,
    )
    key = _content_key(params)
    out = Path(path) if path is not None else default_cache_dir() / f"{arch}-{key}"
    key_file = out / _KEY_FILE
    if key_file.is_file():
        try:
            if json.loads(key_file.read_text()).get("key") == key:
                return str(out)
        except (OSError, ValueError):
            pass

    tokenizer = build_tiny_tokenizer(vocab_size)
    n_vocab = len(tokenizer)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    common = dict(
        vocab_size=n_vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, eos_token_id=eos_id, pad_token_id=pad_id,
        bos_token_id=None, rms_norm_eps=1e-6,
    )
    if arch == "qwen2":
        from transformers import Qwen2Config as Config, Qwen2ForCausalLM as Model
    else:
        from transformers import LlamaConfig as Config, LlamaForCausalLM as Model
        common["head_dim"] = head_dim
    config = Config(**common)

    torch.manual_seed(seed)
    model = Model(config)
    model.eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # Re-draw every parameter from a seeded generator (independent of transformers' init
        # order). Block matrices get std block_std (HF's initializer_range), embeddings
        # unit scale, and the head std logit_std/sqrt(hidden) so logits have std ~ logit_std.
        head = model.get_output_embeddings().weight
        emb = model.get_input_embeddings().weight
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
            elif p is head or p is emb:
                continue
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * block_std)
            else:  # biases (Qwen2 q/k/v)
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        head_std = logit_std / math.sqrt(hidden_size)
        emb.copy_(torch.randn(emb.shape, generator=gen) * (head_std if tie_word_embeddings else 1.0))
        if not tie_word_embeddings:
            head.copy_(torch.randn(head.shape, generator=gen) * head_std)
    model = model.to(getattr(torch, dtype))
    if hasattr(model.config, "dtype"):
        model.config.dtype = dtype
    else:  # transformers < 4.56 names it torch_dtype
        model.config.torch_dtype = dtype

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # Some loaders read only tokenizer_config.json's template, others chat_template.jinja.
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    key_file.write_text(json.dumps({"key": key, "params": params}, sort_keys=True))
    return str(out)
