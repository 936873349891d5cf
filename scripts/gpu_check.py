"""The GPU check of the core: CUDA against CPU for every entry point, TF32 against the head passes, the sampler pass's
speed at a real vocabulary and the correction's overhead. Needs only rollout-parity and torch; sections 1-3 took 22 s
on an H200 (2026-11-27, before the float64 reference and the six sampler rows below: at the GPU sizes the
reference took 85 s and each new row's CPU side about 5 s on a shared 2-core CPU; not yet timed on a GPU host's
CPUs), section 4 adds torch.compile's first compilations (70 s on this CPU at --small); at most 8 minutes.

    python scripts/gpu_check.py                      # on a GPU: everything, at V = 151,936, H = 4,096
    python scripts/gpu_check.py --device cpu --small # here: the same code end to end, at small sizes

1. **Parity**: each core entry point that computes on tensors (the correction, the loss, the three logprob passes
   forward and backward, the kept-set metrics, the fp32 head patch, MoE routing replay, the sync-check verdict) runs
   on the same inputs on CPU and on ``--device``; the largest difference is printed against a tolerance.
   ``sampler_logprobs_from_hidden`` has a row for each way its device path can differ (top-k 40, top-p 0.9, min-p
   0.02 and T = 0.7 unless the name says otherwise; every other token drawn from the model, the rest uniform):
   fp32 and bf16 hidden states and head; replay (``kept_sets=``); each cover of the candidates' kernel on CUDA
   (``top-p (mass cover)``, ``top-k 40 (count cover)``, ``top-k 40+top-p 0.9 (count cover)``; the min-p bound
   cover in the rows above); ``top-k -1 (off)+top-p 0.9``, vLLM's "off" value; ``strided ids (B*T,2)[:,0]``, the
   token ids as a column of pairs (stride 2); and both tie rules named on both sides (``rule pytorch, both sides``,
   ``rule triton, both sides``: under the default ``"auto"`` CUDA takes the triton rule and CPU the pytorch one, so
   the other rows compare two rules, equal without ties). Those rows are judged against a float64 reference
   computed here, chunk by chunk: full = log_softmax(z64)[y] and processed = z64[y] - logsumexp(z64 over the kept
   set), z64 = (h W^T + b) / T in float64, the kept set decided by the CPU path's rule (``processed_logits`` on
   float32 logits, plus y by the boundary rule; the recorded set for replay). The device's and the CPU's error
   against it are printed; the device's must be within twice the CPU's plus 1e-4 (at most 1e-3). Tokens whose
   kept-set membership differs between the device and the CPU, or between the CPU and the reference (float noise at
   an edge), are counted and left out, at most 1 in 1,000.
2. **TF32**: bf16 hidden states and head (N = 2,048, H = 3,584, V = 151,936, T = 0.7), the caller's TF32 off and on
   (``allow_tf32`` and ``set_float32_matmul_precision("high")``): mean and max |logprob - float64| of the two head
   passes, of a plain fp32 head written the usual way (upcast, ``h / T`` before the matmul, the caller's TF32) and of
   a bf16 head; the largest error of the bf16 GEMM's logits and of the fp32 upcast's against float64 (relative to the
   row's largest logit); and whether the caller's settings came back unchanged.
3. **Speed and memory**: ``benchmarks/sampler_pass.py --device <device> --dtype bfloat16`` at N = 8,192,
   H = 4,096, V = 151,936 (the chunk chosen by the passes), with its RESULT line; its ``replay_err`` (max
   |replayed - recomputed| processed logprob) must be within ``REPLAY_BOUND`` (1e-4).
4. **The correction's overhead**: ``benchmarks/correction_overhead.py --device <device>`` (B = 64, T = 4,096; eager and
   ``compile_correction``), with its RESULT line.

Every section prints ``GPU_CHECK <section> ...`` summary lines; the exit status is 1 if a parity row, the TF32 bound
or the replay bound fails, or if section 3 or 4 exits non-zero, prints no RESULT line or runs past
``--bench-timeout`` seconds (each). A row or a section that raises on the device is named with its error (and fails
the run); a section that times out is killed and named on its line (``timed_out=True timeout=<s>``, with the output
it had printed and its last RESULT line if any), and fails the run; the rest still runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from rollout_parity.core.config import CorrectionConfig
from rollout_parity.core.correction import compute_correction
from rollout_parity.core.fp32_head import apply_fp32_lm_head
from rollout_parity.core.fp32_logprobs import chunked_fp32_logprobs
from rollout_parity.core import head_matmul
from rollout_parity.core import sampler as sampler_core  # the reference's own processed_logits
from rollout_parity.core.head_matmul import head_matmul_path
from rollout_parity.core.loss import policy_loss
from rollout_parity.core.replay import KeptSets
from rollout_parity.core.routing import replayed_routing
from rollout_parity.core.sampler import (
    kept_mass_metrics, processed_logits, rollout_on_full_vocabulary, sampler_logprobs, sampler_logprobs_from_hidden,
    topk_topp_rule,
)
from rollout_parity.core.sync_check import judge

ROOT = Path(__file__).resolve().parents[1]


def _diff(a, b, rel: float = 0.0) -> float:
    """Largest |a - b| - rel |a| (at least 0) over tensors, numbers and (nested) dicts, tuples and dataclasses of
    them; inf where the shapes, the finite entries or the non-finite values differ. ``rel`` allows a rounding step of
    the result's own dtype (a bf16 gradient rounded from fp32 values that differ in the last bits can land one bf16
    step apart: 2**-7 of its size)."""
    if isinstance(a, dict):
        return max([_diff(a[k], b[k], rel) for k in a] + [0.0])
    if isinstance(a, (tuple, list)):
        return max([_diff(x, y, rel) for x, y in zip(a, b)] + [0.0])
    if hasattr(a, "__dataclass_fields__"):
        return _diff({k: getattr(a, k) for k in a.__dataclass_fields__},
                     {k: getattr(b, k) for k in b.__dataclass_fields__}, rel)
    if a is None or isinstance(a, str):
        return 0.0 if a == b else float("inf")
    a, b = torch.as_tensor(a).double().cpu(), torch.as_tensor(b).double().cpu()
    if a.shape != b.shape:
        return float("inf")
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    special = dict(nan=0.0, posinf=1.0, neginf=-1.0)
    if not torch.equal(fa, fb) or not torch.equal(a[~fa].nan_to_num(**special), b[~fb].nan_to_num(**special)):
        return float("inf")
    return float(((a[fa] - b[fa]).abs() - rel * a[fa].abs()).clamp_min(0).max()) if fa.any() else 0.0


def _compare(ref, got, rel: float = 0.0) -> tuple[float, int]:
    """(largest difference, tokens whose kept-set membership flipped). A sampled token within float noise of the
    top-p edge may be inside on one device and outside on the other (the GEMMs differ in the last bits); such
    flips are counted, and the logprobs compared where both sides agree."""
    if not hasattr(ref, "outside_mask"):
        return _diff(ref, got, rel), 0
    flips = (ref.outside_mask.cpu() != got.outside_mask.cpu())
    agree = ~flips
    d = max(_diff(ref.full, got.full) if hasattr(ref, "full") else 0.0,
            _diff(getattr(ref, "processed", getattr(ref, "logprobs", None)).cpu()[agree],
                  getattr(got, "processed", getattr(got, "logprobs", None)).cpu()[agree]))
    return d, int(flips.sum())


def _to(x, device):
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x.to(device) if torch.is_tensor(x) else x


#: The float64 judgement of the ``sampler_logprobs_from_hidden`` rows: the device's largest |logprob - float64| may be
#: twice the CPU's own (both are float32 passes over the same inputs, exact in float64; their GEMMs and log-sum-exps
#: round in other orders, so neither is closer by construction) plus a floor of 1e-4, the tolerance these rows had
#: against the CPU: the bf16 GEMM with fp32 output of a GPU is less exact than the CPU's upcast (on the H200 of
#: docs/data/gpu/gpu_check_h200.log its logits were 5.9e-6 of the row's largest off float64 against the upcast's
#: 8.7e-7, and these rows 5.3e-5 off the CPU's, which is itself ~1e-5 off float64 at these sizes; its float32
#: log-softmax is off by up to 7e-5 on flat rows at V >= 32K). Never more than 1e-3: a CPU path that drifted that far
#: from float64 cannot excuse the device (a bug both paths share fails here, not in a CPU-against-device diff). A
#: wrong kept set, temperature or a bf16 rounding of the logits is off by 1e-3 to 1e-1.
FP64_FACTOR, FP64_FLOOR, FP64_CAP = 2.0, 1e-4, 1e-3


def _pairs_column(ids: torch.Tensor, device) -> torch.Tensor:
    """``ids`` as column 0 of a (B*T, 2) tensor, reshaped to ``ids.shape``: the same values with stride 2, as a
    trainer holding (token, position) pairs would pass them."""
    pairs = torch.stack([ids.reshape(-1), ids.reshape(-1).flip(0)], -1).to(device)  # (B*T, 2)
    return pairs[:, 0].reshape(ids.shape)


def _fp64_sampler_reference(hidden, weight, bias, ids, specs: dict, rows: int = 256) -> dict:
    """Per row of ``specs`` (name: (dtype, the keywords of ``sampler_logprobs_from_hidden``)): ``(full, processed,
    inside)``, each (N,) on CPU, computed naively in float64 from the inputs as the pass sees them (hidden and head
    cast to ``dtype``): full = log_softmax(z64)[y], processed = z64[y] - logsumexp(z64 over the kept set) with
    z64 = (h W^T + b) / T, and whether the kept set held y before the boundary rule.

    The kept set is the CPU path's rule: the finite entries of ``processed_logits`` of float32 logits (the float64
    ones rounded: the CPU pass's own float32 logits differ from them in the last bits, so a token within that noise
    of an edge may be decided otherwise: the caller counts those and leaves them out) under the CPU's tie rule
    (``engine_topk_topp`` as the row names it; ``"auto"`` is ``"pytorch"`` on CPU), plus the sampled token (the
    boundary rule: K | {y}, equal to K where y is inside); or the recorded set of ``kept_sets`` as it is (no boundary
    rule: a token missing from the engine's set stays -inf). ``rows`` rows at a time: the float64 logits of one chunk
    per dtype (256 x 32,000 x 8 bytes = 66 MB at the GPU sizes), one kept set (one sort) per distinct setting."""
    n = ids.numel()
    y = ids.reshape(-1).cpu()
    flat = hidden.reshape(n, -1).cpu()
    padded = {name: kw["kept_sets"].to_padded().reshape(n, -1) for name, (_, kw) in specs.items()
              if kw.get("kept_sets") is not None}
    out = {name: (torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64),
                  torch.empty(n, dtype=torch.bool)) for name in specs}
    heads = {dtype: (weight.cpu().to(dtype), bias.cpu()) for dtype, _ in specs.values()}
    for s in range(0, n, rows):
        e = min(n, s + rows)
        yc = y[s:e, None]
        logits, done = {}, {}
        for name, (dtype, kw) in specs.items():
            if dtype not in logits:
                h, (w, b) = flat[s:e].to(dtype), heads[dtype]
                z64 = h.double() @ w.double().t() + b.double()
                logits[dtype] = (z64.float(), z64)  # the float32 logits the kept set is decided on
            z32, z64 = logits[dtype]
            t, k, p, m = kw["temperature"], kw["top_k"], kw["top_p"], kw["min_p"]
            k = k if k is not None and 0 < k < z64.shape[-1] else None  # -1, 0 and k >= V: off, as in vLLM
            rule = topk_topp_rule(kw.get("engine_topk_topp", "auto"), "cpu")
            keep_sampled = kw.get("keep_sampled", True)
            key = ("replay", name) if name in padded else (dtype, t, k, p, m, rule, keep_sampled)
            if key not in done:
                zt = z64 / t
                full = zt.log_softmax(-1).gather(-1, yc).squeeze(-1)
                if name in padded:
                    listed = padded[name][s:e]
                    r, c = (listed >= 0).nonzero(as_tuple=True)
                    kept = torch.zeros(zt.shape, dtype=torch.bool)
                    kept[r, listed[r, c]] = True
                    inside = kept.gather(-1, yc).squeeze(-1)
                else:
                    kept = torch.isfinite(sampler_core.processed_logits(z32, t, k, p, m, engine_topk_topp=rule))
                    inside = kept.gather(-1, yc).squeeze(-1)
                    if keep_sampled:
                        kept.scatter_(-1, yc, True)
                lse = zt.masked_fill(~kept, float("-inf")).logsumexp(-1)
                done[key] = (full, zt.gather(-1, yc).squeeze(-1) - lse, inside)
            for slot, value in zip(out[name], done[key]):
                slot[s:e] = value
    return out


def _fp64_errors(res, ref64, rows: torch.Tensor) -> float:
    """Largest |result - float64| of a row's ``full`` (everywhere) and ``processed`` (at ``rows``)."""
    full64, proc64, _ = ref64
    return max(_diff(res.full.reshape(-1).cpu(), full64),
               _diff(res.processed.reshape(-1).cpu()[rows], proc64[rows]))


def parity(device: torch.device, small: bool) -> bool:
    """Each entry point on CPU and on ``device``, same inputs: the largest difference against its tolerance; the
    ``sampler_logprobs_from_hidden`` rows judged against a float64 reference instead."""
    g = torch.Generator().manual_seed(0)
    B, T, V, H = (4, 24, 512, 64) if small else (8, 256, 32000, 1024)
    mask = (torch.rand(B, T, generator=g) > 0.1).float()
    old = -torch.rand(B, T, generator=g) * 3
    rollout = old + torch.randn(B, T, generator=g) * 0.05
    current = old + torch.randn(B, T, generator=g) * 0.02
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    cfg = CorrectionConfig(rollout_importance_sampling_mode="token_truncate", rollout_rejection=("seq_mean_k3",),
                           rollout_rejection_threshold=0.01, off_policy_sequence_mask_delta=0.02)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H ** 0.5 * 4
    bias = torch.randn(V, generator=g) * 0.1
    ids = torch.randint(0, V, (B, T), generator=g)
    logits = torch.randn(B, T, V, generator=g) * 3
    sets = KeptSets.from_padded(torch.where(torch.rand(B, T, 8, generator=g) > 0.3,
                                            torch.randint(0, V, (B, T, 8), generator=g), -1))
    # the tokens of the sampler_logprobs_from_hidden rows: every other one drawn from the model at T = 0.7 as an
    # engine draws it (nearly all inside the kept set: the renormalised logprob's own path, and a top-p edge
    # sometimes near), the rest uniform over the vocabulary (nearly all outside: the boundary rule). Uniform alone
    # would leave the kept set holding y at ~1 token in 10,000 at V = 32,000. Drawn last, from their own generator:
    # the other rows' inputs are as before.
    gd = torch.Generator().manual_seed(3)
    with torch.no_grad():
        drawn = torch.cat([((h @ weight.t() + bias) / 0.7).softmax(-1).multinomial(1, generator=gd).squeeze(-1)
                           for h in hidden.reshape(-1, H).split(256)]).reshape(B, T)
    tokens = torch.where(torch.arange(B * T).reshape(B, T) % 2 == 0, drawn, ids)
    sets_ids = torch.cat([tokens[..., None], sets.to_padded()], -1)  # every set holds its token
    repeated = (sets_ids[..., :, None] == sets_ids[..., None, :]).tril(-1).any(-1)
    sets = KeptSets.from_padded(sets_ids.masked_fill(repeated, -1))  # each id once, as an engine records a set
    router = torch.randn(B * T, 16, generator=g)
    routes = torch.where(torch.rand(B * T, 1, generator=g) > 0.5, torch.randint(0, 16, (B * T, 2), generator=g), -1)
    sampling = dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02)

    def head_pass(d, dtype, grad=False):
        h = hidden.to(d, dtype).detach().clone().requires_grad_()
        lp, ent = chunked_fp32_logprobs(h, weight.to(d, dtype), ids.to(d), bias=bias.to(d), temperature=0.7,
                                        return_entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        return h.grad.float() if grad else (lp.detach(), ent.detach())

    def fp32_head(d):
        lin = nn.Linear(H, V).to(d, torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(weight.to(d)), lin.bias.copy_(bias.to(d))
        apply_fp32_lm_head(lin)
        with torch.no_grad():
            return lin(hidden[0].to(d, torch.bfloat16))

    def from_hidden(d, dtype, strided=False, **kw):
        y = _pairs_column(tokens, d) if strided else tokens.to(d)
        return sampler_logprobs_from_hidden(hidden.to(d, dtype), weight.to(d, dtype), y, bias=bias.to(d),
                                            response_mask=mask.to(d), **dict(sampling, **kw))

    # sampler_logprobs_from_hidden: name -> (dtype, layout and keyword overrides of ``sampling``). Without a named
    # rule a row runs under "auto" (the triton tie rule on CUDA, the pytorch one on CPU). On CUDA the candidates'
    # kernel covers an open row by the min-p bound where min-p is on, else by count where top-k is on, else by mass.
    bf16 = torch.bfloat16
    hidden_rows = {
        "sampler_logprobs_from_hidden fp32": (torch.float32, {}),  # top-k 40, top-p 0.9, min-p 0.02: bound cover
        "sampler_logprobs_from_hidden bf16": (bf16, {}),
        "sampler_logprobs_from_hidden replay": (bf16, dict(kept_sets=sets)),
        # top-p alone: on CUDA the candidates' kernel covers the row by mass (above: by the min-p bound)
        "sampler_logprobs_from_hidden top-p (mass cover)": (bf16, dict(top_k=None, min_p=0.0)),
        "sampler_logprobs_from_hidden top-k 40 (count cover)": (bf16, dict(top_p=1.0, min_p=0.0)),
        "sampler_logprobs_from_hidden top-k 40+top-p 0.9 (count cover)": (bf16, dict(min_p=0.0)),
        # -1 is vLLM's documented "off": the pass must treat it as no top-k, on the device as on CPU
        "sampler_logprobs_from_hidden top-k -1 (off)+top-p 0.9": (bf16, dict(top_k=-1, min_p=0.0)),
        # the sampled ids as column 0 of (B*T, 2) pairs: stride 2, reshaped to (B, T) like the other rows' ids
        "sampler_logprobs_from_hidden strided ids (B*T,2)[:,0]": (bf16, dict(strided=True)),
        # both tie rules named, the same on both sides ("auto" compares triton on CUDA with pytorch on CPU)
        "sampler_logprobs_from_hidden rule pytorch, both sides": (bf16, dict(engine_topk_topp="pytorch")),
        "sampler_logprobs_from_hidden rule triton, both sides": (bf16, dict(engine_topk_topp="triton")),
    }
    cases = {
        "compute_correction": (lambda d: compute_correction(cfg, old_logprobs=old.to(d), rollout_logprobs=rollout.to(d),
                                                            response_mask=mask.to(d), advantages=adv.to(d),
                                                            current_logprobs=current.to(d), with_metrics=True), 1e-6),
        # compiled on the device (Inductor's Triton kernels) against eager on CPU; fused sums round in another order
        "compute_correction, compile_correction": (
            lambda d: compute_correction(cfg.replace(compile_correction=d.type != "cpu"), old_logprobs=old.to(d),
                                         rollout_logprobs=rollout.to(d), response_mask=mask.to(d),
                                         advantages=adv.to(d), current_logprobs=current.to(d)), (1e-6, 1e-4)),
        "policy_loss": (lambda d: policy_loss(cfg, current_logprobs=current.to(d), advantages=adv.to(d),
                                              old_logprobs=old.to(d), response_mask=mask.to(d),
                                              correction=compute_correction(cfg, old_logprobs=old.to(d),
                                                                            rollout_logprobs=rollout.to(d),
                                                                            response_mask=mask.to(d),
                                                                            advantages=adv.to(d),
                                                                            current_logprobs=current.to(d))), 1e-6),
        "processed_logits": (lambda d: processed_logits(logits[0].to(d), **sampling), 1e-5),
        "sampler_logprobs": (lambda d: sampler_logprobs(logits.to(d), ids.to(d), **sampling, response_mask=mask.to(d),
                                                        return_outside=True), 1e-5),
        "chunked_fp32_logprobs fp32": (lambda d: head_pass(d, torch.float32), 1e-4),
        "chunked_fp32_logprobs fp32, grad": (lambda d: head_pass(d, torch.float32, grad=True), 1e-4),
        "chunked_fp32_logprobs bf16": (lambda d: head_pass(d, torch.bfloat16), 1e-4),
        # the gradient is returned in the hidden states' dtype: one bf16 step apart where fp32 values round apart
        "chunked_fp32_logprobs bf16, grad": (lambda d: head_pass(d, torch.bfloat16, grad=True), (1e-4, 2 ** -7)),
        **{name: (lambda d, _dt=dtype, _kw=kw: from_hidden(d, _dt, **_kw), 1e-4)
           for name, (dtype, kw) in hidden_rows.items()},
        "kept_mass_metrics": (lambda d: kept_mass_metrics((old - rollout).abs().to(d), mask.to(d),
                                                          outside_mask=(rollout < -2.9).to(d)), 1e-6),
        "rollout_on_full_vocabulary": (lambda d: rollout_on_full_vocabulary(rollout.to(d), old.to(d),
                                                                            (old + 0.1).to(d)), 1e-6),
        "apply_fp32_lm_head (bf16 Linear)": (lambda d: fp32_head(d), 1e-4),
        "replayed_routing": (lambda d: replayed_routing(router.to(d), routes.to(d), 2, True), 1e-6),
        "judge": (lambda d: judge(old.to(d), rollout.to(d), 0.1), 1e-9),
    }
    print(f"\n== 1. parity: {device} against cpu (B={B} T={T} V={V} H={H}; bf16 paths on {device}: "
          f"{head_matmul_path(torch.bfloat16, torch.bfloat16, device)}, on cpu: upcast_tiles)")
    t0 = time.perf_counter()
    try:
        refs = _fp64_sampler_reference(hidden, weight, bias, tokens,
                                       {name: (dtype, {k: v for k, v in dict(sampling, **kw).items() if k != "strided"})
                                        for name, (dtype, kw) in hidden_rows.items()})
        print(f"  float64 reference of the {len(hidden_rows)} sampler_logprobs_from_hidden rows: "
              f"{time.perf_counter() - t0:.1f} s (judged on |{device.type} - float64| <= min({FP64_FACTOR:g} "
              f"|cpu - float64| + {FP64_FLOOR:.0e}, {FP64_CAP:.0e}))")
    except Exception as e:  # noqa: BLE001 - those rows fail by name below; the others still run
        refs = None
        print(f"  float64 reference: error {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    valid = mask.reshape(-1).bool()
    width = max(map(len, cases))
    allowed = max(1, B * T // 1000)
    ok, worst, flipped, fp64_dev, fp64_cpu = True, 0.0, 0, 0.0, 0.0
    for name, (fn, tol) in cases.items():
        tol, rel = tol if isinstance(tol, tuple) else (tol, 0.0)
        torch.manual_seed(0)
        ref = _to(fn(torch.device("cpu")), "cpu")
        torch.manual_seed(0)
        vs64, ref_flips = "", 0
        try:
            got = fn(device)
            d, flips = _compare(ref, got, rel)
            error = ""
            if name in hidden_rows:
                if refs is None:
                    raise RuntimeError("no float64 reference")
                # compared where the device, the CPU and the reference agree on whether the kept set held y
                cpu_out = ref.outside_mask.reshape(-1).cpu()
                dev_flip = got.outside_mask.reshape(-1).cpu() != cpu_out
                ref_flip = valid & (~refs[name][2] != cpu_out)
                rows = valid & ~dev_flip & ~ref_flip
                ref_flips = int(ref_flip.sum())
                e_dev, e_cpu = _fp64_errors(got, refs[name], rows), _fp64_errors(ref, refs[name], rows)
                fp64_dev, fp64_cpu = max(fp64_dev, e_dev), max(fp64_cpu, e_cpu)
                tol = min(FP64_FACTOR * e_cpu + FP64_FLOOR, FP64_CAP)
                vs64 = f"; vs float64 {device.type} {e_dev:.2e}, cpu {e_cpu:.2e}"
        except Exception as e:  # noqa: BLE001 - a path that fails on the device only: named, the other rows still run
            d, flips, error = float("inf"), 0, f"  error {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            e_dev = float("inf")
        judged = e_dev if name in hidden_rows else d
        good = judged <= tol and flips + ref_flips <= allowed
        ok &= good
        worst, flipped = max(worst, judged / tol), flipped + flips
        print(f"  {name:<{width}} max |{device.type} - cpu|{f' - {rel:.3g} |cpu|' if rel else ''} {d:.2e}{vs64}  "
              f"(tolerance {tol:.{1 if vs64 else 0}e})"
              f"{f', {flips} kept-set flips' if flips else ''}{f', {ref_flips} reference flips' if ref_flips else ''}"
              f"  {'ok' if good else 'FAILED'}{error}")
    print(f"GPU_CHECK parity device={device.type} entry_points={len(cases)} all_within_tolerance={ok} "
          f"worst_diff_over_tolerance={worst:.2e} kept_set_flips={flipped} fp64_rows={len(hidden_rows)} "
          f"fp64_max_err_device={fp64_dev:.2e} fp64_max_err_cpu={fp64_cpu:.2e}")
    return ok


def _flags() -> tuple:
    m = torch.backends.cuda.matmul
    return (torch.get_float32_matmul_precision(), m.allow_tf32, m.fp32_precision,
            m.allow_bf16_reduced_precision_reduction)


def _fp64_logprobs(hidden, weight, ids, temperature, rows):
    out = torch.empty(ids.shape[0], dtype=torch.float64, device=hidden.device)
    w64 = weight.double()
    for s in range(0, ids.shape[0], rows):
        z = (hidden[s:s + rows].double() @ w64.t()) / temperature
        out[s:s + rows] = z.log_softmax(-1).gather(-1, ids[s:s + rows, None]).squeeze(-1)
    return out


def _usual_fp32_head(hidden, weight, ids, temperature, rows):
    """The fp32 head written the usual way: upcast W, 1/T on the hidden states, the caller's matmul precision."""
    w = weight.float()
    out = torch.empty(ids.shape[0], dtype=torch.float32, device=hidden.device)
    for s in range(0, ids.shape[0], rows):
        z = (hidden[s:s + rows].float() / temperature) @ w.t()
        out[s:s + rows] = z.log_softmax(-1).gather(-1, ids[s:s + rows, None]).squeeze(-1)
    return out


USUAL = "usual fp32 head (upcast, h/T, caller's TF32)"


def tf32(device: torch.device, small: bool) -> bool:
    n, H, V, T = (256, 256, 4096, 0.7) if small else (2048, 3584, 151936, 0.7)
    g = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn(n, H, generator=g, device=device).bfloat16()
    weight = (torch.randn(V, H, generator=g, device=device) * (8 / H) ** 0.5).bfloat16()
    rows = min(512, n)
    with torch.no_grad():  # tokens sampled from the float64 head, as an engine would have drawn them
        ids = torch.empty(n, dtype=torch.long, device=device)
        gen = torch.Generator(device=device).manual_seed(2)
        w64 = weight.double()
        for s in range(0, n, rows):
            probs = ((hidden[s:s + rows].double() @ w64.t()) / T).softmax(-1)
            ids[s:s + rows] = probs.multinomial(1, generator=gen).squeeze(-1)
        del w64, probs
        ref = _fp64_logprobs(hidden, weight, ids, T, rows)
        bf16_head = torch.cat([((hidden[s:s + rows] @ weight.t()) / T).float().log_softmax(-1)
                               .gather(-1, ids[s:s + rows, None]).squeeze(-1) for s in range(0, n, rows)])
    print(f"\n== 2. TF32: bf16 hidden and head, N={n} H={H} V={V} T={T}; |logprob - float64| (mean / max)")
    saved = _flags()
    restored_all = True
    results = {}
    try:
        for on in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = on
            torch.set_float32_matmul_precision("high" if on else "highest")
            before = _flags()
            with torch.no_grad():
                plain = chunked_fp32_logprobs(hidden, weight, ids, temperature=T)
                sampler = sampler_logprobs_from_hidden(hidden, weight, ids, T).full
                usual = _usual_fp32_head(hidden, weight, ids, T, rows)
            restored = _flags() == before
            for name, lp in (("chunked_fp32_logprobs", plain), ("sampler_logprobs_from_hidden", sampler),
                             (USUAL, usual), ("bf16 head", bf16_head)):
                d = (lp.double() - ref).abs()
                results[(name, on)] = (float(d.mean()), float(d.max()))
                print(f"  TF32 {'on ' if on else 'off'} {name:<46} {d.mean():.2e} / {d.max():.2e}")
            print(f"  TF32 {'on ' if on else 'off'} caller's settings unchanged after the passes: {restored}")
            restored_all &= restored
        # the logits of one chunk, bf16 GEMM with fp32 output (GPU) and fp32 upcast, against float64
        with torch.no_grad():
            z64 = (hidden[:rows].double() @ weight.double().t())
            out = torch.empty(rows, V, device=device)
            head = head_matmul.HeadProjector(weight, None, 1.0, torch.bfloat16, torch.float32, rows)
            with head_matmul.exact_fp32_matmul():
                head.logits_into(out, hidden[:rows])
            scale = z64.abs().amax(-1, keepdim=True)  # relative to each row's largest logit
            gemm_err = float(((out.double() - z64).abs() / scale).max())
            upcast = head_matmul.HeadProjector(weight, None, 1.0, torch.float32, torch.float32, rows)  # forces tiles
            with head_matmul.exact_fp32_matmul():
                upcast.logits_into(out, hidden[:rows])
            up_err = float(((out.double() - z64).abs() / scale).max())
        print(f"  logits of {rows} rows, max |z - z_float64| / max |z| of the row: {head.path} {gemm_err:.1e}, "
              f"{upcast.path} {up_err:.1e}")
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cuda.matmul.allow_tf32 = saved[1]
    # the passes must be exact whatever the caller's setting: the same error with TF32 on as off
    exact = all(results[(name, True)][0] <= 2 * results[(name, False)][0] + 1e-7
                for name in ("chunked_fp32_logprobs", "sampler_logprobs_from_hidden"))
    off, on = results[("chunked_fp32_logprobs", False)], results[("chunked_fp32_logprobs", True)]
    usual_off, usual_on = results[(USUAL, False)], results[(USUAL, True)]
    print(f"GPU_CHECK tf32 device={device.type} n={n} hidden={H} vocab={V} pass_mean_off={off[0]:.2e} "
          f"pass_mean_on={on[0]:.2e} pass_max_on={on[1]:.2e} usual_mean_off={usual_off[0]:.2e} "
          f"usual_mean_on={usual_on[0]:.2e} usual_max_on={usual_on[1]:.2e} "
          f"bf16_head_mean={results[('bf16 head', False)][0]:.2e} gemm_path={head.path} gemm_max_rel={gemm_err:.1e} "
          f"upcast_max_rel={up_err:.1e} exact_under_tf32={exact} settings_restored={restored_all}")
    return exact and restored_all


#: The bound on sampler_pass.py's ``replay_err``: max |replayed - recomputed| of the processed logprobs, where the
#: replay pass is given the kept sets the benchmark recorded from the exact fp32 logits of the same hidden states and
#: head (top-k 50, top-p 0.9) and the other pass recomputes them. Both passes project the same chunks through the same
#: GEMM, so where the sets agree both are log p_T(y) - log S over the same set of the same logits, apart only in the
#: order S is summed (float32 rounding: ~1e-6 here; 0.0 on the H200 of docs/data/gpu/gpu_check_h200.log). 1e-4 is
#: the tolerance of the same pass between two devices. A replayed set read wrong (a shifted row or chunk, an id
#: dropped) moves it by log(1 + p/S) of the tokens concerned, 1e-3 and more for any token holding 0.1% of the mass;
#: so does a set recorded from logits that put a token on the other side of an edge than the pass's GEMM does (the
#: data is seeded: at a given size that happens on every run or on none).
REPLAY_BOUND = 1e-4


def _text(out) -> str:
    """A child's captured output: str, or the bytes (or None) that ``TimeoutExpired`` holds even in text mode."""
    if out is None:
        return ""
    return out.decode(errors="replace") if isinstance(out, bytes) else out


def _fields(result_line: str) -> dict:
    """``key=value`` pairs of a RESULT line."""
    return dict(item.split("=", 1) for item in result_line.split() if "=" in item)


def bench(device: torch.device, small: bool, timeout: int) -> bool:
    """Sections 3 and 4, each in a subprocess with ``timeout`` seconds: True when both finished with status 0 and the
    sampler pass's replay error is within ``REPLAY_BOUND``. A section that times out or cannot start is named on its
    GPU_CHECK line (with what it printed before) and fails the run; the other still runs."""
    sampler = ["--n", "512", "--hidden", "256", "--vocab", "8192", "--repeats", "2"] if small else \
        ["--n", "8192", "--hidden", "4096", "--vocab", "151936", "--repeats", "3"]
    correction = ["--batch", "8", "--tokens", "512", "--repeats", "5"] if small else []
    ok = True
    for label, section, script, args in (
            ("bench", "3. speed and memory", "sampler_pass.py", ["--dtype", "bfloat16", *sampler]),
            ("correction", "4. the correction's overhead", "correction_overhead.py", correction)):
        cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--device", str(device), *args]
        print(f"\n== {section}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        head = f"GPU_CHECK {label} device={device.type}"
        try:
            # unbuffered: a child killed at the timeout has printed what it had done so far
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                 env=dict(os.environ, PYTHONUNBUFFERED="1"))
        except subprocess.TimeoutExpired as e:  # killed: what it printed so far, and the next section still runs
            ok = False
            out, err = _text(e.stdout), _text(e.stderr)
            print(out, err[-2000:], sep="", end="" if not out + err or (out + err).endswith("\n") else "\n")
            result = [line for line in out.splitlines() if line.startswith("RESULT")]
            print(f"{head} seconds={time.perf_counter() - t0:.0f} timed_out=True timeout={timeout} "
                  f"partial_stdout_lines={len(out.splitlines())} "
                  f"{result[-1][len('RESULT '):] if result else 'no RESULT line'}", flush=True)
            continue
        except Exception as e:  # noqa: BLE001 - a section that cannot start is named; the next still runs
            ok = False
            print(f"{head} seconds={time.perf_counter() - t0:.0f} error={type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200] if str(e) else ''!r}", flush=True)
            continue
        print(run.stdout, run.stderr[-2000:] if run.returncode else "", sep="", end="")
        result = [line for line in run.stdout.splitlines() if line.startswith("RESULT")]
        checks = ""
        good = run.returncode == 0 and bool(result)
        if label == "bench":
            replay = _fields(result[-1]).get("replay_err") if result else None
            try:
                replay_ok = replay is not None and float(replay) <= REPLAY_BOUND
            except ValueError:
                replay_ok = False
            good &= replay_ok
            checks = f" replay_err_bound={REPLAY_BOUND:.0e} replay_within_bound={replay_ok}"
        ok &= good
        print(f"{head} seconds={time.perf_counter() - t0:.0f} returncode={run.returncode} "
              f"{result[-1][len('RESULT '):] if result else 'no RESULT line'}{checks}", flush=True)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="small sizes (a CPU run of the whole script)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["parity", "tf32", "bench"])
    ap.add_argument("--bench-timeout", type=int, default=300, help="seconds for each of sections 3 and 4")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_check: torch {torch.__version__}, device {device} ({name}), bf16 head path "
          f"{head_matmul_path(torch.bfloat16, torch.bfloat16, device)}")
    ok = True
    for section, run in (("parity", parity), ("tf32", tf32)):
        if section in args.skip:
            continue
        try:
            ok &= run(device, args.small)
        except Exception as e:  # noqa: BLE001 - one section's failure is reported; the device time buys the rest
            ok = False
            print(f"GPU_CHECK {section} device={device.type} error={type(e).__name__}: {str(e).splitlines()[0][:200]!r}")
    if "bench" not in args.skip:
        try:
            ok &= bench(device, args.small, args.bench_timeout)
        except Exception as e:  # noqa: BLE001 - as above: named, and the summary line still comes
            ok = False
            print(f"GPU_CHECK bench device={device.type} error={type(e).__name__}: {str(e).splitlines()[0][:200]!r}")
    print(f"GPU_CHECK done seconds={time.perf_counter() - t0:.0f} ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
