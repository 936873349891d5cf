"""Compile the package's CUDA kernels for GPU targets with Triton's own compiler, on a machine without a GPU.

    python scripts/compile_kernels.py [--targets 80,90,100]

Triton's NVIDIA backend (the PTX generator and ``ptxas``, shipped in Triton's wheel) compiles a kernel for a named
target without a device: what a GPU would run first, minus the launch. Each kernel of ``rollout_parity/kernels/``,
in every variant the package launches, is compiled for each target (``80``: A100, ``90``: H100/H200, ``100``:
B200) with the argument types the package passes; the resource usage ``cuobjdump`` reads from the cubin says
whether registers spill to local memory (slow). One line per kernel and target::

    KERNEL_COMPILE triton=3.9.0 target=sm_90 kernel=kept_candidates+mass regs=75 local=0 ok=True

and a last ``KERNEL_COMPILE done ok=...`` line; the exit status is 1 when a kernel does not compile or spills.
Run it under other Triton versions by putting one first on ``PYTHONPATH`` (``pip install --target DIR
triton==X --no-deps``): docs/fp32_and_sampler.md quotes such a sweep. The kernels' results are checked elsewhere
(under the interpreter, and on a GPU by ``scripts/gpu_check.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

#: The row kernel's arguments: fp32 logits, int64 token ids, fp32 outputs; the ints fit 32 bits at any vocabulary.
ROW_SIGNATURE = {"z_ptr": "*fp32", "row_stride": "i32", "ids_ptr": "*i64", "logp_ptr": "*fp32", "ent_ptr": "*fp32",
                 "lse_ptr": "*fp32", "peak_ptr": "*fp32", "V": "i32", "T": "fp32"}
CANDIDATES_SIGNATURE = {"z_ptr": "*fp32", "row_stride": "i32", "lse_ptr": "*fp32", "peak_ptr": "*fp32",
                        "open_ptr": "*i8", "out_ptr": "*fp32", "count_ptr": "*i32", "V": "i32", "T": "fp32",
                        "need": "fp32"}


def variants():
    """(name, jit function, signature, constexprs, warps) for each kernel variant the package launches, with the
    compile-time arguments its launch passes (each kernel module's ``launch_constants``)."""
    from rollout_parity.kernels import kept_candidates as kc
    from rollout_parity.kernels import row_logsumexp as rl

    for entropy, lse in ((False, False), (True, False), (False, True)):  # the plain pass, with entropy, the sampler's
        name = "row_logprob_entropy" + (" +entropy" if entropy else "") + (" +lse" if lse else "")
        yield name, rl._row_logprob_entropy_kernel, ROW_SIGNATURE, rl.launch_constants(entropy, lse), rl.NUM_WARPS
    for cover in kc.COVERS:
        yield (f"kept_candidates +{cover}", kc._kept_candidates_kernel, CANDIDATES_SIGNATURE,
               kc.launch_constants(cover), kc.NUM_WARPS)


def resource_usage(cubin: bytes) -> dict:
    """``REG`` and ``LOCAL`` (bytes of spilled registers per thread) of a cubin, by Triton's bundled cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    return {k: int(v) for k, v in re.findall(r"\b(REG|LOCAL):(\d+)", out.stdout)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="80,90,100", help="compute capabilities, comma-separated")
    ap.add_argument("--only", default=None, help="compile only the variants whose name contains this")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns while its default is implicit
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ok = True
    for cc in (int(c) for c in args.targets.split(",")):
        for name, fn, signature, constexprs, warps in variants():
            if args.only and args.only not in name:
                continue
            sig = dict(signature, **{k: "constexpr" for k in constexprs})
            try:
                kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                                        target=GPUTarget("cuda", cc, 32), options={"num_warps": warps})
                usage = resource_usage(kernel.asm["cubin"])
                good = usage.get("LOCAL", 0) == 0
                detail = f"regs={usage.get('REG')} local={usage.get('LOCAL')}"
            except Exception as e:  # noqa: BLE001 - report any compiler failure by name, go on with the rest
                good, detail = False, f"error={type(e).__name__}: {str(e).splitlines()[0][:200]!r}"
            ok &= good
            print(f"KERNEL_COMPILE triton={triton.__version__} target=sm_{cc} kernel={name.replace(' ', '')} "
                  f"{detail} ok={good}", flush=True)
    print(f"KERNEL_COMPILE done ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
