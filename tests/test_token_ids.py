"""The on-policy token-ID splice against a real locally trained BPE tokenizer and chat template.

Each drift case first shows that plain re-templating loses the model's token IDs (the problem of
../shared/seeds/nemo-gym-on-policy-token-ids.txt is real for this tokenizer), then that the
splice restores them exactly, with the new turns taken from the template.
"""

from __future__ import annotations

import json

import pytest

from rollout_parity.testing.stack import need

from rollout_parity.core.token_ids import (
    MessageTokenIdsError,
    MissingTurnTerminatorError,
    NoEOSTokenError,
    NonMonotonicHistoryError,
    TokenSpliceError,
    carry_token_ids,
    message_token_ids,
    model_prefix_from_messages,
    splice_on_policy_token_ids,
    spliced_prompt_token_ids,
    validate_request,
)
from rollout_parity.testing.tokenizer import (
    build_chat_tokenizer,
    find_merge_pair,
    find_split_pair,
    render_ids,
)


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def tok_think():
    return build_chat_tokenizer(strip_think=True)


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def render(tok):
    return lambda messages, gen: render_ids(tok, messages, add_generation_prompt=gen)


def response(tok, prompt_ids, gen_ids, **message):
    """What the model server returns: the final output item with the three token-ID fields."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    body = gen_ids[:-1] if gen_ids and gen_ids[-1] == eos else gen_ids
    item = {"role": "assistant", "content": tok.decode(body)}
    item.update(message)
    item.update(prompt_token_ids=prompt_ids, generation_token_ids=gen_ids,
                generation_log_probs=[-0.5] * len(gen_ids))
    return item


def two_call_case(tok, gen_ids, parsed=None, follow=None):
    """Call 1 on [user]; call 2 on [user, assistant(call 1), *follow]. Returns the pieces."""
    messages = [{"role": "user", "content": "Tell me about skinny skiers."}]
    prompt1 = render_ids(tok, messages, add_generation_prompt=True)
    item = response(tok, prompt1, gen_ids)
    messages.append(carry_token_ids(item, parsed))
    messages.extend(follow or [{"role": "user", "content": "And the weather?"}])
    plain = [{k: v for k, v in m.items() if not k.endswith(("token_ids", "log_probs"))}
             for m in messages]
    template_prefix = render_ids(tok, plain[:2], add_generation_prompt=False)
    template = render_ids(tok, plain, add_generation_prompt=True)
    return messages, prompt1, template_prefix, template


def expected_tail(tok, follow_text):
    """What follows the previous turn, tokenised independently of the splice."""
    return [tok.convert_tokens_to_ids("<|im_end|>")] + enc(tok, follow_text)


FOLLOW_TEXT = "\n<|im_start|>user\nAnd the weather?<|im_end|>\n<|im_start|>assistant\n"


def test_published_example():
    # NeMo RL's docstring example, eos_token_id = 2.
    out = splice_on_policy_token_ids([11, 12, 13, 40, 41, 220, 17, 2],
                                     [11, 12, 13, 40, 41, 1001, 2],
                                     [11, 12, 13, 40, 41, 1001, 2, 21, 22, 40, 41],
                                     eos_token_id=2)
    assert out == [11, 12, 13, 40, 41, 220, 17, 2, 21, 22, 40, 41]


def test_first_call_returns_template():
    assert splice_on_policy_token_ids([], [], [5, 6, 7], eos_token_id=2) == [5, 6, 7]
    assert splice_on_policy_token_ids(None, [], [5, 6, 7], eos_token_id=None) == [5, 6, 7]


@pytest.mark.parametrize("kind", ["merge", "split"])
def test_retokenization_drift_is_restored(tok, kind):
    pair, canonical = (find_merge_pair if kind == "merge" else find_split_pair)(tok)
    if kind == "merge":
        assert len(canonical) == 1  # "_Ski" + "nny" -> "_Skinny"
    else:
        assert len(canonical) == 2 and canonical != pair  # "_Ski" + "nny" -> "_Skin" + "ny"
    eos = tok.eos_token_id
    gen = enc(tok, "The") + pair + enc(tok, " is fun") + [eos]
    messages, prompt1, template_prefix, template = two_call_case(tok, gen)

    # The problem: re-templating re-tokenises the model's text differently.
    retokenised = template_prefix[len(prompt1):]
    assert retokenised != gen
    assert all(c in retokenised for c in canonical)
    assert template[: len(prompt1) + len(gen)] != prompt1 + gen

    out = splice_on_policy_token_ids(prompt1 + gen, template_prefix, template, eos_token_id=eos)
    assert out[: len(prompt1) + len(gen)] == prompt1 + gen
    assert out == prompt1 + gen + expected_tail(tok, FOLLOW_TEXT)[1:]
    # The message-level path gives the same IDs.
    assert spliced_prompt_token_ids(messages, render(tok), eos_token_id=eos) == out


def test_rechat_templating_drift_is_restored(tok):
    eos = tok.eos_token_id
    call = {"name": "calculator", "arguments": {"expression": "6 * 7"}}
    # The model writes compact JSON; the template renders the parsed call in its own layout.
    raw = "Let me check.<tool_call>" + json.dumps(call, separators=(",", ":")) + "</tool_call>"
    gen = enc(tok, raw) + [eos]
    parsed = {"role": "assistant", "content": "Let me check.",
              "tool_calls": [{"type": "function", "function": call}]}
    follow = [{"role": "tool", "content": "42"}]
    messages, prompt1, template_prefix, template = two_call_case(tok, gen, parsed, follow)
    assert tok.decode(template_prefix[len(prompt1):-1]) != raw
    assert template[: len(prompt1) + len(gen)] != prompt1 + gen

    out = spliced_prompt_token_ids(messages, render(tok), eos_token_id=eos)
    tail = "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert out == prompt1 + gen + enc(tok, tail)
    assert messages[1]["generation_token_ids"] is gen  # carried by reference, unchanged


def test_template_stripping_think_from_history(tok_think):
    tok = tok_think
    eos = tok.eos_token_id
    think = [tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")]
    gen = ([think[0]] + enc(tok, "six times seven") + [think[1]] + enc(tok, "\nThe answer is 42.")
           + [eos])
    messages, prompt1, template_prefix, template = two_call_case(tok, gen)
    # The full template dropped the reasoning of the earlier turn; its prefix kept it.
    assert think[0] in template_prefix and think[0] not in template
    assert len(template) - len(template_prefix) < len(enc(tok, FOLLOW_TEXT))

    out = splice_on_policy_token_ids(prompt1 + gen, template_prefix, template, eos_token_id=eos)
    assert out == prompt1 + gen + enc(tok, FOLLOW_TEXT)
    # Cutting at the prefix's last-EOS *position* (the pre-count algorithm) would splice the
    # wrong span of the stripped template; counting EOS finds the right turn boundary.
    last = max(i for i, t in enumerate(template_prefix) if t == eos)
    by_position = prompt1 + gen[:-1] + template[last:]
    assert by_position != out


def test_configurable_turn_terminator():
    tok = build_chat_tokenizer(eos="<|endoftext|>")  # a base tokenizer; turns end with im_end
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id != im_end
    gen = enc(tok, "The answer is 42.") + [im_end]
    _, prompt1, template_prefix, template = two_call_case(tok, gen)
    with pytest.raises(MissingTurnTerminatorError, match="turn_terminator_ids"):
        splice_on_policy_token_ids(prompt1 + gen, template_prefix, template,
                                   eos_token_id=tok.eos_token_id)
    want = prompt1 + gen + enc(tok, FOLLOW_TEXT)
    assert splice_on_policy_token_ids(prompt1 + gen, template_prefix, template,
                                      eos_token_id=tok.eos_token_id,
                                      turn_terminator_ids=im_end) == want
    both = {im_end, tok.eos_token_id}
    assert splice_on_policy_token_ids(prompt1 + gen, template_prefix, template,
                                      eos_token_id=None, turn_terminator_ids=both) == want


def test_generation_cut_by_max_tokens_gets_the_template_eos(tok):
    gen = enc(tok, "The answer is")  # no EOS: the model hit max_tokens
    _, prompt1, template_prefix, template = two_call_case(tok, gen)
    out = splice_on_policy_token_ids(prompt1 + gen, template_prefix, template,
                                     eos_token_id=tok.eos_token_id)
    assert out == prompt1 + gen + expected_tail(tok, FOLLOW_TEXT)


def test_generation_cut_by_max_tokens_on_tensors_keeps_the_last_model_token(tok):
    """The tensor path of the same case: the model's last token is not a terminator, so nothing of
    the model's is cut; the template's terminator follows it (as on the list path)."""
    torch = need("torch")
    np = need("numpy")
    gen = enc(tok, "The answer is")  # no EOS: the model hit max_tokens
    _, prompt1, template_prefix, template = two_call_case(tok, gen)
    want = prompt1 + gen + expected_tail(tok, FOLLOW_TEXT)
    for kind in (torch.tensor, np.asarray):
        got = splice_on_policy_token_ids(*(kind(x) for x in (prompt1 + gen, template_prefix, template)),
                                         eos_token_id=tok.eos_token_id)
        assert got.tolist() == want, kind


def test_tokenizer_without_eos():
    tok = build_chat_tokenizer(eos=None)
    assert tok.eos_token_id is None
    with pytest.raises(NoEOSTokenError, match="no EOS"):
        splice_on_policy_token_ids([1, 2, 3], [1, 2, 3], [1, 2, 3, 4], eos_token_id=tok.eos_token_id)
    with pytest.raises(NoEOSTokenError, match="empty"):
        splice_on_policy_token_ids([1, 2, 3], [1, 2, 3], [1, 2, 3, 4], turn_terminator_ids=[])


def test_missing_eos_in_template_prefix():
    with pytest.raises(MissingTurnTerminatorError, match="template_prefix_token_ids"):
        splice_on_policy_token_ids([1, 2, 9], [1, 5, 6], [1, 5, 6, 7, 8], eos_token_id=9)


def test_non_monotonic_history_is_an_error(tok):
    eos = tok.eos_token_id
    # Call 1 and 2 as usual, then the harness summarises history before call 3.
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "six times seven?"}]
    prompt1 = render_ids(tok, messages, add_generation_prompt=True)
    messages.append(carry_token_ids(response(tok, prompt1, enc(tok, "42") + [eos])))
    messages.append({"role": "user", "content": "and plus one?"})
    prompt2 = spliced_prompt_token_ids(messages, render(tok), eos_token_id=eos)
    messages.append(carry_token_ids(response(tok, prompt2, enc(tok, "43") + [eos])))
    messages.append({"role": "user", "content": "thanks"})
    assert spliced_prompt_token_ids(messages, render(tok), eos_token_id=eos)[: len(prompt2)] \
        == prompt2
    summarised = [messages[1]] + messages[3:]  # the system turn was dropped
    with pytest.raises(NonMonotonicHistoryError, match="non-monotonic"):
        spliced_prompt_token_ids(summarised, render(tok), eos_token_id=eos)
    # Unchecked (a template that writes the terminator inside turns): the splice goes ahead, the
    # model's last call exactly as it was, then the re-templated turns after it.
    unchecked = spliced_prompt_token_ids(summarised, render(tok), eos_token_id=eos, check_history=False)
    last = prompt2 + enc(tok, "43") + [eos]
    assert unchecked[: len(last)] == last
    assert unchecked[len(last):] == expected_tail(tok, "\n<|im_start|>user\nthanks<|im_end|>\n"
                                                        "<|im_start|>assistant\n")[1:]
    # A full template with fewer turns than its own prefix.
    with pytest.raises(NonMonotonicHistoryError, match="shrank"):
        splice_on_policy_token_ids([1, 9, 3, 9], [1, 9, 3, 9], [1, 9, 3], eos_token_id=9,
                                   check_history=False)
    assert issubclass(NonMonotonicHistoryError, TokenSpliceError)
    assert issubclass(TokenSpliceError, ValueError)


def test_hundred_turn_conversation(tok_think):
    """100 model calls with think stripping, tool calls, merges and splits: every prompt is the
    previous prompt + the previous generation, exactly, followed by the new turns."""
    tok = tok_think
    eos = tok.eos_token_id
    merge, _ = find_merge_pair(tok)
    split, _ = find_split_pair(tok)
    think = [tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")]
    messages = [{"role": "system", "content": "You are a skier."},
                {"role": "user", "content": "Start."}]
    prompt = render_ids(tok, messages, add_generation_prompt=True)
    drifted = 0
    gen_prompt = enc(tok, "<|im_start|>assistant\n")
    for turn in range(100):
        gen = [think[0]] + enc(tok, f"turn {turn}") + [think[1]] + enc(tok, "\nSee")
        gen += merge if turn % 2 else split
        parsed = None
        if turn % 3 == 0:
            call = {"name": "calculator", "arguments": {"expression": f"{turn} * 7"}}
            gen += enc(tok, "<tool_call>" + json.dumps(call, separators=(",", ":"))
                       + "</tool_call>")
            parsed = {"role": "assistant", "content": tok.decode(gen).split("<tool_call>")[0],
                      "tool_calls": [{"type": "function", "function": call}]}
        if turn % 7 != 6:
            gen = gen + [eos]  # every 7th call stops on max_tokens
        messages.append(carry_token_ids(response(tok, prompt, gen), parsed))
        new = ([{"role": "tool", "content": str(turn * 7)}] if turn % 3 == 0
               else [{"role": "user", "content": f"next {turn}"}])
        messages.extend(new)
        naive = render(tok)([{k: v for k, v in m.items() if "token_ids" not in k
                              and "log_probs" not in k} for m in messages], True)
        drifted += naive[: len(prompt) + len(gen)] != prompt + gen
        nxt = spliced_prompt_token_ids(messages, render(tok), eos_token_id=eos)
        seen = prompt + gen + ([] if gen[-1] == eos else [eos])
        assert nxt[: len(seen)] == seen, f"turn {turn}"
        assert nxt[len(seen):] == naive[len(naive) - (len(nxt) - len(seen)):]
        assert nxt[-len(gen_prompt):] == gen_prompt
        prompt = nxt
    assert drifted == 100
    assert len(prompt) > 3000
    assert model_prefix_from_messages(messages) == messages[-2]["prompt_token_ids"] + \
        messages[-2]["generation_token_ids"]


def test_server_side_splice_with_a_turn_terminator_other_than_eos():
    """``spliced_prompt_token_ids(turn_terminator_ids=...)``: a base tokenizer whose turns end with
    im_end, not its EOS. Without the terminator the server refuses; with it, the model's IDs stay."""
    tok = build_chat_tokenizer(eos="<|endoftext|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    messages, prompt1, _, _ = two_call_case(tok, enc(tok, "The answer is 42.") + [im_end])
    with pytest.raises(MissingTurnTerminatorError):
        spliced_prompt_token_ids(messages, render(tok), eos_token_id=tok.eos_token_id)
    out = spliced_prompt_token_ids(messages, render(tok), eos_token_id=tok.eos_token_id, turn_terminator_ids=im_end)
    assert out == prompt1 + enc(tok, "The answer is 42.") + [im_end] + enc(tok, FOLLOW_TEXT)


def test_message_fields_all_or_none(tok):
    full = {"role": "assistant", "content": "x", "prompt_token_ids": [1],
            "generation_token_ids": [2, 3], "generation_log_probs": [-0.1, -0.2]}
    ids = message_token_ids(full)
    assert ids.model_prefix_token_ids == [1, 2, 3]
    assert message_token_ids({"role": "user", "content": "x"}) is None
    partial = dict(full)
    del partial["generation_log_probs"]
    with pytest.raises(MessageTokenIdsError, match="generation_log_probs"):
        message_token_ids(partial)
    with pytest.raises(MessageTokenIdsError, match=r"^messages\[3\] carries"):
        message_token_ids(partial, where="messages[3]")
    with pytest.raises(MessageTokenIdsError, match="same length"):
        message_token_ids(dict(full, generation_log_probs=[-0.1]))
    with pytest.raises(MessageTokenIdsError, match="no token-ID fields"):
        carry_token_ids({"role": "assistant", "content": "x"})
    carried = carry_token_ids(full, {"role": "assistant", "content": "parsed"})
    assert carried["content"] == "parsed"
    assert all(carried[k] is full[k] for k in ("prompt_token_ids", "generation_token_ids",
                                               "generation_log_probs"))


def test_request_contract(tok):
    msg = {"role": "assistant", "content": "x", "prompt_token_ids": [1],
           "generation_token_ids": [2], "generation_log_probs": [-0.1]}
    validate_request({"messages": [{"role": "user", "content": "q"}, msg]})
    with pytest.raises(MessageTokenIdsError, match="top-level"):
        validate_request({"messages": [msg], "prompt_token_ids": [1, 2]})
    with pytest.raises(MessageTokenIdsError, match="top-level"):
        validate_request({"messages": [msg], "required_prefix_token_ids": [1, 2]})
    dropped = [{"role": "user", "content": "q"}, msg, {"role": "user", "content": "r"},
               {"role": "assistant", "content": "y"}]
    with pytest.raises(MessageTokenIdsError, match="dropped"):
        validate_request({"messages": dropped})


def test_tensor_and_array_inputs_give_the_list_result(tok_think):
    np = need("numpy")
    torch = need("torch")
    tok = tok_think
    eos = tok.eos_token_id
    merge, _ = find_merge_pair(tok)
    think = [tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")]
    gen = [think[0]] + enc(tok, "hmm") + [think[1]] + enc(tok, "\nok") + merge + [eos]
    _, prompt1, template_prefix, template = two_call_case(tok, gen)
    want = splice_on_policy_token_ids(prompt1 + gen, template_prefix, template, eos_token_id=eos)
    assert want == prompt1 + gen + enc(tok, FOLLOW_TEXT)
    as_t = [torch.tensor(x) for x in (prompt1 + gen, template_prefix, template)]
    got = splice_on_policy_token_ids(*as_t, eos_token_id=eos)
    assert isinstance(got, torch.Tensor) and got.tolist() == want
    got = splice_on_policy_token_ids(*as_t, eos_token_id=None,
                                     turn_terminator_ids={eos, tok.pad_token_id})
    assert got.tolist() == want
    as_np = [np.asarray(x) for x in (prompt1 + gen, template_prefix, template)]
    got = splice_on_policy_token_ids(*as_np, eos_token_id=eos)
    assert isinstance(got, np.ndarray) and got.tolist() == want
    # Same errors as the list path.
    with pytest.raises(NoEOSTokenError):
        splice_on_policy_token_ids(*as_t, eos_token_id=None)
    with pytest.raises(MissingTurnTerminatorError):
        splice_on_policy_token_ids(*as_t, eos_token_id=12345)
    with pytest.raises(NonMonotonicHistoryError, match="shrank"):
        splice_on_policy_token_ids(as_t[0], as_t[1], as_t[1][:-3], eos_token_id=eos)
    with pytest.raises(NonMonotonicHistoryError, match="non-monotonic"):
        first_turn_end = (prompt1 + gen).index(eos)
        splice_on_policy_token_ids(as_t[0][first_turn_end + 1:], as_t[1], as_t[2],
                                   eos_token_id=eos)
    assert splice_on_policy_token_ids(torch.tensor([], dtype=torch.long), [], as_t[2],
                                      eos_token_id=eos).tolist() == template


def test_fast_path_equals_the_counting_path(monkeypatch):
    """When the template extends its prefix, the splice finds the cut with one list comparison
    instead of counting terminators; on seeded random histories (extended, stripped, rewritten,
    shrunk, one or two terminators, model prefixes with and without a final terminator) both
    paths, and the tensor path, give the same prompt or the same error."""
    import random

    import rollout_parity.core.token_ids as token_ids

    def outcome(*args, **kw):
        try:
            return splice_on_policy_token_ids(*args, **kw)
        except TokenSpliceError as exc:
            return type(exc)

    torch = need("torch")
    rng = random.Random(5)
    taken = ends_open = 0
    for _ in range(2000):
        turns = [[rng.randrange(4, 30) for _ in range(rng.randint(0, 5))] + [rng.choice([2, 3])]
                 for _ in range(rng.randint(1, 5))]
        prefix = [t for turn in turns for t in turn] + [rng.randrange(4, 30)] * rng.randint(0, 2)
        template = prefix + [rng.randrange(4, 30) for _ in range(rng.randint(0, 6))] + [2]
        kind = rng.random()
        if kind < 0.2:  # a template that strips part of an earlier turn
            i = rng.randrange(len(template))
            template = template[:i] + template[i + rng.randint(1, 3):]
        elif kind < 0.3:  # a rewritten token
            template[rng.randrange(len(template))] = rng.randrange(4, 30)
        elif kind < 0.35:
            template = template[: rng.randrange(len(template) + 1)]
        model = [rng.randrange(4, 30) for _ in range(rng.randint(0, 4))] + prefix[: rng.randint(0, len(prefix))]
        kw = rng.choice([dict(eos_token_id=2), dict(turn_terminator_ids=(2, 3))])
        kw["check_history"] = rng.random() < 0.5
        taken += token_ids._cut_if_template_extends_prefix(prefix, template, (2, 3) if "turn_terminator_ids" in kw
                                                           else (2,)) >= 0
        fast = outcome(model, prefix, template, **kw)
        with monkeypatch.context() as m:
            m.setattr(token_ids, "_cut_if_template_extends_prefix", lambda *a: -1)
            counted = outcome(model, prefix, template, **kw)
        assert fast == counted, (model, prefix, template, kw)
        # The tensor path (its own vectorised code) on the same histories: the same prompt or error.
        tensors = outcome(*(torch.tensor(x, dtype=torch.long) for x in (model, prefix, template)), **kw)
        assert (tensors.tolist() if isinstance(tensors, torch.Tensor) else tensors) == fast, (model, prefix, template, kw)
        ends_open += bool(model) and model[-1] not in (2, 3) and isinstance(fast, list)
    assert taken > 500
    assert ends_open > 200  # model prefixes not ending in a terminator (a generation cut by max_tokens)
