"""The one patch layer every adapter uses: idempotent, reversible, marked, validated before any change.

A patch replaces one attribute (a module's function, a class's method, one trainer's method,
a module global) with a wrapper built by :func:`wrapper`: ``functools.wraps`` of the original
(so ``__wrapped__`` is the original and the signature reads through), marked with :data:`MARK`,
calling ``behaviour(original, *args, **kwargs)``, which only adds to the original. A
:class:`Patches` ledger records each replacement and reverts in reverse order, bit for bit:
what the owner did not hold itself (an inherited method, a trainer falling back to its class,
a name a lazy module had not bound yet) is deleted again, not set to the value once seen.
Applying twice leaves the same wrapper; a wrapper that is not ours is refused, never stacked on.

:class:`ModulePatcher` adds what process-wide patches of a framework need: a table of
:class:`PatchPoint` (where a name is defined, and the modules that imported it by value at
their own import time, which get the very same wrapper), eager points patched at ``apply``,
and an import hook that patches the others the moment the framework imports their module.
A name missing at patch time is a :class:`FrameworkAPIError`, never a skipped patch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

from rollout_parity.framework_api import FrameworkAPIError, check_framework, installed_version

__all__ = ["MARK", "is_ours", "mark", "wrapper", "Patches", "patched", "PatchPoint", "ModulePatcher"]

#: The one marker every rollout-parity wrapper carries.
MARK = "__rollout_parity_patch__"
_ABSENT = object()


def is_ours(obj: Any) -> bool:
    return bool(getattr(obj, MARK, False))


def mark(fn: Callable) -> Callable:
    setattr(fn, MARK, True)
    return fn


def wrapper(original: Callable, behaviour: Callable) -> Callable:
    """``functools.wraps(original)`` around ``behaviour(original, *args, **kwargs)``, marked.

    A class (a module global such as TRL's ``LLM``) lends its names, not its namespace. A coroutine
    function gets a coroutine function (``behaviour`` is then ``async`` too), so frameworks that
    dispatch on ``inspect.iscoroutinefunction`` (verl's worker groups) still see one.
    """
    updated = () if isinstance(original, type) else functools.WRAPPER_UPDATES
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original, updated=updated)
        async def patched_async(*args: Any, **kwargs: Any) -> Any:
            return await behaviour(original, *args, **kwargs)

        return mark(patched_async)

    @functools.wraps(original, updated=updated)
    def patched(*args: Any, **kwargs: Any) -> Any:
        return behaviour(original, *args, **kwargs)

    return mark(patched)


def owner_and_name(root: Any, attr: str) -> tuple[Any, str]:
    """``(Class, "method")`` for ``attr="Class.method"`` under ``root``; ``(root, attr)`` for a plain name."""
    *path, name = attr.split(".")
    owner = root
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _own_decorator(owner: Any, current: Any) -> bool:
    """A wrapper the framework put on its own method at definition time (verl's ``@register``): its code lives
    in the owner's top-level package, which is not someone else's patch."""
    module = owner.__name__ if isinstance(owner, types.ModuleType) else getattr(owner, "__module__", "")
    spec = importlib.util.find_spec(module.split(".")[0]) if module else None
    roots = list(getattr(spec, "submodule_search_locations", None) or [])
    code = getattr(current, "__code__", None)
    return code is not None and any(code.co_filename.startswith(root.rstrip("/") + "/") for root in roots)


def _foreign(owner: Any, name: str, current: Any) -> bool:
    """Someone else's replacement sits at ``owner.name`` (stacking on it would corrupt both reverts)."""
    if is_ours(current):
        return False
    if isinstance(owner, (types.ModuleType, type)):
        return isinstance(current, types.FunctionType) and getattr(current, "__wrapped__", None) is not None \
            and not _own_decorator(owner, current)
    return name in vars(owner)  # an instance holding its own value overrides its class's method


def _describe(obj: Any) -> str:
    code = getattr(obj, "__code__", None)  # functools.wraps copied the original's names; the code tells whose
    where = f" ({code.co_name} at {code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"{getattr(obj, '__qualname__', obj)!r}{where}"


class Patches:
    """A ledger of replaced attributes; :meth:`revert` undoes them in reverse order."""

    def __init__(self) -> None:
        self._entries: list[tuple[Any, str, Any]] = []  # (owner, name, what the owner held, or _ABSENT)

    def replace(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name = value``, remembering what ``owner`` itself held."""
        self._entries.append((owner, name, vars(owner).get(name, _ABSENT)))
        setattr(owner, name, value)

    def wrap(self, owner: Any, name: str, behaviour: Callable, *, dotted: str) -> Callable:
        """Replace ``owner.name`` by :func:`wrapper` of it; the existing wrapper if it is ours already."""
        current = getattr(owner, name, _ABSENT)
        if current is _ABSENT:
            raise FrameworkAPIError(f"{dotted} does not exist: there is nothing to patch")
        if is_ours(current):
            return current
        if _foreign(owner, name, current):
            raise RuntimeError(f"{dotted} is already replaced by {_describe(current)}, not by rollout-parity; "
                               "refusing to stack on it")
        patched = wrapper(current, behaviour)
        self.replace(owner, name, patched)
        return patched

    def record(self, owner: Any, name: str, previous: Any) -> None:
        """Note a replacement made elsewhere (a module that imported our wrapper), to undo it too."""
        self._entries.append((owner, name, previous))

    def holds(self, owner: Any, name: str) -> bool:
        return any(o is owner and n == name for o, n, _ in self._entries)

    def previous(self, owner: Any, name: str, default: Any = None) -> Any:
        """What ``owner.name`` was before the first replacement this ledger made."""
        for o, n, value in self._entries:
            if o is owner and n == name:
                return default if value is _ABSENT else value
        return default

    def revert(self, keep: int = 0) -> None:
        """Undo every replacement after the first ``keep`` (all by default), newest first."""
        while len(self._entries) > keep:
            owner, name, value = self._entries.pop()
            if value is _ABSENT:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)

    def __len__(self) -> int:
        return len(self._entries)


@contextlib.contextmanager
def patched(owner: Any, name: str, behaviour: Callable, *, dotted: str) -> Iterator[None]:
    """``owner.name`` wrapped by ``behaviour`` while the block runs (a nested block leaves the outer wrapper)."""
    patches = Patches()
    patches.wrap(owner, name, behaviour, dotted=dotted)
    try:
        yield
    finally:
        patches.revert()


@dataclass(frozen=True)
class PatchPoint:
    """A framework name to wrap: where it is defined and where it is looked up.

    ``callers`` imported the name by value at their own import time and get the same wrapper.
    ``eager`` points are imported and patched at ``apply``; the others when (if) the framework
    imports their module. ``optional`` ones exist only in some versions of the framework.
    """

    module: str
    attr: str  # "function" or "Class.method"
    behaviour: Callable
    callers: tuple[str, ...] = ()
    eager: bool = False
    optional: bool = False

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.attr}"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``on_import(name, module)`` right after a watched module has executed."""

    def __init__(self, on_import: Callable[[str, Any], None]) -> None:
        self.watch: set[str] = set()
        self._on_import = on_import

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.watch:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                original_exec = spec.loader.exec_module

                def exec_module(module, _original=original_exec, _name=fullname):
                    _original(module)
                    self._on_import(_name, module)

                spec.loader.exec_module = exec_module
                return spec
        return None


class ModulePatcher:
    """Process-wide patches of one framework: ``apply`` (idempotent, all or nothing), ``revert``, ``is_applied``."""

    def __init__(self, framework: str, points: Iterable[PatchPoint], *, distributions: tuple[str, ...],
                 tested: str, extra: str) -> None:
        self.framework, self.points = framework, tuple(points)
        self._check = dict(framework=framework, distributions=distributions, tested=tested, extra=extra)
        self.patches = Patches()
        self._wrappers: dict[int, Callable] = {}  # id(original) -> its wrapper, for the caller modules
        self.hook = _PatchOnImport(self._on_import)

    def apply(self) -> None:
        """Check the version (one warning outside the tested range), patch what is imported, watch the rest."""
        check_framework(**self._check)
        if self.is_applied():
            return
        done = len(self.patches)
        try:
            for point in self.points:
                if point.eager or point.module in sys.modules:
                    self._patch_definition(point, importlib.import_module(point.module))
                    self._patch_callers(point)
                else:
                    self.hook.watch.add(point.module)
                self.hook.watch.update(c for c in point.callers if c not in sys.modules)
        except Exception:
            self.patches.revert(keep=done)
            self.hook.watch.clear()
            raise
        if self.hook not in sys.meta_path:
            sys.meta_path.insert(0, self.hook)

    def revert(self) -> None:
        """Every original back (newest first), and no more patching on import."""
        self.patches.revert()
        self._wrappers.clear()
        self.hook.watch.clear()
        if self.hook in sys.meta_path:
            sys.meta_path.remove(self.hook)

    def is_applied(self) -> bool:
        """True while every eager point carries our wrapper (with none: while the import hook watches)."""
        eager = [point for point in self.points if point.eager]
        if not eager:
            return self.hook in sys.meta_path
        return all(is_ours(self.current(point)) for point in eager)

    @staticmethod
    def current(point: PatchPoint) -> Optional[Any]:
        """What ``point`` names now (None while its module is not imported or lacks it)."""
        module = sys.modules.get(point.module)
        if module is None:
            return None
        try:
            owner, name = owner_and_name(module, point.attr)
        except AttributeError:
            return None
        return getattr(owner, name, None)

    def _patch_definition(self, point: PatchPoint, module: Any) -> None:
        try:
            owner, name = owner_and_name(module, point.attr)
        except AttributeError:
            owner, name = None, ""
        if owner is None or getattr(owner, name, None) is None:
            version = installed_version(self._check["distributions"]) or "(version unknown)"
            raise FrameworkAPIError(
                f"rollout-parity's {self.framework} adapter needs {point.dotted}, which {self.framework} {version} "
                f"does not have; the adapter is tested with {self.framework} {self._check['tested']} "
                f"(pip install 'rollout-parity[{self._check['extra']}]')")
        original = getattr(owner, name)
        patched = self.patches.wrap(owner, name, point.behaviour, dotted=point.dotted)
        if patched is not original:
            self._wrappers[id(original)] = patched

    def _patch_callers(self, point: PatchPoint) -> None:
        """Give every imported caller module the wrapper; note callers that bound it themselves, for revert."""
        *_, name = point.attr.split(".")
        for caller in point.callers:
            module = sys.modules.get(caller)
            current = None if module is None else getattr(module, name, None)
            if current is None:
                continue  # not imported (yet): it will import the wrapped name
            if is_ours(current):
                if not self.patches.holds(module, name):  # imported after apply(): bound our wrapper itself
                    self.patches.record(module, name, current.__wrapped__)
                continue
            patched = self._wrappers.get(id(current))
            if patched is not None:  # a caller holding something other than the definition is left alone
                self.patches.replace(module, name, patched)

    def _on_import(self, module_name: str, module: Any) -> None:
        if not len(self.patches) and not self.hook.watch:
            return
        for point in self.points:
            if point.module == module_name:
                self._patch_definition(point, module)
            if module_name in point.callers or point.module == module_name:
                self._patch_callers(point)
        self.hook.watch.discard(module_name)
