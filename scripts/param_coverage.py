#!/usr/bin/env python
"""Every public parameter of rollout-parity, and the tests that set it to a non-default value.

    python scripts/param_coverage.py            # one line per parameter, then the summary
    python scripts/param_coverage.py --missing  # only the parameters no test sets

Exit 1 (listing them) when a parameter has no test that sets it to a value other than its
default; CI runs this through ``tests/test_param_coverage.py``. Issue 21: a parameter no test
ever changes is one a mutation can break unnoticed.

The parameters are derived, never listed by hand:

* Python: the names in ``__all__`` of ``rollout_parity`` (its lazy exports), of every module of
  ``rollout_parity/core/`` and of ``rollout_parity/engines/`` (a module without ``__all__`` is an error: declare
  its face), of every
  public adapter (``rollout_parity/adapters/<name>`` not starting with ``_``), of ``rollout_parity.doctor``
  and of ``rollout_parity.check``. A function gives its parameters with a default; a class its
  dataclass fields declared in rollout-parity (TRL's own ``GRPOConfig`` fields are TRL's) or its
  ``__init__``'s; its public methods (and ``__call__``) theirs. Parameters without a default are set by
  every call and are only counted.
* The verl block: each shared flag (a ``CorrectionConfig`` field) and ``preset`` as
  ``+rollout_parity.<flag>=``.
* The command lines: every option of ``rollout-parity doctor``, ``check`` (``rollout_parity.cli``)
  and ``launch`` (``rollout_parity.launcher``), read from the argparse parsers.

What counts as a test setting one (a static ``ast`` scan of ``tests/`` and ``integration_tests/``):

* a call of the function, class or method by its name with ``name=<value>`` (also ``**{"name": v}``, or
  the value in the parameter's place among the positional arguments; for ``f(**name)``, a dict literal
  or ``dict(...)`` in the same file whose keys are all parameters of ``f``),
  and, for a dataclass, of its methods taking ``**kwargs`` (``CorrectionConfig.replace``/``preset``),
  where ``<value>`` is not a literal equal to the default (a variable or expression counts);
* for a class built from a mapping too (a ``from_*`` classmethod: ``CorrectionConfig.from_dict``,
  ``RolloutParityLossFn.from_nemo_config``): a mapping key (dict literal, ``dict(...)``) or a YAML key
  in a test string, with a non-default value;
* for the verl block: a Hydra override ``rollout_parity.<flag>=<value>`` in a string, or the key in a
  dict literal held under ``"rollout_parity"``;
* for a command line: the option string (``--top_k``) with a non-default value after it, in a list or a
  command string; the subcommand is the one named in that list, string or test function (``launch``
  for a function calling ``rollout_parity.launcher``); a ``--<field>`` with no subcommand around it is
  TRL's command line, which sets ``ParityGRPOConfig`` fields (``TrlParser``).

Not counted: a helper of the test suite passing a parameter on (the test must set it where it calls
rollout-parity). The scan says where a value is set, not that the test asserts something that changes
with it: that part is the reviewer's (and the mutation spot-checks', docs/testing.md).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import math
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional

ROOT = Path(__file__).resolve().parents[1]
TEST_DIRS = ("tests", "integration_tests")
PACKAGE = "rollout_parity"
MODULES = ("rollout_parity.doctor", "rollout_parity.check")  # besides the top level, core, engines and adapters
CLI_PARSERS = {  # subcommand -> the function building its parser (its options are the parameters)
    "doctor": ("rollout_parity.cli", "build_parser", "doctor"),
    "check": ("rollout_parity.cli", "build_parser", "check"),
    "launch": ("rollout_parity.launcher", "build_parser", None),
}
#: Classes parsed from TRL's command line (``TrlParser``): ``--<field> <value>`` sets a field.
TRL_CLI_CLASSES = ("ParityGRPOConfig",)
#: The options class each subcommand builds from its parsed arguments (``rollout_parity/cli.py``): an
#: option whose ``dest`` is a field's name sets that field.
CLI_OPTIONS_CLASSES = {"doctor": "DoctorOptions", "check": "CheckOptions"}
#: The verl config block and the keys it takes besides the shared flags (adapters/verl/config.py).
VERL_BLOCK, VERL_BLOCK_EXTRA = "rollout_parity", ("preset",)

#: Records the library returns or builds internally: their fields are results, not options a user
#: sets, so no test "sets" them; each is listed with what fills it.
RECORDS = {
    "rollout_parity.core.correction.CorrectionOutput": "compute_correction's result",
    "rollout_parity.core.config.RejectionRule": "one parsed rollout_rejection option (CorrectionConfig.rejection_rules)",
    "rollout_parity.core.sampler.SamplerLogprobs": "sampler_logprobs(return_outside=True)'s result",
    "rollout_parity.core.sampler.HeadLogprobs": "sampler_logprobs_from_hidden's result",
    "rollout_parity.core.distributed.MaskedSummary": "masked_summary's result",
    "rollout_parity.core.token_ids.MessageTokenIds": "message_token_ids's result",
    "rollout_parity.doctor.rowspec.RowSpec": "one row of an engine's fixed table of doctor rows (doctor/engine_<key>.py)",
    "rollout_parity.engines.spec.EngineFeature": "one row of an engine's fixed table of features (VLLM_FEATURES, "
                                                 "SGLANG_FEATURES)",
    "rollout_parity.check.report.CheckResult": "one check's result in the report",
    "rollout_parity.check.report.FrameworkReport": "one framework's result in the report",
}
#: Parameters that cannot change an outcome, each with the reason. Keep this short.
ALLOWED: dict[str, str] = {
    # with_rollout_parity never reads ``name`` (loss.py's metric comprehension rebinds the name); it
    # only keys _wrapped_loss's cache, whose result does not depend on it.
    "adapters.verl.loss.with_rollout_parity name": "unused by the wrapper (a cache key of its caller)",
    # TRL's own GRPOConfig field, redeclared with TRL's default only to say in --help how the shared flags meet it;
    # test_trl_adapter.py sets it (as a mapping the scan cannot see) and asserts the refusals and warnings. (TRL's
    # vllm_importance_sampling_* fields are set by test_trl_own_correction.py's grid.)
    "adapters.trl.config.ParityGRPOConfig cast_lm_head_to_fp32":
        "TRL's own field (help text added; TRL's tests own it)",
}

#: Parameters whose tests wait for an open issue that replaces them; printed as PENDING with the issue
#: (not a failure). Drop an entry when its issue lands: the listing then demands a test or its removal.
PENDING: dict[str, str] = {}

_MISSING = object()


# ---------------------------------------------------------------------------------------- parameters


@dataclasses.dataclass
class Param:
    key: str                 # what the listing prints: "<owner> <name>"
    name: str                # the keyword / field / dest
    default: Any
    kind: str                # "kw" | "field" | "cli" | "verl"
    call_names: frozenset    # callee names that set it by keyword
    mapping: bool = False    # a mapping key sets it (class with from_dict)
    trl_cli: bool = False    # TRL's --<field> sets it
    cli_of: str = ""         # a subcommand whose options with this dest set it (CLI_OPTIONS_CLASSES)
    position: Optional[int] = None  # its index among a call's positional arguments, if it can be given so
    siblings: frozenset = frozenset()  # every parameter name of its owner (for ``**kwargs`` dicts)
    options: tuple = ()      # cli: its option strings; parser: its subcommand
    parser: str = ""
    store_true: bool = False
    switch: bool = False     # cli: an optional true/false value; alone (or before a non-bool word) it is true
    found: list = dataclasses.field(default_factory=list)


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return _MISSING


def _ours(obj: Any) -> bool:
    return getattr(obj, "__module__", "").split(".")[0] == PACKAGE


def _own_fields(cls: type) -> list[dataclasses.Field]:
    """Dataclass fields declared in a rollout-parity class of ``cls``'s MRO (not a framework's)."""
    declared = set()
    for klass in cls.__mro__:
        if _ours(klass):
            declared |= set(getattr(klass, "__annotations__", {}))
    return [f for f in dataclasses.fields(cls) if f.name in declared]


def _signature_params(fn: Any, owner: str, call_names: Iterable[str], required: list) -> list[Param]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    out = []
    positional = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.name not in ("self", "cls")]
    siblings = frozenset(p.name for p in sig.parameters.values())
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in ("self", "cls"):
            continue
        if p.default is inspect.Parameter.empty:
            required.append(f"{owner} {p.name}")
            continue
        out.append(Param(f"{owner} {p.name}", p.name, p.default, "kw", frozenset(call_names),
                         position=positional.index(p) if p in positional else None, siblings=siblings))
    return out


def _class_params(cls: type, owner: str, names: set[str], required: list) -> list[Param]:
    out: list[Param] = []
    if dataclasses.is_dataclass(cls):
        forwarders = {n for n, v in vars(cls).items() if not n.startswith("_") and callable(
            getattr(v, "__func__", v)) and any(p.kind == p.VAR_KEYWORD for p in _safe_params(getattr(v, "__func__", v)))}
        mapping = _from_mapping(cls)
        all_fields = [f for f in dataclasses.fields(cls) if f.init]
        for f in _own_fields(cls):
            default = _default(f)
            if default is _MISSING:
                required.append(f"{owner} {f.name}")
                continue
            cli_of = next((sub for sub, name in CLI_OPTIONS_CLASSES.items() if name == cls.__name__), "")
            out.append(Param(f"{owner} {f.name}", f.name, default, "field", frozenset(names | forwarders),
                             mapping=mapping, trl_cli=cls.__name__ in TRL_CLI_CLASSES, cli_of=cli_of,
                             position=all_fields.index(f) if f in all_fields and not f.kw_only else None,
                             siblings=frozenset(x.name for x in all_fields)))
    elif "__init__" in vars(cls) and _ours(cls):
        for p in _signature_params(cls.__init__, owner, names, required):
            p.mapping = _from_mapping(cls)
            out.append(p)
    for name, value in vars(cls).items():
        if name.startswith("_") and name != "__call__":
            continue
        fn = getattr(value, "__func__", value)
        if isinstance(value, property) or not callable(fn):
            continue
        out += _signature_params(fn, f"{owner}.{name}", {name}, required)
    return out


def _from_mapping(cls: type) -> bool:
    """Built from a mapping of its parameters too (``CorrectionConfig.from_dict``, ``from_nemo_config``)."""
    return any(name.startswith("from_") and isinstance(value, classmethod) for name, value in vars(cls).items())


def _safe_params(fn: Any) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []


def _modules() -> list[str]:
    names = [PACKAGE]
    names += sorted(f"{PACKAGE}.core.{p.stem}" for p in (ROOT / PACKAGE / "core").glob("*.py") if p.stem != "__init__")
    names.append(f"{PACKAGE}.engines.spec")
    for engine in sorted(p for p in (ROOT / PACKAGE / "engines").iterdir() if (p / "__init__.py").exists()):
        names += sorted(f"{PACKAGE}.engines.{engine.name}.{p.stem}" for p in engine.glob("*.py") if p.stem != "__init__")
    for p in sorted((ROOT / PACKAGE / "adapters").iterdir()):
        if p.name.startswith("_") or p.name.startswith(".") or not (p.suffix == ".py" or (p / "__init__.py").exists()):
            continue
        names.append(f"{PACKAGE}.adapters.{p.stem}")
    return names + list(MODULES)


def python_params(errors: list[str], required: list[str]) -> tuple[list[Param], dict[str, str]]:
    params: list[Param] = []
    seen: dict[int, str] = {}
    records: dict[str, str] = {}
    for modname in _modules():
        try:
            module = importlib.import_module(modname)
        except Exception as exc:  # noqa: BLE001 - an unimportable module is a listing we cannot make
            errors.append(f"cannot import {modname}: {type(exc).__name__}: {exc}")
            continue
        exported = getattr(module, "__all__", None)
        if exported is None:
            errors.append(f"{modname} has no __all__: declare its public names")
            continue
        for name in exported:
            obj = getattr(module, name, None)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)) or not _ours(obj):
                continue  # constants, and names re-exported from a framework
            if id(obj) in seen:
                continue
            qual = f"{obj.__module__}.{obj.__qualname__}"
            seen[id(obj)] = qual
            if qual in RECORDS:
                records[qual] = RECORDS[qual]
                continue
            owner = f"{obj.__module__}.{obj.__qualname__}".replace(f"{PACKAGE}.", "", 1)
            names = {obj.__name__, name}
            if inspect.isclass(obj):
                if issubclass(obj, BaseException):
                    continue
                params += _class_params(obj, owner, names, required)
            else:
                params += _signature_params(obj, owner, names, required)
    for qual in RECORDS:
        if qual not in records:
            errors.append(f"RECORDS names {qual}, which is not exported any more: drop it")
    return params, records


def verl_params() -> list[Param]:
    from rollout_parity.core.config import CorrectionConfig

    out = []
    for name in (*CorrectionConfig.field_names(), *VERL_BLOCK_EXTRA):
        default = CorrectionConfig.__dataclass_fields__[name].default if name in CorrectionConfig.field_names() else None
        out.append(Param(f"verl +{VERL_BLOCK}.{name}", name, default, "verl", frozenset()))
    return out


def cli_params() -> list[Param]:
    out = []
    for sub, (modname, builder, name) in CLI_PARSERS.items():
        parser = getattr(importlib.import_module(modname), builder)()
        if name is not None:
            subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
            parser = subs.choices[name]
        for action in parser._actions:  # noqa: SLF001 - argparse's public way to list options is none
            if not action.option_strings:
                continue
            store_true = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))  # noqa: SLF001
            # a switch taking an optional true/false (rollout_parity/_argv.py): present alone means true
            switch = action.nargs == "?" and action.const is True
            key = f"cli {sub} {'/'.join(action.option_strings)}"
            out.append(Param(key, action.dest, action.default, "cli", frozenset(), options=tuple(action.option_strings),
                             parser=sub, store_true=store_true or isinstance(action, argparse._HelpAction),  # noqa: SLF001
                             switch=switch))
    return out


# ---------------------------------------------------------------------------------------- evidence


@dataclasses.dataclass
class Evidence:
    where: str
    value: Any  # an ast node, or text (CLI, Hydra, YAML), or _MISSING (a store_true flag)


def _literal(node: Any) -> Any:
    if not isinstance(node, ast.AST):
        return node
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _MISSING


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return len(value) == len(default) and all(_same(a, b) for a, b in zip(value, default))
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default or (isinstance(value, bool) and isinstance(default, bool) and value == default)
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return float(value) == float(default) or (math.isnan(value) and math.isnan(default))
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001
        return False


def _text_is_default(text: str, default: Any) -> bool:
    t = text.strip().strip("'\"")
    if default is None:
        return t.lower() in ("", "none", "null")
    if isinstance(default, bool):
        return t.lower() == str(default).lower()
    if isinstance(default, (int, float)):
        try:
            return float(t) == float(default)
        except ValueError:
            return False
    if isinstance(default, (list, tuple)):
        return [x.strip() for x in t.strip("[]()").split(",") if x.strip()] == [str(x) for x in default]
    return t == str(default)


def sets_non_default(ev: Evidence, param: Param) -> bool:
    if ev.value is _MISSING:
        return True
    if isinstance(ev.value, str):
        return not _text_is_default(ev.value, param.default)
    value = _literal(ev.value)
    return value is _MISSING or not _same(value, param.default)


def _is_option(text: str) -> bool:
    """``--flag`` or ``-m``, not a negative number (``-1`` is a value)."""
    if not text.startswith("-"):
        return False
    try:
        float(text)
    except ValueError:
        return True
    return False


class Scan(ast.NodeVisitor):
    """Collects, per test file, keyword arguments by callee, mapping keys, Hydra overrides and CLI options."""

    SUBCOMMANDS = tuple(CLI_PARSERS)

    def __init__(self, path: Path, tree: ast.Module):
        self.rel = str(path.relative_to(ROOT))
        self.keywords: dict[tuple[str, str], list[Evidence]] = defaultdict(list)
        self.dicts: list[dict[str, Evidence]] = []  # every dict literal / dict(...) with string keys
        self.splatted: set[str] = set()  # callees called with ``**name`` (a dict built elsewhere)
        self.mapping: dict[str, list[Evidence]] = defaultdict(list)
        self.verl: dict[str, list[Evidence]] = defaultdict(list)
        self.cli: list[tuple[str, Evidence, frozenset]] = []  # (option, evidence, subcommands of the context)
        self.aliases = self._aliases(tree)
        self.function: Optional[ast.AST] = None
        self.function_context: frozenset = frozenset()
        self.file_context: frozenset = frozenset()
        self.done_strings: set[int] = set()
        self.in_assert = False
        self.file_context = self._context_of(tree)
        self.visit(tree)

    @staticmethod
    def _aliases(tree: ast.Module) -> dict[str, str]:
        out = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        return out

    def _where(self, node: ast.AST) -> str:
        name = getattr(self.function, "name", "<module>")
        return f"{self.rel}::{name}:{getattr(node, 'lineno', '?')}"

    def _context_of(self, tree: ast.AST) -> frozenset:
        """The subcommands a function (or file) names: a string that is one, or a use of ``rollout_parity.launcher``."""
        words = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in self.SUBCOMMANDS:
                words.add(node.value)
            elif isinstance(node, ast.Name) and self.aliases.get(node.id, "").startswith(f"{PACKAGE}.launcher"):
                words.add("launch")
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and self.aliases.get(
                    node.value.id, "") == f"{PACKAGE}.launcher":
                words.add("launch")
        return frozenset(words)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        outer = self.function is None
        if outer:
            self.function, self.function_context = node, self._context_of(node) or self.file_context
        self.generic_visit(node)
        if outer:
            self.function, self.function_context = None, self.file_context

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    @staticmethod
    def _callee(func: ast.AST) -> Optional[str]:
        if isinstance(func, ast.Name):
            return func.id
        if isinstance(func, ast.Attribute):
            return func.attr
        return None

    def visit_Call(self, node: ast.Call) -> None:
        callee = self._callee(node.func)
        args = list(node.args)
        if callee == "partial" and args:  # functools.partial(f, name=value)
            callee, args = self._callee(args[0]), args[1:]
        if callee is not None:
            for i, arg in enumerate(args):
                if isinstance(arg, ast.Starred):
                    break
                self.keywords[(callee, f"#{i}")].append(Evidence(self._where(arg), arg))
            for kw in node.keywords:
                if kw.arg is not None:
                    self.keywords[(callee, kw.arg)].append(Evidence(self._where(kw.value), kw.value))
                elif not isinstance(kw.value, (ast.Dict, ast.Call)):
                    self.splatted.add(callee)
                elif isinstance(kw.value, ast.Dict):
                    for k, v in zip(kw.value.keys, kw.value.values):
                        if isinstance(k, ast.Constant) and isinstance(k.value, str):
                            self.keywords[(callee, k.value)].append(Evidence(self._where(v), v))
        if callee == "dict" and node.keywords and all(kw.arg is not None for kw in node.keywords):
            for kw in node.keywords:
                self.mapping[kw.arg].append(Evidence(self._where(kw.value), kw.value))
            self.dicts.append({kw.arg: Evidence(self._where(kw.value), kw.value) for kw in node.keywords})
        in_assert, self.in_assert = self.in_assert, False  # what a call is given is an input, even in an assert
        self._sequence(node.args)
        self.generic_visit(node)
        self.in_assert = in_assert

    def visit_Dict(self, node: ast.Dict) -> None:
        if node.keys and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
            self.dicts.append({k.value: Evidence(self._where(v), v) for k, v in zip(node.keys, node.values)})
        for k, v in zip(node.keys, node.values) if not self.in_assert else ():
            if isinstance(k, ast.Constant) and isinstance(k.value, str):
                self.mapping[k.value].append(Evidence(self._where(v), v))
                if k.value == VERL_BLOCK and isinstance(v, ast.Dict):
                    for kk, vv in zip(v.keys, v.values):
                        if isinstance(kk, ast.Constant) and isinstance(kk.value, str):
                            self.verl[kk.value].append(Evidence(self._where(vv), vv))
        self.generic_visit(node)

    def _sequence(self, items: list) -> None:
        if self.in_assert:
            return
        words = frozenset(e.value for e in items if isinstance(e, ast.Constant) and e.value in self.SUBCOMMANDS)
        for i, e in enumerate(items):
            if not (isinstance(e, ast.Constant) and isinstance(e.value, str)) or id(e) in self.done_strings:
                continue
            self.done_strings.add(id(e))
            short = len(e.value) == 2 and e.value[0] == "-" and e.value[1].isalpha()  # -m (not python's: after it)
            if short and i and (isinstance(items[i - 1], ast.Attribute) and items[i - 1].attr == "executable"
                                or isinstance(items[i - 1], ast.Constant) and str(items[i - 1].value).endswith("python")):
                continue
            if not short and (" " in e.value.strip() or not e.value.startswith("--")):
                self._string(e)  # a whole command line, a Hydra override, YAML, or a value
                continue
            option, _, inline = e.value.partition("=")
            if inline:
                value: Any = inline
            elif i + 1 < len(items) and isinstance(items[i + 1], ast.Constant):
                nxt = items[i + 1].value
                value = _MISSING if isinstance(nxt, str) and _is_option(nxt) else str(nxt)
            elif i + 1 < len(items):
                value = items[i + 1]  # an expression: counts as set
            else:
                value = _MISSING
            self.cli.append((option, Evidence(self._where(e), value), words or self.function_context))

    visit_List = visit_Tuple = lambda self, node: (self._sequence(node.elts), self.generic_visit(node))  # noqa: E731

    def _string(self, node: ast.Constant) -> None:
        text = node.value
        for m in re.finditer(rf"(?:^|[\s\[\"'+,])\+?{VERL_BLOCK}\.(\w+)=(\[[^\]]*\]|[^\s\"',]*)", text):
            self.verl[m.group(1)].append(Evidence(self._where(node), m.group(2)))
        tokens = text.split()
        words = frozenset(t for t in tokens if t in self.SUBCOMMANDS)
        for i, tok in enumerate(tokens):
            if tok.startswith("--") and len(tok) > 2:
                option, _, inline = tok.partition("=")
                value = inline or (tokens[i + 1] if i + 1 < len(tokens) and not _is_option(tokens[i + 1])
                                   else _MISSING)
                self.cli.append((option, Evidence(self._where(node), value), words or self.function_context))
        if "\n" in text and ":" in text:
            self._yaml(node, text)

    def _yaml(self, node: ast.Constant, text: str) -> None:
        try:
            import yaml

            doc = yaml.safe_load(text)
        except Exception:  # noqa: BLE001 - most strings are not YAML
            return
        stack = [doc]
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                for k, v in item.items():
                    if isinstance(k, str):
                        self.mapping[k].append(Evidence(self._where(node), v if isinstance(v, str) else repr(v)
                                                        if not isinstance(v, (dict, list)) else ast.Constant(None)))
                    stack.append(v)
            elif isinstance(item, list):
                stack.extend(item)

    def visit_Assert(self, node: ast.Assert) -> None:
        # A command line, override or mapping written in an assert is an expected output, not a setting;
        # the calls in it still count.
        self.in_assert = True
        self.generic_visit(node)
        self.in_assert = False

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and id(node) not in self.done_strings and not self.in_assert:
            self._string(node)


def scan_tests() -> list[Scan]:
    scans = []
    for directory in TEST_DIRS:
        for path in sorted((ROOT / directory).rglob("*.py")):
            scans.append(Scan(path, ast.parse(path.read_text(), filename=str(path))))
    return scans


def attribute(params: list[Param], scans: list[Scan]) -> None:
    cli_dests = {(p.parser, p.name): p.options for p in params if p.kind == "cli"}
    for p in params:
        for scan in scans:
            found: list[Evidence] = []
            if p.kind in ("kw", "field"):
                for callee in p.call_names:
                    found += scan.keywords.get((callee, p.name), [])
                    if p.position is not None:
                        found += scan.keywords.get((callee, f"#{p.position}"), [])
                    if callee in scan.splatted:  # f(**settings): the file's dicts made of f's parameters
                        found += [d[p.name] for d in scan.dicts if p.name in d and set(d) <= p.siblings]
                if p.mapping:
                    found += scan.mapping.get(p.name, [])
                if p.trl_cli:
                    found += [ev for option, ev, ctx in scan.cli if option == f"--{p.name}" and not ctx]
                if p.cli_of:
                    options = cli_dests.get((p.cli_of, p.name), ())
                    found += [ev for option, ev, ctx in scan.cli if option in options and p.cli_of in ctx]
            elif p.kind == "verl":
                found += scan.verl.get(p.name, [])
            elif p.kind == "cli":
                for option, ev, ctx in scan.cli:
                    if option in p.options and p.parser in ctx:
                        bool_word = isinstance(ev.value, str) and ev.value.strip().lower() in ("true", "false")
                        present = p.store_true or (p.switch and not bool_word)
                        found.append(Evidence(ev.where, True if present and p.switch else _MISSING) if present
                                     else ev)
            p.found += [ev.where for ev in found if sets_non_default(ev, p)]


# ---------------------------------------------------------------------------------------- report


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--missing", action="store_true", help="print only the parameters no test sets")
    ap.add_argument("--all-tests", action="store_true", help="print every place a parameter is set, not the first 3")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    errors: list[str] = []
    required: list[str] = []
    params, records = python_params(errors, required)
    if not errors:
        params += verl_params() + cli_params()
    attribute(params, scan_tests())

    covered = [p for p in params if p.found]
    allowed = [p for p in params if not p.found and p.key in ALLOWED]
    pending = [p for p in params if not p.found and p.key in PENDING]
    missing = [p for p in params if not p.found and p.key not in ALLOWED and p.key not in PENDING]
    stale = sorted((set(ALLOWED) | set(PENDING)) - {p.key for p in params if not p.found})
    if not args.missing:
        for p in params:
            if p.found:
                shown = list(dict.fromkeys(p.found))
                more = "" if args.all_tests or len(shown) <= 3 else f" (+{len(shown) - 3} more)"
                print(f"ok       {p.key}  <- {', '.join(shown if args.all_tests else shown[:3])}{more}")
            elif p.key in ALLOWED:
                print(f"allowed  {p.key}  ({ALLOWED[p.key]})")
            elif p.key in PENDING:
                print(f"PENDING  {p.key}  (no test yet: {PENDING[p.key]})")
        for qual, why in records.items():
            print(f"record   {qual}  ({why}; fields are results)")
    for p in missing:
        print(f"MISSING  {p.key}  (default {p.default!r}): no test sets it to another value")
    for key in stale:
        print(f"STALE    ALLOWED/PENDING names {key!r}, which is not an untested parameter (any more): drop it")
    for e in errors:
        print(f"ERROR    {e}")
    print(f"\n{len(params)} public parameters with a default ({len(covered)} set by a test, {len(allowed)} allowed "
          f"without one, {len(pending)} pending an open issue, {len(missing)} missing); {len(required)} required "
          f"parameters (set by every call); {len(records)} result records")
    if missing or errors or stale:
        print("FAIL: add a test that sets each MISSING parameter to a non-default value and asserts an outcome "
              "that changes with it (or, if it truly cannot change an outcome, add it to ALLOWED with why)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
