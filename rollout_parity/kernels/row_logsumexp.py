"""One pass over each row of fp32 head logits: the token's logprob and the entropy at temperature T.

For a chunk of logits z (rows, V) as the GEMM wrote them (before the temperature), per row i:

    x_iv   = z_iv / T                       (IEEE division, as vLLM's ``logits.div_(temp)``)
    m_i    = max_v x_iv,   s_i = sum_v exp(x_iv - m_i)
    logp_i = (x_{i, y_i} - m_i) - log s_i
    H_i    = log s_i - sum_v exp(x_iv - m_i) (x_iv - m_i) / s_i

read once, in blocks of the vocabulary with a running maximum (the online softmax: the partial sums are rescaled by
exp(m_old - m_new) when the maximum grows, and the entropy's sum of ``e (x - m)`` is moved by ``s (m_old - m_new)``).
The shifted form is torch's own log-softmax order (``x - max - log sum``): forming ``lse = m + log s`` first loses the
low bits of ``log s`` when the logits are large (6e-6 at |logit| ~ 3,000). The torch path runs three passes over the
chunk for the same result (the division, the in-place log-softmax, the entropy's exp); on an H200 at
8,192 x 4,096 x 151,936 those passes were most of the plain head pass's time beside its GEMM
(docs/fp32_and_sampler_kernels.md, "Where the time goes").

The exponentials and the logarithm are Triton's (``exp2``/``log2`` based): a logprob differs from torch's
log-softmax of the same logits by float rounding (about 1e-6 at |logprob| ~ 10), far below the head's own
GEMM-to-GEMM difference between devices. The division is ``div_rn``: exactly torch's fp32 ``z / T``.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["row_logprob_entropy", "BLOCK", "NUM_WARPS", "SIGNATURE", "launch_constants"]

#: Vocabulary entries a program reads per step.
BLOCK = 4096
NUM_WARPS = 8
#: The kernel's runtime arguments as the package passes them (``scripts/compile_kernels.py`` compiles this).
SIGNATURE = {"z_ptr": "*fp32", "row_stride": "i32", "ids_ptr": "*i64", "ids_stride": "i32", "logp_ptr": "*fp32",
             "ent_ptr": "*fp32", "rowmax_ptr": "*fp32", "logsum_ptr": "*fp32", "V": "i32", "T": "fp32"}


def launch_constants(want_entropy: bool, want_lse: bool) -> dict:
    """The kernel's compile-time arguments (one compiled variant per pair): what :func:`row_logprob_entropy`
    launches and what ``scripts/compile_kernels.py`` compiles."""
    return dict(WANT_ENTROPY=want_entropy, WANT_LSE=want_lse, BLOCK_V=BLOCK)


@triton.jit
def _row_logprob_entropy_kernel(z_ptr, row_stride, ids_ptr, ids_stride, logp_ptr, ent_ptr, rowmax_ptr, logsum_ptr,
                                V, T, WANT_ENTROPY: tl.constexpr, WANT_LSE: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * row_stride
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    u = tl.zeros((), tl.float32)  # sum of exp(x - m) (x - m), for the entropy
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        inside = offs < V
        x = tl.math.div_rn(tl.load(base + offs, mask=inside, other=float("-inf")), T)
        new_m = tl.maximum(m, tl.max(x, 0))
        # exp(-inf - -inf) is nan: a maximum still at -inf rescales nothing
        scale = tl.where(new_m == float("-inf"), 0.0, tl.exp(m - new_m))
        e = tl.where(inside, tl.exp(x - new_m), 0.0)
        if WANT_ENTROPY:
            moved = tl.where(m == float("-inf"), 0.0, s * (m - new_m))  # the old terms' shift to the new maximum
            # 0 log 0 = 0: a logit of -inf (a masked entry) adds nothing, not 0 * -inf
            u = (u + moved) * scale + tl.sum(e * tl.where(inside & (x != float("-inf")), x - new_m, 0.0), 0)
        s = s * scale + tl.sum(e, 0)
        m = new_m
    log_s = tl.log(s)
    token = tl.load(ids_ptr + row.to(tl.int64) * ids_stride)
    xt = tl.math.div_rn(tl.load(base + token), T)
    tl.store(logp_ptr + row, (xt - m) - log_s)
    if WANT_ENTROPY:
        tl.store(ent_ptr + row, log_s - u / s)
    if WANT_LSE:
        tl.store(rowmax_ptr + row, m)
        tl.store(logsum_ptr + row, log_s)


def row_logprob_entropy(z: torch.Tensor, token_ids: torch.Tensor, temperature: float, logp_out: torch.Tensor,
                        ent_out: Optional[torch.Tensor] = None, rowmax_out: Optional[torch.Tensor] = None,
                        logsum_out: Optional[torch.Tensor] = None) -> None:
    """``logp_out[i]`` <- log softmax(z_i / T)[y_i] and ``ent_out[i]`` <- the entropy of softmax(z_i / T), for the
    fp32 logits ``z`` (rows, V) with unit stride along V, ``token_ids`` (rows,) in [0, V) of any stride (not checked
    against V here: the caller validated them), outputs contiguous fp32 of ``rows`` entries. ``z`` is only read.

    ``rowmax_out`` and ``logsum_out`` (both or neither): the row's ``m_i = max_v z_iv / T`` and ``log s_i``, for a
    caller that reads the log-probabilities ``(div_rn(z, T) - m) - log s`` again (the kept set's search,
    :mod:`rollout_parity.kernels.kept_candidates`): the same float operations, so the same values as ``logp_out``;
    the row's largest log-probability is ``-log s_i``."""
    if z.dtype != torch.float32 or z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(f"z must be a 2-D float32 tensor contiguous along the vocabulary, got {z.dtype} "
                         f"{tuple(z.shape)} strides {z.stride()}")
    rows, vocab = z.shape
    if token_ids.dim() != 1 or token_ids.shape[0] != rows or token_ids.dtype != torch.long:
        raise ValueError(f"token_ids must be int64 ({rows},), got {token_ids.dtype} {tuple(token_ids.shape)}")
    outs = [t for t in (logp_out, ent_out, rowmax_out, logsum_out) if t is not None]
    if any(t.dtype != torch.float32 or tuple(t.shape) != (rows,) or not t.is_contiguous() for t in outs):
        raise ValueError(f"the outputs must be contiguous float32 ({rows},) tensors")
    if rows == 0:
        return
    want = ent_out is not None
    if (rowmax_out is None) != (logsum_out is None):
        raise ValueError("pass rowmax_out and logsum_out together")
    want_lse = rowmax_out is not None
    # Triton launches on the current CUDA device: make it the logits' one (a rank whose tensors sit on another)
    with torch.cuda.device(z.device) if z.is_cuda else contextlib.nullcontext():
        _row_logprob_entropy_kernel[(rows,)](
            z, z.stride(0), token_ids, token_ids.stride(0), logp_out, ent_out if want else logp_out,
            rowmax_out if want_lse else logp_out, logsum_out if want_lse else logp_out, vocab, float(temperature),
            **launch_constants(want, want_lse), num_warps=NUM_WARPS)
