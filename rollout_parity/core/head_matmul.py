"""The fp32 head's logits for one chunk of rows: exact fp32 whatever the caller's settings, no fp32 copy of the head.

Every trainer-side head pass (:func:`~rollout_parity.core.fp32_logprobs.chunked_fp32_logprobs`,
:func:`~rollout_parity.core.sampler.sampler_logprobs_from_hidden`) computes, a chunk of rows at a time,

    z = (h W^T + b) / T          (float32; float64 when an input is float64)

in vLLM's order: the matmul in fp32, then the division by the temperature (vLLM's sampler divides the
logits, ``logits.div_(temp)``). Three decisions make that z the fp32 head's, on any device:

**Exact fp32, locally.** TF32 (``torch.backends.cuda.matmul.allow_tf32``,
``torch.set_float32_matmul_precision("high")``, transformers' ``tf32=True``) runs "fp32" matmuls with
10-bit mantissas, and reduced-precision reductions let bf16/fp16 GEMMs accumulate in low precision.
:func:`exact_fp32_matmul` turns both off for the pass (and oneDNN's bf16 shortcut for fp32 matmuls on
CPU, ``set_float32_matmul_precision("medium")``) and restores the caller's settings after it, also when
the pass raises. The settings are process-wide torch flags: nested and concurrent passes share one
save/restore (a lock and a depth count), so the last pass to finish restores them; another thread's
own matmuls run exact while a pass is in flight.

**The fastest exact path** (:func:`head_matmul_path`):

* ``"gemm_fp32_out"``: on CUDA with a bf16 head and bf16 hidden states (or both fp16),
  ``torch.mm(h, W.T, out_dtype=torch.float32)``. The product of two bf16 numbers (8-bit significands)
  is exact in fp32 (24 bits) and the GEMM accumulates in fp32, so this is the fp32 head's matmul, on
  tensor cores, with no fp32 copy of W. Chosen only where a probe of the op on that device succeeds.
* ``"direct"``: the weight already has the compute dtype (an fp32 head; float64): a plain ``mm`` on
  views; only the chunk's hidden states are upcast.
* ``"upcast_tiles"``: everything else (CPU, whose torch has no ``mm(..., out_dtype=)`` kernel; a bf16
  head with fp32 hidden states): W is upcast one vocabulary tile at a time into a reused buffer.

**No whole-head fp32 copy.** The head is never upcast whole: beyond the (chunk, V) logits buffer a pass
holds at most one fp32 vocabulary tile of W (:func:`tile_rows`: at most a quarter of the chunk's
logits buffer, and at least 256 rows).

**The chunk from the device** (:func:`chunk_rows`): when the caller gives no ``chunk_size``, the rows
per chunk are the most whose working set (the logits buffer, the pass's temporaries and the tile,
1.75 chunks of logits) fits ``memory_budget`` bytes; the default budget is
:func:`default_memory_budget`: 256 MiB on CPU, and on a GPU a quarter of the memory free to torch
(driver-free plus torch's cached, unused blocks), at most 4 GiB.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch

__all__ = [
    "GEMM_DTYPES", "HeadProjector", "chunk_rows", "default_memory_budget", "exact_fp32_matmul",
    "head_matmul_path", "tile_rows",
]

#: Head dtypes whose products are exact in fp32 (significand 8 and 11 bits: products of 16 and 22 bits <= 24).
GEMM_DTYPES = (torch.bfloat16, torch.float16)
#: Logits buffers of one chunk that a pass's working set spans: the buffer, its temporaries, the tile.
WORKING_SET_CHUNKS = 1.75
_MIN_TILE_ROWS = 256
_CPU_BUDGET = 256 * 2**20
_GPU_BUDGET_CAP = 4 * 2**30

# --- exact fp32 matmuls, whatever the caller set -------------------------------------------------------

_flags_lock = threading.Lock()
_flags_depth = 0
_flags_saved: Optional[dict] = None


def _reduction_flag(kind: str):
    """The value that sets cuBLAS's reduced-precision reduction for ``kind`` (bf16/fp16) back as it was."""
    m = torch.backends.cuda.matmul
    allow = getattr(m, f"allow_{kind}_reduced_precision_reduction")
    try:
        return allow, getattr(m, f"allow_{kind}_reduced_precision_reduction_split_k")
    except AttributeError:  # a torch without the split-k switch takes a bool
        return allow


def _backend_precisions() -> dict:
    """torch's per-backend fp32 matmul precisions (the API of torch >= 2.9), where this torch has them."""
    out = {}
    for key, backend in (("cuda", torch.backends.cuda.matmul), ("mkldnn", getattr(torch.backends.mkldnn, "matmul", None))):
        try:
            out[key] = backend.fp32_precision
        except AttributeError:
            pass
    return out


def _save_flags() -> dict:
    saved = {"backends": _backend_precisions()}
    try:
        saved["legacy"] = torch.get_float32_matmul_precision()
    except RuntimeError:  # the caller mixed torch's legacy and per-backend precision APIs: restore the latter
        saved["legacy"] = None
    saved["reduction"] = {kind: _reduction_flag(kind) for kind in ("bf16", "fp16")}
    try:
        saved["fp16_accumulation"] = torch.backends.cuda.matmul.allow_fp16_accumulation
    except AttributeError:
        pass
    return saved


def _set_exact_flags(saved: dict) -> None:
    m = torch.backends.cuda.matmul
    if saved["legacy"] is not None:
        torch.set_float32_matmul_precision("highest")  # also sets the per-backend precisions to "ieee"
    for key in saved["backends"]:
        (m if key == "cuda" else torch.backends.mkldnn.matmul).fp32_precision = "ieee"
    m.allow_bf16_reduced_precision_reduction = False
    m.allow_fp16_reduced_precision_reduction = False
    if "fp16_accumulation" in saved:
        m.allow_fp16_accumulation = False


def _restore_flags(saved: dict) -> None:
    m = torch.backends.cuda.matmul
    if saved["legacy"] is not None:
        torch.set_float32_matmul_precision(saved["legacy"])
    for key, value in saved["backends"].items():
        (m if key == "cuda" else torch.backends.mkldnn.matmul).fp32_precision = value
    m.allow_bf16_reduced_precision_reduction = saved["reduction"]["bf16"]
    m.allow_fp16_reduced_precision_reduction = saved["reduction"]["fp16"]
    if "fp16_accumulation" in saved:
        m.allow_fp16_accumulation = saved["fp16_accumulation"]


@contextlib.contextmanager
def exact_fp32_matmul() -> Iterator[None]:
    """Inside: fp32 matmuls in full fp32 (no TF32, no oneDNN bf16) and fp32 accumulation for bf16/fp16 GEMMs.

    The caller's settings are restored on exit, exception or not. Nested and concurrent uses share one
    save/restore: the first to enter saves, the last to leave restores.
    """
    global _flags_depth, _flags_saved
    with _flags_lock:
        if _flags_depth == 0:
            saved = _save_flags()
            _set_exact_flags(saved)
            _flags_saved = saved
        _flags_depth += 1
    try:
        yield
    finally:
        with _flags_lock:
            _flags_depth -= 1
            if _flags_depth == 0:
                saved, _flags_saved = _flags_saved, None
                _restore_flags(saved)


# --- which path, how many rows -------------------------------------------------------------------------

_gemm_probe: dict[tuple[str, Optional[int], torch.dtype], bool] = {}


def _gemm_fp32_out_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Does ``torch.mm(a, b, out_dtype=torch.float32, out=...)`` run for ``dtype`` on ``device``? Probed once."""
    key = (device.type, device.index, dtype)
    if key not in _gemm_probe:
        try:
            a = torch.ones(16, 16, dtype=dtype, device=device)
            out = torch.empty(16, 16, dtype=torch.float32, device=device)
            torch.mm(a, a.t(), out_dtype=torch.float32, out=out)
            _gemm_probe[key] = bool((out == 16).all())
        except (RuntimeError, TypeError, NotImplementedError):
            _gemm_probe[key] = False
    return _gemm_probe[key]


def head_matmul_path(hidden_dtype: torch.dtype, weight_dtype: torch.dtype, device: torch.device | str) -> str:
    """The path a head pass takes for these dtypes on ``device``: ``"gemm_fp32_out"``, ``"direct"`` or
    ``"upcast_tiles"`` (see the module docstring)."""
    device = torch.device(device)
    cdtype = torch.promote_types(torch.promote_types(hidden_dtype, weight_dtype), torch.float32)
    if (device.type == "cuda" and hidden_dtype == weight_dtype and weight_dtype in GEMM_DTYPES
            and _gemm_fp32_out_works(device, weight_dtype)):
        return "gemm_fp32_out"
    return "direct" if weight_dtype == cdtype else "upcast_tiles"


def default_memory_budget(device: torch.device | str) -> int:
    """Bytes a head pass may spend on its working set when the caller gives no ``memory_budget``:
    256 MiB on CPU; on a GPU a quarter of what torch can still allocate (free device memory plus torch's
    cached, unused blocks), at most 4 GiB."""
    device = torch.device(device)
    if device.type != "cuda":
        return _CPU_BUDGET
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(min(_GPU_BUDGET_CAP, (free + cached) // 4))


def chunk_rows(n_rows: int, vocab: int, device: torch.device | str, memory_budget: Optional[int] = None,
               itemsize: int = 4) -> int:
    """Rows per chunk: the most whose working set (``WORKING_SET_CHUNKS`` logits buffers of ``vocab`` values of
    ``itemsize`` bytes) fits ``memory_budget`` (default :func:`default_memory_budget`), a multiple of 64 from 64
    rows up, at least 1 and at most ``n_rows``."""
    budget = default_memory_budget(device) if memory_budget is None else memory_budget
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")
    rows = int(budget // (WORKING_SET_CHUNKS * vocab * itemsize))
    if rows >= 64:
        rows -= rows % 64
    return max(1, min(rows, max(n_rows, 1)))


def tile_rows(vocab: int, hidden_size: int, chunk: int) -> int:
    """Vocabulary rows of W upcast at once: the fp32 tile is at most a quarter of the chunk's logits buffer
    (``chunk * vocab`` values), with at least 256 rows (or the whole vocabulary)."""
    return min(vocab, max(_MIN_TILE_ROWS, chunk * vocab // (4 * max(hidden_size, 1))))


class HeadProjector:
    """``z = (h W^T + b) / T`` for chunks of rows of ``h`` (and ``dz W`` for a backward), on the path of
    :func:`head_matmul_path`, with at most one upcast vocabulary tile of W alive.

    ``cdtype`` is the compute dtype (float32, or float64 when an input is); ``chunk`` the rows per call, which size
    the tile (:func:`tile_rows`) unless ``tile`` gives its rows. Run it inside :func:`exact_fp32_matmul`.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], temperature: float,
                 hidden_dtype: torch.dtype, cdtype: torch.dtype, chunk: int, tile: Optional[int] = None):
        self.weight, self.cdtype = weight, cdtype
        self.path = head_matmul_path(hidden_dtype, weight.dtype, weight.device)
        if self.path == "gemm_fp32_out" and cdtype != torch.float32:
            self.path = "upcast_tiles"
        self.bias = None if bias is None else bias.to(cdtype)
        self.temperature = float(temperature)
        vocab, hidden_size = weight.shape
        self.tile = tile_rows(vocab, hidden_size, chunk) if tile is None else max(1, min(int(tile), vocab))
        self._wbuf: Optional[torch.Tensor] = None

    def _tiles(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(v0, v1, W[v0:v1] in the compute dtype), upcast into one reused buffer."""
        vocab = self.weight.shape[0]
        if self.weight.dtype == self.cdtype:
            yield 0, vocab, self.weight
            return
        if self._wbuf is None:
            self._wbuf = torch.empty(min(self.tile, vocab), self.weight.shape[1], dtype=self.cdtype,
                                     device=self.weight.device)
        for v0 in range(0, vocab, self.tile):
            v1 = min(v0 + self.tile, vocab)
            yield v0, v1, self._wbuf[: v1 - v0].copy_(self.weight[v0:v1])

    def release(self) -> None:
        """Free the tile buffer (the pass is over)."""
        self._wbuf = None

    def logits_into(self, out: torch.Tensor, h: torch.Tensor, divide: bool = True) -> torch.Tensor:
        """``out`` (rows, V) <- (h W^T + b) / T for the chunk ``h`` (rows, H) in its own dtype (``divide=False``:
        h W^T + b, for a caller that divides as it reads)."""
        if self.path == "gemm_fp32_out":
            _gemm_fp32_out(h, self.weight, out)
            if self.bias is not None:
                out.add_(self.bias)
        else:
            h = h.to(self.cdtype)
            for v0, v1, w in self._tiles():
                o = out[:, v0:v1]
                if self.bias is None:
                    torch.mm(h, w.t(), out=o)
                else:
                    torch.addmm(self.bias[v0:v1], h, w.t(), out=o)
        if divide and self.temperature != 1.0:
            # vLLM divides the fp32 logits by a float32 temperature per row: the same operation.
            out.div_(torch.full((out.shape[0], 1), self.temperature, dtype=out.dtype, device=out.device))
        return out

    def grad_hidden_into(self, out: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
        """``out`` (rows, H) <- dz W for ``dz`` (rows, V) in the compute dtype (the upcast tiles on every path)."""
        first = True
        for v0, v1, w in self._tiles():
            if first:
                torch.mm(dz[:, v0:v1], w, out=out)
                first = False
            else:
                out.addmm_(dz[:, v0:v1], w)
        return out


def _gemm_fp32_out(h: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` <- h W^T with bf16 (fp16) inputs, fp32 accumulation and output (CUDA)."""
    torch.mm(h, weight.t(), out_dtype=torch.float32, out=out)
