"""The GPU check of the core: CUDA against CPU for every entry point, TF32 against the head passes, the sampler pass's
speed at a real vocabulary and the correction's overhead. Needs only rollout-parity and torch; sections 1-3 took 22 s
on an H200 (2026-11-27), section 4 adds torch.compile's first compilations (70 s on this CPU at --small); at most 8
minutes.

    python scripts/gpu_check.py                      # on a GPU: everything, at V = 151,936, H = 4,096
    python scripts/gpu_check.py --device cpu --small # here: the same code end to end, at small sizes

1. **Parity**: each core entry point that computes on tensors (the correction, the loss, the three logprob passes
   forward and backward, the kept-set metrics, the fp32 head patch, MoE routing replay, the sync-check verdict) runs
   on the same inputs on CPU and on ``--device``; the largest difference is printed against a tolerance.
2. **TF32**: bf16 hidden states and head (N = 2,048, H = 3,584, V = 151,936, T = 0.7), the caller's TF32 off and on
   (``allow_tf32`` and ``set_float32_matmul_precision("high")``): mean and max |logprob - float64| of the two head
   passes, of a plain fp32 head written the usual way (upcast, ``h / T`` before the matmul, the caller's TF32) and of a
   bf16 head; the largest error of the bf16 GEMM's logits and of the fp32 upcast's against float64 (relative to the
   row's largest logit); and whether the caller's settings came back unchanged.
3. **Speed and memory**: ``benchmarks/sampler_pass.py --device <device> --dtype bfloat16`` at N = 8,192,
   H = 4,096, V = 151,936 (the chunk chosen by the passes), with its RESULT line.
4. **The correction's overhead**: ``benchmarks/correction_overhead.py --device <device>`` (B = 64, T = 4,096; eager and
   ``compile_correction``), with its RESULT line.

Every section prints ``GPU_CHECK <section> ...`` summary lines; the exit status is 1 if a parity row or the TF32
bound fails. A row or a section that raises on the device is named with its error (and fails the run); the rest
still runs.
"""

from __future__ import annotations

import argparse
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
from rollout_parity.core.head_matmul import head_matmul_path
from rollout_parity.core.loss import policy_loss
from rollout_parity.core.replay import KeptSets
from rollout_parity.core.routing import replayed_routing
from rollout_parity.core.sampler import (
    kept_mass_metrics, processed_logits, rollout_on_full_vocabulary, sampler_logprobs, sampler_logprobs_from_hidden,
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


def parity(device: torch.device, small: bool) -> bool:
    """Each entry point on CPU and on ``device``, same inputs: the largest difference against its tolerance."""
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
    sets_ids = torch.cat([ids[..., None], sets.to_padded()], -1)  # every set holds its token
    sets = KeptSets.from_padded(sets_ids)
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

    def from_hidden(d, dtype, **kw):
        return sampler_logprobs_from_hidden(hidden.to(d, dtype), weight.to(d, dtype), ids.to(d), bias=bias.to(d),
                                            response_mask=mask.to(d), **dict(sampling, **kw))

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
        "sampler_logprobs_from_hidden fp32": (lambda d: from_hidden(d, torch.float32), 1e-4),
        "sampler_logprobs_from_hidden bf16": (lambda d: from_hidden(d, torch.bfloat16), 1e-4),
        "sampler_logprobs_from_hidden replay": (lambda d: from_hidden(d, torch.bfloat16, kept_sets=sets), 1e-4),
        # top-p alone: on CUDA the candidates' kernel covers the row by mass (above: by top-k)
        "sampler_logprobs_from_hidden top-p": (lambda d: from_hidden(d, torch.bfloat16, top_k=None, min_p=0.0), 1e-4),
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
    ok, worst, flipped = True, 0.0, 0
    for name, (fn, tol) in cases.items():
        tol, rel = tol if isinstance(tol, tuple) else (tol, 0.0)
        torch.manual_seed(0)
        ref = _to(fn(torch.device("cpu")), "cpu")
        torch.manual_seed(0)
        try:
            d, flips = _compare(ref, fn(device), rel)
            error = ""
        except Exception as e:  # noqa: BLE001 - a path that fails on the device only: named, the other rows still run
            d, flips, error = float("inf"), 0, f"  error {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        good = d <= tol and flips <= max(1, B * T // 1000)
        ok &= good
        worst, flipped = max(worst, d / tol), flipped + flips
        print(f"  {name:<40} max |{device.type} - cpu|{f' - {rel:.3g} |cpu|' if rel else ''} {d:.2e}  (tolerance {tol:.0e})"
              f"{f', {flips} kept-set flips' if flips else ''}  {'ok' if good else 'FAILED'}{error}")
    print(f"GPU_CHECK parity device={device.type} entry_points={len(cases)} all_within_tolerance={ok} "
          f"worst_diff_over_tolerance={worst:.2e} kept_set_flips={flipped}")
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


def bench(device: torch.device, small: bool, timeout: int) -> None:
    sampler = ["--n", "512", "--hidden", "256", "--vocab", "8192", "--repeats", "2"] if small else \
        ["--n", "8192", "--hidden", "4096", "--vocab", "151936", "--repeats", "3"]
    correction = ["--batch", "8", "--tokens", "512", "--repeats", "5"] if small else []
    for label, section, script, args in (
            ("bench", "3. speed and memory", "sampler_pass.py", ["--dtype", "bfloat16", *sampler]),
            ("correction", "4. the correction's overhead", "correction_overhead.py", correction)):
        cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--device", str(device), *args]
        print(f"\n== {section}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        print(run.stdout, run.stderr[-2000:] if run.returncode else "", sep="", end="")
        result = [line for line in run.stdout.splitlines() if line.startswith("RESULT")]
        print(f"GPU_CHECK {label} device={device.type} seconds={time.perf_counter() - t0:.0f} "
              f"returncode={run.returncode} {result[-1][len('RESULT '):] if result else 'no RESULT line'}")


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
        bench(device, args.small, args.bench_timeout)
    print(f"GPU_CHECK done seconds={time.perf_counter() - t0:.0f} ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
