"""Token logprobs (and entropy) through an fp32 output head, chunked, without N x V logits.

The trainer side of "fp32 lm_head" (../shared/seeds/pipelinerl-vllm-v1-parity.txt, "The
Remaining Gap: fp32 lm_head"; MiniMax-M1 and ScaleRL compute the head in fp32): for hidden
states h (N, H), head weight W (V, H), bias b and temperature T,

    z_i      = (W h_i + b) / T                                  (fp32 logits, one row per token)
    logp_i   = z_{i, y_i} - log sum_v exp(z_iv)                 (token logprob)
    H_i      = -sum_v p_iv log p_iv,   p_i = softmax(z_i)       (entropy)

Only a chunk of rows of z exists at any time.  The backward recomputes each chunk's logits
once (activation recomputation) and uses

    dL/dz_iv = g_i (1[v = y_i] - p_iv) - e_i p_iv (log p_iv + H_i)

(g = upstream grad of logp, e = upstream grad of H), then dL/dh = (dL/dz / T) W and
dL/dW = sum_i (dL/dz_i / T) h_i^T, accumulated chunk by chunk.  For logprobs alone the
per-row g_i is moved onto the (chunk, H) operands, so the (chunk, V) buffer only holds
p - onehot.

The logits of a chunk come from :class:`~rollout_parity.core.head_matmul.HeadProjector`: exact
fp32 whatever the caller's TF32 / matmul-precision settings (restored after the pass), T dividing
the logits after the matmul as vLLM's sampler does, a bf16 x bf16 GEMM with fp32 output on a GPU,
and the head upcast one vocabulary tile at a time elsewhere (never a whole fp32 copy of W).

Memory beyond inputs and gradients: one (chunk, V) buffer reused for every chunk, a scratch
of 1/8 chunk for the entropy, one upcast vocabulary tile of W (at most 1/4 chunk) and
per-token vectors.  The weight's gradient is accumulated in the compute dtype (it is an
output).  Without ``chunk_size`` the chunk is the largest whose working set fits
``memory_budget`` (:func:`~rollout_parity.core.head_matmul.chunk_rows`).  The (log-)softmax of
a chunk runs in place with torch's fused row kernel (one pass over memory instead of
max/sub/exp/sum); that in-place use is probed once per dtype and replaced by a sub-blocked copy
if a torch build ever stops supporting it.  On CUDA the forward reads each chunk of fp32 logits
once instead (:mod:`rollout_parity.kernels.row_logsumexp`: the division by T, the online
log-sum-exp, the token's logit and the entropy in one Triton pass); the backward keeps the torch
passes.  float64 stays float64 (gradcheck).

Under DeepSpeed ZeRO-3 pass the gathered weight (``deepspeed.zero.GatheredParameters``).
"""

from __future__ import annotations

import torch

from .head_matmul import HeadProjector, chunk_rows, exact_fp32_matmul
from .kernel_launch import kernels_allowed, launch

__all__ = ["chunked_fp32_logprobs", "DEFAULT_CHUNK_SIZE"]

#: ``chunk_size`` default: None, the chunk is chosen from the device and ``memory_budget``.
DEFAULT_CHUNK_SIZE = None

_inplace_ok: dict[tuple[str, torch.dtype, str], bool] = {}


def _aliasing_works(kind: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Does aten::_{log_,}softmax.out give the right answer with out aliasing the input?"""
    key = (kind, dtype, device.type)
    if key not in _inplace_ok:
        op = torch.ops.aten._log_softmax if kind == "log" else torch.ops.aten._softmax
        x = torch.randn(8, 3001, generator=torch.Generator().manual_seed(0), dtype=dtype) * 4
        x = x.to(device)
        ref = op(x, 1, False)
        try:
            y = x.clone()
            op.out(y, 1, False, out=y)
            _inplace_ok[key] = bool(torch.equal(y, ref))
        except RuntimeError:
            _inplace_ok[key] = False
    return _inplace_ok[key]


def _softmax_rows_(z: torch.Tensor, log: bool) -> torch.Tensor:
    """z <- (log_)softmax(z, dim=1) in place."""
    op = torch.ops.aten._log_softmax if log else torch.ops.aten._softmax
    if _aliasing_works("log" if log else "exp", z.dtype, z.device):
        return op.out(z, 1, False, out=z)
    step = max(1, -(-z.shape[0] // 8))
    for r0 in range(0, z.shape[0], step):
        z[r0 : r0 + step].copy_(op(z[r0 : r0 + step], 1, False))
    return z


def _row_kernel(device: torch.device, cdtype: torch.dtype):
    """The forward's one-pass row kernel (:mod:`rollout_parity.kernels.row_logsumexp`) for fp32 logits on an NVIDIA
    CUDA device where Triton imports; None elsewhere (CPU, ROCm, float64, no Triton): the torch passes then."""
    if not kernels_allowed(device) or cdtype != torch.float32:
        return None
    try:
        from ..kernels.row_logsumexp import row_logprob_entropy
    except ImportError:
        return None
    return row_logprob_entropy


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, token_ids, rows, temperature, want_entropy):
        cdtype = _compute_dtype(hidden, weight, bias)
        n, vocab = hidden.shape[0], weight.shape[0]
        dev = hidden.device
        with exact_fp32_matmul(), torch.autocast(device_type=dev.type, enabled=False):
            head = HeadProjector(weight, bias, temperature, hidden.dtype, cdtype, rows)
            logp = torch.empty(n, dtype=cdtype, device=dev)
            ent = torch.empty(n, dtype=cdtype, device=dev) if want_entropy else None
            buf = torch.empty(rows, vocab, dtype=cdtype, device=dev)
            row_pass = _row_kernel(dev, cdtype)
            variant = "row_logprob_entropy" + ("+entropy" if want_entropy else "")
            sub = max(1, -(-rows // 8))
            scratch = None
            for s in range(0, n, rows):
                e = min(s + rows, n)
                if row_pass is not None:  # one read of the chunk: divide, reduce, gather (and the entropy)
                    z = head.logits_into(buf[: e - s], hidden[s:e], divide=False)
                    if launch(variant, dev, row_pass, z, token_ids[s:e], temperature, logp[s:e],
                              ent[s:e] if want_entropy else None):
                        continue
                    row_pass = None  # the launch failed (warned once): this chunk and the rest take torch's passes
                if want_entropy and scratch is None:
                    scratch = torch.empty(sub, vocab, dtype=cdtype, device=dev)
                z = _softmax_rows_(head.logits_into(buf[: e - s], hidden[s:e]), log=True)  # log p
                logp[s:e] = z.gather(1, token_ids[s:e, None]).squeeze(1)
                if want_entropy:
                    for r0 in range(0, e - s, sub):
                        r1 = min(r0 + sub, e - s)
                        p = torch.exp(z[r0:r1], out=scratch[: r1 - r0])
                        # 0 log 0 = 0: an entry with logit -inf (a masked vocabulary entry) adds nothing, not NaN
                        p.mul_(z[r0:r1]).masked_fill_(z[r0:r1].isneginf(), 0.0)
                        ent[s + r0 : s + r1] = p.sum(dim=1).neg_()
            head.release()

        ctx.save_for_backward(hidden, weight, bias, token_ids, ent)
        ctx.rows, ctx.temperature, ctx.cdtype = rows, temperature, cdtype
        if want_entropy:
            return logp, ent
        return logp, None

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, token_ids, ent = ctx.saved_tensors
        with exact_fp32_matmul(), torch.autocast(device_type=hidden.device.type, enabled=False):
            return _backward(ctx, hidden, weight, bias, token_ids, ent, g_logp, g_ent)


def _backward(ctx, hidden, weight, bias, token_ids, ent, g_logp, g_ent):
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    cdtype, rows = ctx.cdtype, ctx.rows
    inv_temp = 1.0 / ctx.temperature
    head = HeadProjector(weight, bias, ctx.temperature, hidden.dtype, cdtype, rows)
    n, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    g_logp = (
        torch.zeros(n, dtype=cdtype, device=dev) if g_logp is None else g_logp.to(cdtype)
    ) * inv_temp  # d/dh, d/dW pick up 1/T once: fold it into the row weights
    use_ent = g_ent is not None and ent is not None
    g_ent = g_ent.to(cdtype) * inv_temp if use_ent else None

    grad_h = torch.empty(hidden.shape, dtype=cdtype, device=dev) if need_h else None
    grad_w = None  # written by the first chunk's product, accumulated by the others
    grad_b = torch.zeros(vocab, dtype=cdtype, device=dev) if need_b else None
    buf = torch.empty(rows, vocab, dtype=cdtype, device=dev)
    sub = max(1, -(-rows // 8))
    scratch = torch.empty(sub, vocab, dtype=cdtype, device=dev) if use_ent else None

    for s in range(0, n, rows):
        e = min(s + rows, n)
        z = head.logits_into(buf[: e - s], hidden[s:e])
        h = hidden[s:e].to(cdtype)
        rows_idx = torch.arange(e - s, device=dev)
        if use_ent:
            _softmax_rows_(z, log=True)
            for r0 in range(0, e - s, sub):
                r1 = min(r0 + sub, e - s)
                zr = z[r0:r1]  # log p
                p = torch.exp(zr, out=scratch[: r1 - r0])
                masked = zr.isneginf()  # p = 0 there: no gradient (not 0 * inf)
                gl = g_logp[s + r0 : s + r1, None]
                ge = g_ent[s + r0 : s + r1, None]
                # dL/dz = g (1[v=y] - p) - e p (log p + H)
                zr.add_(ent[s + r0 : s + r1, None]).mul_(ge).add_(gl).mul_(p).neg_().masked_fill_(masked, 0.0)
            z.index_put_((rows_idx, token_ids[s:e]), g_logp[s:e], accumulate=True)
            row_scale, hg = None, h
        else:
            # dL/dz_i = -g_i (p_i - 1[v=y_i]): keep P - onehot and move the per-row g_i
            # onto the (chunk, H) operands, saving a pass over the (chunk, V) buffer.
            _softmax_rows_(z, log=False)
            minus_one = z.new_full((e - s,), -1.0)
            z.index_put_((rows_idx, token_ids[s:e]), minus_one, accumulate=True)
            row_scale = g_logp[s:e, None].neg()
            hg = h * row_scale
        if need_h:
            head.grad_hidden_into(grad_h[s:e], z)
            if row_scale is not None:
                grad_h[s:e].mul_(row_scale)
        if need_w:
            if grad_w is None:
                grad_w = torch.mm(z.t(), hg)
            else:
                grad_w.addmm_(z.t(), hg)
        if need_b:
            if row_scale is None:
                grad_b.add_(z.sum(0))
            else:
                grad_b.addmv_(z.t(), row_scale.squeeze(1))
    head.release()

    if need_w and grad_w is None:  # no rows at all
        grad_w = torch.zeros(vocab, weight.shape[1], dtype=cdtype, device=dev)
    return (
        None if grad_h is None else grad_h.to(hidden.dtype),
        None if grad_w is None else grad_w.to(weight.dtype),
        None if grad_b is None else grad_b.to(bias.dtype),
        None,
        None,
        None,
        None,
    )


def chunked_fp32_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    memory_budget: int | None = None,
):
    """Per-token logprobs of ``token_ids`` (and entropies) under the fp32 head ``(weight, bias)``.

    Args:
        hidden: (..., H) final hidden states (any float dtype; upcast to fp32 chunk by chunk, or
            multiplied with a bf16 head by a bf16 GEMM with fp32 output on a GPU).
        weight: (V, H) head weight (``lm_head.weight``, or the tied embedding matrix; never
            copied whole to fp32).
        token_ids: (...) integer ids in [0, V), the token each position predicts.
        bias: optional (V,) head bias.
        chunk_size: rows of logits materialised at once (one (chunk_size, V) buffer); None
            (default): the most rows whose working set fits ``memory_budget``.
        temperature: the logits are divided by it after the matmul (as the sampler does), > 0.
        return_entropy: also return the entropy of each row's distribution.
        memory_budget: bytes for the working set when ``chunk_size`` is None (default:
            :func:`~rollout_parity.core.head_matmul.default_memory_budget` of the device).

    Returns:
        ``logprobs`` of shape (...) in fp32 (float64 if an input is float64), or
        ``(logprobs, entropy)`` when ``return_entropy``.  Differentiable w.r.t. hidden,
        weight and bias, with a backward that recomputes each chunk's logits once.
    """
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden (..., H) and weight (V, H) disagree: hidden {tuple(hidden.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if tuple(hidden.shape[:-1]) != tuple(token_ids.shape):
        raise ValueError(
            f"token_ids shape {tuple(token_ids.shape)} must equal hidden.shape[:-1] "
            f"(hidden {tuple(hidden.shape)})"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias shape {tuple(bias.shape)} must be ({weight.shape[0]},)")
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if chunk_size is not None and memory_budget is not None:
        raise ValueError("pass chunk_size or memory_budget, not both: memory_budget chooses the chunk size")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    vocab = weight.shape[0]
    ids = token_ids.reshape(-1).to(device=hidden.device, dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"token_ids must lie in [0, {vocab}) (weight {tuple(weight.shape)}), "
            f"got range [{int(ids.min())}, {int(ids.max())}]"
        )
    flat = hidden.reshape(-1, hidden.shape[-1])
    itemsize = _compute_dtype(hidden, weight, bias).itemsize
    rows = chunk_size if chunk_size is not None else chunk_rows(flat.shape[0], vocab, hidden.device, memory_budget,
                                                                itemsize)
    rows = min(rows, max(flat.shape[0], 1))
    logp, ent = _ChunkedLogprobs.apply(flat, weight, bias, ids, rows, float(temperature), bool(return_entropy))
    logp = logp.reshape(token_ids.shape)
    if return_entropy:
        return logp, ent.reshape(token_ids.shape)
    return logp
