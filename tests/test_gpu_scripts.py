"""The prepared GPU scripts run end to end on CPU, and the GPU check's comparison is as strict as it says.

``scripts/gpu_check.py`` and ``scripts/gpu_head_pass_profile.py`` are what a lent GPU runs
(docs/fp32_and_sampler_gpu.md, "On a GPU"); a script that breaks here would waste the GPU's few minutes.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import torch

from rollout_parity.core.sampler import sampler_logprobs_from_hidden
from tests.docs_text import ROOT
from tests.script_loader import load_script


def _load(name: str):
    return load_script(ROOT / "scripts" / f"{name}.py", name)


gpu_check = _load("gpu_check")


def test_a_bf16_gradient_one_rounding_step_apart_passes_only_with_the_bf16_slack():
    ref = torch.tensor([0.7734375, -1.5, 3e-3], dtype=torch.bfloat16)
    one_step = ref.float() + torch.tensor([2 ** -8, 0.0, 0.0])  # 0.7734375 = 198/256: its bf16 step is 2^-8
    assert torch.equal(one_step.bfloat16().float(), one_step)  # still a bf16 number: one step up
    assert gpu_check._diff(ref.float(), one_step) == 2 ** -8
    assert gpu_check._diff(ref.float(), one_step, rel=2 ** -7) == 0.0
    two_steps = ref.float() + torch.tensor([2 ** -7, 0.0, 0.0])
    assert gpu_check._diff(ref.float(), two_steps, rel=2 ** -7) > 0.0
    # a non-finite mismatch stays infinite whatever the slack
    assert gpu_check._diff(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]), rel=2 ** -7) == float("inf")


SAMPLER_ROWS = [f"sampler_logprobs_from_hidden {row}" for row in (
    "fp32", "bf16", "replay", "top-p (mass cover)", "top-k 40 (count cover)", "top-k 40+top-p 0.9 (count cover)",
    "top-k -1 (off)+top-p 0.9", "strided ids (B*T,2)[:,0]", "rule pytorch, both sides", "rule triton, both sides")]


def _rows(out: str) -> dict:
    """Parity row name -> its printed line."""
    return {name: line for line in out.splitlines() for name in SAMPLER_ROWS + ["processed_logits", "judge"]
            if line.startswith(f"  {name} ") and " max |" in line}


def test_gpu_check_runs_end_to_end_on_cpu(capsys):
    assert gpu_check.main(["--device", "cpu", "--small", "--skip", "bench"]) == 0
    out = capsys.readouterr().out
    assert "GPU_CHECK parity device=cpu entry_points=24 all_within_tolerance=True" in out
    assert "fp64_rows=10" in out
    rows = _rows(out)
    for name in SAMPLER_ROWS:  # each cover, rule and layout has its row, judged against float64, and passes
        assert " vs float64 cpu " in rows[name] and rows[name].rstrip().endswith("ok"), rows.get(name)
    assert "exact_under_tf32=True settings_restored=True" in out


def test_the_strided_row_passes_its_ids_with_stride_two():
    ids = torch.arange(12).reshape(3, 4)
    column = gpu_check._pairs_column(ids, "cpu")
    assert torch.equal(column, ids) and column.shape == ids.shape
    assert not column.is_contiguous() and column.stride(-1) == 2


def _drifted(monkeypatch, cpu: float, device: float):
    """sampler_logprobs_from_hidden with ``cpu`` added to the processed logprobs of each row's first call (the CPU
    reference) and ``device`` to its second (the device's; on CPU both are CPU)."""
    real, calls = sampler_logprobs_from_hidden, []

    def drifted(*args, **kwargs):
        calls.append(1)
        res = real(*args, **kwargs)
        return dataclasses.replace(res, processed=res.processed + (cpu if len(calls) % 2 else device))

    monkeypatch.setattr(gpu_check, "sampler_logprobs_from_hidden", drifted)


def test_the_sampler_rows_are_judged_against_float64(monkeypatch, capsys):
    """A drift that the CPU and the device share is invisible to their difference and fails against float64; a
    device right where the CPU drifted (within the cap) passes."""
    _drifted(monkeypatch, cpu=1e-2, device=1e-2)
    assert gpu_check.main(["--device", "cpu", "--small", "--skip", "tf32", "bench"]) == 1
    rows = _rows(capsys.readouterr().out)
    for name in SAMPLER_ROWS:
        assert "max |cpu - cpu| 0.00e+00" in rows[name] and rows[name].rstrip().endswith("FAILED"), rows[name]
    assert rows["processed_logits"].rstrip().endswith("ok") and rows["judge"].rstrip().endswith("ok")

    _drifted(monkeypatch, cpu=2e-4, device=0.0)  # twice the old tolerance of |device - cpu|
    assert gpu_check.main(["--device", "cpu", "--small", "--skip", "tf32", "bench"]) == 0
    rows = _rows(capsys.readouterr().out)
    for name in SAMPLER_ROWS:
        assert "max |cpu - cpu| 2.00e-04" in rows[name] and rows[name].rstrip().endswith("ok"), rows[name]


def _fake_benchmarks(monkeypatch, sampler_pass, correction="RESULT overhead_ratio=1.100\n"):
    """subprocess.run for sections 3 and 4: ``sampler_pass`` (its stdout, or an exception to raise) and
    ``correction``; the commands run are recorded."""
    ran = []

    def run(cmd, **kwargs):
        ran.append(Path(cmd[1]).name)
        out = sampler_pass if ran[-1] == "sampler_pass.py" else correction
        if isinstance(out, BaseException):
            raise out
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    return ran


RESULT = ("RESULT sampler_vs_plain=1.2 replay_vs_plain=1.0 mem_vs_bound=0.9 sorted_rows=0.0000 replay_err={} "
          "kernels=False device=cpu\n")


def test_a_section_that_times_out_is_named_and_the_next_still_runs(monkeypatch, capsys):
    timeout = subprocess.TimeoutExpired(["sampler_pass.py"], 7, output=b"sampler pass benchmark: partial\n",
                                        stderr=b"  repeat 1/3 done\n")
    ran = _fake_benchmarks(monkeypatch, timeout)
    assert gpu_check.main(["--device", "cpu", "--small", "--skip", "parity", "tf32", "--bench-timeout", "7"]) == 1
    out = capsys.readouterr().out
    assert ran == ["sampler_pass.py", "correction_overhead.py"]
    assert "sampler pass benchmark: partial" in out and "repeat 1/3 done" in out  # what it had printed
    assert "GPU_CHECK bench device=cpu seconds=0 timed_out=True timeout=7 partial_stdout_lines=1 no RESULT line" in out
    assert "GPU_CHECK correction device=cpu seconds=0 returncode=0 overhead_ratio=1.100" in out  # still ran
    assert out.rstrip().endswith("ok=False")


def test_a_real_timeout_kills_each_benchmark_and_the_script_finishes(monkeypatch, capsys):
    """The subprocesses themselves, killed after 1 s (importing torch takes longer): TimeoutExpired's bytes output
    is read back, and the summary line still comes."""
    assert gpu_check.main(["--device", "cpu", "--small", "--skip", "parity", "tf32", "--bench-timeout", "1"]) == 1
    out = capsys.readouterr().out
    for label in ("bench", "correction"):
        assert re.search(rf"^GPU_CHECK {label} device=cpu seconds=\d+ timed_out=True timeout=1 ", out, re.M), out
    assert out.rstrip().endswith("ok=False")


def test_the_replay_error_is_checked_against_its_bound(monkeypatch, capsys):
    _fake_benchmarks(monkeypatch, RESULT.format("3.00e-06"))
    assert gpu_check.main(["--device", "cpu", "--small", "--skip", "parity", "tf32"]) == 0
    assert "replay_err=3.00e-06 kernels=False device=cpu replay_err_bound=1e-04 replay_within_bound=True" in \
        capsys.readouterr().out

    monkeypatch.setattr(gpu_check, "REPLAY_BOUND", 1e-6)  # exceeded by the same run
    assert gpu_check.main(["--device", "cpu", "--small", "--skip", "parity", "tf32"]) == 1
    out = capsys.readouterr().out
    assert "replay_err_bound=1e-06 replay_within_bound=False" in out and out.rstrip().endswith("ok=False")

    _fake_benchmarks(monkeypatch, RESULT.replace(" replay_err={}", ""))  # a RESULT line without the figure
    assert gpu_check.main(["--device", "cpu", "--small", "--skip", "parity", "tf32"]) == 1
    assert "replay_within_bound=False" in capsys.readouterr().out


def test_the_sampler_benchmark_prints_the_replay_error_the_check_reads(capsys):
    threads = torch.get_num_threads()
    try:
        assert load_script(ROOT / "benchmarks" / "sampler_pass.py", "sampler_pass").main(
            ["--n", "64", "--hidden", "32", "--vocab", "512", "--repeats", "1", "--threads", str(threads)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = [line for line in capsys.readouterr().out.splitlines() if line.startswith("RESULT")]
    assert float(gpu_check._fields(result[-1])["replay_err"]) <= gpu_check.REPLAY_BOUND


def test_a_path_that_fails_on_the_device_is_named_and_the_rest_still_runs(monkeypatch, capsys):
    """A GPU run is scarce: a row or a section that raises there (a kernel that does not launch) must not take the
    rest of the script down. Here one parity row's device call (processed_logits' second call) raises, the float64
    reference of the sampler rows, and the TF32 section's float64 reference, as a device's call would."""
    gpu_check = _load("gpu_check")
    for name, failing_call in (("processed_logits", 2), ("_fp64_sampler_reference", 1), ("_fp64_logprobs", 1)):
        real, calls = getattr(gpu_check, name), []

        def failing(*args, _real=real, _calls=calls, _at=failing_call, **kwargs):
            _calls.append(1)
            if len(_calls) == _at:
                raise RuntimeError("no kernel image is available for execution on the device")
            return _real(*args, **kwargs)

        monkeypatch.setattr(gpu_check, name, failing)
    assert gpu_check.main(["--device", "cpu", "--small", "--skip", "bench"]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("processed_logits"))
    assert "FAILED  error RuntimeError: no kernel image" in row
    assert "  float64 reference: error RuntimeError: no kernel image" in out
    rows = _rows(out)
    for name in SAMPLER_ROWS:  # without their reference the sampler rows fail by name; the rest still run
        assert rows[name].rstrip().endswith("FAILED  error RuntimeError: no float64 reference"), rows[name]
    assert rows["judge"].rstrip().endswith("ok")
    assert "GPU_CHECK parity device=cpu entry_points=24 all_within_tolerance=False" in out  # every other row ran
    assert "GPU_CHECK tf32 device=cpu error=RuntimeError" in out
    assert "GPU_CHECK done" in out and out.rstrip().endswith("ok=False")


def test_the_head_pass_profile_runs_on_cpu_and_names_the_steps_cpu_cannot_run(capsys):
    assert _load("gpu_head_pass_profile").main(["--device", "cpu", "--small"]) == 0
    out = capsys.readouterr().out
    timed = {line.split()[1] for line in out.splitlines() if line.startswith("TIME ")}
    refused = {line.split()[1] for line in out.splitlines() if line.startswith("ERROR ")}
    assert timed == {"plain", "top_p", "top_k50_top_p", "min_p"}
    assert refused == {"gemm_only", "gemm_div", "gemm_div_logsoftmax_inplace", "gemm_div_logsumexp",
                       "gemm_logsumexp_nodiv"}  # CPU torch has no mm(..., out_dtype=)
    assert out.count("=== PROFILE") == 3
