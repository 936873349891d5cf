"""The boundary rule, sampling replay (``KeptSets``) and the fast kept-set path, against naive references.

* Boundary rule: a sampled token the recomputed kept set missed gets ``log p(y) - log(S + p(y))``,
  the log-probability over the kept set with the token added (a per-row Python reference).
* Replay: with the engine's kept sets, the processed log-probability is the log-softmax over exactly
  that set; a token missing from the engine's own set is -inf (an engine failure).
* The chunked head pass (``sampler_logprobs_from_hidden``) settles peaked rows from their largest
  probabilities, without a sort, and equals the sorting path on them.
"""

from __future__ import annotations

import math

import pytest
import torch

from rollout_parity.core.kept_set import kept_log_mass
from rollout_parity.core.replay import KeptSets
from rollout_parity.engines.vllm.outputs import kept_sets as vllm_kept_sets
from rollout_parity.core.sampler import (kept_mass_metrics, processed_logits, rollout_on_full_vocabulary,
                                         sampler_logprobs, sampler_logprobs_from_hidden)

from .test_sampler import NEG_INF, naive_row

SETTINGS = [
    dict(temperature=0.7, top_k=None, top_p=0.9, min_p=0.0),
    dict(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=5, top_p=0.8, min_p=0.05),
    dict(temperature=0.6, top_k=None, top_p=0.95, min_p=0.1),
]


def _naive_with_set(z: list[float], temperature: float, kept: set[int], y: int) -> float:
    scaled = [v / temperature for v in z]
    m = max(scaled[i] for i in kept | {y})
    return scaled[y] - (m + math.log(sum(math.exp(scaled[i] - m) for i in kept | {y})))


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_boundary_rule_adds_the_sampled_token_to_the_kept_set(s):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(40, 30, generator=g) * 2
    ids = torch.randint(0, 30, (40,), generator=g)  # many of them outside the kept set
    res = sampler_logprobs(logits, ids, **s, return_outside=True)
    strict = sampler_logprobs(logits, ids, **s, return_outside=True, keep_sampled=False)
    assert res.num_outside > 5 and torch.equal(res.outside_mask, strict.outside_mask)
    assert torch.isfinite(res.logprobs).all() and torch.isneginf(strict.logprobs[strict.outside_mask]).all()
    for r in range(40):
        ref = naive_row(logits[r].tolist(), **s)
        kept = {i for i, v in enumerate(ref) if v != NEG_INF}
        y = int(ids[r])
        assert (y not in kept) == bool(res.outside_mask[r])
        assert res.logprobs[r].item() == pytest.approx(_naive_with_set(logits[r].tolist(), s["temperature"], kept, y),
                                                       abs=2e-5)
    # a kept token is untouched by the rule
    inside = ~res.outside_mask
    assert torch.equal(res.logprobs[inside], strict.logprobs[inside])


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_replay_renormalises_over_exactly_the_engines_set(s):
    g = torch.Generator().manual_seed(6)
    B, T, V = 2, 9, 30
    logits = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    # "engine" sets: the recomputed set, plus the sampled token, plus one more token at some positions
    sets = []
    for b in range(B):
        rows = []
        for t in range(T - 2 * b):  # row 1 is shorter: its last two positions have no set (padding)
            ref = naive_row(logits[b, t].tolist(), **s)
            kept = {i for i, v in enumerate(ref) if v != NEG_INF} | {int(ids[b, t])}
            if t % 3 == 0:
                kept.add((int(ids[b, t]) + 1) % V)
            rows.append(sorted(kept))
        sets.append(rows)
    kept_sets = KeptSets.from_lists(sets, width=T)
    assert kept_sets.recorded.tolist() == [[True] * T, [True] * (T - 2) + [False] * 2]
    out = sampler_logprobs(logits, ids, **s, kept_sets=kept_sets, return_outside=True)
    for b in range(B):
        for t in range(T):
            if t < len(sets[b]):
                want = _naive_with_set(logits[b, t].tolist(), s["temperature"], set(sets[b][t]), int(ids[b, t]))
                assert not out.outside_mask[b, t]  # replayed: the recomputed set is not consulted
            else:
                want = sampler_logprobs(logits[b, t:t + 1], ids[b, t:t + 1], **s)[0].item()
            assert out.logprobs[b, t].item() == pytest.approx(want, abs=2e-5), (b, t)
    # the head pass gives the same numbers
    hidden = torch.randn(B, T, 16, generator=g)
    weight = torch.randn(V, 16, generator=g)
    z = hidden @ weight.T
    head = sampler_logprobs_from_hidden(hidden, weight, ids, **s, kept_sets=kept_sets)
    ref = sampler_logprobs(z, ids, **s, kept_sets=kept_sets)
    torch.testing.assert_close(head.processed, ref, rtol=0, atol=2e-5)
    assert head.replayed_mask.tolist() == kept_sets.recorded.tolist() and head.num_replayed == 2 * T - 2
    # a sampled token missing from the engine's own set: an engine failure, -inf, in both paths
    broken = [[[i for i in kept if i != int(ids[0, 0])] for kept in sets[0]], sets[1]]
    bad = KeptSets.from_lists(broken, width=T)
    assert torch.isneginf(sampler_logprobs(logits, ids, **s, kept_sets=bad)[0, 0])
    assert torch.isneginf(sampler_logprobs_from_hidden(hidden, weight, ids, **s, kept_sets=bad).processed[0, 0])


def test_replay_covers_the_boundary_token_the_recomputed_set_misses():
    """The motivating case: engine and trainer logits differ by noise at the nucleus edge."""
    engine = torch.tensor([[2.0, 1.0, 0.5, -3.0]])
    trainer = engine + torch.tensor([[0.0, 0.0, -0.01, 0.0]])  # token 2 drops out of the trainer's top-p
    y = torch.tensor([2])
    above = [float(x.softmax(-1)[0, :2].sum()) for x in (engine, trainer)]  # the mass ranked above token 2
    p = sum(above) / 2  # between the two: the engine keeps token 2, the trainer's nucleus cuts it
    engine_set = [i for i, v in enumerate(naive_row(engine[0].tolist(), 1.0, None, p, 0.0)) if v != NEG_INF]
    assert 2 in engine_set
    engine_lp = naive_row(engine[0].tolist(), 1.0, None, p, 0.0)[2]
    strict = sampler_logprobs(trainer, y, top_p=p, keep_sampled=False)
    assert torch.isneginf(strict[0])  # what made a whole sequence "maximal mismatch" before
    ruled = sampler_logprobs(trainer, y, top_p=p)
    replayed = sampler_logprobs(trainer, y, top_p=p, kept_sets=KeptSets.from_lists([[engine_set]]).reshape(1))
    assert abs(ruled[0].item() - engine_lp) < 0.02  # the noise's size, not 20
    assert abs(replayed[0].item() - engine_lp) < 0.02
    assert replayed[0].item() == pytest.approx(ruled[0].item(), abs=1e-6)  # here the rule recovers the engine's set


def test_kept_sets_formats_round_trip_and_slice():
    class SamplingMask:  # vllm.outputs.SamplingMask's shape, without importing vLLM
        def __init__(self, token_ids):
            self.token_ids = token_ids

    sets = vllm_kept_sets([SamplingMask([[3, 1], [4], [1, 5, 9]]), None, [[2, 6]]], width=4)
    assert sets.shape == (3, 4)
    assert sets.counts.tolist() == [[2, 1, 3, 0], [0, 0, 0, 0], [2, 0, 0, 0]]
    padded = sets.to_padded()
    assert padded.shape == (3, 4, 3) and padded[0, 2].tolist() == [1, 5, 9] and padded[1].eq(-1).all()
    again = KeptSets.from_padded(padded)
    assert torch.equal(again.ids, sets.ids) and torch.equal(again.offsets, sets.offsets) and again.shape == sets.shape
    tail = sets.rows(2, 3)
    assert tail.shape == (1, 4) and tail.to_padded(3)[0, 0].tolist() == [2, 6, -1]
    rows, ids = sets.flat_rows(1, 3)
    assert rows.tolist() == [0, 1, 1, 1] and ids.tolist() == [4, 1, 5, 9]
    with pytest.raises(ValueError, match="4 positions but the batch is 3 tokens wide"):
        KeptSets.from_lists([[[1], [2], [3], [4]]], width=3)
    with pytest.raises(ValueError, match=r"kept_sets has shape \(3, 4\) but token_ids has shape \(3, 5\)"):
        sampler_logprobs(torch.zeros(3, 5, 10), torch.zeros(3, 5, dtype=torch.long), top_k=2, kept_sets=sets)


def _peaked_logits(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Rows shaped like a trained LM's: a few tokens carry the mass, the rest a flat floor."""
    z = torch.randn(rows, vocab, generator=gen)
    for r in range(rows):
        n = int(torch.randint(1, 6, (1,), generator=gen))
        top = torch.randperm(vocab, generator=gen)[:n]
        z[r, top] += 9 + torch.rand(n, generator=gen) * 3
    return z


@pytest.mark.parametrize("s", SETTINGS + [dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.0)],
                         ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_fast_path_settles_peaked_rows_and_equals_the_sorting_path(s):
    g = torch.Generator().manual_seed(8)
    z = _peaked_logits(200, 2000, g) / s["temperature"]
    lp = z.log_softmax(-1)
    log_s, smallest, settled = kept_log_mass(lp, s["top_k"], s["top_p"], s["min_p"])
    assert settled.float().mean() > 0.95, settled.float().mean()
    exact = processed_logits(lp, 1.0, s["top_k"], s["top_p"], s["min_p"])
    kept = ~torch.isneginf(exact)
    torch.testing.assert_close(log_s[settled], torch.logsumexp(exact.double(), -1)[settled], rtol=0, atol=1e-6)
    assert torch.equal((lp >= smallest[:, None])[settled], kept[settled])
    # and the head pass on such rows equals the logits reference, outside tokens and all
    hidden = torch.randn(200, 24, generator=g)
    weight = torch.randn(2000, 24, generator=g) * 0.2
    weight[:, 0] += torch.where(torch.rand(2000, generator=g) < 0.002, 60.0, 0.0)  # a few strong tokens
    logits = hidden @ weight.T
    ids = torch.randint(0, 2000, (200,), generator=g)
    ids[::2] = logits[::2].argmax(-1)
    head = sampler_logprobs_from_hidden(hidden, weight, ids, **s, chunk_size=64)
    ref = sampler_logprobs(logits, ids, **s, return_outside=True)
    torch.testing.assert_close(head.processed, ref.logprobs, rtol=1e-6, atol=2e-5)  # logits of ~100 here
    assert torch.equal(head.outside_mask, ref.outside_mask) and head.num_outside > 0


def test_kept_mass_metrics_count_the_rule_and_replay_from_their_masks():
    log_s = torch.tensor([[-0.1, -0.2, -0.05], [-0.3, 0.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    outside = torch.tensor([[False, True, False], [False, True, False]])  # (1, 1) is padding: not counted
    replayed = torch.tensor([[True, True, False], [False, False, False]])
    out = kept_mass_metrics(log_s, mask, outside_mask=outside, replayed_mask=replayed)
    assert out["rollout_correction/sampler_outside_kept_frac"] == pytest.approx(1 / 5)
    assert out["rollout_correction/sampler_replayed_frac"] == pytest.approx(2 / 5)
    assert out["rollout_correction/sampler_log_kept_mass"] == pytest.approx((-0.1 - 0.2 - 0.05 - 0.3) / 4)
    assert "rollout_correction/sampler_replayed_frac" not in kept_mass_metrics(log_s, mask, outside_mask=outside)


def test_bypass_moves_a_boundary_token_like_any_other():
    logits = torch.tensor([[[2.0, 1.0, 0.5, -3.0], [3.0, 0.0, -1.0, -2.0]]])
    ids = torch.tensor([[2, 0]])
    full = logits.log_softmax(-1).gather(-1, ids[..., None])[..., 0]
    processed = sampler_logprobs(logits, ids, top_p=0.7)  # token 2 outside the 0.7 nucleus: the rule
    rollout = processed + 0.01
    moved = rollout_on_full_vocabulary(rollout, full, processed)
    torch.testing.assert_close(moved, full + 0.01)  # log q + log S' = log p + 0.01 on both tokens


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_flat_rows_settle_from_the_ascending_end_as_vllm_walks_them(top_p):
    from rollout_parity.core.kept_set import settle_kept_sets

    g = torch.Generator().manual_seed(11)
    lp = (torch.randn(40, 5000, generator=g) * torch.rand(40, 1, generator=g)).log_softmax(-1)  # no favourites
    assert kept_log_mass(lp, None, top_p, 0.0)[2].float().mean() < 0.5  # the largest do not settle them
    log_s, smallest, settled = settle_kept_sets(lp, None, top_p, 0.0)
    assert settled.all()
    exact = processed_logits(lp, 1.0, None, top_p, 0.0)
    torch.testing.assert_close(log_s, torch.logsumexp(exact.double(), -1), rtol=0, atol=1e-6)
    assert torch.equal(lp >= smallest[:, None], ~torch.isneginf(exact))


def test_fewer_candidates_settle_fewer_rows_and_those_they_settle_exactly():
    """``candidates``: how many of a row's largest probabilities settle its kept set. With one candidate only
    rows whose top token alone passes top-p settle; with the whole vocabulary every row does; what is
    settled is exact either way (the sorting path's kept set and log S)."""
    g = torch.Generator().manual_seed(3)
    lp = (_peaked_logits(200, 500, g) / 0.7).log_softmax(-1)
    exact = processed_logits(lp, 1.0, None, 0.9, 0.0)
    kept = ~torch.isneginf(exact)
    share = {}
    for candidates in (1, 32, 500):
        log_s, smallest, settled = kept_log_mass(lp, None, 0.9, 0.0, candidates=candidates)
        torch.testing.assert_close(log_s[settled], torch.logsumexp(exact.double(), -1)[settled], rtol=0, atol=1e-6)
        assert torch.equal((lp >= smallest[:, None])[settled], kept[settled])
        share[candidates] = settled.float().mean().item()
    one_token = kept.sum(-1) == 1  # a row one candidate can settle: its top token is the whole kept set
    assert share[1] == pytest.approx(one_token.float().mean().item()) and 0 < share[1] < share[32] <= share[500] == 1.0
