"""Suite-wide setup: the environment the tests need, framework markers, a per-framework summary.

The environment is set here, before any test module imports a framework, so that
``pytest`` alone behaves like ``bash scripts/run.sh test``: no model hub, vLLM engines in
process, DeepSpeed on CPU. Values already set by the caller win.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict

_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "DS_ACCELERATOR": "cpu",
    # Ray, vLLM and TRL must never phone home from a test.
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "WANDB_MODE": "disabled",
    # A fixed KV cache per CPU engine (GiB): the default, a share of RAM minus this process's
    # RSS, goes negative once the test process has imported a few frameworks.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # One OpenMP thread per process. The in-process vLLM engines run on torch's threads, and with
    # two an engine that recomputes preempted requests and a fresh engine scoring the same tokens
    # differed from run to run (test_vllm_async_update's exactness check failed 1 run in 2; with one
    # thread it holds at ~2e-7). Set before torch is imported; the doctor's trainer pass still
    # takes the idle cores (grpo_rounds.trainer_threads) and gives them back.
    "OMP_NUM_THREADS": "1",
}
for _key, _value in _ENV.items():
    os.environ.setdefault(_key, _value)
# Forced, not defaulted: the shared in-process test engines and the CPU weight-sync shim
# only work with vLLM's engine core in this process.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from rollout_parity.testing.stack import FRAMEWORK_MARKERS, require_stack  # noqa: E402

_outcomes: dict[str, Counter] = defaultdict(Counter)


def pytest_configure(config):
    for name, what in FRAMEWORK_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: runs {what}")
    # TRL 1.15's fused log-prob head is Triton-only; the compat runs (scripts/compat.sh) need a CPU one.
    from integration_tests.support.trl_cpu_head import install as install_trl_cpu_head

    install_trl_cpu_head()


def pytest_collection_finish(session):
    # Said once, before the first test (also under -q): without NeMo RL's source the nemo_rl tests can only skip,
    # each with the same line.
    from integration_tests.support.nemo_anchor import source_report

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in source_report():
            reporter.write_line(line)


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        for name in FRAMEWORK_MARKERS:
            if name in report.keywords:
                _outcomes[name][report.outcome] += 1


def pytest_terminal_summary(terminalreporter):
    stack = "required (a missing framework fails)" if require_stack() else "optional (a missing framework skips)"
    terminalreporter.write_sep("-", f"tests per framework; stack {stack}")
    for name in FRAMEWORK_MARKERS:
        counts = _outcomes.get(name, Counter())
        parts = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "skipped") if counts[k])
        terminalreporter.write_line(f"{name:10s} {parts or 'none collected'}")
