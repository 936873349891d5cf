"""A kernel that fails to launch falls back to the torch path, with one warning that names it and its cause.

On a user's GPU a Triton kernel is compiled at its first launch, which can fail where the import did not (no host C
compiler for Triton's launcher, a ptxas/driver mismatch, ``OutOfResources``). These tests make the launches fail as
they would there (the kernel raises at the call) and compare the pass with the torch path on the same inputs; the
candidates kernel failing alone, beside a working row kernel, runs under Triton's interpreter in
``tests/test_kept_candidates_kernel.py`` (section 4).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from rollout_parity.core import fp32_logprobs, kernel_launch, sampler
from rollout_parity.core.kernel_launch import KernelFallbackWarning, failed_launches, launch


@pytest.fixture(autouse=True)
def _fresh():
    kernel_launch.reset_failed_launches()
    yield
    kernel_launch.reset_failed_launches()


def _failing(message="Failed to find C compiler. Please specify via CC environment variable."):
    calls = []

    def kernel(*args, **kwargs):
        calls.append(1)
        raise RuntimeError(message)

    kernel.calls = calls
    return kernel


def _inputs(n=30, h=16, v=300):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(n, h, generator=g) * 3, torch.randn(v, h, generator=g) / h ** 0.5,
            torch.randint(0, v, (n,), generator=g))


def test_a_row_kernel_that_fails_to_launch_leaves_torchs_answer_and_warns_once(monkeypatch):
    hidden, weight, ids = _inputs()
    ref = sampler.sampler_logprobs_from_hidden(hidden, weight, ids, 0.7, top_k=20, top_p=0.9, chunk_size=8)
    row = _failing()
    monkeypatch.setattr(sampler, "_row_kernels", lambda device, top_k: (row, _failing("never reached")))
    with pytest.warns(KernelFallbackWarning, match=r"row_logprob_entropy\+lse failed to launch on cpu "
                                                   r"\(RuntimeError: Failed to find C compiler"):
        got = sampler.sampler_logprobs_from_hidden(hidden, weight, ids, 0.7, top_k=20, top_p=0.9, chunk_size=8)
    assert torch.equal(got.full, ref.full) and torch.equal(got.processed, ref.processed)
    assert torch.equal(got.outside_mask, ref.outside_mask)
    assert len(row.calls) == 1  # the other three chunks did not try again
    assert failed_launches() == {("cpu", "row_logprob_entropy+lse"): "RuntimeError: Failed to find C compiler. "
                                                                       "Please specify via CC environment variable."}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call: no warning, no launch
        again = sampler.sampler_logprobs_from_hidden(hidden, weight, ids, 0.7, top_k=20, top_p=0.9, chunk_size=8)
    assert torch.equal(again.processed, ref.processed) and len(row.calls) == 1


def test_the_plain_passs_kernel_falls_back_per_variant(monkeypatch):
    hidden, weight, ids = _inputs()
    ref_lp, ref_ent = fp32_logprobs.chunked_fp32_logprobs(hidden, weight, ids, temperature=0.7, chunk_size=8,
                                                          return_entropy=True)
    row = _failing("out of resource: shared memory, Required: 262144, Hardware limit: 232448")
    monkeypatch.setattr(fp32_logprobs, "_row_kernel", lambda device, cdtype: row)
    with pytest.warns(KernelFallbackWarning, match=r"row_logprob_entropy\+entropy failed to launch"):
        lp, ent = fp32_logprobs.chunked_fp32_logprobs(hidden, weight, ids, temperature=0.7, chunk_size=8,
                                                      return_entropy=True)
    assert torch.equal(lp, ref_lp) and torch.equal(ent, ref_ent)
    # another variant (no entropy) on the same device is tried on its own
    with pytest.warns(KernelFallbackWarning, match=r"row_logprob_entropy failed to launch"):
        lp = fp32_logprobs.chunked_fp32_logprobs(hidden, weight, ids, temperature=0.7, chunk_size=8)
    assert torch.equal(lp, ref_lp) and len(row.calls) == 2


def test_the_backward_after_a_fallback_is_torchs(monkeypatch):
    hidden, weight, ids = _inputs()
    grads = []
    for kernel in (None, _failing()):
        monkeypatch.setattr(fp32_logprobs, "_row_kernel", lambda device, cdtype, k=kernel: k)
        h = hidden.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KernelFallbackWarning)
            fp32_logprobs.chunked_fp32_logprobs(h, weight, ids, chunk_size=8).sum().backward()
        grads.append(h.grad)
    assert torch.equal(*grads)


def test_an_argument_error_of_a_wrapper_is_the_callers_and_propagates():
    def wrapper(*args):
        raise ValueError("z must be a 2-D float32 tensor")

    with pytest.raises(ValueError, match="2-D float32"):
        launch("row_logprob_entropy", torch.device("cpu"), wrapper)
    assert failed_launches() == {}  # not recorded as a failed launch


def test_rocm_keeps_the_torch_path(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    assert not kernel_launch.kernels_allowed(torch.device("cuda"))
    assert fp32_logprobs._row_kernel(torch.device("cuda"), torch.float32) is None
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert kernel_launch.kernels_allowed(torch.device("cuda"))
    assert not kernel_launch.kernels_allowed(torch.device("cpu"))
