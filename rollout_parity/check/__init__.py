"""``rollout-parity check``: the cross-framework tests, run against the installed stack.

For every framework it finds installed, the shared cross-framework batch (``shared_batch.py``,
its frozen numbers packaged beside it) runs through that framework's own code with our adapter:
TRL's real ``GRPOTrainer`` generation and loss (``trl_checks``), verl's driver helper and every
registered loss (``verl_checks``), NeMo RL's ``ClippedPGLossFn`` beside ours (``nemo_checks``,
installed or from ``--nemo_rl_source``); the core alone always runs (``core_checks``). With
vLLM installed, a live probe (``vllm_probe``) builds the recipe's engine on a tiny local model
and compares its logprobs with the trainer's on this hardware. Each check is a row of one table
(``report``), or of the ``--json`` report; the command exits non-zero when a check fails or a
framework errors, and names what it skipped. Nothing is downloaded.

The suite runs the same functions (``integration_tests/test_check.py``). The self-test knob
``ROLLOUT_PARITY_CHECK_CORRUPT=<check name>`` makes one weight wrong in that check.
"""

from __future__ import annotations

from rollout_parity.check.report import CORRUPT_ENV, CheckResult, FrameworkReport, failed, format_table, report_dict
from rollout_parity.check.runner import FRAMEWORKS, CheckOptions, corruptible_checks, environment, run_check

__all__ = ["CORRUPT_ENV", "CheckOptions", "CheckResult", "FrameworkReport", "FRAMEWORKS", "corruptible_checks",
           "environment", "failed", "format_table", "report_dict", "run_check"]
