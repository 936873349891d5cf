"""A real chat tokenizer built locally, for the multi-turn token-ID tests and benchmarks.

``build_chat_tokenizer()`` trains a byte-level BPE with the ``tokenizers`` library on a small
built-in corpus (no download) and wraps it in a ``transformers.PreTrainedTokenizerFast`` with a
ChatML chat template written here. The template has the three features that make multi-turn
re-tokenisation drift (../shared/seeds/nemo-gym-on-policy-token-ids.txt, Problems 1-3):

- assistant ``tool_calls`` are rendered by the template (``<tool_call>\\n{json}\\n</tool_call>``),
  so a tool call the model wrote in another layout comes back different (re-chat-templating);
- with ``strip_think=True``, ``<think>...</think>`` is removed from assistant turns that precede
  the last user message (as Qwen3's template does), so history is not a plain prefix;
- turns end with ``<|im_end|>``; ``eos="<|endoftext|>"`` gives a tokenizer whose EOS is not the
  turn terminator (the configurable-terminator case).

``find_merge_pair`` / ``find_split_pair`` search the trained vocabulary for two tokens the model
may emit that re-tokenise into one token (merge) or into a different pair (split), the
"_Ski" + "nny" cases of the seed.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

__all__ = [
    "CHAT_TEMPLATE",
    "CHAT_TEMPLATE_STRIP_THINK",
    "build_chat_tokenizer",
    "find_merge_pair",
    "find_split_pair",
    "render_ids",
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>"]

# ChatML; tool calls are rendered from the parsed message, never from the model's raw text.
_MESSAGE = (
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- set content = message['content'] if message['content'] is not none else '' -%}"
    "{%- if message['role'] == 'assistant' and strip and loop.index0 < last_user "
    "and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{ content }}"
    "{%- if message.get('tool_calls') -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{{ '<tool_call>\\n' + (call['function'] | tojson) + '\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
)


def _template(strip_think: bool) -> str:
    return (
        "{%- set ns = namespace(last_user=-1) -%}"
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- set last_user = ns.last_user -%}"
        f"{{%- set strip = {'true' if strip_think else 'false'} -%}}"
        "{%- for message in messages -%}" + _MESSAGE + "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


CHAT_TEMPLATE = _template(strip_think=False)
CHAT_TEMPLATE_STRIP_THINK = _template(strip_think=True)

_CORPUS = """\
The skinny cat sat on the skin of the drum. Skinny jeans, skinny latte, a skinny dip.
Skin care, skinny fit, the Skinny Skier skis in the snow; skiing is fun, skinny skiers ski.
Ski, skis, skied, skier, skiers, skiing. Skin, skins, skinned, skinny, skinnier, skinniest.
Tokens merge and split: the model may emit two pieces that re-tokenize into one piece.
Assistant: the answer is 42. User: what is six times seven? Tool: result 42.
Let me think step by step about the question before answering it carefully.
The weather today is sunny, tomorrow is rainy, and the day after is windy and funny.
Many many tokens, any penny, a nanny and a granny, funny bunny, sunny honey money.
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "calculator", "arguments": {"expression": "6 * 7"}}
"""


def build_chat_tokenizer(*, vocab_size: int = 700, strip_think: bool = False,
                         eos: str = "<|im_end|>", corpus: Optional[Iterable[str]] = None) -> Any:
    """Train a byte-level BPE locally and return a ``PreTrainedTokenizerFast`` with a chat template.

    ``eos`` is the tokenizer's ``eos_token``: ``"<|im_end|>"`` (the turn terminator, as in chat
    models) or ``"<|endoftext|>"`` (a base tokenizer whose turns end with another token), or
    ``None`` for a tokenizer without EOS. Deterministic for given arguments.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = list(corpus) if corpus is not None else [line for line in _CORPUS.splitlines() if line]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(text * 4, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIAL_TOKENS[1:])
    if eos is not None:
        tok.eos_token = eos
    tok.chat_template = CHAT_TEMPLATE_STRIP_THINK if strip_think else CHAT_TEMPLATE
    return tok


def render_ids(tok: Any, messages: list[dict], *, add_generation_prompt: bool) -> list[int]:
    """The chat template applied to ``messages`` and tokenised: a plain ``list[int]``."""
    text = tok.apply_chat_template(messages, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)
    return tok(text, add_special_tokens=False)["input_ids"]


def _plain_tokens(tok: Any) -> list[tuple[int, str]]:
    special = set(tok.all_special_ids)
    out = []
    for idx in sorted(tok.get_vocab().values()):
        if idx in special:
            continue
        out.append((idx, tok.decode([idx])))
    return out


def _encode(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _merge_pair(tok: Any, prefer: str):
    tokens = _plain_tokens(tok)
    by_text = {text: idx for idx, text in tokens}
    # A merge: a multi-character token that the model could also emit as two pieces.
    words = sorted((text for _, text in tokens if len(text.strip()) >= 4),
                   key=lambda w: (prefer not in w, -len(w), w))
    for word in words:
        for cut in range(1, len(word)):
            a, b = by_text.get(word[:cut]), by_text.get(word[cut:])
            if a is not None and b is not None and len(_encode(tok, word)) == 1:
                return [a, b], _encode(tok, word)
    return None


def _split_pair(tok: Any, prefer: str):
    tokens = [(i, t) for i, t in _plain_tokens(tok) if len(t) >= 2]
    # A split: two pieces whose text the tokenizer cuts at another place.
    firsts = sorted(tokens, key=lambda it: (prefer not in it[1], it[0]))
    for a, ta in firsts:
        for b, tb in tokens:
            if tb.startswith(" "):
                continue
            again = _encode(tok, ta + tb)
            if len(again) == 2 and again != [a, b]:
                return [a, b], again
    return None


def find_merge_pair(tok: Any) -> tuple[list[int], list[int]]:
    """Two token IDs ``[a, b]`` whose decoded text re-tokenises to ONE token ``[c]``.

    Returns ``([a, b], [c])``; raises ``LookupError`` when the vocabulary has no such pair.
    """
    found = _merge_pair(tok, prefer="kinny")
    if found is None:
        raise LookupError("no token pair in this vocabulary re-tokenises into a single token")
    return found


def find_split_pair(tok: Any) -> tuple[list[int], list[int]]:
    """Two token IDs ``[a, b]`` whose text re-tokenises to a DIFFERENT pair ``[c, d]``.

    ("_Ski" + "nny" -> "_Skin" + "ny".) Raises ``LookupError`` when there is none.
    """
    found = _split_pair(tok, prefer="ki")
    if found is None:
        raise LookupError("no token pair in this vocabulary re-tokenises into a different pair")
    return found
