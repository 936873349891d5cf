"""The task of ``tim_training.py`` and ``tim_truncated.py``: say the word the prompt names, N times.

A prompt names one of eight words (``Say blue.``, ``Please say river.``, ...). The answer is
N words (``answer_words``: 8 in ``tim_training.py``, 32 in ``tim_truncated.py``); the reward is the
fraction of the first N words of the completion that equal the named word (0, 1/N, ..., 1). The
words are single tokens of the local tokenizer (with their leading space), so an answer is N
tokens and the end-of-turn token.

The model is the repository's tiny Qwen2 (``build_tiny_model``: 2 layers, hidden 128, vocab 512,
built locally), pre-trained here for a few hundred AdamW steps on answers where each word is
the named one with probability ``BIAS`` and otherwise uniform over the eight: the pre-trained
policy reads the prompt (reward about 0.39 at the start) and GRPO has to raise that to 1.
It is cached under ``~/.cache/rollout-parity/tim-task/<key>`` as a bfloat16 checkpoint: vLLM
loads it in bf16 by default (the mismatch conditions) or upcast to float32 when asked (the parity
condition), and the trainer upcasts it to float32, so every condition starts from the same numbers.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path
from typing import Any

__all__ = ["WORDS", "BIAS", "ANSWER_WORDS", "build_task_model", "prompts", "train_dataset", "eval_prompts",
           "reward_say_word", "reward_function", "score_completion"]

WORDS = ("red", "green", "blue", "cat", "dog", "tree", "river", "stone")
BIAS = 0.3  # pre-training: each answer word is the named one with this probability, else uniform
ANSWER_WORDS = 8  # the first experiment's answer length (tim_training.py)
_PHRASINGS = ("Say {w}.", "Please say {w}.", "Repeat {w}.", "Only {w} now.", "Tell me {w}.", "Write {w}.")
_HELD_OUT = ("Just {w}, please.", "Give {w}.")  # phrasings never seen in training (evaluation only)
_VERSION = 1  # bump when the build changes


def _task_root() -> Path:
    import os

    root = os.environ.get("ROLLOUT_PARITY_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rollout-parity")
    return Path(root) / "tim-task"


def prompts(phrasings: tuple[str, ...] = _PHRASINGS) -> list[tuple[str, str]]:
    """Every (user text, named word) pair for ``phrasings``."""
    return [(p.format(w=w), w) for p in phrasings for w in WORDS]


def eval_prompts() -> list[tuple[str, str]]:
    """Held-out phrasings (never trained on), for the end-of-run evaluation."""
    return prompts(_HELD_OUT)


def train_dataset(n: int, seed: int):
    """A ``datasets.Dataset`` of ``n`` conversational prompts (TRL's format) with their ``target`` word."""
    from datasets import Dataset

    rng = random.Random(seed)
    pairs = prompts()
    picks = [rng.choice(pairs) for _ in range(n)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": text}] for text, _ in picks],
                              "target": [w for _, w in picks]})


def score_completion(text: str, target: str, answer_words: int = ANSWER_WORDS) -> float:
    """Fraction of the first ``answer_words`` words of ``text`` that are ``target`` (missing words score 0)."""
    words = re.findall(r"[a-z]+", text.lower())[:answer_words]
    return sum(w == target for w in words) / answer_words


def reward_function(answer_words: int = ANSWER_WORDS) -> Any:
    """A TRL reward function for answers of ``answer_words`` words (``target``: the dataset column)."""

    def reward_say_word(completions: list, target: list[str], **kwargs: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score_completion(t, w, answer_words) for t, w in zip(texts, target)]

    return reward_say_word


#: The first experiment's reward function (eight-word answers).
reward_say_word = reward_function(ANSWER_WORDS)


def _pretraining_text(tokenizer: Any, rng: random.Random, answer_words: int) -> str:
    text, word = rng.choice(prompts())
    answer = [word if rng.random() < BIAS else rng.choice(WORDS) for _ in range(answer_words)]
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}, {"role": "assistant", "content": " " + " ".join(answer)}],
        tokenize=False)


def build_task_model(steps: int = 800, batch_size: int = 32, lr: float = 3e-3, seed: int = 0,
                     log: Any = print, answer_words: int = ANSWER_WORDS) -> str:
    """Pre-train (or reuse) the task model for ``answer_words``-word answers; returns the path of its
    bfloat16 checkpoint.

    Loss on every token of the chat-templated pre-training text (prompt and answer), AdamW with
    warm-up and cosine decay. One torch thread: on a CPU shared with other jobs, OpenMP threads
    stall at every barrier while a core is taken. 30-80 s here; the result scores about 0.38 on
    the training phrasings and 0.34 on the held-out ones.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_parity.testing.tiny_model import build_tiny_model, pretrain

    params = dict(v=_VERSION, words=WORDS, bias=BIAS, n=answer_words, phrasings=_PHRASINGS, steps=steps,
                  batch_size=batch_size, lr=lr, seed=seed)
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    root = _task_root() / key
    path = root / "bfloat16"
    done = root / "done.json"
    if done.is_file():
        return str(path)

    base = build_tiny_model(seed=seed, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(base)
    for w in WORDS:
        if len(tokenizer.encode(" " + w)) != 1:
            raise RuntimeError(f"' {w}' is not one token of the tiny tokenizer: the task needs single-token words")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rng = random.Random(seed)

    def texts(step: int) -> dict:
        batch = tokenizer([_pretraining_text(tokenizer, rng, answer_words) for _ in range(batch_size)], return_tensors="pt",
                          padding=True)
        return {**batch, "labels": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)}

    losses = pretrain(model, texts, steps=steps, lr=lr, log=log, log_every=100, label="[tim_task] pre-training")
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    done.write_text(json.dumps({**params, "final_loss": sum(losses[-20:]) / 20}, sort_keys=True))
    return str(path)
