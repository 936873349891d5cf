"""The kept set's candidates in each row of fp32 head logits, on the GPU, with no sort and no top-k.

The sampler-aware pass needs, per row, the mass ``S`` of the set vLLM's filters keep (``core/kept_set.py``). That
set lies among the row's largest log-probabilities ``lp_v = (div_rn(z_v, T) - m) - log s`` (the row kernel's values,
:mod:`rollout_parity.kernels.row_logsumexp`), and a threshold ``t`` *covers* it when every entry the filters need
is ``>= t``:

* ``mass`` (top-p alone): the mass at or above ``t`` reaches top_p (the fewest largest entries that reach it are
  then inside);
* ``count`` (top-k): at least k entries are ``>= t`` (the k largest and every tie of the k-th are then inside);
* ``bound`` (min-p): ``t = lp_max + log(min_p)``, less a margin (every entry with ``p >= p_max min_p`` is inside);
* ``count+bound`` (top-k with min-p): the higher of the two thresholds (min-p's survivors among top-k's lie above
  both), so a low min-p bound does not widen the row past top-k's few entries.

With top-p after top-k or min-p, vLLM renormalises over their survivors, so the candidates must hold all of them:
the caller then asks for the top-k or min-p cover.

For ``mass`` and ``count``, a first read of the row sums, for ``J`` thresholds ``t_j = lp_max - gap_j``, the mass
(float32) or the number of entries at or above each, and the first (highest) covering threshold is chosen; a
``bound`` is the threshold itself. The first read is a software pipeline (``tl.range(..., num_stages=NUM_STAGES)``:
later blocks' loads are in flight while one is summed), one entry per lane. A second read writes every entry ``>= t``
to the row of ``out``, in vocabulary order (at most ``CAP - 1`` of them: a row with more, or with no covering
threshold, gets ``count -1`` and is left to the caller's sorting path; the write stops reading a row once it is past
the cap, and a top-p row whose peak holds so little mass that ``CAP - 1`` entries cannot reach top_p is not read).
The caller sorts those few values and applies vLLM's filters to them in float64: this kernel only narrows the row,
it decides nothing about the kept set. Rows not marked open are not read.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["CAP", "COVERS", "GAP0", "LEVELS", "NUM_STAGES", "NUM_WARPS", "RATIO", "SIGNATURE", "kept_candidates",
           "launch_constants"]

#: Columns of the candidates' output per row (a row keeps at most ``CAP - 1`` candidates: the last column stays
#: -inf, which tells ``_on_candidates`` that nothing beyond them survives).
CAP = 256
#: Vocabulary entries a program reads per step while it counts (times ``LEVELS`` partial sums held per lane) and
#: while it writes the candidates.
BLOCK_COUNT, BLOCK_WRITE = 256, 1024
#: The thresholds' distances below the row's largest log-probability, in nats: ``GAP0 * RATIO**j`` for j < 32,
#: from 0.25 to 33 (e^-33 ~ 5e-15: below that, an entry's mass does not move a float32 sum of the rest). The
#: kernel computes them itself (a table copied to the device per call would wait for the host).
GAP0, RATIO, LEVELS = 0.25, 132.0 ** (1 / 31), 32


@triton.jit
def _kept_candidates_kernel(z_ptr, row_stride, rowmax_ptr, logsum_ptr, open_ptr, out_ptr, count_ptr, V, T, need, bound,
                            COVER: tl.constexpr, CAP: tl.constexpr, J: tl.constexpr, GAP0: tl.constexpr,
                            LOG_RATIO: tl.constexpr, BLOCK_COUNT: tl.constexpr, BLOCK_WRITE: tl.constexpr,
                            NUM_STAGES: tl.constexpr):
    row = tl.program_id(0)
    if tl.load(open_ptr + row) != 0:
        base = z_ptr + row.to(tl.int64) * row_stride
        m = tl.load(rowmax_ptr + row)
        log_s = tl.load(logsum_ptr + row)
        peak = -log_s  # the row's largest log-probability, (m - m) - log s
        if COVER == 2:  # a bound below the peak: the threshold itself, no read to find it
            t_first = peak + bound
            found = t_first == t_first  # False for a NaN row: the caller's sorting path then
        elif COVER == 0 and need > (CAP - 1) * tl.exp(peak):
            # no entry holds more than the peak's mass: more than CAP - 1 of them are needed, none is read
            t_first = peak
            found = peak != peak
        else:
            j = tl.arange(0, J)
            t = peak - GAP0 * tl.exp(j.to(tl.float32) * LOG_RATIO)
            # per-lane partial sums (masses, or counts), reduced once after the loop: no cross-lane step per block;
            # the loads of later blocks are issued while this one is summed (a software pipeline)
            acc = tl.zeros((J, BLOCK_COUNT), tl.float32)
            for start in tl.range(0, V, BLOCK_COUNT, num_stages=NUM_STAGES):
                offs = start + tl.arange(0, BLOCK_COUNT)
                lp = (tl.math.div_rn(tl.load(base + offs, mask=offs < V, other=float("-inf")), T) - m) - log_s
                ge = lp[None, :] >= t[:, None]  # a padded -inf is below every finite threshold
                if COVER == 0:
                    acc += tl.where(ge, tl.exp(lp)[None, :], 0.0)
                else:
                    acc += ge.to(tl.float32)  # counts up to 2^24 are exact in float32
            first = tl.min(tl.where(tl.sum(acc, 1) >= need, j, J), 0)
            t_first = tl.sum(tl.where(j == first, t, 0.0), 0)
            found = first < J
            if COVER == 3:  # top-k's count and min-p's bound: min-p's survivors lie above both thresholds
                t_first = tl.where(found, tl.maximum(t_first, peak + bound), peak + bound)
                found = t_first == t_first
        if found:
            pos = tl.zeros((), tl.int32)
            start = tl.zeros((), tl.int32)
            while (start < V) & (pos < CAP):  # a row past the cap is refused: the rest of it is not read
                offs = start + tl.arange(0, BLOCK_WRITE)
                lp = (tl.math.div_rn(tl.load(base + offs, mask=offs < V, other=float("-inf")), T) - m) - log_s
                if tl.max(lp, 0) >= t_first:  # most blocks hold no candidate: no scan for them
                    sel = lp >= t_first
                    at = pos + tl.cumsum(sel.to(tl.int32), 0) - 1
                    tl.store(out_ptr + row.to(tl.int64) * CAP + at, lp, mask=sel & (at < CAP - 1))
                    pos += tl.sum(sel.to(tl.int32), 0)
                start += BLOCK_WRITE
            tl.store(count_ptr + row, tl.where(pos < CAP, pos, -1))
        else:
            tl.store(count_ptr + row, -1)
    else:
        tl.store(count_ptr + row, -1)


#: The kernel's covers: by the mass above a threshold, by the count above it, a bound given outright, or the higher
#: of a count's threshold and a bound (top-k with min-p).
COVERS = {"mass": 0, "count": 1, "bound": 2, "count+bound": 3}
NUM_WARPS = 8
#: Blocks of the counting loop in flight at once (``tl.range``'s software pipeline: the loads wait on latency, not
#: on bandwidth, when one block is read at a time).
NUM_STAGES = 4
#: The kernel's runtime arguments as the package passes them (``scripts/compile_kernels.py`` compiles this).
SIGNATURE = {"z_ptr": "*fp32", "row_stride": "i32", "rowmax_ptr": "*fp32", "logsum_ptr": "*fp32", "open_ptr": "*i8",
             "out_ptr": "*fp32", "count_ptr": "*i32", "V": "i32", "T": "fp32", "need": "fp32", "bound": "fp32"}


def launch_constants(cover: str) -> dict:
    """The kernel's compile-time arguments for ``cover`` (one compiled variant per cover): what
    :func:`kept_candidates` launches and what ``scripts/compile_kernels.py`` compiles."""
    return dict(COVER=COVERS[cover], CAP=CAP, J=LEVELS, GAP0=GAP0, LOG_RATIO=math.log(RATIO), BLOCK_COUNT=BLOCK_COUNT,
                BLOCK_WRITE=BLOCK_WRITE, NUM_STAGES=NUM_STAGES)


def kept_candidates(z: torch.Tensor, temperature: float, rowmax: torch.Tensor, logsum: torch.Tensor,
                    open_rows: torch.Tensor, out: torch.Tensor, count_out: torch.Tensor, *,
                    mass: Optional[float] = None, count: Optional[int] = None, bound: Optional[float] = None) -> None:
    """``out[i]`` <- the entries ``>= t_i`` of row ``i`` of ``(div_rn(z, T) - m) - log s`` (in vocabulary order, the
    rest of the row of ``out`` untouched) and ``count_out[i]`` <- how many, for each row with ``open_rows[i]``. The
    covers set ``t_i`` (``peak_i = -log s_i``): ``mass`` (top-p alone): the first threshold ``peak_i - GAP0 *
    RATIO**j`` whose entries' mass reaches it (a row whose peak is too small for ``CAP - 1`` entries to reach it is
    not read); ``count`` (top-k): the first whose entries number at least that; ``bound`` (min-p, ``log min_p`` less
    a margin): ``peak_i + bound``, found without a read; ``count`` and ``bound`` together (top-k with min-p): the
    higher of the two thresholds. ``count_out[i]`` is -1 where no threshold covers the row, where the row holds
    ``CAP`` or more such entries (then ``out[i]`` holds only some of them: the caller must not use it; the write
    stops reading the row there), and where the row is not open.

    ``z``: (rows, V) float32, unit stride along V; ``rowmax``, ``logsum``: float32 (rows,) from
    :func:`~rollout_parity.kernels.row_logsumexp.row_logprob_entropy`; ``open_rows``: bool (rows,); ``out``:
    float32 (rows, CAP), contiguous (fill it with -inf first); ``count_out``: int32 (rows,). Nothing is checked
    against V or synchronised with the host."""
    given = [n for n, v in (("mass", mass), ("count", count), ("bound", bound)) if v is not None]
    if not given or ("mass" in given and len(given) > 1):
        raise ValueError(f"pass mass= alone, or count= and/or bound= (the kept set's cover), got {given}")
    cover = "+".join(given)
    need = mass if mass is not None else count if count is not None else 0.0
    if z.dtype != torch.float32 or z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(f"z must be a 2-D float32 tensor contiguous along the vocabulary, got {z.dtype} "
                         f"{tuple(z.shape)} strides {z.stride()}")
    rows, vocab = z.shape
    if tuple(out.shape) != (rows, CAP) or not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError(f"out must be a contiguous float32 ({rows}, {CAP}) tensor, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if count_out.dtype != torch.int32 or tuple(count_out.shape) != (rows,):
        raise ValueError(f"count_out must be int32 ({rows},), got {count_out.dtype} {tuple(count_out.shape)}")
    if rows == 0:
        return
    with torch.cuda.device(z.device) if z.is_cuda else contextlib.nullcontext():
        _kept_candidates_kernel[(rows,)](
            z, z.stride(0), rowmax, logsum, open_rows.to(torch.int8), out, count_out, vocab, float(temperature),
            float(need), float(bound if bound is not None else 0.0), **launch_constants(cover), num_warps=NUM_WARPS)
