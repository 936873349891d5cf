"""``sampler_logprobs_from_hidden``: the chunked head pass equals the full-logits references."""

from __future__ import annotations

import pytest
import torch

from rollout_parity.core.sampler import sampler_logprobs, sampler_logprobs_from_hidden

SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=20),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=0.9, top_k=40, top_p=0.85, min_p=0.02),
    dict(temperature=0.0),
]


@pytest.mark.parametrize("sampling", SETTINGS)
@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_equals_full_logits_references(sampling, chunk_size):
    gen = torch.Generator().manual_seed(1234)
    hidden = torch.randn(3, 11, 16, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(97, 16, generator=gen) * 0.8).to(torch.bfloat16)
    bias = torch.randn(97, generator=gen) * 0.1
    logits = hidden.float() @ weight.float().T + bias  # the fp32 head, materialised once here
    temperature = sampling["temperature"]
    scaled = logits if temperature < 1e-5 else logits / temperature
    tokens = scaled.softmax(-1).reshape(-1, 97).multinomial(1, generator=gen).reshape(3, 11)

    out = sampler_logprobs_from_hidden(hidden, weight, tokens, bias=bias, chunk_size=chunk_size, **sampling)

    naive_full = torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.full, naive_full, rtol=0, atol=1e-5)
    processed = sampler_logprobs(logits, tokens, return_outside=True, **sampling)
    torch.testing.assert_close(out.processed, processed.logprobs, rtol=0, atol=1e-5)
    assert torch.equal(out.outside_mask, processed.outside_mask)
    assert out.num_outside == processed.num_outside
    finite = torch.isfinite(out.processed)
    if sampling.get("top_k") or sampling.get("top_p", 1.0) < 1.0:
        # Renormalising over the kept set raises every kept token's logprob by -log S > 0.
        assert (out.processed[finite] >= out.full[finite] - 1e-6).all()
        assert (out.processed[finite] - out.full[finite]).max() > 1e-3


def test_rejects_mismatched_shapes_naming_them():
    with pytest.raises(ValueError, match=r"hidden .*\(2, 5, 8\).*token_ids \(2, 4\)"):
        sampler_logprobs_from_hidden(torch.zeros(2, 5, 8), torch.zeros(10, 8), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"weight must be \(vocab, 8\)"):
        sampler_logprobs_from_hidden(torch.zeros(2, 8), torch.zeros(10, 9), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token_ids must lie in \[0, 10\)"):
        sampler_logprobs_from_hidden(torch.zeros(2, 8), torch.zeros(10, 8), torch.tensor([0, 10]))


def test_projects_in_fp32_under_bf16_autocast():
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(40, 16, generator=gen)
    weight = torch.randn(97, 16, generator=gen)
    tokens = torch.randint(0, 97, (40,), generator=gen)
    plain = sampler_logprobs_from_hidden(hidden, weight, tokens, temperature=0.7)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        under = sampler_logprobs_from_hidden(hidden, weight, tokens, temperature=0.7)
    assert torch.equal(under.full, plain.full)
    assert torch.equal(under.processed, plain.processed)


def test_response_mask_counts_only_its_tokens_outside_the_kept_set():
    """Padding positions carry arbitrary ids: a token outside the kept set there is not counted,
    exactly as ``sampler_logprobs(response_mask=...)`` on the full logits counts it."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 6, 16, generator=gen)
    weight = torch.randn(97, 16, generator=gen)
    logits = hidden @ weight.T
    tokens = logits.argmin(-1)  # the least likely token: outside top-k 5 everywhere
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    out = sampler_logprobs_from_hidden(hidden, weight, tokens, top_k=5, response_mask=mask)
    ref = sampler_logprobs(logits, tokens, top_k=5, response_mask=mask, return_outside=True)
    assert out.num_outside == ref.num_outside == 4
    assert torch.equal(out.outside_mask, mask.bool()) and torch.equal(out.outside_mask, ref.outside_mask)
    assert sampler_logprobs_from_hidden(hidden, weight, tokens, top_k=5).num_outside == 12
