"""NeMo RL's own source, imported from a tree on disk and put away after use.

NeMo RL does not install everywhere (Python >= 3.13.13, git-sourced dependencies, CUDA torch),
but its loss module imports on CPU from a source tree (``--nemo_rl_source``; the suite's
``../shared/anchors/nemo-rl/<version>``) once the few heavy top-level modules it imports but
never calls on the loss path (``pynvml``, ``wandb``, ``ray``, ...) are answered by stubs.
Nothing of NeMo RL itself is stubbed or copied: its real modules run.

``NemoRLSources.activate(tree)`` is a context manager. On entry it puts the tree first on
``sys.path`` and a stub finder last on ``sys.meta_path``; the finder answers only imports made
*by the tree's own files* of modules nothing else can import, so a real library's optional
import is never fooled. On exit ``sys.path``, ``sys.meta_path``, ``os.environ``, the root
logger's handlers, the warning filters, ``sys.excepthook`` and
``transformers.AutoTokenizer.from_pretrained`` (which ``nemo_rl.models.policy`` wraps at import)
are as before, and every ``nemo_rl.*`` module and stub leaves ``sys.modules`` (kept aside per
tree, so activating the same tree again is instant and two trees can take turns in one process).
:data:`SOURCES` is the one instance per process that the check and the suite share.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import types
import typing
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

__all__ = ["NemoRLSources", "SOURCES", "StubModule", "is_source_tree"]

# Reported versions of stubs for modules whose version NeMo RL checks at import time
# (v0.7.0 asserts transformers < 5.12 in nemo_rl/models/policy/__init__.py).
_STUB_VERSIONS = {"tensorboard": "2.20.0", "transformers": "5.10.4", "pynvml": "12.0.0"}


def is_source_tree(tree: os.PathLike | str) -> bool:
    """True when ``tree`` holds a ``nemo_rl`` package (``<tree>/nemo_rl/__init__.py``)."""
    return (Path(tree) / "nemo_rl" / "__init__.py").is_file()


# ----------------------------------------------------------------------------- stubs


class _StubMeta(type):
    """Classes standing in for anything a stubbed module is asked for.

    A stub can be subclassed, called, subscripted (``Optional[ray.ObjectRef]``), or'ed in
    annotations, and used as a decorator with or without arguments (``@ray.remote``,
    ``@ray.remote(num_gpus=1)``): called with one callable and nothing else, it returns it.
    """

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        if cls.__dict__.get("_stub_root", False):
            if len(args) == 1 and not kwargs and callable(args[0]):
                return args[0]
            return _stub_class(f"{cls.__qualname__}()")
        return super().__call__(*args, **kwargs)

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls


def _stub_class(qualname: str) -> type:
    cls = _StubMeta(qualname.rsplit(".", 1)[-1], (), {"_stub_root": True})
    cls.__qualname__ = qualname
    cls.__module__ = qualname.split(".", 1)[0]
    return cls


class StubModule(types.ModuleType):
    """A module that answers every attribute with a stub class (and is a package)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []
        self.__version__ = _STUB_VERSIONS.get(name.split(".", 1)[0], "99.0.0")

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stub_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return StubModule(spec.name)

    def exec_module(self, module):
        return None


class _StubFinder(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: reached only when no real finder knows the module, and then
    answers only imports whose importing frame is a file of the active NeMo RL tree."""

    def __init__(self, tree: Path):
        self.tree = str(tree) + os.sep
        self.stubbed: set[str] = set()

    def _imported_by_nemo(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if not (name.startswith("<frozen importlib") or name == __file__
                    or name.endswith(os.path.join("importlib", "__init__.py"))
                    or name.endswith(os.path.join("importlib", "util.py"))):
                return name.startswith(self.tree)
            frame = frame.f_back
        return False

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] == "nemo_rl" or not self._imported_by_nemo():
            return None
        self.stubbed.add(fullname)
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


# ----------------------------------------------------------------------------- activation


class NemoRLSources:
    """Activate one NeMo RL source tree at a time (see the module doc)."""

    def __init__(self):
        self._stash: dict[str, dict[str, types.ModuleType]] = {}
        self.active: Optional[str] = None
        self.stubbed: dict[str, set[str]] = {}

    @contextmanager
    def activate(self, tree: os.PathLike | str) -> Iterator[types.SimpleNamespace]:
        """Import from ``tree`` inside the block; yields ``tree`` and ``load`` (``importlib.import_module``)."""
        tree = Path(tree).resolve()
        key = str(tree)
        if self.active is not None:
            raise RuntimeError(f"NeMo RL source {self.active} is active; leave it before {key}")
        if not is_source_tree(tree):
            raise FileNotFoundError(f"no NeMo RL source at {tree} (expected {tree / 'nemo_rl' / '__init__.py'})")
        leftovers = [m for m in sys.modules if m == "nemo_rl" or m.startswith("nemo_rl.")]
        if leftovers:
            raise RuntimeError(f"nemo_rl is already imported ({leftovers[0]}, ...): an installed NeMo "
                               "RL or a leaked import; a source tree needs a process without it")
        saved_path, saved_meta = list(sys.path), list(sys.meta_path)
        saved_env = dict(os.environ)
        saved_filters, saved_excepthook = list(warnings.filters), sys.excepthook
        try:  # NeMo RL wraps AutoTokenizer.from_pretrained at import; the wrapper is undone on exit
            from transformers import AutoTokenizer
        except ImportError:
            AutoTokenizer = None
        saved_from_pretrained = AutoTokenizer.__dict__["from_pretrained"] if AutoTokenizer else None
        root_logger = logging.getLogger()
        saved_handlers, saved_level = list(root_logger.handlers), root_logger.level
        before = set(sys.modules)
        finder = _StubFinder(tree)
        saved_typed_dict = typing.TypedDict
        if sys.version_info < (3, 12):
            # NeMo RL (Python >= 3.13) builds pydantic models over its TypedDict configs (grpo.MasterConfig),
            # and pydantic accepts only typing_extensions' TypedDict before 3.12; restored on exit.
            import typing_extensions

            typing.TypedDict = typing_extensions.TypedDict
        sys.path.insert(0, key)
        sys.meta_path.append(finder)
        sys.modules.update(self._stash.pop(key, {}))
        self.active = key
        try:
            yield types.SimpleNamespace(tree=tree, load=importlib.import_module)
        finally:
            self.active = None
            keep: dict[str, types.ModuleType] = {}
            for name in list(sys.modules):
                module = sys.modules[name]
                if (name == "nemo_rl" or name.startswith("nemo_rl.") or isinstance(module, StubModule)) \
                        and name not in before:
                    keep[name] = sys.modules.pop(name)
            self._stash[key] = keep
            self.stubbed.setdefault(key, set()).update(finder.stubbed)
            sys.path[:] = saved_path
            sys.meta_path[:] = saved_meta
            for name in set(os.environ) - set(saved_env):
                del os.environ[name]
            for name, value in saved_env.items():
                if os.environ.get(name) != value:
                    os.environ[name] = value
            root_logger.handlers[:] = saved_handlers
            root_logger.setLevel(saved_level)
            warnings.filters[:] = saved_filters
            getattr(warnings, "_filters_mutated", lambda: None)()
            sys.excepthook = saved_excepthook
            typing.TypedDict = saved_typed_dict
            if AutoTokenizer is not None:
                AutoTokenizer.from_pretrained = saved_from_pretrained


#: One per process: the stash lets every user (the check, each test module) reuse the first
#: import of each tree.
SOURCES = NemoRLSources()
