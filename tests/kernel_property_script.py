"""Property-based check (hypothesis) of the CUDA branch's Triton kernels, run by Triton's interpreter on CPU.

Run by ``tests/test_kernel_properties.py`` in a subprocess with ``TRITON_INTERPRET=1`` (the variable must be set
before the kernels are defined, at import). It drives ``sampler_logprobs_from_hidden`` and ``chunked_fp32_logprobs``
through their CUDA branch (the Triton kernels of ``rollout_parity/kernels``) and through their torch path on the same
inputs, and compares both with float64 references, over hypothesis's draws of layouts, dtypes, vocabulary sizes, row
kinds and the sampler's whole parameter domain. It writes a JSON report: every failing example of every property,
and for each failing property hypothesis's shrunk minimal example.

How the CUDA branch is forced on CPU: only the device check of the kernel selectors is changed.
``sampler._row_kernels`` and ``fp32_logprobs._row_kernel`` are replaced by wrappers that call the real selectors
with ``torch.device("cuda")``, so a selector that refuses some inputs to the kernels (a top-k the candidates'
columns cannot hold, float64 logits) still sends them to torch, as on a GPU. The wrappers count the kernels'
launches (the report's coverage).

Two hypothesis phases share one cached evaluation per drawn case (``derandomize=True``: the same function draws
the same cases in the same order):

1. explore: ``max_examples`` cases, every property evaluated on each, nothing raised, every failure recorded;
2. shrink: for each property that failed, the same generation again (cache hits up to its first failure), the
   test raising only for that property, and hypothesis's shrinker looking for a smaller failing case (bounded in
   time: the interpreter makes each evaluation take a fraction of a second).

Usage: ``TRITON_INTERPRET=1 python tests/kernel_property_script.py --out report.json [--max-examples N]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import warnings

if os.environ.get("TRITON_INTERPRET") != "1":
    raise SystemExit("set TRITON_INTERPRET=1 before starting Python: Triton reads it when the kernels are defined")

import torch  # noqa: E402
from hypothesis import HealthCheck, Phase, Verbosity, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import HypothesisException  # noqa: E402

from rollout_parity.core import fp32_logprobs, sampler  # noqa: E402
from rollout_parity.core.replay import KeptSets  # noqa: E402

torch.set_num_threads(1)

# --------------------------------------------------------------------------------------------------------------
# Tolerances.
#
# Both the CUDA branch and the torch path compute float32 log-softmaxes of the SAME float32 logits z (one GEMM,
# rollout_parity.core.head_matmul), in a different order: Triton's exp2/log2 and an online log-sum-exp against
# torch's three passes. For the token's log-probability lp = (x_y - m) - log s (x = z / T, m = max x,
# s = sum exp(x - m)), the float32 error of a correct implementation against the exact value of the same x is
#
#   |x_y - m| and lp rounded once each:       <= 2^-24 (|x_y - m| + |lp|) <= 2^-23 |lp|     (|x_y - m| <= |lp|)
#   log s: the sum's and the exps' rounding:  ~ 2^-24 (log2 V + sum_v p_v |x_v - m|) <= a few 2^-23 (1 + ln V)
#
# so TOL_FP32(lp) = 2^-23 (C_OUT |lp| + C_LSE (1 + ln V)), C_OUT = 4, C_LSE = 8 (2-4x the bound above; the report's
# "margins" give the largest |error| / tol seen: torch's own path against the exact value used at most 0.29 of it
# over 300 draws, the fixed kernels at most 0.15, the kernels of 588d6b1 up to 1e9). It scales with the OUTPUT's magnitude, not with max|z / T|: a row at
# |logit| ~ 3,000 whose token is its top one has lp ~ 0 and is computed to ~1e-6 by torch. A bound of the form
# c 2^-23 max|z/T| would be ~1e-3 there and would admit exactly the precision loss of forming
# lse = m + log s first (half an ulp of m: 1.2e-4 at m = 2,000), which is a bug, not rounding of the result.
# Kernel vs torch: twice that (each side's error). The processed logprob lp_y - log S adds log S's error, a
# weighted mean of the kept entries' errors (sum_v w_v |lp_v| <= |log S| + ln V): 2^-23 C_OUT (|log S| + 1 + ln V).
#
# Against float64 of (h W^T + b) / T (not of the float32 logits) the GEMM's rounding enters as well: each float32
# logit is off by at most ~(H + 1) 2^-24 sum_j |h_j W_vj| + |b_v| (plus 2^-24 |x| for float32 T), and lp moves by
# at most twice the largest logit error: + 2^-23 (H + 3) A, A = max_v (sum_j |h_j W_vj| + |b_v|) / T. That term is
# legitimately proportional to the logits' magnitude (it is the GEMM's error, not the log-softmax's), so the
# float64 check cannot see a large-logit precision loss; the checks against the exact log-softmax of the float32
# logits ("exact") and against torch can.
#
# Entropy: H = log s - sum_v p_v (x_v - m). An error d of log s (the sum's rounding, shared by every entry) moves
# each p_v by a relative d and H by about (1 + H) d (measured: torch's own entropy of a flat row at V = 4,097 is
# off by 2.0e-5, 166 2^-23, more than the log-probabilities' bound allows), so TOL_ENT = 2^-23 (C_OUT (H + 1 + ln V) + C_LSE (1 + ln V)(1 + H));
# against float64 of h, W the GEMM term times (1 + 2 H) (|dH| <= 2 max|dz| sum_v p_v |lp_v + H| <= 4 H max|dz|).
U = 2.0 ** -23
C_OUT, C_LSE = 4.0, 8.0
# Kept-set edges: a decision (min-p ratio, top-k near-tie, top-p cumulative mass) whose exact value lies within
# the two sides' float noise of its threshold may go either way on each side. Such tokens are "fragile"; the
# sides may disagree on them (outside_mask) and on the kept mass by at most the fragile tokens' mass (processed).
# The mass window: the entries' log errors (TOL_FP32, both sides) plus float32 cumulative sums over the row,
# whose rounding the two sides may take differently: 8 sqrt(V) 2^-23.
SAMPLING_EPS = 1e-5  # vLLM's greedy threshold (sampler._SAMPLING_EPS)

EDGE_V = (1, 2, 3, 255, 256, 257, 1023, 1025, 4095, 4097)
FINITE_KINDS = ("normal", "peaked", "flat", "exact_flat", "tie_top", "large_spread", "large_offset")
NONFINITE_KINDS = ("nan", "posinf", "neginf")
# finite kinds three times as likely as non-finite ones (a list with repeats: sampled_from shrinks to "normal")
ROW_KINDS = FINITE_KINDS * 3 + NONFINITE_KINDS
TOP_K = (None, None, -1, -1, 0, 1, 2, "lt_V", 254, 255, 256, 300, "V-1", "V", "V+7")  # "off" values weighted up
TOP_P = (1.0, 1.0, 0.5, 0.9, 0.9999, 0.99999, "random")
MIN_P = (0.0, 0.0, 0.0, 1e-9, 0.05, 1.0, "random")
TEMPERATURES = (1.0, 0.0, 1e-6, 1e-5, 3e-5, 0.3, 2.0)

PROPERTIES = {
    # sampler_logprobs_from_hidden
    "sp_runs": "the sampler pass runs on both branches (documented inputs only are drawn)",
    "sp_full_kernel_vs_torch": "full: CUDA branch == torch path (same non-finite pattern, finite within 2 TOL_FP32)",
    "sp_full_kernel_vs_exact": "full (CUDA branch) == float64 log-softmax of the same float32 logits, TOL_FP32",
    "sp_full_torch_vs_exact": "control: full (torch path) == float64 log-softmax of the float32 logits, TOL_FP32",
    "sp_full_kernel_vs_float64": "full (CUDA branch) == float64 log-softmax of (h W^T + b) / T, TOL_FP32 + GEMM",
    "sp_processed_kernel_vs_torch": "processed: CUDA branch == torch path (pattern; finite within tolerance, "
                                    "plus the mass of tokens at a kept-set edge)",
    "sp_outside_kernel_vs_torch": "outside_mask (finite rows) and replayed_mask: CUDA branch == torch path, except "
                                  "tokens within float noise of a kept-set edge",
    "sp_outside_nonfinite_rows": "outside_mask on rows whose logits hold NaN or +inf: CUDA branch == torch path",
    "sp_processed_vs_full": "both branches: processed == full bitwise where nothing truncates and nothing is "
                            "replayed; processed >= full - tol where finite (log S <= 0)",
    # chunked_fp32_logprobs
    "fp_runs": "chunked_fp32_logprobs runs on both branches, with and without entropy",
    "fp_logprob_kernel_vs_torch": "logprobs: kernel branch == torch path (pattern; 2 TOL_FP32)",
    "fp_logprob_kernel_vs_exact": "logprobs (kernel branch) == float64 log-softmax of the float32 logits",
    "fp_logprob_kernel_vs_float64": "logprobs (kernel branch) == float64 of (h W^T + b) / T, TOL_FP32 + GEMM",
    "fp_logprob_with_and_without_entropy": "logprobs are bitwise the same with and without return_entropy "
                                           "(each branch)",
    "fp_entropy_kernel_vs_torch": "entropy (rows without -inf logits): kernel branch == torch path",
    "fp_entropy_kernel_vs_exact": "entropy (rows without -inf logits, kernel) == float64 of the float32 logits",
    "fp_entropy_kernel_vs_float64": "entropy (rows without -inf logits, kernel) == float64 of h, W, TOL + GEMM",
    "fp_torch_vs_exact": "control: logprobs and entropy (torch path) == float64 of the float32 logits",
    "fp_entropy_masked_rows": "entropy of rows with some -inf logits (a -inf bias) but a finite maximum: finite "
                              "(0 log 0 = 0) and == float64, both branches",
}
SAMPLER_PROPS = [p for p in PROPERTIES if p.startswith("sp_")]
FP32_PROPS = [p for p in PROPERTIES if p.startswith("fp_")]


# --------------------------------------------------------------------------------------------------------------
# The strategy: one drawn case is a dict of primitives (hashable as JSON: the evaluation cache's key). Every
# sampled_from lists its simplest value first, so hypothesis shrinks toward it.

@st.composite
def cases(draw):
    V = draw(st.one_of(st.sampled_from(EDGE_V), st.integers(2, 6000)))
    if draw(st.sampled_from(("1d", "2d"))) == "1d":
        shape = [draw(st.integers(1, 8))]
    else:
        shape = [draw(st.integers(1, 3)), draw(st.integers(1, 4))]
    n = math.prod(shape)
    H = draw(st.integers(1, 16))
    kinds = draw(st.lists(st.sampled_from(ROW_KINDS), min_size=n, max_size=n))
    temperature = draw(st.sampled_from(TEMPERATURES))
    top_k = draw(st.sampled_from(TOP_K))
    if top_k == "lt_V":
        top_k = draw(st.integers(1, max(1, V - 1)))
    elif isinstance(top_k, str):
        top_k = {"V-1": V - 1, "V": V, "V+7": V + 7}[top_k]
        top_k = top_k if top_k >= -1 else None
    top_p = draw(st.sampled_from(TOP_P))
    if top_p == "random":
        top_p = draw(st.floats(0.0, 1.0, exclude_min=True))
    min_p = draw(st.sampled_from(MIN_P))
    if min_p == "random":
        min_p = draw(st.floats(0.0, 1.0))
    kept = None
    if temperature >= SAMPLING_EPS and draw(st.booleans()):  # vLLM replays only temperature > 0
        kept = dict(rows=draw(st.lists(st.booleans(), min_size=n, max_size=n)), width=draw(st.integers(1, 40)),
                    with_token=draw(st.sampled_from((True, True, True, False))))
    return dict(
        V=V, shape=shape, H=H, kinds=kinds,
        hidden_dtype=draw(st.sampled_from(("float32", "bfloat16"))),
        weight_dtype=draw(st.sampled_from(("float32", "bfloat16"))),
        hidden_layout=draw(st.sampled_from(("contiguous", "slice", "transposed"))),
        ids_layout=draw(st.sampled_from(("contiguous", "pair_column", "stride3", "transposed", "int32"))),
        bias=draw(st.sampled_from(("none", "random", "masked"))),
        dups=draw(st.integers(0, 3)),
        token_mode=draw(st.sampled_from(("sampled", "uniform", "argmax", "tie"))),
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        keep_sampled=draw(st.booleans()),
        rule=draw(st.sampled_from(("pytorch", "triton"))),
        chunk_size=draw(st.integers(1, 4)),
        kept_sets=kept,
        seed=draw(st.integers(0, 2**20)),
    )


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build(case: dict) -> dict:
    """The case's tensors, deterministic in its seed."""
    g = torch.Generator().manual_seed(case["seed"])
    V, H, shape = case["V"], case["H"], case["shape"]
    n = math.prod(shape)
    W = torch.randn(V, H, generator=g, dtype=torch.float64)
    if H >= 2:  # unit rows in the first H - 1 columns, the last a column of ones: h[-1] shifts the whole row
        W[:, : H - 1] /= W[:, : H - 1].norm(dim=1, keepdim=True).clamp_min(1e-12)
        W[:, H - 1] = 1.0
    else:
        W = torch.where(W >= 0, 1.0, -1.0).to(torch.float64)
    perm = torch.randperm(V, generator=g)
    t0 = int(perm[0])  # the tied top token of "tie_top" rows
    dups = [int(v) for v in perm[1: 1 + case["dups"]]]
    for d in dups:
        W[d] = W[t0]
    bias = None
    if case["bias"] != "none":
        bias = torch.randn(V, generator=g, dtype=torch.float64) * 0.5
        if case["bias"] == "masked" and V > 1:  # a few masked ids (-inf), never the tied top token
            masked = perm[1 + case["dups"]:][: 1 + V // 8]
            bias[masked] = float("-inf")
        for d in dups:
            bias[d] = bias[t0]
    weight = W.to(DTYPES[case["weight_dtype"]])
    bias_t = None if bias is None else bias.to(torch.float32)

    rows = torch.zeros(n, H, dtype=torch.float64)
    for i, kind in enumerate(case["kinds"]):
        base = torch.randn(H, generator=g, dtype=torch.float64)
        big = 1000.0 + 2000.0 * float(torch.rand((), generator=g, dtype=torch.float64))
        j = int(torch.randint(0, H, (), generator=g))
        if kind in ("normal", "nan", "posinf", "neginf"):
            row = base * 2
        elif kind == "peaked":
            row = base * 12
        elif kind == "flat":
            row = base * 1e-3
        elif kind == "exact_flat":
            row = torch.zeros(H, dtype=torch.float64)
        elif kind == "tie_top":
            row = 30 * W[t0].clone()
            if H >= 2:
                row[H - 1] = 0.0
        elif kind == "large_spread":
            row = base * big
        elif kind == "large_offset":
            row = base * 4
            if H >= 2:
                row[H - 1] = big * (1 if j % 2 else -1)
            else:
                row = row / row.abs().clamp_min(1e-3) * big
        else:
            raise AssertionError(kind)
        if kind in NONFINITE_KINDS:
            row[j] = {"nan": float("nan"), "posinf": float("inf"), "neginf": float("-inf")}[kind]
        rows[i] = row
    hdt = DTYPES[case["hidden_dtype"]]
    h = rows.to(hdt)
    if case["hidden_layout"] == "contiguous":
        hidden = h.reshape(*shape, H).clone()
    elif case["hidden_layout"] == "slice":  # a slice of a wider tensor: rows of stride H + 3
        wide = torch.zeros(*shape, H + 3, dtype=hdt)
        wide[..., 1: H + 1] = h.reshape(*shape, H)
        hidden = wide[..., 1: H + 1]
    else:  # transposed, then transposed back as a view
        perm_dims = tuple(range(len(shape), -1, -1))
        hidden = h.reshape(*shape, H).permute(*perm_dims).contiguous().permute(*perm_dims)

    # float64 of the hidden states and head as stored (bf16 values are exact in float64)
    z64 = hidden.reshape(n, H).double() @ weight.double().t()
    if bias is not None:
        z64 = z64 + bias_t.double()
    t_eff = 1.0 if case["temperature"] < SAMPLING_EPS else case["temperature"]
    good64 = torch.isfinite(z64.amax(-1)) & ~z64.isnan().any(-1)
    mode = case["token_mode"]
    ids = torch.randint(0, V, (n,), generator=g)
    if mode == "sampled":
        p = torch.where(good64[:, None], (z64 / t_eff).softmax(-1), 1.0)
        p = torch.where(p.isfinite() & (p.sum(-1, keepdim=True) > 0), p, 1.0)
        ids = torch.multinomial(p, 1, generator=g).squeeze(-1)
    elif mode == "argmax":
        ids = torch.where(good64, torch.nan_to_num(z64, nan=-1.0).argmax(-1), ids)
    elif mode == "tie":
        pick = torch.randint(0, len(dups) + 1, (n,), generator=g)
        ids = torch.tensor([([t0] + dups)[int(k)] for k in pick], dtype=torch.long)
    junk = (ids + 1 + torch.randint(0, max(V - 1, 1), (n,), generator=g)) % V  # other valid ids (V > 1)
    lay = case["ids_layout"]
    if lay == "contiguous":
        token_ids = ids.reshape(shape).clone()
    elif lay == "int32":
        token_ids = ids.reshape(shape).to(torch.int32)
    elif lay == "pair_column":  # column 0 of (..., 2): stride 2, a view even when flattened
        token_ids = torch.stack([ids, junk], -1).reshape(*shape, 2)[..., 0]
    elif lay == "stride3":  # every third entry of a wider tensor
        token_ids = torch.stack([junk, ids, junk], -1).reshape(*shape[:-1], shape[-1] * 3)[..., 1::3]
    else:  # transposed view (2-D); a column of a transposed (n, 4) in 1-D
        if len(shape) == 2:
            token_ids = ids.reshape(shape).t().contiguous().t()
        else:
            token_ids = torch.stack([ids, junk, junk, junk], 0).t()[:, 0]
    assert torch.equal(token_ids.reshape(-1).long(), ids)

    kept_sets = None
    if case["kept_sets"] is not None:
        spec = case["kept_sets"]
        width = spec["width"]
        padded = torch.full((n, width + 1), -1, dtype=torch.long)
        for i in range(n):
            if not spec["rows"][i]:
                continue
            top = torch.nan_to_num(z64[i], nan=0.0).topk(min(width, V)).indices
            s = set(int(v) for v in top)
            if spec["with_token"]:
                s.add(int(ids[i]))
            elif len(s) > 1:
                s.discard(int(ids[i]))
            vals = sorted(s)[: width + 1]
            padded[i, : len(vals)] = torch.tensor(vals)
        kept_sets = KeptSets.from_padded(padded.reshape(*shape, width + 1))
    return dict(hidden=hidden, weight=weight, bias=bias_t, token_ids=token_ids, ids=ids, z64=z64,
                kept_sets=kept_sets, t_eff=t_eff, n=n)


def float32_logits(inp: dict, chunk: int) -> tuple[torch.Tensor, str]:
    """The float32 logits h W^T + b both branches read, by the package's own head (HeadProjector, the same chunk
    rows), so the "exact" reference is the exact log-softmax of exactly those logits; a plain addmm if the head's
    interface changed (then reported)."""
    hidden, weight, bias = inp["hidden"], inp["weight"], inp["bias"]
    flat = hidden.reshape(-1, hidden.shape[-1])
    n, V = flat.shape[0], weight.shape[0]
    rows = min(chunk, max(n, 1))
    try:
        from rollout_parity.core.head_matmul import HeadProjector, exact_fp32_matmul
        out = torch.empty(n, V, dtype=torch.float32)
        with exact_fp32_matmul():
            head = HeadProjector(weight, bias, 1.0, flat.dtype, torch.float32, rows)
            for s in range(0, n, rows):
                e = min(s + rows, n)
                head.logits_into(out[s:e], flat[s:e], divide=False)
            head.release()
        return out, "HeadProjector"
    except Exception:  # noqa: BLE001 - the head is not under test here
        w = weight.float()
        z = flat.float() @ w.t()
        return (z if bias is None else z + bias), "addmm"


def divide(z: torch.Tensor, t: float) -> torch.Tensor:
    """z / T as both branches form it: a float32 division by a float32 temperature (none at 1)."""
    return z if t == 1.0 else z.div(torch.full((z.shape[0], 1), t, dtype=torch.float32))


# --------------------------------------------------------------------------------------------------------------
# The forced CUDA branch.

REAL_ROW_KERNELS = sampler._row_kernels
REAL_ROW_KERNEL = fp32_logprobs._row_kernel
LAUNCHES: dict[str, int] = {}


def _counting(fn):
    name = getattr(fn, "__name__", repr(fn))

    def run(*args, **kwargs):
        LAUNCHES[name] = LAUNCHES.get(name, 0) + 1
        return fn(*args, **kwargs)

    run.__name__ = name
    return run


def forced_row_kernels(device, *args, **kwargs):
    """The real selector, asked as if the pass ran on CUDA (its other refusals stand)."""
    kernels = REAL_ROW_KERNELS(torch.device("cuda"), *args, **kwargs)
    return None if kernels is None else tuple(_counting(k) for k in kernels)


def forced_row_kernel(device, *args, **kwargs):
    kernel = REAL_ROW_KERNEL(torch.device("cuda"), *args, **kwargs)
    return None if kernel is None else _counting(kernel)


try:  # a kernel that raises at launch falls back to torch for the rest of the process (and warns once)
    from rollout_parity.core import kernel_launch
except ImportError:  # older trees: no fallback, a failed launch raises
    kernel_launch = None


def _call(fn, *args, **kwargs):
    """``(result, None)``, or ``(None, what went wrong)``: an exception, or a kernel launch that failed and fell
    back to torch (under the interpreter a failed launch is the kernel's own error; the fallback is forgotten so
    that the next case launches the kernels again)."""
    if kernel_launch is not None:
        kernel_launch.reset_failed_launches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - an exception is a finding, reported with its message
            return None, f"{type(e).__name__}: {str(e)[:300]}"
    failed = kernel_launch.failed_launches() if kernel_launch is not None else {}
    fallbacks = [str(w.message)[:300] for w in caught if w.category.__name__ == "KernelFallbackWarning"]
    if failed or fallbacks:
        kernel_launch.reset_failed_launches()
        return None, f"a kernel launch failed and fell back to torch: {failed or fallbacks}"
    return out, None


def run_sampler(case: dict, inp: dict, kernel: bool):
    sampler._row_kernels = forced_row_kernels if kernel else REAL_ROW_KERNELS
    LAUNCHES.clear()
    try:
        out, err = _call(sampler.sampler_logprobs_from_hidden, inp["hidden"], inp["weight"], inp["token_ids"],
                         case["temperature"], case["top_k"], case["top_p"], case["min_p"], bias=inp["bias"],
                         chunk_size=case["chunk_size"], keep_sampled=case["keep_sampled"],
                         kept_sets=inp["kept_sets"], engine_topk_topp=case["rule"])
    finally:
        sampler._row_kernels = REAL_ROW_KERNELS
    return out, err, dict(LAUNCHES)


def run_fp32(case: dict, inp: dict, kernel: bool, entropy: bool, t: float):
    fp32_logprobs._row_kernel = forced_row_kernel if kernel else REAL_ROW_KERNEL
    LAUNCHES.clear()
    try:
        out, err = _call(fp32_logprobs.chunked_fp32_logprobs, inp["hidden"], inp["weight"], inp["token_ids"],
                         bias=inp["bias"], chunk_size=case["chunk_size"], temperature=t, return_entropy=entropy)
    finally:
        fp32_logprobs._row_kernel = REAL_ROW_KERNEL
    return out, err, dict(LAUNCHES)


# --------------------------------------------------------------------------------------------------------------
# Comparisons.

def pattern(x: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    x = x.double()
    return torch.where(x.isnan(), 1, torch.where(x == math.inf, 2, torch.where(x == -math.inf, 3, 0)))


def _f(x) -> float:
    return float(x)


#: per comparison, the largest |got - want| / tol seen over every evaluated case (the tolerances' margin, reported)
MARGINS: dict[str, float] = {}


def compare(name: str, got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor, where: torch.Tensor | None = None,
            pattern_ok: torch.Tensor | None = None, extra: dict | None = None) -> dict | None:
    """None when ``got`` and ``want`` (flat) agree on ``where``: the same non-finite pattern (except where
    ``pattern_ok``) and finite entries within ``tol``; else the failure: counts and the worst entry."""
    got, want, tol = got.reshape(-1).double(), want.reshape(-1).double(), tol.reshape(-1).double()
    where = torch.ones_like(got, dtype=torch.bool) if where is None else where.reshape(-1)
    pat_bad = (pattern(got) != pattern(want)) & where
    if pattern_ok is not None:
        pat_bad &= ~pattern_ok.reshape(-1)
    both = (pattern(got) == 0) & (pattern(want) == 0) & where
    diff = torch.where(both, (got - want).abs(), 0.0)
    val_bad = both & (diff > tol)
    if both.any():
        MARGINS[name] = max(MARGINS.get(name, 0.0), float((diff / tol.clamp_min(1e-300))[both].max()))
    if not (pat_bad.any() or val_bad.any()):
        return None
    ratio = torch.where(val_bad, diff / tol.clamp_min(1e-300), 0.0)
    i = int(pat_bad.nonzero()[0]) if pat_bad.any() else int(ratio.argmax())
    out = dict(n_pattern=int(pat_bad.sum()), n_value=int(val_bad.sum()), index=i, got=_f(got[i]), want=_f(want[i]),
               diff=_f(diff[i]), tol=_f(tol[i]), worst_ratio=_f(ratio.max()))
    for k, v in (extra or {}).items():
        out[k] = _f(v.reshape(-1)[i]) if isinstance(v, torch.Tensor) else v
    return out


def one_minus_top_p_limit(top_p: float) -> float:
    """vLLM drops a position when its float32 ascending cumsum <= float32(1 - float32(top_p)): a token is kept
    when the (renormalised) mass ranked strictly above it is below 1 - that."""
    import numpy as np
    return 1.0 - float(np.float32(1.0 - float(np.float32(top_p))))


def kept_set_edges(lp: torch.Tensor, tol: torch.Tensor, top_k, top_p: float, min_p: float) -> dict:
    """vLLM's filters in float64 on one row's exact log-probabilities ``lp`` (V,) of the float32 logits: the kept
    set's mass S (PyTorch tie rule; the Triton rule keeps the same mass), and which tokens' membership lies within
    the two sides' float noise of a threshold (fragile). ``tol`` (V,): each entry's log error bound."""
    V = lp.shape[0]
    p = lp.exp()
    eps = 2 * tol  # both sides
    fin = torch.isfinite(lp)
    kept = fin.clone()
    frag = torch.zeros(V, dtype=torch.bool)
    top = lp.max()
    if min_p > 0.0:
        arg = lp - top - math.log(min_p)
        frag |= fin & (arg.abs() <= eps + eps.max() + 8 * U)
        kept &= arg >= 0
    k = top_k if top_k is not None and 0 < top_k < V else None
    if k is not None:
        vals = torch.where(kept, lp, -math.inf)
        s = vals.sort(descending=True).values
        kth, nxt = s[k - 1], s[k]
        if torch.isfinite(nxt) and 0 < kth - nxt <= 4 * tol.max():  # a near-tie rounding may make exact
            frag |= (vals == kth) | (vals == nxt)
        kept &= vals >= kth
    if top_p < 1.0:
        limit = one_minus_top_p_limit(top_p)
        tol_mass = 4 * float(tol[kept].max()) if kept.any() else 0.0
        eps_m = tol_mass + 8 * math.sqrt(V) * U
        if abs(float(p.max()) - limit) <= eps_m:  # the "alone" stage: the top token alone, or the whole set
            frag |= kept
        q = torch.where(kept, p, 0.0)
        q = q / q.sum()
        order = q.argsort(descending=True, stable=True)
        qs = q[order]
        above = qs.cumsum(0) - qs
        near = (above - limit).abs() <= eps_m
        frag[order] |= near & (qs > 0)
        keep_pos = above < limit
        keep_pos[0] = True
        kept[order] &= keep_pos
    if frag.any():  # a tie group shares its members' fate
        frag |= torch.isin(lp, lp[frag]) & fin
    S = float((p * kept).sum())
    frag_kept = float((p * (frag & kept)).sum())
    frag_out = float((p * (frag & ~kept)).sum())
    slack = max(math.log((S + frag_out) / S) if S > 0 else 0.0,
                (math.log(S) - math.log(S - frag_kept)) if S > frag_kept else math.inf)
    return dict(S=S, frag=frag, slack=slack)


def check_sampler(case: dict, inp: dict) -> tuple[dict, dict]:
    """{property: failure or None} for the sampler pass, and coverage counts."""
    res = {p: None for p in SAMPLER_PROPS}
    out_t, err_t, _ = run_sampler(case, inp, kernel=False)
    out_k, err_k, launches = run_sampler(case, inp, kernel=True)
    cover = dict(row_kernel=launches.get("row_logprob_entropy", 0), candidates=launches.get("kept_candidates", 0))
    if err_t or err_k:
        res["sp_runs"] = dict(torch_error=err_t, kernel_error=err_k)
        return res, cover
    n, V = inp["n"], case["V"]
    ids = inp["ids"]
    z32, head = float32_logits(inp, case["chunk_size"])
    cover["head"] = head
    x32 = divide(z32, inp["t_eff"])
    lpz = x32.double().log_softmax(-1)  # exact log-softmax of the float32 logits both branches read
    lp64 = (inp["z64"] / inp["t_eff"]).log_softmax(-1)
    L = math.log(V) + 1
    tol_row = U * (C_OUT * torch.nan_to_num(lpz, nan=0.0, posinf=0.0, neginf=0.0).abs() + C_LSE * L)  # (n, V)
    r = torch.arange(n)
    lpz_y, lp64_y, tol_y = lpz[r, ids], lp64[r, ids], tol_row[r, ids]
    A = (inp["hidden"].reshape(n, -1).double().abs() @ inp["weight"].double().abs().t())
    if inp["bias"] is not None:
        A = A + inp["bias"].double().abs()
    A = torch.nan_to_num(A, nan=0.0, posinf=0.0).amax(-1) / inp["t_eff"]
    gemm = U * (case["H"] + 3) * A
    full_k, full_t = out_k.full.reshape(-1), out_t.full.reshape(-1)
    proc_k, proc_t = out_k.processed.reshape(-1), out_t.processed.reshape(-1)
    extra = dict(exact=lpz_y, float64=lp64_y, kernel=full_k, torch=full_t)
    res["sp_full_kernel_vs_torch"] = compare("sp_full_kernel_vs_torch", full_k, full_t, 2 * tol_y, extra=extra)
    res["sp_full_kernel_vs_exact"] = compare("sp_full_kernel_vs_exact", full_k, lpz_y, tol_y, extra=extra)
    res["sp_full_torch_vs_exact"] = compare("sp_full_torch_vs_exact", full_t, lpz_y, tol_y, extra=extra)
    res["sp_full_kernel_vs_float64"] = compare("sp_full_kernel_vs_float64", full_k, lp64_y, tol_y + gemm, extra=extra)

    # the kept sets: truncation as vLLM maps the parameters; replayed rows; edges on the recomputed rows
    greedy = case["temperature"] < SAMPLING_EPS
    k_on = case["top_k"] is not None and 0 < case["top_k"] < V
    truncates = not greedy and (k_on or case["top_p"] < 1.0 or case["min_p"] > 0.0)
    replayed = (torch.zeros(n, dtype=torch.bool) if inp["kept_sets"] is None
                else inp["kept_sets"].recorded.reshape(-1))
    good = torch.isfinite(x32.amax(-1)) & ~x32.isnan().any(-1)  # a finite maximum, no NaN: lp finite or -inf
    log_s = torch.zeros(n, dtype=torch.float64)
    slack = torch.zeros(n, dtype=torch.float64)
    frag_y = torch.zeros(n, dtype=torch.bool)
    if inp["kept_sets"] is not None:
        rows_k, kept_ids = inp["kept_sets"].flat_rows(0, n)
        for i in range(n):
            if replayed[i]:
                log_s[i] = torch.logsumexp(lpz[i, kept_ids[rows_k == i]], 0)
    for i in range(n):
        if truncates and not replayed[i] and good[i]:
            e = kept_set_edges(lpz[i], tol_row[i], case["top_k"], case["top_p"], case["min_p"])
            log_s[i] = math.log(e["S"]) if e["S"] > 0 else 0.0
            slack[i] = e["slack"]
            frag_y[i] = bool(e["frag"][ids[i]])
    log_s = torch.nan_to_num(log_s, nan=0.0, neginf=0.0)
    tol_p = 2 * U * (C_OUT * (torch.nan_to_num(lpz_y, nan=0.0, neginf=0.0).abs() + log_s.abs() + L) + C_LSE * L)
    edge = slack > 0
    res["sp_processed_kernel_vs_torch"] = compare(
        "sp_processed_kernel_vs_torch", proc_k, proc_t, tol_p + slack, pattern_ok=frag_y & (not case["keep_sampled"]),
        extra=dict(kernel=proc_k, torch=proc_t, full_kernel=full_k, full_torch=full_t, exact_full=lpz_y,
                   edge_slack=slack, replayed=bool(replayed.any())))
    out_mask_k, out_mask_t = out_k.outside_mask.reshape(-1), out_t.outside_mask.reshape(-1)
    differ = out_mask_k != out_mask_t
    bad = differ & good & ~frag_y
    rep_k = None if out_k.replayed_mask is None else out_k.replayed_mask.reshape(-1).tolist()
    rep_t = None if out_t.replayed_mask is None else out_t.replayed_mask.reshape(-1).tolist()
    if bad.any() or rep_k != rep_t or out_k.num_outside != int(out_mask_k.sum()):
        i = int(bad.nonzero()[0]) if bad.any() else -1
        res["sp_outside_kernel_vs_torch"] = dict(
            n_differ=int(bad.sum()), index=i, kernel=out_mask_k.tolist(), torch=out_mask_t.tolist(),
            replayed_kernel=rep_k, replayed_torch=rep_t, num_outside_kernel=out_k.num_outside,
            processed_kernel=_f(proc_k[i]) if i >= 0 else None, processed_torch=_f(proc_t[i]) if i >= 0 else None,
            exact_full=_f(lpz_y[i]) if i >= 0 else None)
    nonfinite_rows = ~good
    if (differ & nonfinite_rows).any():
        i = int((differ & nonfinite_rows).nonzero()[0])
        res["sp_outside_nonfinite_rows"] = dict(n_differ=int((differ & nonfinite_rows).sum()), index=i,
                                                kernel=bool(out_mask_k[i]), torch=bool(out_mask_t[i]),
                                                row_kind=case["kinds"][i])
    # processed against full, each branch: the identity without truncation, log S <= 0 with it
    ident = ~replayed if not truncates else torch.zeros(n, dtype=torch.bool)
    problems = []
    for side, full, proc, om in (("kernel", full_k, proc_k, out_mask_k), ("torch", full_t, proc_t, out_mask_t)):
        same = (full == proc) | (full.isnan() & proc.isnan())
        for i in (ident & (~same | om)).nonzero().flatten().tolist():
            problems.append(dict(side=side, index=i, kind="identity", full=_f(full[i]), processed=_f(proc[i]),
                                 outside=bool(om[i])))
        fin = torch.isfinite(proc) & torch.isfinite(full) & ~ident
        below = fin & (proc.double() < full.double() - tol_p)
        for i in below.nonzero().flatten().tolist():
            problems.append(dict(side=side, index=i, kind="log S > 0", full=_f(full[i]), processed=_f(proc[i]),
                                 tol=_f(tol_p[i])))
    if problems:
        res["sp_processed_vs_full"] = dict(n=len(problems), first=problems[:4])
    cover["edge_rows"] = int(edge.sum())
    cover["fragile_tokens"] = int(frag_y.sum())
    cover["outside_allowed"] = int((differ & good & frag_y).sum())
    return res, cover


def check_fp32(case: dict, inp: dict) -> tuple[dict, dict]:
    res = {p: None for p in FP32_PROPS}
    t = case["temperature"] if case["temperature"] > 0 else 1.0  # chunked_fp32_logprobs: T > 0, no greedy rule
    runs = {}
    errors = {}
    cover = {}
    for kernel in (True, False):
        for ent in (True, False):
            out, err, launches = run_fp32(case, inp, kernel, ent, t)
            runs[(kernel, ent)] = out
            if err:
                errors[f"{'kernel' if kernel else 'torch'}{'+entropy' if ent else ''}"] = err
            if kernel and ent:
                cover["row_kernel"] = launches.get("row_logprob_entropy", 0)
    if errors:
        res["fp_runs"] = errors
        return res, cover
    n, V = inp["n"], case["V"]
    ids = inp["ids"]
    r = torch.arange(n)
    z32, _ = float32_logits(inp, case["chunk_size"])
    lpz = divide(z32, t).double().log_softmax(-1)
    lp64 = (inp["z64"] / t).log_softmax(-1)
    ent_z = -torch.special.xlogy(lpz.exp(), lpz.exp()).sum(-1)  # 0 log 0 = 0
    ent_64 = -torch.special.xlogy(lp64.exp(), lp64.exp()).sum(-1)
    ent_z = torch.where(lpz.isnan().any(-1), math.nan, ent_z)
    ent_64 = torch.where(lp64.isnan().any(-1), math.nan, ent_64)
    L = math.log(V) + 1
    lpz_y, lp64_y = lpz[r, ids], lp64[r, ids]
    tol_y = U * (C_OUT * torch.nan_to_num(lpz_y, nan=0.0, neginf=0.0).abs() + C_LSE * L)
    ent_abs = torch.nan_to_num(ent_z, nan=0.0)
    tol_e = U * (C_OUT * (ent_abs + L) + C_LSE * L * (1 + ent_abs))
    A = inp["hidden"].reshape(n, -1).double().abs() @ inp["weight"].double().abs().t()
    if inp["bias"] is not None:
        A = A + torch.nan_to_num(inp["bias"].double().abs(), posinf=0.0)
    A = torch.nan_to_num(A, nan=0.0, posinf=0.0).amax(-1) / t
    gemm = U * (case["H"] + 3) * A
    (lp_k, en_k), lp_k0 = runs[(True, True)], runs[(True, False)]
    (lp_t, en_t), lp_t0 = runs[(False, True)], runs[(False, False)]
    lp_k, en_k, lp_k0 = lp_k.reshape(-1), en_k.reshape(-1), lp_k0.reshape(-1)
    lp_t, en_t, lp_t0 = lp_t.reshape(-1), en_t.reshape(-1), lp_t0.reshape(-1)
    extra = dict(kernel=lp_k, torch=lp_t, exact=lpz_y, float64=lp64_y)
    for name, got, want, tol in (("fp_logprob_kernel_vs_torch", lp_k, lp_t, 2 * tol_y),
                                 ("fp_logprob_kernel_vs_exact", lp_k, lpz_y, tol_y),
                                 ("fp_logprob_kernel_vs_float64", lp_k, lp64_y, tol_y + gemm)):
        res[name] = compare(name, got, want, tol, extra=extra)
    same = []
    for side, a, b in (("kernel", lp_k, lp_k0), ("torch", lp_t, lp_t0)):
        if not torch.equal(torch.nan_to_num(a, nan=123.0), torch.nan_to_num(b, nan=123.0)):
            i = int((torch.nan_to_num(a, nan=123.0) != torch.nan_to_num(b, nan=123.0)).nonzero()[0])
            same.append(dict(side=side, index=i, with_entropy=_f(a[i]), without=_f(b[i])))
    res["fp_logprob_with_and_without_entropy"] = dict(first=same) if same else None
    masked = torch.isneginf(lpz).any(-1) & torch.isfinite(lpz.amax(-1)) & ~lpz.isnan().any(-1)
    plain = ~masked
    extra_e = dict(kernel=en_k, torch=en_t, exact=ent_z, float64=ent_64)
    gemm_e = gemm * (1 + 2 * ent_64.nan_to_num(0.0))
    for name, got, want, tol in (("fp_entropy_kernel_vs_torch", en_k, en_t, 2 * tol_e),
                                 ("fp_entropy_kernel_vs_exact", en_k, ent_z, tol_e),
                                 ("fp_entropy_kernel_vs_float64", en_k, ent_64, tol_e + gemm_e)):
        res[name] = compare(name, got, want, tol, where=plain, extra=extra_e)
    ctl = dict(logprob=compare("fp_torch_logprob_vs_exact", lp_t, lpz_y, tol_y, extra=extra),
               entropy=compare("fp_torch_entropy_vs_exact", en_t, ent_z, tol_e, where=plain, extra=extra_e))
    res["fp_torch_vs_exact"] = ctl if any(ctl.values()) else None
    m = [compare(f"fp_entropy_masked_rows_{side}", en, ent_z, tol_e, where=masked, extra=extra_e)
         for side, en in (("kernel", en_k), ("torch", en_t))]
    if any(m):
        res["fp_entropy_masked_rows"] = dict(kernel=m[0], torch=m[1])
    return res, cover


# --------------------------------------------------------------------------------------------------------------
# The hypothesis runs.

CACHE: dict = {}
STATS = dict(evaluations=0, cache_hits=0)


def evaluate(case: dict, group: str) -> tuple[dict, dict]:
    key = (group, json.dumps(case, sort_keys=True))
    if key in CACHE:
        STATS["cache_hits"] += 1
        return CACHE[key]
    STATS["evaluations"] += 1
    inp = build(case)
    CACHE[key] = check_sampler(case, inp) if group == "sampler" else check_fp32(case, inp)
    return CACHE[key]


class PropertyFailure(AssertionError):
    def __init__(self, prop: str, case: dict, detail: dict):
        super().__init__(f"{prop}: {json.dumps(detail, default=str)[:500]}")
        self.record = dict(property=prop, case=case, detail=detail)


STATE = dict(mode="explore", target=None)
EXPLORED: list = []


def body(case):
    if STATE["mode"] == "explore":
        t0 = time.perf_counter()
        failures, cover = {}, {}
        for group in ("sampler", "fp32"):
            res, cov = evaluate(case, group)
            cover[group] = cov
            failures.update({p: d for p, d in res.items() if d is not None})
        EXPLORED.append(dict(case=case, failures=failures, cover=cover, seconds=time.perf_counter() - t0))
        return
    prop = STATE["target"]
    res, _ = evaluate(case, "sampler" if prop.startswith("sp_") else "fp32")
    if res[prop] is not None:
        raise PropertyFailure(prop, case, res[prop])


COMMON = dict(derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              report_multiple_bugs=False, print_blob=False, verbosity=Verbosity.quiet)


def _brief(case: dict, detail: dict) -> dict:
    """One line per failing draw: the parameters that tell the failures apart, and how far off it was."""
    keys = ("V", "H", "hidden_dtype", "weight_dtype", "ids_layout", "bias", "temperature", "top_k", "top_p", "min_p",
            "keep_sampled", "rule")
    out = {k: case[k] for k in keys}
    out["kinds"] = sorted(set(case["kinds"]))
    out["replay"] = case["kept_sets"] is not None
    out["worst_ratio"] = detail.get("worst_ratio") if isinstance(detail, dict) else None
    return out


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-examples", type=int, default=300)
    ap.add_argument("--shrink-seconds", type=float, default=60.0, help="total time for all properties' shrinks")
    args = ap.parse_args()
    started = time.perf_counter()

    # 1. explore: every property on every drawn case, nothing raised
    STATE["mode"] = "explore"
    settings(max_examples=args.max_examples, phases=[Phase.generate], **COMMON)(given(cases())(body))()
    explore_s = time.perf_counter() - started

    failing = [p for p in PROPERTIES if any(p in e["failures"] for e in EXPLORED)]
    # 2. shrink: one run per failing property, its time bounded (hypothesis reads the engine's module constant)
    from hypothesis.internal.conjecture import engine as hyp_engine
    minimal = {}
    budget = args.shrink_seconds
    for idx, prop in enumerate(failing):
        share = budget / max(1, len(failing) - idx)
        t0 = time.perf_counter()
        hyp_engine.MAX_SHRINKING_SECONDS = max(1, int(share))
        STATE.update(mode="shrink", target=prop)
        try:
            settings(max_examples=args.max_examples, phases=[Phase.generate, Phase.shrink],
                     **COMMON)(given(cases())(body))()
            minimal[prop] = dict(error="the shrink run found no failure (the generation did not replay)")
        except PropertyFailure as e:
            minimal[prop] = e.record
        except (HypothesisException, Exception) as e:  # noqa: BLE001 - reported, not hidden
            minimal[prop] = dict(error=f"{type(e).__name__}: {e}"[:2000], trace=traceback.format_exc()[-3000:])
        minimal[prop]["shrink_seconds"] = round(time.perf_counter() - t0, 1)
        budget -= time.perf_counter() - t0

    props = {}
    for p, what in PROPERTIES.items():
        fails = [dict(case=e["case"], detail=e["failures"][p]) for e in EXPLORED if p in e["failures"]]
        props[p] = dict(description=what, failed=len(fails), examples=fails[:3], minimal=minimal.get(p),
                        failing_draws=[_brief(f["case"], f["detail"]) for f in fails])
    sp_cover = [e["cover"]["sampler"] for e in EXPLORED]
    fp_cover = [e["cover"]["fp32"] for e in EXPLORED]
    coverage = dict(
        examples=len(EXPLORED),
        sampler_kernel_branch=sum(1 for c in sp_cover if c.get("row_kernel", 0) > 0),
        sampler_candidates_kernel=sum(1 for c in sp_cover if c.get("candidates", 0) > 0),
        fp32_kernel_branch=sum(1 for c in fp_cover if c.get("row_kernel", 0) > 0),
        head_reference=sorted({c.get("head", "?") for c in sp_cover}),
        edge_rows=sum(c.get("edge_rows", 0) for c in sp_cover),
        fragile_tokens=sum(c.get("fragile_tokens", 0) for c in sp_cover),
        outside_differences_allowed=sum(c.get("outside_allowed", 0) for c in sp_cover),
        strided_ids=sum(1 for e in EXPLORED if e["case"]["ids_layout"] in ("pair_column", "stride3")),
        top_k_minus_one_truncating=sum(1 for e in EXPLORED if e["case"]["top_k"] == -1 and (
            e["case"]["top_p"] < 1 or e["case"]["min_p"] > 0) and e["case"]["temperature"] >= SAMPLING_EPS),
        large_rows=sum(1 for e in EXPLORED for k in e["case"]["kinds"] if k.startswith("large")),
        nonfinite_rows=sum(1 for e in EXPLORED for k in e["case"]["kinds"] if k in NONFINITE_KINDS),
        vocab_sizes=sorted({e["case"]["V"] for e in EXPLORED}),
    )
    report = dict(
        max_examples=args.max_examples, seconds=round(time.perf_counter() - started, 1),
        explore_seconds=round(explore_s, 1), slowest_example_seconds=round(max(e["seconds"] for e in EXPLORED), 2),
        evaluations=STATS["evaluations"], cache_hits=STATS["cache_hits"],
        tolerance=dict(U=U, C_OUT=C_OUT, C_LSE=C_LSE), margins={k: round(v, 3) for k, v in sorted(MARGINS.items())},
        coverage=coverage, failing=failing, properties=props)
    with open(args.out, "w") as f:
        json.dump(_jsonable(report), f, indent=1)
    print(f"{len(EXPLORED)} examples, failing: {failing}, {report['seconds']} s")


if __name__ == "__main__":
    sys.exit(main())
