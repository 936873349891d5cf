"""Compile the package's CUDA kernels for GPU targets with Triton's own compiler, on a machine without a GPU.

    python scripts/compile_kernels.py [--targets 80,90,100] [--only NAME]
    python scripts/compile_kernels.py --sweep [DIR ...] [--log FILE]

Triton's NVIDIA backend (the PTX generator and ``ptxas``, shipped in Triton's wheel) compiles a kernel for a named
target without a device: what a GPU would run first, minus the launch. Each kernel of ``rollout_parity/kernels/``,
in every variant the package launches, is compiled for each target (``80``: A100, ``90``: H100/H200, ``100``:
B200); the resource usage ``cuobjdump`` reads from the cubin says whether registers spill to local memory (slow).
The variants and their argument types are the kernel modules' own: each module's ``SIGNATURE`` (the runtime
arguments), ``launch_constants(...)`` (the compile-time ones) and ``NUM_WARPS``, for each variant the package
launches (the row kernel's three, and every cover in ``kept_candidates.COVERS``).

Each variant is compiled twice. ``spec=generic``: the signature alone, no assumption on the values. ``spec=V151936``:
the binary a real launch at vocabulary V = 151,936 runs. When Triton launches a JIT kernel it specialises its
arguments on their values: an integer equal to 1 becomes a compile-time constant, and an integer divisible by 16
or a pointer whose address is 16-byte aligned gets ``tt.divisibility = 16`` (vectorised loads, simpler masks).
Those attributes are Triton's own here: its launcher's binder (``create_function_from_signature`` in
``triton/runtime/jit.py``, with the backend's ``get_arg_specialization``/``parse_attr``) is run on representative
launch arguments for a target without a device (CPU torch tensors of the signature's dtypes, freshly allocated and so
aligned as a CUDA allocation is; ``V`` and ``row_stride`` = 151,936, a token-id stride of 1), and the signature,
constants and attributes it gives are what ``triton.compile`` gets, as in ``JITFunction.run``
(tests/test_kernel_compile.py checks that the package's wrappers launched through Triton's own launch code build
the same compile). One line per target, variant and specialisation::

    KERNEL_COMPILE triton=3.9.0 target=sm_90 kernel=row_logprob_entropy spec=generic regs=48 local=0 div16=0 ok=True
    KERNEL_COMPILE triton=3.9.0 target=sm_90 kernel=row_logprob_entropy spec=V151936 regs=39 local=0 div16=8 ok=True

``div16``: the kernel's arguments that carry ``tt.divisibility = 16`` in the TTIR (none in a generic compile; in a
specialised one, every argument Triton's launcher marks: a line is not ok when they differ or there are none).
``pipelined`` (the kept-candidates covers with a counting loop, every one but ``bound``): whether the PTX holds
``cp.async`` copies, the software pipeline ``tl.range(..., num_stages=...)`` asks for (``... pipelined=True
ok=True``); reported, not required.
A last ``KERNEL_COMPILE done ok=...`` line; the exit status is 1 when a kernel does not compile, spills, or a
specialised compile lacks its attributes.

``--sweep DIR ...`` runs this script once per Triton installed in each ``DIR`` (``pip install --no-deps --target DIR
triton==X``), each first on ``PYTHONPATH``, then once under this interpreter's own Triton, and writes their output
under a ``$ PYTHONPATH=<triton==X>:. python scripts/compile_kernels.py`` line each (to ``--log FILE``, or stdout;
``--targets`` and ``--only`` are passed on):
docs/data/cpu/kernel_compile.log is such a sweep, quoted in docs/fp32_and_sampler_kernels.md. The kernels' results are
checked elsewhere (under the interpreter, and on a GPU by ``scripts/gpu_check.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]

#: The launch a specialised compile reproduces: Qwen's vocabulary (divisible by 16), the logits' rows contiguous
#: (row stride V), the token ids contiguous (stride 1: Triton makes it a constant). Every integer argument of a
#: kernel's ``SIGNATURE`` needs its value here.
VOCAB = 151_936
LAUNCH_INTS = {"V": VOCAB, "row_stride": VOCAB, "ids_stride": 1}
SPEC = f"V{VOCAB}"
#: Triton's pointer types' element types as torch names them (a launch passes a tensor of that dtype).
TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64", "i64": "int64",
                "i32": "int32", "i16": "int16", "i8": "int8", "u8": "uint8", "i1": "bool"}
DIVISIBILITY = re.compile(r"tt\.divisibility\s*=\s*16\b")


class Variant(NamedTuple):
    """A kernel variant the package launches: its name, the JIT function, its runtime arguments' types (the
    module's ``SIGNATURE``), its compile-time arguments, warps, and whether it has a loop meant to be pipelined."""

    name: str
    fn: Any
    signature: dict
    constexprs: dict
    warps: int
    counting_loop: bool = False


def variants():
    """Each kernel variant the package launches, from the kernel modules: their ``SIGNATURE``, ``NUM_WARPS`` and
    ``launch_constants`` for each variant (the row kernel's plain pass, with entropy, the sampler's with the row's
    maximum and log-sum; every cover of ``kept_candidates.COVERS``)."""
    from rollout_parity.kernels import kept_candidates as kc
    from rollout_parity.kernels import row_logsumexp as rl

    for entropy, lse in ((False, False), (True, False), (False, True)):
        name = "row_logprob_entropy" + ("+entropy" if entropy else "") + ("+lse" if lse else "")
        yield Variant(name, rl._row_logprob_entropy_kernel, getattr(rl, "SIGNATURE"), rl.launch_constants(entropy, lse),
                      rl.NUM_WARPS)
    for cover in kc.COVERS:  # every cover but a bound given outright counts over the row first
        yield Variant(f"kept_candidates+{cover}", kc._kept_candidates_kernel, getattr(kc, "SIGNATURE"),
                      kc.launch_constants(cover), kc.NUM_WARPS, counting_loop=cover != "bound")


def full_signature(fn, signature: dict, constexprs: dict) -> dict:
    """The signature ``triton.compile`` takes: every parameter of ``fn`` in order, the compile-time ones as
    ``constexpr``. ``signature`` must name exactly the kernel's other parameters."""
    runtime = [a for a in fn.arg_names if a not in constexprs]
    if sorted(runtime) != sorted(signature) or not set(constexprs) <= set(fn.arg_names):
        raise ValueError(f"the signature names {sorted(signature)} and the constants {sorted(constexprs)}; "
                         f"{fn.__name__} takes {list(fn.arg_names)}")
    return {a: "constexpr" if a in constexprs else signature[a] for a in fn.arg_names}


def launch_args(signature: dict) -> dict:
    """Representative runtime arguments of a real launch, by name: a fresh contiguous CPU tensor of
    the pointer's dtype (Triton specialises a tensor on its address alone, ``data_ptr() % 16``; torch aligns a CPU
    allocation to 64 bytes as its CUDA allocator does to 512), ``LAUNCH_INTS`` for an integer, 1.0 for a float
    (Triton does not specialise floats)."""
    import torch

    args = {}
    for name, ty in signature.items():
        if ty.startswith("*"):
            args[name] = torch.empty(16, dtype=getattr(torch, TORCH_DTYPES[ty.lstrip("*k")]))
        elif ty == "i1":
            args[name] = True
        elif ty[0] in "iu":
            if name not in LAUNCH_INTS:
                raise KeyError(f"no launch value for the integer argument {name!r}: add it to LAUNCH_INTS")
            args[name] = LAUNCH_INTS[name]
        else:
            args[name] = 1.0
    return args


def launch_specialisation(fn, args: dict, constexprs: dict, warps: int, cc: int):
    """``(signature, constexprs, attrs)`` as Triton's launcher computes them for ``fn[grid](**args, **constexprs,
    num_warps=warps)`` on a ``sm_<cc>`` GPU: its binder (``create_function_from_signature``, whose
    ``specialize_impl`` asks the backend's ``get_arg_specialization`` for a ``"D"``, divisible by 16) and the packing
    ``JITFunction.run`` does before it compiles (``JITFunction._pack_args`` from Triton 3.5; inline in ``run``
    before; attribute ``"D"`` -> ``[["tt.divisibility", 16]]`` by the backend's ``parse_attr``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import jit

    backend = make_backend(GPUTarget("cuda", cc, 32))
    binder = jit.create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(constexprs, num_warps=warps)
    bound_args, specialization, _ = binder(**args, **kwargs)
    if hasattr(fn, "_pack_args"):  # Triton 3.5 and later
        _, signature, constants, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, None)
        return signature, constants, attrs
    # Triton 3.3 and 3.4: the same lines inline in JITFunction.run
    sigvals = [x[0] for x in specialization]
    signature = dict(zip([p.name for p in fn.params], sigvals))
    constants = jit.find_paths_if(sigvals, lambda _, val: val == "constexpr")
    constants = {path: jit.get_iterable_path(list(bound_args.values()), path) for path in constants}
    attrvals = [x[1] for x in specialization]
    attrs = jit.find_paths_if(attrvals, lambda _, x: isinstance(x, str))
    attrs = {k: backend.parse_attr(jit.get_iterable_path(attrvals, k)) for k in attrs}
    return signature, constants, attrs


def compile_variant(variant: Variant, cc: int, specialised: bool):
    """``(compiled kernel, arguments Triton marks divisible by 16)``: the variant compiled for ``sm_<cc>``, generic or
    as a launch at ``VOCAB`` specialises it."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns while its default is implicit
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = variant.fn
    signature = full_signature(fn, variant.signature, variant.constexprs)
    constexprs, attrs = variant.constexprs, {}
    if specialised:
        args = launch_args(variant.signature)
        signature, constexprs, attrs = launch_specialisation(fn, args, variant.constexprs, variant.warps, cc)
    marked = sum(any(a[0] == "tt.divisibility" for a in v) for v in attrs.values())
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", cc, 32), options={"num_warps": variant.warps})
    return kernel, marked


def divisible_arguments(ttir: str) -> int:
    """How many of the kernel's arguments carry ``tt.divisibility = 16`` in its TTIR (the entry ``tt.func``)."""
    head = re.search(r"tt\.func public @[^(]+\((.*?)\)\s*(attributes|\{)", ttir, re.DOTALL)
    return len(DIVISIBILITY.findall(head[1])) if head else 0


def pipelined(ptx: str) -> bool:
    """Whether the PTX copies global memory to shared asynchronously (``cp.async``): a software-pipelined loop."""
    return "cp.async" in ptx


def resource_usage(cubin: bytes) -> dict:
    """``REG`` and ``LOCAL`` (bytes of spilled registers per thread) of a cubin, by Triton's bundled cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    return {k: int(v) for k, v in re.findall(r"\b(REG|LOCAL):(\d+)", out.stdout)}


def report(variant: Variant, cc: int, specialised: bool) -> tuple[bool, str]:
    """Whether the compile is good, and the line's fields after ``spec=``."""
    try:
        kernel, marked = compile_variant(variant, cc, specialised)
        usage = resource_usage(kernel.asm["cubin"])
        div16 = divisible_arguments(kernel.asm["ttir"])
        good = usage.get("LOCAL", 0) == 0 and (div16 == marked > 0 if specialised else div16 == 0)
        detail = f"regs={usage.get('REG')} local={usage.get('LOCAL')} div16={div16}"
        if specialised and div16 != marked:
            detail += f" expected_div16={marked}"
        if variant.counting_loop:
            detail += f" pipelined={pipelined(kernel.asm['ptx'])}"
    except Exception as e:  # noqa: BLE001 - report any compiler failure by name, go on with the rest
        good, detail = False, f"error={type(e).__name__}: {str(e).splitlines()[0][:200]!r}"
    return good, detail


def sweep(dirs: list[str], argv: list[str], log: str | None) -> int:
    """This script under each Triton of ``dirs`` (first on ``PYTHONPATH``) and then this interpreter's own, the
    outputs joined under a command line each; 1 when a run fails."""
    out, ok = [], True
    for d in [*dirs, None]:
        if d is not None and not os.path.isdir(os.path.join(d, "triton")):
            lines, rc = [f"KERNEL_COMPILE error=no triton/ in {d}"], 1
        else:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (d and os.path.abspath(d), str(ROOT)) if p))
            run = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, text=True)
            lines, rc = run.stdout.splitlines(), run.returncode
        version = next((m[1] for x in lines if (m := re.match(r"KERNEL_COMPILE triton=(\S+)", x))), "?")
        out += [f"$ PYTHONPATH=<triton=={version}>:. python scripts/compile_kernels.py{''.join(' ' + a for a in argv)}",
                *lines]
        ok &= rc == 0
        if log is None:
            print("\n".join(out[-len(lines) - 1:]), flush=True)
    if log is not None:
        Path(log).write_text("\n".join(out) + "\n")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="80,90,100", help="compute capabilities, comma-separated")
    ap.add_argument("--only", default=None, help="compile only the variants whose name contains this")
    ap.add_argument("--sweep", nargs="*", metavar="DIR", default=None,
                    help="run under the Triton installed in each DIR, then under this interpreter's own")
    ap.add_argument("--log", default=None, help="with --sweep: write the combined output here (default: stdout)")
    args = ap.parse_args(argv)
    if args.sweep is not None:
        passed = ["--targets", args.targets] if args.targets != ap.get_default("targets") else []
        return sweep(args.sweep, passed + (["--only", args.only] if args.only else []), args.log)
    import triton

    ok = True
    for cc in (int(c) for c in args.targets.split(",")):
        for variant in variants():
            if args.only and args.only not in variant.name:
                continue
            for specialised in (False, True):
                good, detail = report(variant, cc, specialised)
                ok &= good
                print(f"KERNEL_COMPILE triton={triton.__version__} target=sm_{cc} kernel={variant.name} "
                      f"spec={SPEC if specialised else 'generic'} {detail} ok={good}", flush=True)
    print(f"KERNEL_COMPILE done ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
