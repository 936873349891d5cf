"""The head passes' matmul: exact fp32 whatever the caller's precision settings (restored after, also on error and
across threads), the temperature after the matmul, the path per device and dtype, no whole-head fp32 copy, and the
chunk from a memory budget.

What CPU cannot show: TF32 itself (CPU has none) and the bf16 GEMM with fp32 output (CPU torch has no kernel for
``mm(..., out_dtype=)``). Here the flags are checked at the moment the pass multiplies, and the GEMM branch runs
with a CPU stand-in for the CUDA op; ``scripts/gpu_check.py`` runs both for real on a GPU.
"""

from __future__ import annotations

import threading

import pytest
import torch

from rollout_parity.core import head_matmul
from rollout_parity.core.fp32_logprobs import chunked_fp32_logprobs
from rollout_parity.core.head_matmul import (
    HeadProjector, chunk_rows, default_memory_budget, exact_fp32_matmul, head_matmul_path, tile_rows,
)
from rollout_parity.core.sampler import sampler_logprobs_from_hidden
from rollout_parity.testing.memory import peak_alloc_bytes


def _flags() -> dict:
    """Every precision setting torch exposes, as a caller would read it (an error is a value too)."""
    m = torch.backends.cuda.matmul
    out = {}
    for name, read in [("legacy", torch.get_float32_matmul_precision), ("allow_tf32", lambda: m.allow_tf32),
                       ("cuda", lambda: m.fp32_precision), ("mkldnn", lambda: torch.backends.mkldnn.matmul.fp32_precision),
                       ("global", lambda: torch.backends.fp32_precision),
                       ("bf16_reduction", torch._C._get_cublas_allow_bf16_reduced_precision_reduction),
                       ("fp16_reduction", torch._C._get_cublas_allow_fp16_reduced_precision_reduction),
                       ("fp16_accumulation", lambda: m.allow_fp16_accumulation)]:
        try:
            out[name] = read()
        except RuntimeError as exc:
            out[name] = f"raises: {str(exc)[:40]}"
    return out


EXACT = {"legacy": "highest", "allow_tf32": False, "cuda": "ieee", "mkldnn": "ieee",
         "bf16_reduction": (False, True), "fp16_reduction": (False, True), "fp16_accumulation": False}


def _set_tf32_high():
    torch.set_float32_matmul_precision("high")


def _set_medium():
    torch.set_float32_matmul_precision("medium")  # also lets oneDNN run fp32 matmuls in bf16 on CPU


def _set_allow_tf32():
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = (False, False)


def _set_new_api_only():
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # torch >= 2.9's API alone: the legacy getters raise
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"


CALLER_SETTINGS = {"default": lambda: None, "precision high": _set_tf32_high, "precision medium": _set_medium,
                   "allow_tf32, fp16 split-k off": _set_allow_tf32, "new API only": _set_new_api_only}


@pytest.fixture
def restore_torch_flags():
    """Put torch's process-wide settings back after the test, whatever it did (and check the module's count)."""
    m = torch.backends.cuda.matmul
    saved = (torch.get_float32_matmul_precision(), m.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision,
             torch.backends.fp32_precision, torch._C._get_cublas_allow_bf16_reduced_precision_reduction(),
             torch._C._get_cublas_allow_fp16_reduced_precision_reduction())
    yield
    assert head_matmul._flags_depth == 0
    torch.set_float32_matmul_precision(saved[0])
    m.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision, torch.backends.fp32_precision = saved[1:4]
    m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = saved[4:]


def _spy(monkeypatch, seen: list, then=None):
    """Record the precision settings each time a pass multiplies by the head."""
    real = HeadProjector.logits_into

    def logits_into(self, out, h):
        seen.append(_flags())
        if then is not None:
            then()
        return real(self, out, h)

    monkeypatch.setattr(HeadProjector, "logits_into", logits_into)


def _inputs(n=24, h=16, v=97, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, generator=g).to(dtype), torch.randn(v, h, generator=g).to(dtype),
            torch.randint(0, v, (n,), generator=g), torch.randn(v, generator=g).to(dtype))


@pytest.mark.parametrize("setting", list(CALLER_SETTINGS))
def test_every_pass_multiplies_in_exact_fp32_and_restores_the_callers_settings(setting, monkeypatch,
                                                                               restore_torch_flags):
    CALLER_SETTINGS[setting]()
    before = _flags()
    seen = []
    _spy(monkeypatch, seen)
    hidden, weight, ids, bias = _inputs()
    hidden.requires_grad_()
    chunked_fp32_logprobs(hidden, weight, ids, bias=bias, chunk_size=7, temperature=0.7).sum().backward()
    sampler_logprobs_from_hidden(hidden.detach(), weight, ids, 0.7, 20, 0.9, bias=bias, chunk_size=7)
    assert len(seen) == 12  # 4 chunks of 7 rows in each of the forward, the backward and the sampler pass
    for inside in seen:
        assert {k: inside[k] for k in EXACT} == EXACT
    assert _flags() == before


def test_settings_are_restored_when_the_pass_raises(monkeypatch, restore_torch_flags):
    _set_tf32_high()
    before = _flags()

    def boom():
        raise RuntimeError("out of memory in the middle of a pass")

    _spy(monkeypatch, [], then=boom)
    hidden, weight, ids, _ = _inputs()
    with pytest.raises(RuntimeError, match="middle of a pass"):
        chunked_fp32_logprobs(hidden, weight, ids, chunk_size=7)
    with pytest.raises(RuntimeError, match="middle of a pass"):
        sampler_logprobs_from_hidden(hidden, weight, ids, 0.7, chunk_size=7)
    assert _flags() == before and head_matmul._flags_depth == 0


def test_concurrent_and_nested_passes_share_one_save_and_restore(monkeypatch, restore_torch_flags):
    """Two threads inside a pass at once, and a pass nested in an exact block: exact throughout, and the caller's
    settings come back only when the last one leaves."""
    _set_tf32_high()
    before = _flags()
    both_inside = threading.Barrier(2, timeout=60)
    seen: list = []
    _spy(monkeypatch, seen, then=both_inside.wait)
    hidden, weight, ids, _ = _inputs(n=8)
    errors: list = []

    def run():
        try:
            chunked_fp32_logprobs(hidden, weight, ids, chunk_size=8)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(seen) == 2
    assert all({k: s[k] for k in EXACT} == EXACT for s in seen)
    assert _flags() == before
    monkeypatch.undo()
    with exact_fp32_matmul():
        chunked_fp32_logprobs(hidden, weight, ids, chunk_size=8)
        assert _flags()["legacy"] == "highest"  # the inner pass left: the outer block still holds
    assert _flags() == before


def test_temperature_divides_the_logits_after_the_matmul():
    """As vLLM's sampler: fp32 logits, then ``div_`` by a float32 temperature; bit for bit on one chunk, and within
    fp32 rounding of a float64 reference."""
    hidden, weight, ids, bias = _inputs(n=16, h=64, v=300)
    t = 0.7
    z = torch.addmm(bias, hidden, weight.t()).div_(torch.full((16, 1), t))
    lp = z.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
    assert torch.equal(chunked_fp32_logprobs(hidden, weight, ids, bias=bias, chunk_size=16, temperature=t), lp)
    head = sampler_logprobs_from_hidden(hidden, weight, ids, t, bias=bias, chunk_size=16)
    assert torch.equal(head.full, lp)
    ref = ((hidden.double() @ weight.double().t() + bias.double()) / t).log_softmax(-1).gather(-1, ids[:, None])
    ref = ref.squeeze(-1)
    assert ((lp.double() - ref).abs() / ref.abs().clamp_min(1)).max() < 1e-6  # fp32 rounding of the logprob
    before = torch.addmm(bias / t, hidden / t, weight.t())  # the old order: 1/T on the hidden states and bias
    assert not torch.equal(before.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1), lp)


def test_the_path_per_device_and_dtype(monkeypatch):
    bf16, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    assert not head_matmul._gemm_fp32_out_works(torch.device("cpu"), bf16)  # CPU torch: no mm(..., out_dtype=)
    assert head_matmul_path(bf16, bf16, "cpu") == "upcast_tiles"
    assert head_matmul_path(f32, f32, "cpu") == head_matmul_path(bf16, f32, "cpu") == "direct"
    assert head_matmul_path(f64, bf16, "cpu") == "upcast_tiles" and head_matmul_path(f64, f64, "cpu") == "direct"
    # a GPU whose torch has the bf16 GEMM with fp32 output (probed once per device and dtype)
    monkeypatch.setattr(head_matmul, "_gemm_fp32_out_works", lambda device, dtype: True)
    assert head_matmul_path(bf16, bf16, "cuda") == head_matmul_path(f16, f16, "cuda:1") == "gemm_fp32_out"
    assert head_matmul_path(f32, bf16, "cuda") == "upcast_tiles"  # fp32 hidden: a bf16 cast would round them
    assert head_matmul_path(bf16, f32, "cuda") == head_matmul_path(f32, f32, "cuda") == "direct"
    assert head_matmul_path(bf16, f16, "cuda") == "upcast_tiles"
    monkeypatch.setattr(head_matmul, "_gemm_fp32_out_works", lambda device, dtype: False)
    assert head_matmul_path(bf16, bf16, "cuda") == "upcast_tiles"  # an older GPU or torch: the upcast


def _fp64_logprobs(hidden, weight, ids, bias, t):
    z = (hidden.double() @ weight.double().t() + bias.double()) / t
    return z.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)


def test_bf16_head_paths_are_fp32_accurate(monkeypatch):
    """The tile-wise upcast (CPU) and the GEMM branch (run here with a CPU stand-in for the CUDA op, checking what
    the branch hands it) give the fp32 head's logprobs: within fp32 rounding of float64 and of each other."""
    hidden, weight, ids, bias = _inputs(n=40, h=256, v=3000)
    hidden, weight, bias = (hidden * 0.2).bfloat16(), weight.bfloat16(), bias.bfloat16()  # logits of std ~3
    t = 0.7
    ref = _fp64_logprobs(hidden, weight, ids, bias, t)
    tiles = chunked_fp32_logprobs(hidden, weight, ids, bias=bias, chunk_size=16, temperature=t)
    assert tile_rows(3000, 256, 16) < 3000  # several tiles
    with exact_fp32_matmul():  # the tile's size changes nothing but the memory
        z_small, z_whole = torch.empty(40, 3000), torch.empty(40, 3000)
        HeadProjector(weight, bias, t, torch.bfloat16, torch.float32, 40, tile=7).logits_into(z_small, hidden)
        HeadProjector(weight, bias, t, torch.bfloat16, torch.float32, 40, tile=3000).logits_into(z_whole, hidden)
    assert ((z_small - z_whole).abs() / z_whole.abs().amax(-1, keepdim=True)).max() < 1e-6
    calls = []

    def gemm_stand_in(h, w, out):
        assert h.dtype == w.dtype == torch.bfloat16 and out.dtype == torch.float32 and w.data_ptr() == weight.data_ptr()
        calls.append(h.shape[0])
        torch.mm(h.float(), w.float().t(), out=out)

    monkeypatch.setattr(head_matmul, "_gemm_fp32_out", gemm_stand_in)
    monkeypatch.setattr(head_matmul, "head_matmul_path", lambda *a: "gemm_fp32_out")
    gemm = chunked_fp32_logprobs(hidden, weight, ids, bias=bias, chunk_size=16, temperature=t)
    gemm_sampler = sampler_logprobs_from_hidden(hidden, weight, ids, t, 50, 0.9, bias=bias, chunk_size=16)
    assert calls == [16, 16, 8] * 2
    monkeypatch.undo()
    tiles_sampler = sampler_logprobs_from_hidden(hidden, weight, ids, t, 50, 0.9, bias=bias, chunk_size=16)
    for got in (tiles, gemm, gemm_sampler.full, tiles_sampler.full):
        assert ((got.double() - ref).abs() / ref.abs().clamp_min(1)).max() < 1e-6
    torch.testing.assert_close(gemm_sampler.processed, tiles_sampler.processed, rtol=0, atol=5e-6)
    # the bf16 head itself (bf16 output) is far off: what the fp32 paths avoid
    bf16_out = ((hidden @ weight.t() + bias) / t).float().log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
    assert (bf16_out.double() - ref).abs().max() > 1e-3


def test_a_bf16_head_is_never_copied_whole_to_fp32():
    """Peak extra memory of both passes with a bf16 head: within 1.5 chunks of logits plus one fp32 vocabulary
    tile (and the chunk's upcast hidden states), far below the whole head in fp32."""
    n, h, v, chunk = 256, 512, 4096, 64
    hidden, weight, ids, _ = _inputs(n=n, h=h, v=v, dtype=torch.bfloat16)
    chunk_bytes, tile_bytes = chunk * v * 4, tile_rows(v, h, chunk) * h * 4
    bound = 1.5 * chunk_bytes + tile_bytes + chunk * h * 4
    whole_head = v * h * 4
    assert whole_head > 2 * bound
    outputs = 3 * n * 4  # logprobs, processed, outside
    plain = peak_alloc_bytes(lambda: chunked_fp32_logprobs(hidden, weight, ids, chunk_size=chunk, temperature=0.7))
    sampler = peak_alloc_bytes(lambda: sampler_logprobs_from_hidden(hidden, weight, ids, 0.7, None, 0.9,
                                                                    chunk_size=chunk))
    assert plain - outputs < bound and sampler - outputs < bound, (plain, sampler, bound, whole_head)


def test_the_chunk_comes_from_the_memory_budget():
    v = 5000
    assert default_memory_budget("cpu") == 256 * 2**20
    assert chunk_rows(10**6, v, "cpu") == (256 * 2**20 // int(1.75 * v * 4)) // 64 * 64
    assert chunk_rows(10**6, v, "cpu", 2**20) == 2**20 // int(1.75 * v * 4) // 1  # below 64 rows: as computed
    assert chunk_rows(10**6, v, "cpu", 2**30, itemsize=8) == chunk_rows(10**6, v, "cpu", 2**29)  # float64 rows
    assert chunk_rows(30, v, "cpu") == 30 and chunk_rows(0, v, "cpu") == 1 and chunk_rows(9, v, "cpu", 1) == 1
    with pytest.raises(ValueError, match="memory_budget"):
        chunk_rows(10, v, "cpu", 0)
    hidden, weight, ids, _ = _inputs(n=512, h=32, v=v)
    peaks = {}
    for budget in (2**20, 8 * 2**20):
        peaks[budget] = {
            "plain": peak_alloc_bytes(lambda: chunked_fp32_logprobs(hidden, weight, ids, memory_budget=budget)),
            "sampler": peak_alloc_bytes(lambda: sampler_logprobs_from_hidden(hidden, weight, ids, 0.8, 20, 0.9,
                                                                             memory_budget=budget)),
        }
        for peak in peaks[budget].values():
            assert peak - 3 * 512 * 4 <= budget
    assert all(peaks[8 * 2**20][k] > 4 * peaks[2**20][k] for k in ("plain", "sampler"))  # a larger chunk
    full = chunked_fp32_logprobs(hidden, weight, ids, chunk_size=512)
    assert torch.equal(chunked_fp32_logprobs(hidden, weight, ids, memory_budget=2**20), full)
    for fn in (lambda: chunked_fp32_logprobs(hidden, weight, ids, chunk_size=64, memory_budget=2**20),
               lambda: sampler_logprobs_from_hidden(hidden, weight, ids, chunk_size=64, memory_budget=2**20)):
        with pytest.raises(ValueError, match="chunk_size or memory_budget"):
            fn()


def test_the_fp32_head_patch_is_exact_and_never_copies_the_head(monkeypatch, restore_torch_flags):
    """``apply_fp32_lm_head``'s forward and backward: the caller's TF32 off inside and restored after, the numbers
    and gradients of ``F.linear`` on fp32 copies, and a bf16 head upcast one tile at a time (its whole fp32 copy
    would be 8 MiB)."""
    from rollout_parity.core.fp32_head import apply_fp32_lm_head

    _set_tf32_high()
    before = _flags()
    v, h = 4096, 512
    head = nn_linear = torch.nn.Linear(h, v).to(torch.bfloat16)
    apply_fp32_lm_head(nn_linear)
    x = torch.randn(2, 8, h).bfloat16().requires_grad_()
    seen = []
    real = HeadProjector.logits_into

    def spy(self, out, hh):
        seen.append(_flags())
        return real(self, out, hh)

    monkeypatch.setattr(HeadProjector, "logits_into", spy)
    out = head(x)
    (out * torch.linspace(-1, 1, v)).sum().backward()
    assert out.dtype == torch.float32 and len(seen) == 1 and {k: seen[0][k] for k in EXACT} == EXACT
    assert _flags() == before
    x2 = x.detach().clone().requires_grad_()
    w2, b2 = head.weight.detach().clone().requires_grad_(), head.bias.detach().clone().requires_grad_()
    ref = torch.nn.functional.linear(x2.float(), w2.float(), b2.float())
    (ref * torch.linspace(-1, 1, v)).sum().backward()
    assert torch.equal(out, ref)
    for got, want in ((x.grad, x2.grad), (head.weight.grad, w2.grad), (head.bias.grad, b2.grad)):
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)  # bf16 gradients
    x3 = torch.randn(1, h).bfloat16()
    with torch.no_grad():
        peak = peak_alloc_bytes(lambda: head(x3))
    assert peak <= v * 4 + (v // 8) * h * 4 + h * 4 + v * 4 < v * h * 4 // 4, peak  # logits, an eighth of W, x, b


def test_logits_into_leaves_the_division_to_a_caller_that_divides_as_it_reads():
    """``divide=False`` (the CUDA row kernel's input): h W^T + b exactly as before the division, which then gives
    ``divide=True``'s logits bit for bit."""
    g = torch.Generator().manual_seed(3)
    h, w, b = torch.randn(5, 16, generator=g), torch.randn(40, 16, generator=g), torch.randn(40, generator=g)
    head = HeadProjector(w, b, 0.7, torch.float32, torch.float32, 5)
    with exact_fp32_matmul():
        divided = head.logits_into(torch.empty(5, 40), h)
        raw = head.logits_into(torch.empty(5, 40), h, divide=False)
    assert torch.equal(raw, torch.addmm(b, h, w.t()))
    assert torch.equal(raw / torch.full((5, 1), 0.7), divided)
    assert not torch.equal(raw, divided)
