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

__all__ = [
    "build_tiny_model", "build_trained_tiny_model", "build_tiny_tokenizer", "chat_corpus", "CHAT_TEMPLATE",
    "SYSTEM_PROMPT", "TOPICS", "story", "read_and_answer", "default_cache_dir", "pretrain",
]

_FORMAT_VERSION = 1  # bump when the build changes, so old cache entries are not reused
_CORPUS_VERSION = 1  # bump when chat_corpus() changes (part of the trained model's key)
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


def build_tiny_tokenizer(vocab_size: int = 512, corpus: list[str] | None = None):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML specials and a chat template.

    ``corpus``: the lines the BPE merges are learnt from (default: the built-in word salad).
    """
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
    tok.train_from_iterator(corpus if corpus is not None else _corpus(), trainer=trainer)
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


def _check_dims(arch: str, hidden_size: int, num_heads: int, num_kv_heads: int, dtype: str) -> None:
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


def _is_cached(out: Path, key: str) -> bool:
    key_file = out / _KEY_FILE
    if key_file.is_file():
        try:
            return json.loads(key_file.read_text()).get("key") == key
        except (OSError, ValueError):
            return False
    return False


def _new_model(tokenizer: Any, arch: str, seed: int, *, hidden_size: int, num_layers: int, num_heads: int,
               num_kv_heads: int, intermediate_size: int, max_position_embeddings: int,
               tie_word_embeddings: bool) -> Any:
    """A freshly constructed (transformers-initialised) Qwen2 or Llama for ``tokenizer``."""
    import torch

    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN), bos_token_id=None, rms_norm_eps=1e-6,
    )
    if arch == "qwen2":
        from transformers import Qwen2Config as Config, Qwen2ForCausalLM as Model
    else:
        from transformers import LlamaConfig as Config, LlamaForCausalLM as Model
        common["head_dim"] = hidden_size // num_heads
    torch.manual_seed(seed)
    model = Model(Config(**common))
    model.eval()
    return model


def _save(model: Any, tokenizer: Any, out: Path, key: str, params: dict[str, Any], dtype: str,
          extra: dict[str, Any] | None = None) -> str:
    import torch

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
    (out / _KEY_FILE).write_text(json.dumps({"key": key, "params": params, **(extra or {})}, sort_keys=True))
    return str(out)


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
    _check_dims(arch, hidden_size, num_heads, num_kv_heads, dtype)
    params = dict(
        arch=arch, seed=seed, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, logit_std=logit_std, block_std=block_std,
        tie_word_embeddings=tie_word_embeddings, dtype=dtype,
    )
    key = _content_key(params)
    out = Path(path) if path is not None else default_cache_dir() / f"{arch}-{key}"
    if _is_cached(out, key):
        return str(out)

    tokenizer = build_tiny_tokenizer(vocab_size)
    model = _new_model(tokenizer, arch, seed, hidden_size=hidden_size, num_layers=num_layers,
                       num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                       max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings)
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
    return _save(model, tokenizer, out, key, params, dtype)


# ----------------------------------------------------------------------------- trained model

#: The system prompt of the chat corpus (and of the doctor's prompts).
SYSTEM_PROMPT = (
    "You are a careful assistant for short questions about numbers, words and small stories. "
    "Think step by step before you answer, and check every number twice. Answer with one or two "
    "short sentences and prefer small, plain words. Never guess: if a value is missing from the "
    "question, say that it is missing. When the user gives you a story to read, answer only from "
    "the story. When the user asks for a sum, write the two numbers, the word plus, and the "
    "result. When the user asks what a thing is, give its meaning in a few words. Keep every "
    "answer under thirty words, do not repeat the question, and end with the result."
)
#: Topics of the chat corpus, each with the one definition the model learns for it.
TOPICS = {
    "river": "water that runs down to the sea", "stone": "a small hard piece of rock",
    "city": "a large town where many people live", "model": "a small copy of a real thing",
    "reward": "a gift for a good act", "token": "a small piece of text",
    "cache": "a place to keep things for later", "engine": "a machine that makes a thing move",
    "house": "a building where people live", "road": "a long hard way for cars",
    "tree": "a tall plant with a trunk of wood", "bird": "an animal with wings that can fly",
}
_ADJECTIVES = "small large fast slow red green blue old new quiet warm cold".split()
_VERBS = "sees finds makes moves keeps takes follows helps".split()


def story(rng: Any, sentences: int, names: list[str] | None = None) -> str:
    """``sentences`` templated sentences about the corpus topics (``names`` or all of them)."""
    names = names or list(TOPICS)
    return " ".join(
        f"The {rng.choice(_ADJECTIVES)} {rng.choice(names)} {rng.choice(_VERBS)} "
        f"the {rng.choice(_ADJECTIVES)} {rng.choice(names)}." for _ in range(sentences)
    )


def read_and_answer(context: str, a: int, b: int, topic: str) -> str:
    """The user turn of the long-context question (the doctor's prompts use it too)."""
    return f"Read this story: {context} Now, what is {a} plus {b}, and what is a {topic}?"


def _chat_turn(rng: Any) -> tuple[str, str]:
    """One user question and its answer: arithmetic, definitions, stories, or reading."""
    topic = rng.choice(list(TOPICS))
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    kind = rng.randrange(6)
    if kind == 0:
        return (f"What is {a} plus {b}, and what is a {topic}?",
                f"{a} plus {b} is {a + b}. A {topic} is {TOPICS[topic]}.")
    if kind == 1:
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}. The answer is {a + b}."
    if kind == 2:
        return f"What is a {topic}?", f"A {topic} is {TOPICS[topic]}."
    if kind == 3:
        return (read_and_answer(story(rng, rng.randint(3, 12)), a, b, topic),
                f"{a} plus {b} is {a + b}. A {topic} is {TOPICS[topic]}.")
    one, two = rng.sample(list(TOPICS), 2)
    return f"Tell me a short story about a {one} and a {two}.", story(rng, rng.randint(2, 4), [one, two])


def chat_corpus(n_conversations: int = 4000, seed: int = 0) -> list[str]:
    """Chat-templated conversations (ChatML), the training text of the trained tiny model.

    Most carry :data:`SYSTEM_PROMPT`; each has one or two user/assistant turns. The answers
    mix near-deterministic text (definitions, the chat format), harder tokens (sums) and
    free choices (stories), so the trained model's next-token distributions are peaked at
    most positions and broad at a few, like a trained LM's.
    """
    import random

    rng = random.Random(seed)
    texts = []
    for _ in range(n_conversations):
        parts = []
        if rng.random() < 0.7:
            parts.append(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n")
        for _ in range(rng.randint(1, 2)):
            question, answer = _chat_turn(rng)
            parts.append(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n")
        texts.append("".join(parts))
    return texts


def build_trained_tiny_model(
    path: str | os.PathLike | None = None,
    arch: str = "qwen2",
    seed: int = 0,
    *,
    steps: int = 250,
    batch_size: int = 6,
    seq_len: int = 384,
    lr: float = 3e-3,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    dtype: str = "bfloat16",
    threads: int = 1,
    log: Any = None,
) -> str:
    """Build (or reuse) a tiny chat LM trained briefly on :func:`chat_corpus`; return its path.

    A model with random weights has near-flat next-token distributions; a trained LM's are
    peaked (most positions nearly certain, a few open). This one is trained from scratch for
    ``steps`` AdamW steps (lr ``lr`` with warm-up and cosine decay, gradient clipping at 1) on
    ``batch_size`` random windows of ``seq_len`` tokens of the chat corpus, in float32, then
    saved in ``dtype``. The tokenizer's BPE is learnt on the same corpus. About a minute on
    CPU core; cached like :func:`build_tiny_model` (``<arch>-trained-<key>``), and the key file
    records the final training loss. ``threads``: torch threads while training, restored
    afterwards. One by default: on a CPU shared with other work, OpenMP threads stall at every
    barrier whenever a core is taken (two threads measured 10x slower than one here), and
    one thread keeps the result the same from machine to machine. ``log``: a callable
    receiving progress lines.
    """
    import torch

    arch = arch.lower()
    _check_dims(arch, hidden_size, num_heads, num_kv_heads, dtype)
    if steps < 1 or batch_size < 1 or seq_len < 2 or not lr > 0:
        raise ValueError(f"steps, batch_size >= 1, seq_len >= 2 and lr > 0 are required, got "
                         f"steps={steps}, batch_size={batch_size}, seq_len={seq_len}, lr={lr}")
    params = dict(
        kind="trained", corpus=_CORPUS_VERSION, arch=arch, seed=seed, steps=steps, batch_size=batch_size,
        seq_len=seq_len, lr=lr, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, dtype=dtype,
    )
    key = _content_key(params)
    out = Path(path) if path is not None else default_cache_dir() / f"{arch}-trained-{key}"
    if _is_cached(out, key):
        return str(out)

    texts = chat_corpus(seed=seed)
    tokenizer = build_tiny_tokenizer(vocab_size, corpus=texts)
    ids = torch.tensor([t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"]])
    if ids.numel() <= seq_len + 1:
        raise ValueError(f"seq_len={seq_len} is longer than the corpus ({ids.numel()} tokens)")
    model = _new_model(tokenizer, arch, seed, hidden_size=hidden_size, num_layers=num_layers,
                       num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                       max_position_embeddings=max_position_embeddings, tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # seeded init, independent of transformers' own init order
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                p.zero_()
    def windows(step: int) -> dict:
        starts = torch.randint(0, ids.numel() - seq_len - 1, (batch_size,), generator=gen).tolist()
        batch = torch.stack([ids[i : i + seq_len] for i in starts])
        return {"input_ids": batch, "labels": batch}

    losses = pretrain(model.float(), windows, steps=steps, lr=lr, threads=threads, log=log, label="tiny model")
    final = sum(losses[-20:]) / len(losses[-20:])
    return _save(model, tokenizer, out, key, params, dtype, extra={"final_loss": final})


def pretrain(model: Any, batch_for_step: Any, *, steps: int, lr: float, threads: int = 1, log: Any = None,
             log_every: int = 50, label: str = "pre-training") -> list[float]:
    """Train ``model`` from ``batch_for_step(step)`` (keyword arguments of its forward, labels
    included); return the per-step losses and leave the model in eval mode.

    The recipe both locally pre-trained models use (the doctor's chat model, the TIM task's
    model): AdamW (betas 0.9/0.98, no weight decay), linear warm-up over the first tenth of the
    steps then cosine decay, gradient clipping at 1, ``threads`` torch threads while training
    (restored afterwards; see :func:`build_trained_tiny_model` for why one). ``log`` receives a
    line every ``log_every`` steps with the mean loss of the last 20.
    """
    import torch

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1.0 + math.cos(math.pi * s / steps)))
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    losses: list[float] = []
    try:
        for step in range(steps):
            loss = model(**batch_for_step(step)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            losses.append(loss.item())
            if log is not None and (step + 1) % log_every == 0:
                recent = losses[-20:]
                log(f"{label}: step {step + 1}/{steps}, loss {sum(recent) / len(recent):.3f}")
    finally:
        torch.set_num_threads(old_threads)
    model.eval()
    return losses
