"""Our token-ID splice against NeMo RL's own: ``_replace_prefix_tokens`` (v0.7.0,
``models/generation/vllm/vllm_worker_async.py``) and ``replace_prefix_tokens`` (main 7ea279ab,
``models/generation/openai_server_utils.py``), imported from ``../shared/anchors/nemo-rl``.

We follow main: the cut is the n-th turn terminator of the template, n counted in the template
prefix. v0.7.0 cuts at the last EOS of ``template[:len(template_prefix)]`` (a position), which
is the same cut while the template extends the template prefix, and a different one when the
chat template strips ``<think>`` from earlier assistant turns (Qwen3 does): the stripped turn
is shorter, the position lands later, and v0.7.0 drops the new turns (or asserts, when the
whole template is no longer than its prefix).

Where NeMo RL asserts, we raise a ``TokenSpliceError`` naming the problem. ``check_history``
(on by default) also refuses a model prefix whose finished turns disagree with the template;
with it off, every output equals main's.
"""

from __future__ import annotations

import random
import sys
import types

import pytest

from integration_tests.support.nemo_anchor import ANCHORS, VERSIONS, skip_unless_available
from rollout_parity.core.token_ids import (
    NonMonotonicHistoryError,
    TokenSpliceError,
    carry_token_ids,
    splice_on_policy_token_ids,
    spliced_prompt_token_ids,
)
from rollout_parity.testing.tokenizer import build_chat_tokenizer, render_ids

pytestmark = [pytest.mark.nemo_rl]

EOS = 2
SPLICE = {"v0.7.0": ("nemo_rl.models.generation.vllm.vllm_worker_async", "_replace_prefix_tokens"),
          "head": ("nemo_rl.models.generation.openai_server_utils", "replace_prefix_tokens")}


@pytest.fixture(scope="module")
def splices():
    """Both versions' real functions (each imported under its own activation; the function
    objects keep working after the modules are put away)."""
    skip_unless_available()
    out = {}
    for version in VERSIONS:
        with ANCHORS.activate(version) as ns:
            module, name = SPLICE[version]
            out[version] = getattr(ns.load(module), name)
    return out


def nemo_tokenizer(eos_token_id: int):
    return types.SimpleNamespace(eos_token_id=eos_token_id,
                                 decode=lambda ids: " ".join(map(str, ids)))


def run_theirs(fn, tok, model_prefix, template_prefix, template):
    try:
        return fn(tok, list(model_prefix), list(template_prefix), list(template))
    except AssertionError:
        return AssertionError


def run_ours(model_prefix, template_prefix, template, eos, check_history=False):
    try:
        return splice_on_policy_token_ids(model_prefix, template_prefix, template, eos_token_id=eos,
                                          check_history=check_history)
    except TokenSpliceError:
        return AssertionError


# ----------------------------------------------------------------- random cases


def random_case(rng: random.Random):
    """Token lists shaped like two model calls, with every kind of damage: re-tokenised or
    stripped turns, missing trailing EOS, extra/missing terminators, empty pieces."""

    def seg(lo=0, hi=6):
        return [rng.randrange(3, 40) for _ in range(rng.randint(lo, hi))]

    turns = [seg(1) + [EOS] for _ in range(rng.randint(0, 4))]
    gen = seg(0, 8) + ([EOS] if rng.random() < 0.7 else [])
    prompt = [t for turn in turns for t in turn] + seg(0, 3)
    model_prefix = prompt + gen if rng.random() < 0.95 else []
    # The template re-renders the history: drifted tokens, sometimes a stripped turn.
    rendered = [list(turn) for turn in turns] + [seg(0, 8) + [EOS]]
    for turn in rendered:
        if rng.random() < 0.3 and len(turn) > 1:
            turn[rng.randrange(len(turn) - 1)] = rng.randrange(40, 60)
    template_prefix = [t for turn in rendered for t in turn]
    if rng.random() < 0.3 and len(rendered) > 0:  # a template that strips part of a turn
        i = rng.randrange(len(rendered))
        rendered[i] = rendered[i][-1:] if rng.random() < 0.5 else rendered[i][-2:]
    template = [t for turn in rendered for t in turn] + seg(0, 6) + [EOS] * rng.randint(0, 1) + seg(0, 4)
    if rng.random() < 0.1:
        template = template[: rng.randint(0, len(template))]
    if rng.random() < 0.05:
        template_prefix = [t for t in template_prefix if t != EOS]
    return model_prefix, template_prefix, template


def test_random_cases_against_both_versions(splices):
    rng = random.Random(13)
    tok = nemo_tokenizer(EOS)
    stats = {"cases": 0, "equal_head": 0, "both_raise_head": 0, "equal_v07": 0, "differ_v07": 0,
             "history_refused": 0}
    for _ in range(3000):
        case = random_case(rng)
        stats["cases"] += 1
        ours = run_ours(*case, EOS)
        head = run_theirs(splices["head"], tok, *case)
        # main: the same output, or both refuse (NeMo RL asserts, we raise TokenSpliceError).
        assert ours == head, case
        stats["both_raise_head" if ours is AssertionError else "equal_head"] += 1
        v07 = run_theirs(splices["v0.7.0"], tok, *case)
        model_prefix, template_prefix, template = case
        if model_prefix and ours is not AssertionError and template[:len(template_prefix)] == template_prefix \
                and len(template) > len(template_prefix):
            # The template extends its prefix: v0.7.0's position cut is main's count cut.
            assert v07 == ours, case
        stats["equal_v07" if v07 == ours else "differ_v07"] += 1
        checked = run_ours(*case, EOS, check_history=True)
        assert checked == ours or checked is AssertionError
        stats["history_refused"] += checked is AssertionError and ours is not AssertionError
    print(stats)
    assert stats["equal_head"] > 1500 and stats["both_raise_head"] > 50
    assert stats["differ_v07"] > 100  # stripped turns and shrunk templates


# ----------------------------------------------------------------- template-shaped cases


def conversation_cases(strip_think: bool, seed: int, turns: int = 12):
    """Model calls of a multi-turn chat rendered by a real BPE tokenizer and ChatML template:
    random generations (drift on re-tokenisation), ``<think>`` blocks, tool calls, calls cut by
    max_tokens. Yields (model_prefix, template_prefix, template, tok) per call after the first."""
    tok = build_chat_tokenizer(strip_think=strip_think)
    rng = random.Random(seed)
    eos = tok.eos_token_id
    vocab = [i for i in range(len(tok)) if i not in tok.all_special_ids]
    think = [tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Start."}]
    render = lambda msgs, gen: render_ids(tok, msgs, add_generation_prompt=gen)  # noqa: E731
    prompt = render(messages, True)
    for turn in range(turns):
        gen = [rng.choice(vocab) for _ in range(rng.randint(1, 10))]
        if rng.random() < 0.6:
            gen = [think[0]] + [rng.choice(vocab) for _ in range(rng.randint(1, 12))] + [think[1]] + gen
        parsed = None
        if rng.random() < 0.25:
            call = {"name": "calculator", "arguments": {"expression": f"{turn} * 7"}}
            gen += tok("<tool_call>" + str(call).replace("'", '"') + "</tool_call>",
                       add_special_tokens=False)["input_ids"]
            parsed = {"role": "assistant", "content": tok.decode(gen).split("<tool_call>")[0],
                      "tool_calls": [{"type": "function", "function": call}]}
        if rng.random() < 0.8:
            gen += [eos]
        body = gen[:-1] if gen[-1] == eos else gen
        item = {"role": "assistant", "content": tok.decode(body), "prompt_token_ids": prompt,
                "generation_token_ids": gen, "generation_log_probs": [-0.1] * len(gen)}
        messages.append(carry_token_ids(item, parsed))
        messages.append({"role": "user", "content": f"next {turn}"} if rng.random() < 0.7
                        else {"role": "tool", "content": str(turn * 7)})
        plain = [{k: v for k, v in m.items() if not k.endswith(("token_ids", "log_probs"))}
                 for m in messages]
        template_prefix = render(plain[:-1], False)
        template = render(plain, True)
        yield prompt + gen, template_prefix, template, tok
        prompt = spliced_prompt_token_ids(messages, render, eos_token_id=eos)


@pytest.mark.parametrize("strip_think", [False, True])
def test_template_shaped_cases_against_both_versions(splices, strip_think):
    same_v07 = differ_v07 = 0
    for seed in range(6):
        for model_prefix, template_prefix, template, tok in conversation_cases(strip_think, seed):
            eos = tok.eos_token_id
            ours = splice_on_policy_token_ids(model_prefix, template_prefix, template, eos_token_id=eos)
            assert ours == splices["head"](tok, model_prefix, template_prefix, template)
            # Every earlier turn exactly as the model saw and emitted it.
            assert ours[: len(model_prefix) - (model_prefix[-1] == eos)] == \
                model_prefix[: len(model_prefix) - (model_prefix[-1] == eos)]
            v07 = run_theirs(splices["v0.7.0"], tok, model_prefix, template_prefix, template)
            if v07 == ours:
                same_v07 += 1
            else:
                differ_v07 += 1
                assert strip_think  # only a template that strips <think> tells them apart
    print(f"strip_think={strip_think}: v0.7.0 same {same_v07}, different {differ_v07}")
    assert same_v07 > 0
    assert (differ_v07 > 0) == strip_think


def test_v070_drops_the_new_turn_when_think_is_stripped(splices):
    """The documented difference on one readable case: Qwen3-style stripping of <think>."""
    tok = build_chat_tokenizer(strip_think=True)
    eos = tok.eos_token_id
    messages = [{"role": "user", "content": "Hi"}]
    prompt = render_ids(tok, messages, add_generation_prompt=True)
    gen = tok("<think>Let me think step by step about the question</think>Hello", add_special_tokens=False)[
        "input_ids"] + [eos]
    follow = [{"role": "assistant", "content": tok.decode(gen[:-1])}, {"role": "user", "content": "Bye"}]
    template_prefix = render_ids(tok, messages + follow[:1], add_generation_prompt=False)
    template = render_ids(tok, messages + follow, add_generation_prompt=True)
    ours = splice_on_policy_token_ids(prompt + gen, template_prefix, template, eos_token_id=eos)
    assert ours == splices["head"](tok, prompt + gen, template_prefix, template)
    assert tok.decode(ours).endswith("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
    old = splices["v0.7.0"](tok, prompt + gen, template_prefix, template)
    # v0.7.0's last EOS before len(template_prefix) is the user turn's: "Bye" is lost.
    assert tok.decode(old).endswith("Hello<|im_end|>\n<|im_start|>assistant\n")
    assert "Bye" not in tok.decode(old)


def test_check_history_refuses_what_main_accepts(splices):
    """A model prefix with a turn fewer than the re-templated history (a summarised or
    truncated history): main splices anyway, we refuse by default."""
    case = ([1, 3, 4], [5, EOS, 6, EOS], [5, EOS, 6, EOS, 7, EOS, 8])
    head = splices["head"](nemo_tokenizer(EOS), *case)
    assert splice_on_policy_token_ids(*case, eos_token_id=EOS, check_history=False) == head
    with pytest.raises(NonMonotonicHistoryError):
        splice_on_policy_token_ids(*case, eos_token_id=EOS)


def test_anchor_activation_leaves_nothing_behind():
    import os
    import warnings

    from transformers import AutoTokenizer

    skip_unless_available()
    path, meta, env = list(sys.path), list(sys.meta_path), dict(os.environ)
    filters, hook, from_pretrained = list(warnings.filters), sys.excepthook, AutoTokenizer.from_pretrained
    before = set(sys.modules)
    for version in VERSIONS:
        with ANCHORS.activate(version) as ns:
            ns.load("nemo_rl.algorithms.loss")  # nemo_rl.models.policy wraps from_pretrained
            ns.load("nemo_rl.models.generation.vllm.vllm_worker")
            assert any(m.startswith("nemo_rl") for m in sys.modules)
        assert sys.path == path and sys.meta_path == meta and dict(os.environ) == env
        assert warnings.filters == filters and sys.excepthook is hook
        assert AutoTokenizer.from_pretrained == from_pretrained
        assert not [m for m in set(sys.modules) - before if m == "nemo_rl" or m.startswith("nemo_rl.")]
