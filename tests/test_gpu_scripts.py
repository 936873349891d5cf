"""The prepared GPU scripts run end to end on CPU, and the GPU check's comparison is as strict as it says.

``scripts/gpu_check.py`` and ``scripts/gpu_head_pass_profile.py`` are what a lent GPU runs (docs/fp32_and_sampler.md,
"On a GPU"); a script that breaks here would waste the GPU's few minutes.
"""

from __future__ import annotations


import torch

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


def test_gpu_check_runs_end_to_end_on_cpu(capsys):
    assert gpu_check.main(["--device", "cpu", "--small", "--skip", "bench"]) == 0
    out = capsys.readouterr().out
    assert "GPU_CHECK parity device=cpu entry_points=18 all_within_tolerance=True" in out
    assert "exact_under_tf32=True settings_restored=True" in out


def test_a_path_that_fails_on_the_device_is_named_and_the_rest_still_runs(monkeypatch, capsys):
    """A GPU run is scarce: a row or a section that raises there (a kernel that does not launch) must not take the
    rest of the script down. Here one parity row's device call (processed_logits' second call) raises, and the
    TF32 section's float64 reference, as a device's call would."""
    gpu_check = _load("gpu_check")
    for name, failing_call in (("processed_logits", 2), ("_fp64_logprobs", 1)):
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
    assert "GPU_CHECK parity device=cpu entry_points=18 all_within_tolerance=False" in out  # every other row ran
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
