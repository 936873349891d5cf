"""Speed of the on-policy token-ID splice against a plain list concatenation, and against NeMo
RL's own splice, on the same inputs in one run.

A 100-turn conversation growing to 200k tokens: at every turn the splice rebuilds the prompt
from the model prefix (previous prompt + generation) and the re-templated history, as a chat
server does per request. The baseline is ``a + b`` for two ready lists of the same total length
as each spliced prompt: the copy any prompt rebuild must do. Every list holds its own int
objects, as a tokenizer's or a JSON parser's output does (lists that share int objects compare
by identity, which would flatter any comparison). Each method's time per turn is the best of
several interleaved rounds; the table sums them over the turns.

NeMo RL's splice is imported from ``../shared/anchors/nemo-rl`` (main's
``replace_prefix_tokens``, the algorithm we follow, and v0.7.0's ``_replace_prefix_tokens``,
which cuts by position and is wrong when the template strips history); without the anchors
those rows are left out.

What bounds the list path: every exact splice must read the whole template prefix once (a
terminator can sit anywhere in it), and one pass of Python-int comparisons costs several times
the pointer copy a concatenation does per element. The splice therefore compares the template
with its prefix (one C-level pass, the common case) instead of counting the prefix and walking
the template (two passes, needed when the template rewrote history); the history check counts
the model prefix (one more pass). Tensors run each pass as one vectorised op.

Prints a table, then ``RESULT splice_vs_concat=<lists> ... ours_vs_nemo_main=<ours/theirs>``.
"""

from __future__ import annotations

import random
import sys
import time
import types
from pathlib import Path

from rollout_parity.core.token_ids import splice_on_policy_token_ids

TURNS = 100
TOTAL_TOKENS = 200_000
EOS, OTHER_TERMINATOR = 2, 3
REPEATS = 7


def fresh(ids: list[int]) -> list[int]:
    """The same values as new int objects (what a tokenizer or JSON parser hands over)."""
    return [x + 0 for x in ids]


def build_turns(seed: int = 0):
    """Per turn (model_prefix, template_prefix, template) as value lists, with the drift of a
    re-tokenised generation (a few tokens merge in the template)."""
    rng = random.Random(seed)
    per_turn = TOTAL_TOKENS // TURNS
    model_prefix: list[int] = []
    template_prefix: list[int] = []
    for _ in range(TURNS):
        tool = [rng.randrange(300, 50_000) for _ in range(per_turn // 2 - 1)] + [EOS]
        gen = [rng.randrange(300, 50_000) for _ in range(per_turn // 2 - 1)] + [EOS]
        regen = gen[:5] + [rng.randrange(50_000, 60_000)] + gen[7:]
        model_prefix = model_prefix + tool + gen
        template_prefix = template_prefix + tool + regen
        template = template_prefix + [rng.randrange(300, 50_000) for _ in range(20)] + [EOS]
        yield model_prefix, template_prefix, template


def stripped(template: list[int], template_prefix: list[int]) -> list[int]:
    """The template without 30 tokens of the last assistant turn, as a template that strips
    ``<think>`` from turns before the last user message renders it (the template prefix, whose
    last message is that assistant turn, keeps them): the splice takes its counting path."""
    start = len(template_prefix) - 900
    return fresh(template[:start] + template[start + 30:])


def nemo_splices():
    """NeMo RL's own splice functions from the anchors, or {} when they are absent."""
    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo))
    try:
        from integration_tests.support.nemo_anchor import ANCHORS, available_versions
    finally:
        sys.path.remove(str(repo))
    found = {}
    where = {"v0.7.0": ("nemo_rl.models.generation.vllm.vllm_worker_async", "_replace_prefix_tokens"),
             "head": ("nemo_rl.models.generation.openai_server_utils", "replace_prefix_tokens")}
    for version in available_versions():
        with ANCHORS.activate(version) as ns:
            module, name = where[version]
            found[version] = getattr(ns.load(module), name)
    return found


def main() -> None:
    import torch

    torch.set_num_threads(1)  # intra-op threads only add noise to ops of this size here
    nemo = nemo_splices()
    tok = types.SimpleNamespace(eos_token_id=EOS, decode=lambda ids: str(ids))
    best: dict[str, float] = {}
    final = 0
    for turn, (m_vals, p_vals, t_vals) in enumerate(build_turns()):
        m, p, t = fresh(m_vals), fresh(p_vals), fresh(t_vals)
        t_stripped = stripped(t_vals, p_vals)
        want = splice_on_policy_token_ids(m, p, t, eos_token_id=EOS)
        final = len(want)
        a, b = fresh(m_vals[:-1]), fresh(t_vals[len(t_vals) - (len(want) - len(m) + 1):])
        assert a + b == want
        tensors = [torch.tensor(x) for x in (m_vals, p_vals, t_vals)]
        assert splice_on_policy_token_ids(*tensors, eos_token_id=EOS).tolist() == want
        assert splice_on_policy_token_ids(m, p, t_stripped, eos_token_id=EOS) == want
        methods = {
            "plain list concatenation": lambda: a + b,
            "splice, lists (eos)": lambda: splice_on_policy_token_ids(m, p, t, eos_token_id=EOS),
            "splice, lists (no history check)": lambda: splice_on_policy_token_ids(
                m, p, t, eos_token_id=EOS, check_history=False),
            "splice, lists (2 terminators)": lambda: splice_on_policy_token_ids(
                m, p, t, turn_terminator_ids=(EOS, OTHER_TERMINATOR)),
            "splice, lists, stripped history": lambda: splice_on_policy_token_ids(
                m, p, t_stripped, eos_token_id=EOS),
            "splice, tensors (eos)": lambda: splice_on_policy_token_ids(*tensors, eos_token_id=EOS),
        }
        if "head" in nemo:
            assert nemo["head"](tok, m, p, t) == want
            methods["NeMo RL main replace_prefix_tokens"] = lambda: nemo["head"](tok, m, p, t)
        if "v0.7.0" in nemo:
            assert nemo["v0.7.0"](tok, m, p, t) == want
            methods["NeMo RL v0.7.0 _replace_prefix_tokens"] = lambda: nemo["v0.7.0"](tok, m, p, t)
        turn_best = {name: float("inf") for name in methods}
        for _ in range(REPEATS):  # interleaved: every method sees the same machine load
            for name, fn in methods.items():
                start = time.perf_counter()
                fn()
                turn_best[name] = min(turn_best[name], time.perf_counter() - start)
        for name, value in turn_best.items():
            best[name] = best.get(name, 0.0) + value
        del m, p, t, t_stripped, tensors, a, b

    t_concat = best.pop("plain list concatenation")
    print(f"{TURNS} turns, final prompt {final} tokens, best of {REPEATS} interleaved rounds per turn")
    print(f"{'method':40s} {'total ms':>9s} {'per turn us':>12s} {'vs concat':>10s}")
    print(f"{'plain list concatenation':40s} {t_concat * 1e3:9.2f} {t_concat / TURNS * 1e6:12.1f} {1.0:10.2f}")
    for name, value in best.items():
        print(f"{name:40s} {value * 1e3:9.2f} {value / TURNS * 1e6:12.1f} {value / t_concat:10.2f}")
    r = {name: value / t_concat for name, value in best.items()}
    line = (f"RESULT splice_vs_concat={r['splice, lists (eos)']:.2f}"
            f" splice_nocheck_vs_concat={r['splice, lists (no history check)']:.2f}"
            f" splice_2term_vs_concat={r['splice, lists (2 terminators)']:.2f}"
            f" splice_stripped_history_vs_concat={r['splice, lists, stripped history']:.2f}"
            f" splice_tensor_vs_concat={r['splice, tensors (eos)']:.2f}")
    if "NeMo RL main replace_prefix_tokens" in best:
        theirs = best["NeMo RL main replace_prefix_tokens"]
        print(f"ours / NeMo RL main on the same inputs: {best['splice, lists (eos)'] / theirs:.3f} "
              f"(with the history check), {best['splice, lists (no history check)'] / theirs:.3f} "
              "(without, NeMo RL has none)")
        line += (f" nemo_main_vs_concat={theirs / t_concat:.2f}"
                 f" ours_vs_nemo_main={best['splice, lists (eos)'] / theirs:.3f}"
                 f" ours_nocheck_vs_nemo_main={best['splice, lists (no history check)'] / theirs:.3f}")
    if "NeMo RL v0.7.0 _replace_prefix_tokens" in best:
        line += f" nemo_v070_vs_concat={best['NeMo RL v0.7.0 _replace_prefix_tokens'] / t_concat:.2f}"
    print(line + f" final_tokens={final}")


if __name__ == "__main__":
    main()
