"""chunked_fp32_logprobs against a naive full-logits float64 reference: values, entropy,
gradients (hidden, weight, bias), gradcheck, and that no N x V buffer is ever allocated."""

from __future__ import annotations

import pytest
import torch

from rollout_parity.core.fp32_logprobs import chunked_fp32_logprobs
from rollout_parity.testing.memory import peak_alloc_bytes


def naive(hidden, weight, ids, bias=None, temperature=1.0):
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    logp_all = torch.log_softmax(z / temperature, -1)
    lp = logp_all.gather(-1, ids[..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return lp, ent


def make(n=37, h=16, v=53, seed=0, dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 2).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g).to(dtype).requires_grad_()
    b = torch.randn(v, generator=g).to(dtype).requires_grad_() if bias else None
    ids = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, b, ids


@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_values_and_grads_match_naive(chunk, temperature, with_entropy):
    hidden, weight, bias, ids = make()
    out = chunked_fp32_logprobs(
        hidden, weight, ids, bias=bias, chunk_size=chunk, temperature=temperature,
        return_entropy=with_entropy,
    )
    lp, ent = out if with_entropy else (out, torch.zeros(37))
    rlp, rent = naive(hidden, weight, ids, bias, temperature)
    torch.testing.assert_close(lp.double(), rlp, atol=2e-5, rtol=1e-5)
    if with_entropy:
        torch.testing.assert_close(ent.double(), rent, atol=2e-5, rtol=1e-5)
    assert lp.dtype == torch.float32

    c1 = torch.randn(37, dtype=torch.float64)
    c2 = torch.randn(37, dtype=torch.float64) if with_entropy else torch.zeros(37, dtype=torch.float64)
    (lp.double() * c1 + ent.double() * c2).sum().backward()
    got = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    (rlp * c1 + rent * c2).sum().backward()
    for a, t in zip(got, (hidden, weight, bias)):
        torch.testing.assert_close(a.double(), t.grad.double(), atol=5e-5, rtol=1e-4)


def test_logprob_only_gradient_and_shapes():
    hidden, weight, _, ids = make(n=24, bias=False)
    lp = chunked_fp32_logprobs(hidden.view(4, 6, 16), weight, ids.view(4, 6), chunk_size=7)
    assert lp.shape == (4, 6)
    lp.sum().backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    naive(hidden, weight, ids)[0].sum().backward()
    torch.testing.assert_close(gh, hidden.grad.float(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(gw, weight.grad.float(), atol=2e-5, rtol=1e-4)


def test_gradcheck_float64():
    hidden, weight, bias, ids = make(n=6, h=4, v=7, dtype=torch.float64)

    def f(h, w, b):
        lp, ent = chunked_fp32_logprobs(
            h, w, ids, bias=b, chunk_size=4, temperature=0.8, return_entropy=True
        )
        return lp, ent

    assert torch.autograd.gradcheck(f, (hidden, weight, bias), eps=1e-6, atol=1e-6)
    assert torch.autograd.gradcheck(
        lambda h, w, b: chunked_fp32_logprobs(h, w, ids, bias=b, chunk_size=5, temperature=1.7),
        (hidden, weight, bias),
    )
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_fp32_logprobs(h, w, ids, chunk_size=5), (hidden, weight)
    )


def test_bf16_inputs_are_computed_in_fp32():
    hidden, weight, bias, ids = make(dtype=torch.bfloat16)
    lp = chunked_fp32_logprobs(hidden, weight, ids, bias=bias, chunk_size=8)
    assert lp.dtype == torch.float32
    rlp, _ = naive(hidden.float(), weight.float(), ids, bias.float())
    torch.testing.assert_close(lp.double(), rlp, atol=2e-5, rtol=1e-5)
    # A bf16 head would be visibly off: the point of the fp32 head.
    bf16 = torch.log_softmax((hidden @ weight.t() + bias).float(), -1).gather(-1, ids[:, None])
    assert (bf16.squeeze(-1).double() - rlp).abs().max() > 1e-3
    lp.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == bias.grad.dtype == torch.bfloat16


def test_never_allocates_full_logits():
    n, h, v, chunk = 2048, 32, 4096, 128
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = torch.randn(v, h, generator=g).requires_grad_()
    ids = torch.randint(0, v, (n,), generator=g)
    chunk_bytes = chunk * v * 4
    grads_bytes = (n * h + v * h) * 4  # the gradients themselves are outputs, not overhead

    def run():
        lp, ent = chunked_fp32_logprobs(hidden, weight, ids, chunk_size=chunk, return_entropy=True)
        (lp.sum() + ent.sum()).backward()

    peak = peak_alloc_bytes(run)
    assert peak - grads_bytes < 1.5 * chunk_bytes, (peak, chunk_bytes)
    assert n * v * 4 > 10 * chunk_bytes  # the full logits would be far above the bound


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(hidden=torch.zeros(3, 4), weight=torch.zeros(5, 6), token_ids=torch.zeros(3, dtype=torch.long)), "disagree"),
        (dict(hidden=torch.zeros(3, 4), weight=torch.zeros(5, 4), token_ids=torch.zeros(2, dtype=torch.long)), r"\(2,\).*\(3, 4\)"),
        (dict(hidden=torch.zeros(3, 4), weight=torch.zeros(5, 4), token_ids=torch.tensor([0, 1, 5])), r"\[0, 5\)"),
        (dict(hidden=torch.zeros(3, 4), weight=torch.zeros(5, 4), token_ids=torch.zeros(3, dtype=torch.long), bias=torch.zeros(4)), "bias"),
        (dict(hidden=torch.zeros(3, 4), weight=torch.zeros(5, 4), token_ids=torch.zeros(3, dtype=torch.long), temperature=0.0), "temperature"),
        (dict(hidden=torch.zeros(3, 4), weight=torch.zeros(5, 4), token_ids=torch.zeros(3, dtype=torch.long), chunk_size=0), "chunk_size"),
    ],
)
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        chunked_fp32_logprobs(**args)


def test_fallback_without_inplace_softmax_gives_the_same_numbers(monkeypatch):
    from rollout_parity.core import fp32_logprobs as mod

    hidden, weight, bias, ids = make()
    fast = chunked_fp32_logprobs(hidden, weight, ids, bias=bias, chunk_size=8, return_entropy=True)
    sum(t.sum() for t in fast).backward()
    fast_grads = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    for kind in ("log", "exp"):
        monkeypatch.setitem(mod._inplace_ok, (kind, torch.float32, "cpu"), False)
    slow = chunked_fp32_logprobs(hidden, weight, ids, bias=bias, chunk_size=8, return_entropy=True)
    sum(t.sum() for t in slow).backward()
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    for a, t in zip(fast_grads, (hidden, weight, bias)):
        assert torch.equal(a, t.grad)


def test_masked_vocabulary_entries_add_nothing_to_the_entropy_or_its_gradient():
    """A head bias of -inf (vocabulary entries a model masks) gives p = 0 there: 0 log 0 = 0, not 0 * -inf = NaN,
    in the entropy and in its backward (the kernel of the CUDA forward does the same: test_kernel_properties.py)."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(40, 8, generator=g, dtype=torch.float64)
    bias = torch.zeros(40, dtype=torch.float64)
    bias[[3, 17, 39]] = float("-inf")
    ids = torch.tensor([0, 1, 2, 4, 5, 6])
    h = hidden.clone().requires_grad_()
    lp, ent = chunked_fp32_logprobs(h, weight, ids, bias=bias, chunk_size=4, temperature=0.7, return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    keep = torch.ones(40, dtype=torch.bool)
    keep[[3, 17, 39]] = False
    h_ref = hidden.clone().requires_grad_()
    ref = ((h_ref @ weight[keep].T) / 0.7).log_softmax(-1)  # the unmasked entries alone
    ref_lp = ref.gather(1, torch.searchsorted(keep.nonzero().squeeze(1), ids)[:, None]).squeeze(1)
    ref_ent = -(ref.exp() * ref).sum(-1)
    (ref_lp.sum() + ref_ent.sum()).backward()
    assert torch.allclose(lp, ref_lp, atol=1e-12) and torch.allclose(ent, ref_ent, atol=1e-12)
    assert torch.isfinite(h.grad).all() and torch.allclose(h.grad, h_ref.grad, atol=1e-10)
