"""Speed of the on-policy token-ID splice against a plain list concatenation of the same size.

A 100-turn conversation growing to 200k tokens: at every turn the splice rebuilds the prompt
from the model prefix (previous prompt + generation) and the re-templated history, as a chat
server does per request. The baseline is ``a + b`` for two ready lists of the same total length
as each spliced prompt: the copy any prompt rebuild must do. Both are summed over the 100
turns; each is the best of several interleaved rounds, measured in one run.

Lists of Python ints pay one int comparison per token per scan (the splice needs at least two
scans: count the terminators of the template prefix, find the n-th in the template; a third
checks the model prefix), and one comparison costs several times a pointer copy. Tensors run
each scan as one vectorised op. Both are measured against the same list-concatenation baseline.

Prints a table, then ``RESULT splice_vs_concat=<lists> ... splice_tensor_vs_concat=<tensors>``
(target <= 3).
"""

from __future__ import annotations

import random
import time

from rollout_parity.core.token_ids import splice_on_policy_token_ids

TURNS = 100
TOTAL_TOKENS = 200_000
EOS, OTHER_TERMINATOR = 2, 3
REPEATS = 9


def build_turns(seed: int = 0):
    """(model_prefix, template_prefix, template) per turn, with re-tokenisation drift."""
    rng = random.Random(seed)
    per_turn = TOTAL_TOKENS // TURNS
    model_prefix: list[int] = []
    template_prefix_base: list[int] = []
    cases = []
    for _ in range(TURNS):
        tool = [rng.randrange(10, 50_000) for _ in range(per_turn // 2 - 1)] + [EOS]
        gen = [rng.randrange(10, 50_000) for _ in range(per_turn // 2 - 1)] + [EOS]
        # The template re-tokenises the generation: a few tokens merge.
        regen = gen[:5] + [rng.randrange(50_000, 60_000)] + gen[7:]
        model_prefix = model_prefix + tool + gen
        template_prefix = template_prefix_base + tool + regen
        template = template_prefix + [rng.randrange(10, 50_000) for _ in range(20)] + [EOS]
        cases.append((model_prefix, template_prefix, template))
        template_prefix_base = template_prefix
    return cases


def best_of(fn) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    cases = build_turns()
    outputs = [splice_on_policy_token_ids(m, p, t, eos_token_id=EOS) for m, p, t in cases]
    # Baseline operands: two ready lists whose lengths add up to each spliced prompt's.
    operands = [(m[:-1], t[len(t) - (len(o) - len(m) + 1):]) for (m, _, t), o in
                zip(cases, outputs)]
    assert all(len(a) + len(b) == len(o) for (a, b), o in zip(operands, outputs))
    final = len(outputs[-1])

    def concat():
        for a, b in operands:
            a + b

    def splice(**kw):
        def run():
            for m, p, t in cases:
                splice_on_policy_token_ids(m, p, t, **kw)
        return run

    import torch

    # Intra-op threads only add scheduling noise to ops of this size on a shared machine.
    torch.set_num_threads(1)
    tensor_cases = [tuple(torch.tensor(x) for x in case) for case in cases]
    for (m, p, t), o in zip(tensor_cases, outputs):
        assert splice_on_policy_token_ids(m, p, t, eos_token_id=EOS).tolist() == o

    def splice_tensors():
        for m, p, t in tensor_cases:
            splice_on_policy_token_ids(m, p, t, eos_token_id=EOS)

    # Interleaved rounds: every method sees the same machine load; the best round counts.
    methods = {
        "plain list concatenation": concat,
        "splice, lists (eos)": splice(eos_token_id=EOS),
        "splice, lists (no history check)": splice(eos_token_id=EOS, check_history=False),
        "splice, lists (2 terminators)": splice(turn_terminator_ids=(EOS, OTHER_TERMINATOR)),
        "splice, tensors (eos)": splice_tensors,
    }
    best = {name: float("inf") for name in methods}
    for _ in range(REPEATS):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    t_concat = best.pop("plain list concatenation")
    rows = list(best.items())
    print(f"{TURNS} turns, final prompt {final} tokens, best of {REPEATS} interleaved rounds")
    print(f"{'method':34s} {'total ms':>9s} {'per turn us':>12s} {'vs concat':>10s}")
    print(f"{'plain list concatenation':34s} {t_concat * 1e3:9.2f} {t_concat / TURNS * 1e6:12.1f}"
          f" {1.0:10.2f}")
    for name, t in rows:
        print(f"{name:34s} {t * 1e3:9.2f} {t / TURNS * 1e6:12.1f} {t / t_concat:10.2f}")
    # For scale: what the server pays anyway to re-tokenise the last turn's whole history.
    from rollout_parity.testing.tokenizer import build_chat_tokenizer

    tok = build_chat_tokenizer()
    text = " ".join(["The skinny skier skis in the snow, and the answer is 42."] * 13_400)
    n_text = len(tok(text, add_special_tokens=False)["input_ids"])
    t_tok = best_of(lambda: tok(text, add_special_tokens=False))
    print(f"for scale: tokenising one {n_text}-token prompt with the local BPE: {t_tok * 1e3:.1f} ms "
          f"({t_tok * 1e3 / (rows[0][1] * 1e3 / TURNS):.0f}x one list splice of the 100-turn mean)")
    r = [t / t_concat for _, t in rows]
    print(f"RESULT splice_vs_concat={r[0]:.2f} splice_nocheck_vs_concat={r[1]:.2f}"
          f" splice_2term_vs_concat={r[2]:.2f} splice_tensor_vs_concat={r[3]:.2f}"
          f" final_tokens={final} tokenize_one_prompt_ms={t_tok * 1e3:.1f}")


if __name__ == "__main__":
    main()
