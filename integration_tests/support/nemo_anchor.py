"""NeMo RL's own source, imported for a test and put away after it.

NeMo RL does not install here (Python >= 3.13.13, git-sourced dependencies, CUDA torch), but
its source trees at v0.7.0 and at a newer snapshot ("head") lie in ``../shared/anchors/nemo-rl``
(see that folder's README). Their loss module and the pieces the tests call import on CPU once
the few heavy top-level modules they import but never call on our paths (``pynvml``,
``wandb``, ...) are answered by stubs. This module does that and nothing more:

* ``NemoRLAnchors.activate(version)`` is a context manager. On entry it puts the version's
  tree first on ``sys.path`` and a stub finder last on ``sys.meta_path``; the finder answers
  only imports made *by NeMo RL's own files* of modules nothing else can import, so a real
  library's optional import is never fooled. On exit ``sys.path``, ``sys.meta_path``,
  ``os.environ``, the root logger's handlers, the warning filters, ``sys.excepthook`` and
  ``transformers.AutoTokenizer.from_pretrained`` (which ``nemo_rl.models.policy`` wraps at
  import) are as before, and every ``nemo_rl.*`` module and stub is taken out of
  ``sys.modules`` (kept aside, so activating the same version again is instant and two
  versions can take turns in one pytest process).
* On Python < 3.12, while a version is active ``typing.TypedDict`` is the backport from
  ``typing_extensions``: NeMo RL (which requires Python >= 3.13) builds pydantic models over its TypedDict
  configs (``grpo.MasterConfig``), and pydantic accepts only the backport before 3.12. The
  classes behave the same; ``typing.TypedDict`` is restored on exit.
* ``skip_unless_available()`` skips, or fails in CI (``missing(..., anchor=True)``), when the
  trees are absent.

Nothing here is copied from NeMo RL; tests import its real modules through ``activate``.
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

REPO_ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ("v0.7.0", "head")
COMMITS = {"v0.7.0": "81aa43dda4765b0429cf31dab44441e4e4383911",
           "head": "7ea279abfbeb698b092856d0dab61e7cf39bc909"}
# Reported versions of stubs for modules whose version NeMo RL checks at import time.
_STUB_VERSIONS = {"tensorboard": "2.20.0", "transformers": "5.10.4", "pynvml": "12.0.0"}


def anchor_root() -> Path:
    """``../shared/anchors/nemo-rl`` beside the checkout (``ROLLOUT_PARITY_ANCHORS`` overrides
    the ``anchors`` folder)."""
    base = os.environ.get("ROLLOUT_PARITY_ANCHORS")
    root = Path(base) if base else REPO_ROOT.parent / "shared" / "anchors"
    return root / "nemo-rl"


def available_versions() -> list[str]:
    return [v for v in VERSIONS if (anchor_root() / v / "nemo_rl" / "__init__.py").is_file()]


def skip_unless_available(versions=VERSIONS) -> None:
    """Skip (fail in CI) unless every version in ``versions`` is present."""
    from rollout_parity.testing.stack import missing

    absent = [v for v in versions if v not in available_versions()]
    if absent:
        missing(f"NeMo RL anchor source {absent}",
                f"{anchor_root()} holds no nemo_rl/ tree for {absent} (the anchors sit in "
                "../shared/anchors beside the checkout; see its README)", anchor=True)


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


class NemoRLAnchors:
    """Activate one NeMo RL source tree at a time (see the module doc)."""

    def __init__(self):
        self._stash: dict[str, dict[str, types.ModuleType]] = {}
        self.active: Optional[str] = None
        self.stubbed: dict[str, set[str]] = {}

    @contextmanager
    def activate(self, version: str) -> Iterator[types.SimpleNamespace]:
        if version not in VERSIONS:
            raise ValueError(f"unknown NeMo RL anchor version {version!r}; expected one of {VERSIONS}")
        if self.active is not None:
            raise RuntimeError(f"NeMo RL anchor {self.active!r} is active; leave it before {version!r}")
        tree = anchor_root() / version
        if not (tree / "nemo_rl" / "__init__.py").is_file():
            raise FileNotFoundError(f"no NeMo RL source at {tree}")
        leftovers = [m for m in sys.modules if m == "nemo_rl" or m.startswith("nemo_rl.")]
        if leftovers:
            raise RuntimeError(f"nemo_rl is already imported ({leftovers[0]}, ...): an installed NeMo "
                               "RL or a leaked import; the anchors need a process without it")
        saved_path, saved_meta = list(sys.path), list(sys.meta_path)
        saved_env = dict(os.environ)
        saved_filters, saved_excepthook = list(warnings.filters), sys.excepthook
        saved_typed_dict = typing.TypedDict
        from transformers import AutoTokenizer  # NeMo RL imports it anyway; its wrapper is undone

        saved_from_pretrained = AutoTokenizer.__dict__["from_pretrained"]
        root_logger = logging.getLogger()
        saved_handlers, saved_level = list(root_logger.handlers), root_logger.level
        before = set(sys.modules)
        finder = _StubFinder(tree)
        if sys.version_info < (3, 12):
            import typing_extensions

            typing.TypedDict = typing_extensions.TypedDict
        sys.path.insert(0, str(tree))
        sys.meta_path.append(finder)
        sys.modules.update(self._stash.pop(version, {}))
        self.active = version
        try:
            yield types.SimpleNamespace(version=version, tree=tree, commit=COMMITS[version],
                                        load=importlib.import_module)
        finally:
            self.active = None
            keep: dict[str, types.ModuleType] = {}
            for name in list(sys.modules):
                module = sys.modules[name]
                if (name == "nemo_rl" or name.startswith("nemo_rl.") or isinstance(module, StubModule)) \
                        and name not in before:
                    keep[name] = sys.modules.pop(name)
            self._stash[version] = keep
            self.stubbed.setdefault(version, set()).update(finder.stubbed)
            sys.path[:] = saved_path
            sys.meta_path[:] = saved_meta
            for key in set(os.environ) - set(saved_env):
                del os.environ[key]
            for key, value in saved_env.items():
                if os.environ.get(key) != value:
                    os.environ[key] = value
            root_logger.handlers[:] = saved_handlers
            root_logger.setLevel(saved_level)
            warnings.filters[:] = saved_filters
            getattr(warnings, "_filters_mutated", lambda: None)()
            sys.excepthook = saved_excepthook
            typing.TypedDict = saved_typed_dict
            AutoTokenizer.from_pretrained = saved_from_pretrained


#: One per process: the stash lets every test module reuse the first import of each version.
ANCHORS = NemoRLAnchors()
