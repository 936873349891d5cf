"""On-policy token IDs across model calls: the NeMo Gym / NeMo RL splice.

Source: ../shared/seeds/nemo-gym-on-policy-token-ids.txt ("On-Policy Token ID Fix" and "Data
Interface"). When a multi-turn rollout goes through an OpenAI-style chat endpoint, each new
prompt is normally rebuilt by re-templating the message history and re-tokenising it. That
loses the token IDs the model actually emitted: "_Ski" + "nny" comes back as "_Skinny" (merge)
or "_Skin" + "ny" (split), and a tool call comes back in the template's layout rather than the
model's. The trainer then scores tokens the sampler never produced, and the run is off-policy.

``splice_on_policy_token_ids`` rebuilds the prompt from the IDs the model saw and emitted on its
previous call (``model_prefix``) and takes from the re-templated history only what follows that
call. The algorithm is NeMo RL's ``replace_prefix_tokens`` (nemo_rl/models/generation/
openai_server_utils.py at NVIDIA-NeMo/RL 7ea279ab, formerly ``_replace_prefix_tokens`` in
vllm_worker_async.py); it is re-implemented here, with errors instead of asserts:

1. drop a trailing turn terminator from the model prefix (the model may have stopped on
   max_tokens without one; the template always writes one);
2. count the terminators ``n`` in the re-templated prefix (history up to and including the last
   assistant turn) and cut the re-templated whole history at its ``n``-th terminator. Counting
   terminators rather than comparing positions survives templates that strip ``<think>`` from
   earlier assistant turns: stripping moves positions but not the per-message terminator count;
3. return ``model_prefix[:cut] + template[n-th terminator:]``.

The turn terminator is ``eos_token_id`` by default; templates that end turns with another token
(a base tokenizer whose EOS is ``<|endoftext|>`` while turns end with ``<|im_end|>``) pass
``turn_terminator_ids``.

The token IDs travel with the messages (seed, "Message-level token IDs are the single source of
truth"): the response's final output item carries ``prompt_token_ids``, ``generation_token_ids``
and ``generation_log_probs``; the client sends them back unchanged on that same message; the
server derives the model prefix from them. The helpers below enforce that contract (all three
fields or none, never a separate top-level prefix field).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

__all__ = [
    "TOKEN_ID_FIELDS",
    "TokenSpliceError",
    "NonMonotonicHistoryError",
    "MissingTurnTerminatorError",
    "NoEOSTokenError",
    "MessageTokenIdsError",
    "MessageTokenIds",
    "splice_on_policy_token_ids",
    "message_token_ids",
    "carry_token_ids",
    "validate_request",
    "model_prefix_from_messages",
    "spliced_prompt_token_ids",
]

TOKEN_ID_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
# A prefix supplied beside the messages is a second, competing source of truth (seed).
_TOP_LEVEL_FORBIDDEN = TOKEN_ID_FIELDS + (
    "model_prefix_token_ids", "prefix_token_ids", "required_prefix_token_ids",
    "template_prefix_token_ids",
)

TokenIds = Sequence[int]


class TokenSpliceError(ValueError):
    """The history cannot be spliced onto the model's own token IDs."""


class NonMonotonicHistoryError(TokenSpliceError):
    """The history was rewritten (truncated, summarised, reordered) between model calls."""


class MissingTurnTerminatorError(TokenSpliceError):
    """The re-templated history has no turn terminator to cut at."""


class NoEOSTokenError(TokenSpliceError):
    """No turn terminator is known: the tokenizer has no EOS and none was given."""


class MessageTokenIdsError(TokenSpliceError):
    """Message-level token-ID fields are incomplete, inconsistent or out of band."""


def _as_list(ids: Any, name: str) -> list:
    if isinstance(ids, list):
        return ids
    if hasattr(ids, "tolist"):  # torch.Tensor, numpy.ndarray
        ids = ids.tolist()
    if isinstance(ids, tuple):
        return list(ids)
    if not isinstance(ids, list):
        raise TypeError(f"{name} must be a list of token IDs, got {type(ids).__name__}")
    return ids


def _terminators(eos_token_id: Optional[int],
                 turn_terminator_ids: Union[int, Iterable[int], None]) -> tuple:
    if turn_terminator_ids is None:
        if eos_token_id is None:
            raise NoEOSTokenError(
                "eos_token_id is None (the tokenizer has no EOS token) and no turn_terminator_ids "
                "were given: the splice needs the token that ends each chat turn")
        return (int(eos_token_id),)
    if isinstance(turn_terminator_ids, int):
        return (turn_terminator_ids,)
    terms = tuple(dict.fromkeys(int(t) for t in turn_terminator_ids))
    if not terms:
        raise NoEOSTokenError("turn_terminator_ids is empty")
    return terms


def _count(ids: list, terms: tuple) -> int:
    return sum(ids.count(t) for t in terms)  # list.count runs in C


def _nth_position(ids: list, terms: tuple, n: int) -> int:
    """Index of the n-th (1-based) terminator in ids, or -1 if there are fewer than n."""
    if len(terms) == 1:
        term, pos = terms[0], -1
        try:
            for _ in range(n):
                pos = ids.index(term, pos + 1)  # C scan from the last hit: linear overall
        except ValueError:
            return -1
        return pos
    positions: list[int] = []
    for term in terms:  # at most n hits of each terminator matter
        pos = -1
        try:
            for _ in range(n):
                pos = ids.index(term, pos + 1)
                positions.append(pos)
        except ValueError:
            pass
    if len(positions) < n:
        return -1
    positions.sort()
    return positions[n - 1]


#: How far from the end of the template prefix the fast path looks for its last terminator
#: (a chat template writes at most a newline or two after it).
_TAIL_SCAN = 64
_TAIL_WINDOW = 256


def _cut_if_template_extends_prefix(template_prefix: list, template: list, terms: tuple) -> int:
    """The splice cut when ``template`` starts with ``template_prefix``: the prefix's last
    terminator (the n-th of the template, n counted in the prefix); -1 when the template does
    not extend its prefix or that terminator is not near the prefix's end."""
    n = len(template_prefix)
    if len(template) < n:
        return -1
    for pos in range(n - 1, max(n - 1 - _TAIL_SCAN, -1), -1):
        if template_prefix[pos] in terms:
            break
    else:
        return -1
    # A window at the end first: a template that stripped or rewrote earlier turns has shifted
    # everything after them, so it differs there already, and the full pass is saved.
    window = max(n - _TAIL_WINDOW, 0)
    if template[window:n] != template_prefix[window:] or template[:n] != template_prefix:
        return -1
    return pos


def splice_on_policy_token_ids(model_prefix_token_ids: Optional[TokenIds],
                               template_prefix_token_ids: TokenIds,
                               template_token_ids: TokenIds,
                               *,
                               eos_token_id: Optional[int] = None,
                               turn_terminator_ids: Union[int, Iterable[int], None] = None,
                               check_history: bool = True) -> list[int]:
    """The next prompt's token IDs, with every earlier turn exactly as the model saw and emitted it.

    Args:
        model_prefix_token_ids: the previous call's prompt IDs + generation IDs (what the model
            saw and emitted). Empty or ``None`` on the first call: the template is returned.
        template_prefix_token_ids: the re-templated, re-tokenised history up to and including the
            last assistant turn (no generation prompt).
        template_token_ids: the re-templated, re-tokenised whole history (with the generation
            prompt): what would be sent without the fix.
        eos_token_id: the tokenizer's EOS (``tok.eos_token_id``); the turn terminator unless
            ``turn_terminator_ids`` is given.
        turn_terminator_ids: the token (or set of tokens) that ends each templated turn, for
            templates that do not end turns with ``eos_token_id``.
        check_history: also require the model prefix to hold one terminator fewer than the
            template prefix (one per earlier message), which catches history that was
            truncated or summarised between calls. Turn off for templates that emit the
            terminator elsewhere too.

    Lists in, list out (the chat-server case). Given 1-D integer tensors or numpy arrays, the
    same algorithm runs as vectorised torch ops and returns a tensor (an array for an array
    template): one pass per scan at memory speed instead of one Python-int comparison per
    token.

    Raises (all ``TokenSpliceError``, a ``ValueError``):
        NoEOSTokenError: no terminator known (tokenizer without EOS and none given).
        MissingTurnTerminatorError: the template prefix holds no terminator.
        NonMonotonicHistoryError: the full template holds fewer terminators than its own prefix,
            or (``check_history``) the model prefix disagrees with the template prefix on the
            number of finished turns.
    """
    if any(_is_array(x) for x in (model_prefix_token_ids, template_prefix_token_ids,
                                  template_token_ids)):
        return _splice_tensors(model_prefix_token_ids, template_prefix_token_ids,
                               template_token_ids, _terminators_or_none(
                                   model_prefix_token_ids, eos_token_id, turn_terminator_ids),
                               check_history)
    template = _as_list(template_token_ids, "template_token_ids")
    if model_prefix_token_ids is None or len(model_prefix_token_ids) == 0:
        return list(template)
    model_prefix = _as_list(model_prefix_token_ids, "model_prefix_token_ids")
    template_prefix = _as_list(template_prefix_token_ids, "template_prefix_token_ids")
    terms = _terminators(eos_token_id, turn_terminator_ids)

    model_cut_end = len(model_prefix) - (1 if model_prefix[-1] in terms else 0)

    # Fast path, the same cut: when the template extends its prefix (no stripped history),
    # the n-th terminator of the template is the last one of the prefix. One C-level list
    # comparison replaces counting the prefix and walking the template.
    cut = _cut_if_template_extends_prefix(template_prefix, template, terms)
    needed = -1
    if cut < 0 or check_history:
        needed = _count(template_prefix, terms)
    if cut < 0:
        if needed == 0:
            raise MissingTurnTerminatorError(
                f"no turn terminator {list(terms)} in template_prefix_token_ids "
                f"(len {len(template_prefix)}): the chat template does not end turns with it; "
                "pass turn_terminator_ids=<the id that ends each turn>")
        cut = _nth_position(template, terms, needed)
        if cut < 0:
            raise NonMonotonicHistoryError(
                f"template_token_ids (len {len(template)}) holds {_count(template, terms)} turn "
                f"terminators but template_prefix_token_ids (len {len(template_prefix)}) holds "
                f"{needed}: the history shrank between calls (non-monotonic history)")
    if check_history:
        have = _count(model_prefix, terms) - (len(model_prefix) - model_cut_end)
        if have != needed - 1:
            raise NonMonotonicHistoryError(
                f"model_prefix_token_ids (len {len(model_prefix)}) finished {have} turns before "
                f"the last assistant turn but the re-templated history "
                f"(template_prefix_token_ids, len {len(template_prefix)}) has {needed - 1}: "
                "earlier messages were truncated, summarised or reordered (non-monotonic "
                "history); pass check_history=False if the template writes the terminator "
                "inside turns too")
    out = model_prefix[:model_cut_end]
    out += template[cut:]
    return out


def _is_array(x: Any) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape")


def _terminators_or_none(model_prefix: Any, eos_token_id, turn_terminator_ids):
    if model_prefix is None or len(model_prefix) == 0:
        return None  # first call: no terminator needed (as the list path)
    return _terminators(eos_token_id, turn_terminator_ids)


def _splice_tensors(model_prefix: Any, template_prefix: Any, template: Any,
                    terms: Optional[tuple], check_history: bool) -> Any:
    """The same splice on 1-D integer tensors or arrays: each scan is one vectorised op.

    Returns a ``torch.Tensor``, or a ``numpy.ndarray`` when the template was one.
    """
    import torch

    as_numpy = type(template).__module__ == "numpy"

    def tensor(x: Any, name: str) -> torch.Tensor:
        t = torch.as_tensor(x if x is not None else [], dtype=torch.long)
        if t.dim() != 1:
            raise TypeError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        return t

    tmpl = tensor(template, "template_token_ids")
    model = tensor(model_prefix, "model_prefix_token_ids")
    if model.numel() == 0:
        return tmpl.numpy().copy() if as_numpy else tmpl.clone()
    prefix = tensor(template_prefix, "template_prefix_token_ids")
    term_t = torch.tensor(terms, dtype=torch.long)

    def is_term(t: torch.Tensor) -> torch.Tensor:
        return t == term_t[0] if len(terms) == 1 else torch.isin(t, term_t)

    model_cut_end = model.numel() - int(bool(is_term(model[-1:]).item()))
    needed = int(torch.count_nonzero(is_term(prefix)))
    if needed == 0:
        raise MissingTurnTerminatorError(
            f"no turn terminator {list(terms)} in template_prefix_token_ids "
            f"(len {prefix.numel()}): the chat template does not end turns with it; "
            "pass turn_terminator_ids=<the id that ends each turn>")
    positions = torch.nonzero(is_term(tmpl)).flatten()
    if positions.numel() < needed:
        raise NonMonotonicHistoryError(
            f"template_token_ids (len {tmpl.numel()}) holds {positions.numel()} turn "
            f"terminators but template_prefix_token_ids (len {prefix.numel()}) holds "
            f"{needed}: the history shrank between calls (non-monotonic history)")
    cut = int(positions[needed - 1])
    if check_history:
        have = int(torch.count_nonzero(is_term(model[:model_cut_end])))
        if have != needed - 1:
            raise NonMonotonicHistoryError(
                f"model_prefix_token_ids (len {model.numel()}) finished {have} turns before "
                f"the last assistant turn but the re-templated history has {needed - 1}: "
                "earlier messages were truncated, summarised or reordered (non-monotonic "
                "history); pass check_history=False if the template writes the terminator "
                "inside turns too")
    out = torch.cat([model[:model_cut_end], tmpl[cut:]])
    return out.numpy() if as_numpy else out


@dataclass(frozen=True)
class MessageTokenIds:
    """The three message-level fields of one model call (seed, "What the model server returns")."""

    prompt_token_ids: list
    generation_token_ids: list
    generation_log_probs: list

    @property
    def model_prefix_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.generation_token_ids


def _get(message: Any, key: str) -> Any:
    if isinstance(message, Mapping):
        return message.get(key)
    return getattr(message, key, None)


def message_token_ids(message: Any, *, where: str = "message") -> Optional[MessageTokenIds]:
    """The token-ID fields of one message (dict or object), or ``None`` if it carries none.

    All three fields or none: a message carrying some but not all of them was forwarded by a
    client that dropped fields, and is an error rather than a silent re-tokenisation.
    """
    values = {key: _get(message, key) for key in TOKEN_ID_FIELDS}
    present = [key for key, value in values.items() if value is not None]
    if not present:
        return None
    if len(present) != len(TOKEN_ID_FIELDS):
        missing = [key for key in TOKEN_ID_FIELDS if key not in present]
        raise MessageTokenIdsError(
            f"{where} carries {present} but not {missing}: the token-ID fields travel together "
            "(forward all three unchanged, or none)")
    for key, value in values.items():
        if not isinstance(value, (list, tuple)):
            raise MessageTokenIdsError(
                f"{where}.{key} must be a list, got {type(value).__name__}")
    n_gen, n_lp = len(values["generation_token_ids"]), len(values["generation_log_probs"])
    if n_gen != n_lp:
        raise MessageTokenIdsError(
            f"{where}: generation_token_ids has {n_gen} entries but generation_log_probs has "
            f"{n_lp}; they must be the same length")
    return MessageTokenIds(*(list(values[key]) if isinstance(values[key], tuple) else values[key]
                             for key in TOKEN_ID_FIELDS))


def carry_token_ids(response_item: Mapping, message: Optional[Mapping] = None) -> dict:
    """The message to send back on the next request, carrying the response's token IDs unchanged.

    ``response_item`` is the final output item of a model call (the one the server attached the
    fields to). ``message`` is the harness's own form of that turn (for example the parsed
    assistant message with ``tool_calls``); by default the response item itself. The three
    fields are copied by reference, never re-derived.
    """
    ids = message_token_ids(response_item, where="response_item")
    if ids is None:
        raise MessageTokenIdsError(
            "response_item carries no token-ID fields: the model server must return "
            f"{list(TOKEN_ID_FIELDS)} (NeMo Gym: return_token_id_information: true)")
    out = dict(response_item if message is None else message)
    for key in TOKEN_ID_FIELDS:
        out[key] = response_item[key] if isinstance(response_item, Mapping) else getattr(
            response_item, key)
    return out


def validate_request(request: Mapping) -> None:
    """Refuse out-of-band prefixes and partial message fields in a chat request.

    The prefix is derived from the messages; a top-level ``prompt_token_ids`` (or any prefix
    field) beside them is a competing source of truth that can diverge or be dropped (seed).
    """
    stray = [key for key in _TOP_LEVEL_FORBIDDEN if key in request]
    if stray:
        raise MessageTokenIdsError(
            f"request has top-level {stray}: token IDs travel on the messages they belong to, "
            "never as a separate request field")
    messages = request.get("messages")
    if messages is None:
        raise MessageTokenIdsError("request has no 'messages'")
    model_prefix_from_messages(messages)


def _last_carrier(messages: Sequence[Any]) -> tuple[int, Optional[MessageTokenIds]]:
    last, last_ids = -1, None
    for i, message in enumerate(messages):
        ids = message_token_ids(message, where=f"messages[{i}]")
        if ids is not None:
            last, last_ids = i, ids
        elif last >= 0 and _get(message, "role") == "assistant":
            raise MessageTokenIdsError(
                f"messages[{i}] is an assistant turn after messages[{last}] but carries no "
                "token-ID fields: the client dropped them (forward them unchanged)")
    return last, last_ids


def model_prefix_from_messages(messages: Sequence[Any]) -> Optional[list[int]]:
    """``prompt_token_ids + generation_token_ids`` of the last message carrying them, or None.

    Validates every message (all-or-none) and that no assistant turn after the first model
    call lost its fields.
    """
    _, ids = _last_carrier(messages)
    return None if ids is None else ids.model_prefix_token_ids


def _strip_fields(message: Any) -> Any:
    if isinstance(message, Mapping):
        return {k: v for k, v in message.items() if k not in TOKEN_ID_FIELDS}
    return message


def spliced_prompt_token_ids(messages: Sequence[Any],
                             render: Callable[[list, bool], list[int]],
                             *,
                             eos_token_id: Optional[int] = None,
                             turn_terminator_ids: Union[int, Iterable[int], None] = None,
                             check_history: bool = True) -> list[int]:
    """The server side: the prompt IDs for a chat request whose messages carry token IDs.

    ``render(messages, add_generation_prompt)`` applies the chat template and tokenises (for a
    Hugging Face tokenizer: ``apply_chat_template`` then encode without special tokens). The
    template prefix is the history up to and including the last message carrying token IDs
    (the last assistant turn), rendered without a generation prompt.
    """
    last, ids = _last_carrier(messages)
    plain = [_strip_fields(m) for m in messages]
    template = render(plain, True)
    if ids is None:
        return list(template)
    template_prefix = render(plain[: last + 1], False)
    return splice_on_policy_token_ids(ids.model_prefix_token_ids, template_prefix, template,
                                      eos_token_id=eos_token_id,
                                      turn_terminator_ids=turn_terminator_ids,
                                      check_history=check_history)
