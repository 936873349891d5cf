"""What a check records, how it compares numbers, and how the command prints its report.

A :class:`Check` is one row of the table: a named comparison (``trl/bnpo``) run over several
cases (the shared batch's configs), with its largest difference and a verdict. A
:class:`FrameworkReport` is one framework: its installed version against the range we tested,
and its checks, or the reason it was skipped (not installed: a skip, named, never a pass) or
could not run (an error, which fails the command like a failed check).

The self-test knob :data:`CORRUPT_ENV` (``ROLLOUT_PARITY_CHECK_CORRUPT=<check name>``) makes the
named check's adapter output wrong on purpose (one importance weight, see :func:`corrupt`), so
a test can prove that the command fails and names the check.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

__all__ = ["CORRUPT_ENV", "ENGINE_PROBE_MAX_DELTA", "Check", "CheckResult", "FrameworkReport", "corrupt", "corrupt_target",
           "extra_range", "in_range", "format_table", "report_dict", "failed"]

CORRUPT_ENV = "ROLLOUT_PARITY_CHECK_CORRUPT"
#: Mean |trainer - engine| logprob per token an engine probe accepts, vLLM's and SGLang's alike (the same bf16 body
#: and fp32 head on both sides): 2x the worst recipe row the doctor measured on CPU.
ENGINE_PROBE_MAX_DELTA = 4e-3
_MAX_DETAILS = 3  # failing cases listed per check


def corrupt_target() -> Optional[str]:
    """The check name :data:`CORRUPT_ENV` names, or None."""
    value = os.environ.get(CORRUPT_ENV, "").strip()
    return value or None


def corrupt(check: str, weights: Any, mask: Any = None) -> Any:
    """``weights``, or a copy with one entry made wrong when :data:`CORRUPT_ENV` names ``check``.

    The first entry inside ``mask`` (a token the loss sees) becomes ``1.5 * w + 0.25``, so a loss
    or a comparison downstream of it must notice. A self-test of the check, nothing else.
    """
    if corrupt_target() != check or weights is None:
        return weights
    import torch

    weights = weights.detach().clone().contiguous()
    flat = weights.view(-1)
    inside = torch.ones_like(weights, dtype=torch.bool)
    if mask is not None:
        mask = mask.bool()
        inside = mask.any(-1, keepdim=True).expand_as(weights) if weights.shape != mask.shape else mask
    inside = inside.reshape(-1)
    where = int(inside.nonzero()[0]) if inside.any() else 0
    flat[where] = flat[where] * 1.5 + 0.25
    return weights


def extra_range(extra: str, project: str = "rollout-parity") -> Optional[str]:
    """The version range our extra ``extra`` declares for the framework of the same name
    (the installed package's metadata, i.e. ``pyproject.toml``), e.g. ``">=0.31,<0.32"``."""
    import importlib.metadata
    import re

    try:
        requires = importlib.metadata.requires(project) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for req in requires:
        spec, _, marker = req.partition(";")
        name = re.match(r"[A-Za-z0-9._-]+", spec.strip())
        if name and name.group(0).lower() == extra and re.search(rf"extra\s*==\s*['\"]{extra}['\"]", marker):
            ranges = spec.strip()[name.end():].strip().strip("()").split(",")
            return ",".join(sorted((r.strip() for r in ranges if r.strip()), key=lambda r: not r.startswith(">")))
    return None


def in_range(version: Optional[str], tested: Optional[str]) -> Optional[bool]:
    """Whether ``version`` lies in the PEP 440 range ``tested`` (a local tag like ``+cpu`` ignored)."""
    if version is None or not tested:
        return None
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - packaging comes with torch's own dependencies
        return None
    try:
        return Version(Version(version).base_version) in SpecifierSet(tested)
    except (InvalidVersion, ValueError):
        return False


@dataclass
class CheckResult:
    name: str
    what: str
    cases: int
    max_diff: Optional[float]
    tolerance: Optional[float]
    status: str  # "pass" | "fail"
    failures: list[str] = field(default_factory=list)


class Check:
    """Accumulates one check's comparisons over its cases."""

    def __init__(self, name: str, what: str, tolerance: Optional[float] = 1e-6):
        self.name, self.what, self.tolerance = name, what, tolerance
        self.cases: set[str] = set()
        self.max_diff: Optional[float] = None
        self.failures: list[str] = []
        self.n_failures = 0

    def _fail(self, message: str) -> None:
        self.n_failures += 1
        if len(self.failures) < _MAX_DETAILS:
            self.failures.append(message)

    def _see(self, diff: float) -> None:
        if self.max_diff is None or not diff <= self.max_diff:  # NaN/inf stick
            self.max_diff = diff

    def close(self, case: str, label: str, actual: Any, expected: Any, *, atol: Optional[float] = None,
              rtol: float = 0.0) -> bool:
        """``actual`` equals ``expected`` elementwise within ``atol + rtol * |expected|`` (NaN == NaN)."""
        import torch

        self.cases.add(case)
        atol = self.tolerance if atol is None else atol
        a = torch.as_tensor(actual, dtype=torch.float64).detach().cpu()
        e = torch.as_tensor(expected, dtype=torch.float64).detach().cpu()
        if a.shape != e.shape:
            self._see(math.inf)
            self._fail(f"{case}: {label} shape {tuple(a.shape)} != {tuple(e.shape)}")
            return False
        both_nan = torch.isnan(a) & torch.isnan(e)
        same_inf = torch.isinf(a) & (a == e)
        diff = torch.where(both_nan | same_inf, torch.zeros_like(a), (a - e).abs())
        diff = torch.nan_to_num(diff, nan=math.inf)
        scale = torch.nan_to_num(e.abs(), nan=0.0, posinf=0.0)
        bound = (atol or 0.0) + rtol * scale
        bad = diff > bound
        # reported: the absolute difference, relative to |expected| where that exceeds 1 under a rtol
        shown = diff / scale.clamp_min(1.0) if rtol else diff
        worst = float(shown.max()) if shown.numel() else 0.0
        self._see(worst)
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0]) if diff.dim() else ()
            at = f"[{']['.join(map(str, idx))}]" if idx else ""
            self._fail(f"{case}: {label}{at} {float(a[idx]):.7g}, expected {float(e[idx]):.7g}")
            return False
        return True

    def expect(self, case: str, ok: bool, message: str) -> bool:
        """A condition without a number (finite, zero gradient where removed, keys present)."""
        self.cases.add(case)
        if not ok:
            self._fail(f"{case}: {message}")
        return bool(ok)

    def result(self) -> CheckResult:
        failures = list(self.failures)
        if self.n_failures > len(failures):
            failures.append(f"... and {self.n_failures - len(failures)} more")
        return CheckResult(self.name, self.what, len(self.cases), self.max_diff, self.tolerance,
                           "fail" if self.n_failures else "pass", failures)


@dataclass
class FrameworkReport:
    key: str  # "core" or a registry key (rollout_parity/registry.py)
    framework: str  # the name users know
    version: Optional[str] = None
    tested: Optional[str] = None
    in_range: Optional[bool] = None
    status: str = "ran"  # "ran" | "skipped" | "error"
    reason: Optional[str] = None
    checks: list[CheckResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status != "error" and all(c.status == "pass" for c in self.checks)


def failed(reports: list[FrameworkReport]) -> list[str]:
    """Names of what failed: ``<check name>`` per failed check, ``<framework>`` per error."""
    out = []
    for r in reports:
        if r.status == "error":
            out.append(r.key)
        out += [c.name for c in r.checks if c.status != "pass"]
    return out


def report_dict(reports: list[FrameworkReport], *, seconds: float, environment: dict) -> dict:
    """The JSON form (``--json``)."""
    return {"ok": not failed(reports), "failed": failed(reports), "seconds": round(seconds, 1),
            "environment": environment, "frameworks": [asdict(r) for r in reports]}


def _range_word(r: FrameworkReport) -> str:
    return {True: "inside", False: "OUTSIDE", None: "-"}[r.in_range]


def format_table(reports: list[FrameworkReport], *, seconds: float, environment: dict) -> str:
    """The human table: one row per check; a skipped framework is one named SKIP line."""
    head = ("framework", "version", "tested", "range", "check", "cases", "max diff", "tol", "verdict")
    rows: list[tuple[str, ...]] = []
    details: list[str] = []
    for r in reports:
        front = (r.framework, r.version or "-", r.tested or "-", _range_word(r))
        if r.status == "skipped":
            rows.append(front + ("-", "", "", "", f"SKIP: {r.reason}"))
            continue
        if r.status == "error":
            rows.append(front + ("-", "", "", "", "ERROR"))
            details.append(f"{r.framework}: ERROR: {r.reason}")
        for c in r.checks:
            diff = "-" if c.max_diff is None else f"{c.max_diff:.1e}"
            tol = "-" if c.tolerance is None else f"{c.tolerance:.0e}"
            rows.append(front + (f"{c.name}  {c.what}", str(c.cases), diff, tol, c.status.upper()))
            details += [f"{c.name}: {f}" for f in c.failures]
            front = ("", "", "", "")
        for note in r.notes:
            details.append(f"{r.framework}: note: {note}")
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    widths[-1] = len(head[-1])  # the verdict column may run long (skip reasons)

    def line(cells):
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    env = ", ".join(f"{k} {v}" for k, v in environment.items())
    out = [f"rollout-parity check ({env})", line(head), line(["-" * w for w in widths])]
    out += [line(row) for row in rows]
    out += details
    bad = failed(reports)
    skipped = [r.framework for r in reports if r.status == "skipped"]
    verdict = f"FAILED: {', '.join(bad)}" if bad else "all checks passed"
    out.append(f"{verdict}; skipped (not run, not passed): {', '.join(skipped) or 'none'}; {seconds:.0f} s")
    return "\n".join(out)
