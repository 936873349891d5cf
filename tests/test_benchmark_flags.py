"""The correction benchmark writes its flags out (a bare GPU image lacks omegaconf): they must stay the preset's."""

from pathlib import Path

from rollout_parity import CorrectionConfig
from tests.script_loader import load_script

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "correction_overhead.py"


def test_the_benchmarks_written_out_flags_are_tis_srs_k3_with_the_off_policy_mask():
    module = load_script(BENCH, "correction_overhead")
    assert module.tis_srs_k3_with_off_policy_mask() == CorrectionConfig.preset(
        "tis_srs_k3", off_policy_sequence_mask_delta=0.5)
