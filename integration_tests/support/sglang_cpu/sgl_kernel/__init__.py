"""A plain-PyTorch stand-in for ``sgl_kernel`` (sglang-kernel), for SGLang 0.5.23's CPU engine.

``sgl_kernel`` ships CUDA wheels only, yet with ``SGLANG_USE_CPU_ENGINE=1`` SGLang 0.5.23 imports
these eight names at module import time, unconditionally (file:line in sglang 0.5.23):

    copy_all_layer_kv_cache_cpu           sglang/kernels/ops/kvcache/cache_move.py:10
    assign_req_to_token_pool_cpu          sglang/srt/mem_cache/allocation.py:46
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu          sglang/kernels/ops/speculative/cache_locs.py:28-31
    build_tree_kernel_efficient_cpu       sglang/kernels/ops/speculative/spec_tree.py:40-42
    verify_tree_greedy_cpu                sglang/kernels/ops/speculative/spec_tree.py:43
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu                 sglang/kernels/ops/speculative/eagle.py:10

Nothing else is registered: in particular no ``torch.ops.sgl_kernel`` namespace, so
``sglang.srt.utils.common._is_intel_amx_backend_available()`` (common.py:354-360, which probes
``torch.ops.sgl_kernel.convert_weight_packed``) is False and every layer (RMSNorm, SiluAndMul,
rotary embedding, lm_head, MoE top-k and experts) takes its ``forward_native`` / torch path.

Each op mirrors the Triton kernel that SGLang runs in its place on CUDA (same file), element for
element, and checks the arguments the real op's schema fixes (dtype, rank, sizes) instead of
ignoring them. The two EAGLE tree ops raise: speculative decoding is out of this stand-in's scope.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch

__version__ = "0.5.23+torchstandin"

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu", "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu", "copy_all_layer_kv_cache_cpu", "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu", "verify_tree_greedy_cpu",
]


def _logged(fn):
    """With ``SGL_KERNEL_STANDIN_LOG=<file>`` set, append ``<op> <caller file:line>`` per call (which ops run)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        path = os.environ.get("SGL_KERNEL_STANDIN_LOG")
        if path:
            caller = sys._getframe(1)
            with open(path, "a") as f:
                f.write(f"{fn.__name__} {caller.f_code.co_filename}:{caller.f_lineno} pid={os.getpid()}\n")
        return fn(*args, **kwargs)
    return wrapper


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"sgl_kernel stand-in: {msg}")


def _int_1d(name: str, t: torch.Tensor) -> None:
    _check(isinstance(t, torch.Tensor), f"{name} must be a tensor, got {type(t).__name__}")
    _check(t.dim() == 1, f"{name} must be 1-D, got shape {tuple(t.shape)}")
    _check(not t.is_floating_point() and not t.is_complex(), f"{name} must be an integer tensor, got {t.dtype}")
    _check(t.device.type == "cpu", f"{name} must be on the CPU, got {t.device}")


@_logged
def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Replaces ``sgl_kernel.assign_req_to_token_pool_cpu`` (Triton twin: ``assign_req_to_token_pool``,
    sglang/srt/mem_cache/allocation.py:691-723; caller allocation.py:737-761).

    For request ``i`` (in batch order), with ``o_i = sum_{j<i} (end_j - start_j)``:
    ``req_to_token[req_pool_indices[i], start_i:end_i] = out_cache_loc[o_i : o_i + end_i - start_i]``.
    In place on ``req_to_token`` ([pool_size, pool_len]).
    """
    for name, t in (("req_pool_indices", req_pool_indices), ("start_offset", start_offset),
                    ("end_offset", end_offset), ("out_cache_loc", out_cache_loc)):
        _int_1d(name, t)
    _check(req_to_token.dim() == 2, f"req_to_token must be 2-D, got shape {tuple(req_to_token.shape)}")
    _check(int(pool_len) == req_to_token.shape[1],
           f"pool_len={pool_len} != req_to_token.shape[1]={req_to_token.shape[1]}")
    bs = req_pool_indices.numel()
    _check(start_offset.numel() == bs and end_offset.numel() == bs,
           f"start_offset/end_offset need {bs} entries (one per request), got "
           f"{start_offset.numel()}/{end_offset.numel()}")
    lens = (end_offset - start_offset).tolist()
    _check(all(n >= 0 for n in lens), "end_offset < start_offset for some request")
    _check(sum(lens) <= out_cache_loc.numel(),
           f"out_cache_loc has {out_cache_loc.numel()} slots, the requests need {sum(lens)}")
    o = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        _check(0 <= s and e <= pool_len, f"slots [{s}, {e}) fall outside pool_len={pool_len}")
        req_to_token[r, s:e] = out_cache_loc[o:o + e - s].to(req_to_token.dtype)
        o += e - s


@_logged
def assign_extend_cache_locs_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Replaces ``sgl_kernel.assign_extend_cache_locs_cpu`` (Triton twin: ``assign_extend_cache_locs``,
    sglang/kernels/ops/speculative/cache_locs.py:499-531): the gather that is the inverse of
    :func:`assign_req_to_token_pool_cpu`.

    ``out_cache_loc[o_i : o_i + end_i - start_i] = req_to_token[req_pool_indices[i], start_i:end_i]``,
    ``o_i = sum_{j<i} (end_j - start_j)``. In place on ``out_cache_loc``.
    """
    for name, t in (("req_pool_indices", req_pool_indices), ("start_offset", start_offset),
                    ("end_offset", end_offset), ("out_cache_loc", out_cache_loc)):
        _int_1d(name, t)
    _check(req_to_token.dim() == 2, f"req_to_token must be 2-D, got shape {tuple(req_to_token.shape)}")
    _check(int(pool_len) == req_to_token.shape[1],
           f"pool_len={pool_len} != req_to_token.shape[1]={req_to_token.shape[1]}")
    bs = req_pool_indices.numel()
    _check(start_offset.numel() == bs and end_offset.numel() == bs,
           f"start_offset/end_offset need {bs} entries, got {start_offset.numel()}/{end_offset.numel()}")
    lens = (end_offset - start_offset).tolist()
    _check(all(n >= 0 for n in lens), "end_offset < start_offset for some request")
    _check(sum(lens) <= out_cache_loc.numel(),
           f"out_cache_loc has {out_cache_loc.numel()} slots, the requests need {sum(lens)}")
    o = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        _check(0 <= s and e <= pool_len, f"slots [{s}, {e}) fall outside pool_len={pool_len}")
        out_cache_loc[o:o + e - s] = req_to_token[r, s:e].to(out_cache_loc.dtype)
        o += e - s


@_logged
def assign_draft_cache_locs_contiguous_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                           seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
                                           pool_len: int, topk: int, speculative_num_steps: int) -> None:
    """Replaces ``sgl_kernel.assign_draft_cache_locs_contiguous_cpu`` (Triton twin:
    ``assign_draft_cache_locs_contiguous`` without positions, cache_locs.py:42-82).

    With ``n = topk * speculative_num_steps``:
    ``out_cache_loc[i*n : (i+1)*n] = req_to_token[req_pool_indices[i], seq_lens[i] : seq_lens[i] + n]``.
    """
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens),
                    ("out_cache_loc", out_cache_loc)):
        _int_1d(name, t)
    _check(req_to_token.dim() == 2 and int(pool_len) == req_to_token.shape[1],
           f"pool_len={pool_len} must equal req_to_token.shape[1] of a 2-D req_to_token, got {tuple(req_to_token.shape)}")
    _check(int(topk) >= 1 and int(speculative_num_steps) >= 1,
           f"topk={topk} and speculative_num_steps={speculative_num_steps} must be >= 1")
    n = int(topk) * int(speculative_num_steps)
    bs = req_pool_indices.numel()
    _check(seq_lens.numel() == bs, f"seq_lens needs {bs} entries, got {seq_lens.numel()}")
    _check(out_cache_loc.numel() >= bs * n, f"out_cache_loc needs {bs * n} slots, has {out_cache_loc.numel()}")
    for i, (r, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        _check(s + n <= pool_len, f"slots [{s}, {s + n}) fall outside pool_len={pool_len}")
        out_cache_loc[i * n:(i + 1) * n] = req_to_token[r, s:s + n].to(out_cache_loc.dtype)


@_logged
def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor,
                          accept_stride: int) -> None:
    """Replaces ``sgl_kernel.fill_bonus_tokens_cpu`` (Triton twin: ``fill_bonus_tokens``,
    sglang/kernels/ops/speculative/eagle.py:13-29).

    ``bonus_tokens[i] = accept_tokens.flatten()[accept_stride * i + accept_lens[i] - 1]``
    (``accept_lens`` counts the bonus token, so the last accepted slot is its last entry).
    """
    _int_1d("accept_lens", accept_lens)
    _int_1d("bonus_tokens", bonus_tokens)
    bs = accept_lens.numel()
    _check(bonus_tokens.numel() >= bs, f"bonus_tokens needs {bs} entries, has {bonus_tokens.numel()}")
    _check(int(accept_stride) >= 1, f"accept_stride={accept_stride} must be >= 1")
    flat = accept_tokens.reshape(-1)
    idx = torch.arange(bs, dtype=torch.int64) * int(accept_stride) + accept_lens.to(torch.int64) - 1
    _check(bool(((idx >= 0) & (idx < flat.numel())).all()), "accept_lens points outside accept_tokens")
    bonus_tokens[:bs] = flat[idx].to(bonus_tokens.dtype)


@_logged
def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                  accept_out_cache_loc: torch.Tensor) -> None:
    """Replaces ``sgl_kernel.fill_accept_out_cache_loc_cpu`` (Triton twin: ``fill_accept_out_cache_loc``,
    sglang/kernels/ops/speculative/eagle.py:55-70): stream compaction.

    For each ``p`` with ``accept_index[p] != -1``:
    ``accept_out_cache_loc[#{q < p : accept_index[q] != -1}] = out_cache_loc[accept_index[p]]``.
    """
    flat = accept_index.reshape(-1)
    _check(not flat.is_floating_point(), f"accept_index must be an integer tensor, got {flat.dtype}")
    keep = flat != -1
    src = flat[keep].to(torch.int64)
    _check(accept_out_cache_loc.numel() >= src.numel(),
           f"accept_out_cache_loc needs {src.numel()} slots, has {accept_out_cache_loc.numel()}")
    accept_out_cache_loc.view(-1)[:src.numel()] = out_cache_loc.view(-1)[src].to(accept_out_cache_loc.dtype)


@_logged
def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """Replaces ``sgl_kernel.copy_all_layer_kv_cache_cpu`` (Triton twin: ``copy_all_layer_kv_cache_tiled``,
    sglang/kernels/ops/kvcache/cache_move.py:145-177; caller cache_move.py:180-196).

    ``data_ptrs[b]`` is the address of KV buffer ``b`` (one per layer and K/V), ``strides[b]`` its row size
    in bytes. For every buffer: ``row[tgt_loc[j]] = row[src_loc[j]]`` (bytes), all rows read before any is
    written (gather then scatter), so an in-place move with overlapping ``src``/``tgt`` is safe, as in the
    Triton kernel's single tile. Raw addresses are what the op's schema takes; they are read through ctypes.
    """
    _int_1d("data_ptrs", data_ptrs)
    _int_1d("strides", strides)
    _int_1d("tgt_loc", tgt_loc)
    _int_1d("src_loc", src_loc)
    _check(data_ptrs.numel() == strides.numel(),
           f"data_ptrs ({data_ptrs.numel()}) and strides ({strides.numel()}) need one entry per buffer")
    _check(tgt_loc.numel() == src_loc.numel(), f"tgt_loc ({tgt_loc.numel()}) and src_loc ({src_loc.numel()}) differ")
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    _check(bool((tgt >= 0).all() and (src >= 0).all()), "negative KV slot in tgt_loc/src_loc")
    rows = int(torch.maximum(tgt.max(), src.max()).item()) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        _check(ptr != 0 and stride > 0, f"bad buffer (address {ptr:#x}, stride {stride})")
        buf = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        view = torch.frombuffer(buf, dtype=torch.uint8).view(rows, stride)
        view[tgt] = view[src].clone()


@_logged
def build_tree_kernel_efficient_cpu(*args, **kwargs):
    """Replaces ``sgl_kernel.build_tree_kernel_efficient_cpu`` (EAGLE draft-tree construction;
    caller sglang/kernels/ops/speculative/spec_tree.py:411-424). Not provided: speculative decoding
    is outside this stand-in, so this raises rather than guess at the tree layout."""
    raise NotImplementedError(
        "sgl_kernel stand-in: build_tree_kernel_efficient_cpu (EAGLE speculative decoding) is not "
        "provided; run without --speculative-algorithm")


@_logged
def verify_tree_greedy_cpu(*args, **kwargs):
    """Replaces ``sgl_kernel.verify_tree_greedy_cpu`` (EAGLE greedy tree verification; caller
    sglang/kernels/ops/speculative/spec_tree.py:509-520). Not provided: see
    :func:`build_tree_kernel_efficient_cpu`."""
    raise NotImplementedError(
        "sgl_kernel stand-in: verify_tree_greedy_cpu (EAGLE speculative decoding) is not provided; "
        "run without --speculative-algorithm")
