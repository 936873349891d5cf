"""Read a vLLM source tree or wheel with :mod:`ast`, never importing it (for ``vllm_names.check_source``).

``Source.lookup("module:Qualified.name")`` finds a class, function or member the way Python would: a name
defined in the module, else followed through ``from ... import`` (relative too) and through a lazy
re-export table (``{"LLM": ".entrypoints.llm:LLM"}`` in ``vllm/__init__.py``); a class member is found in the
class body, as ``self.name = ...`` in one of its methods, or in a base class (followed the same way).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

from rollout_parity.engines.vllm.features import parse_vllm_version

__all__ = ["Source", "self_assigned", "ast_params", "tree_version"]


def self_assigned(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
    return out


class Source:
    """Resolve ``module:Qualified.name`` in a vLLM source tree or wheel with :mod:`ast` (re-exports followed)."""

    def __init__(self, root: Path) -> None:
        root = Path(root)
        if root.is_file() and root.suffix == ".whl":
            import zipfile

            self._zip: Optional[zipfile.ZipFile] = zipfile.ZipFile(root)
            self._names = set(self._zip.namelist())
            self.root = root
        else:
            self._zip, self._names = None, set()
            self.root = root.parent if (root / "__init__.py").is_file() and root.name == "vllm" else root
        if not self._is_file("vllm/__init__.py"):
            raise FileNotFoundError(f"no vllm/__init__.py in {root}")
        self._trees: dict[str, Optional[ast.Module]] = {}

    def _is_file(self, rel: str) -> bool:
        return rel in self._names if self._zip is not None else (self.root / rel).is_file()

    def read(self, rel: str) -> Optional[str]:
        if not self._is_file(rel):
            return None
        return self._zip.read(rel).decode() if self._zip is not None else (self.root / rel).read_text()

    def tree(self, module: str) -> Optional[ast.Module]:
        if module not in self._trees:
            base = module.replace(".", "/")
            text = self.read(f"{base}.py")
            if text is None:
                text = self.read(f"{base}/__init__.py")
            self._trees[module] = ast.parse(text) if text is not None else None
        return self._trees[module]

    def find(self, module: str, name: str) -> Optional[tuple[str, ast.AST]]:
        """The ``(module, node)`` defining top-level ``name`` as seen from ``module``."""
        return self._find(module, name, 0)

    def _find(self, module: str, name: str, depth: int) -> Optional[tuple[str, ast.AST]]:
        tree = self.tree(module)
        if tree is None or depth > 8:
            return None
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return module, node
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return module, node
        for node in ast.walk(tree):  # imports anywhere (vLLM imports under TYPE_CHECKING and in functions)
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        src = self._absolute(module, node)
                        hit = self._find(src, alias.name, depth + 1)
                        if hit is None and self.tree(f"{src}.{alias.name}") is not None:
                            return f"{src}.{alias.name}", self.tree(f"{src}.{alias.name}")  # a submodule
                        if hit is not None:
                            return hit
        for node in ast.walk(tree):  # lazy re-exports: {"LLM": ".entrypoints.llm:LLM"} (vllm/__init__.py)
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values):
                    if isinstance(key, ast.Constant) and key.value == name and isinstance(value, ast.Constant) \
                            and isinstance(value.value, str) and ":" in value.value:
                        target, attr = value.value.split(":")
                        target = module + target if target.startswith(".") else target
                        return self._find(target, attr, depth + 1)
        return None

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = module.split(".")
        is_pkg = self._is_file("/".join(package) + "/__init__.py")
        base = package if is_pkg else package[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def member(self, module: str, cls: ast.ClassDef, name: str) -> Optional[ast.AST]:
        """``name`` in a class body, as ``self.name = ...`` in its methods, or in a base class (followed)."""
        return self._member(module, cls, name, 0)

    def _member(self, module: str, cls: ast.ClassDef, name: str, depth: int) -> Optional[ast.AST]:
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return node
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return node
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return node
        if name in self_assigned(cls):
            return cls
        if depth > 8:
            return None
        for base in cls.bases:
            base_name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) \
                else None
            hit = self.find(module, base_name) if base_name else None
            if hit is not None and isinstance(hit[1], ast.ClassDef):
                found = self._member(hit[0], hit[1], name, depth + 1)
                if found is not None:
                    return found
        return None

    def lookup(self, path: str) -> Optional[tuple[str, ast.AST]]:
        module, qual = path.split(":")
        parts = qual.split(".")
        hit = self.find(module, parts[0])
        for part in parts[1:]:
            if hit is None or not isinstance(hit[1], ast.ClassDef):
                return None
            node = self.member(hit[0], hit[1], part)
            hit = None if node is None else (hit[0], node)
        return hit


def ast_params(fn: ast.AST) -> Optional[set[str]]:
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    a = fn.args
    return {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}


def tree_version(src: Source) -> Optional[str]:
    for rel in ("vllm/_version.py", "vllm/version.py"):
        text = src.read(rel)
        for node in ast.walk(ast.parse(text)) if text else ():
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ("__version__", "version")
                                                    for t in node.targets):
                if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                    try:
                        parse_vllm_version(node.value.value)
                        return node.value.value
                    except ValueError:
                        pass
    return None
