"""The layers of docs/architecture.md, held: what each part of the package may import.

Every ``import`` statement of every module (top level and inside functions) is read with ``ast``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rollout_parity"
FRAMEWORKS = {"verl", "trl", "vllm", "nemo_rl", "nemo_gym", "deepspeed", "ray", "transfer_queue", "accelerate",
              "transformers", "peft", "tensordict"}
STDLIB = set(sys.stdlib_module_names)


def _imports(path: Path) -> set[str]:
    """The absolute module names a file imports (relative imports resolved against its package)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names.add(".".join(base + ([node.module] if node.module else [])))
            else:
                names.add(node.module)
    return names


def _modules(sub: str):
    return sorted((PACKAGE / sub).rglob("*.py")) if (PACKAGE / sub).is_dir() else [PACKAGE / f"{sub}.py"]


def _top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("path", _modules("core"), ids=lambda p: p.name)
def test_core_imports_torch_and_itself_only(path):
    """And the CUDA kernels below it (imported inside a function, on CUDA only: tests/test_core_imports.py)."""
    bad = {n for n in _imports(path) if _top(n) not in STDLIB | {"torch", "omegaconf", "yaml", "__future__"}
           and not n.startswith(("rollout_parity.core", "rollout_parity.kernels"))}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _modules("kernels"), ids=lambda p: p.name)
def test_kernels_import_torch_and_triton_only(path):
    bad = {n for n in _imports(path) if _top(n) not in STDLIB | {"torch", "triton", "__future__"}}
    assert not bad, f"{path.name} imports {sorted(bad)}"


def test_core_names_no_engine():
    """The seam cannot drift back: no module, function, class or constant of core is named after an engine."""
    engines = ("vllm", "sglang")
    named = [f"{p.name}: {n}" for p in _modules("core") for node in ast.walk(ast.parse(p.read_text()))
             for n in _defined(node) if any(e in n.lower() for e in engines)]
    assert named == [] and not [p for p in _modules("core") if any(e in p.stem for e in engines)], named


def _defined(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [t.id for t in targets if isinstance(t, ast.Name)]
    return []


def test_framework_api_imports_core_only():
    """The version and private-name guard, shared by the engines and the adapters, sits below both."""
    ours = {n for n in _imports(PACKAGE / "framework_api.py") if n.startswith("rollout_parity")}
    assert all(n.startswith("rollout_parity.core") for n in ours), ours


@pytest.mark.parametrize("path", _modules("engines"), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_an_engine_imports_core_the_seam_and_its_own_package_only(path):
    """No arrow up: an engine's package never reaches an adapter, the doctor or the check; its engine only inside a
    function (engines/<e>/ must import without the engine installed)."""
    rel = path.relative_to(PACKAGE / "engines").parts
    own = "rollout_parity.engines" + (f".{rel[0]}" if len(rel) > 1 else "")
    allowed = ("rollout_parity.core", "rollout_parity.framework_api", "rollout_parity.registry",
               "rollout_parity.engines.spec", own)
    ours = {n for n in _imports(path) if n.startswith("rollout_parity")}
    assert all(n.startswith(allowed) for n in ours), (path.name, sorted(ours))
    top_level = {(n.module if isinstance(n, ast.ImportFrom) else a.name) for n in ast.parse(path.read_text()).body
                 if isinstance(n, (ast.Import, ast.ImportFrom)) for a in getattr(n, "names", [])}
    assert not {n for n in top_level if n and _top(n) in FRAMEWORKS | {"sglang"}}, (path.name, top_level)


SHARED_LAYER = ("_patching", "_refusals", "_routing")


@pytest.mark.parametrize("path", [PACKAGE / "adapters" / f"{m}.py" for m in SHARED_LAYER],
                         ids=lambda p: p.name)
def test_the_shared_adapter_layer_imports_no_framework(path):
    names = _imports(path)
    assert not {n for n in names if _top(n) in FRAMEWORKS}, path.name
    assert all(n.startswith(("rollout_parity.core", "rollout_parity.framework_api", "rollout_parity.engines",
                             "rollout_parity.adapters._")) for n in names
               if n.startswith("rollout_parity")), path.name


#: Every adapter package: a framework's, or an engine's plugin that runs in the engine's processes
#: (tests/test_registry.py holds each to a unit of the registry).
ADAPTERS = sorted(p.name for p in (PACKAGE / "adapters").iterdir() if (p / "__init__.py").exists())


@pytest.mark.parametrize("adapter", sorted(ADAPTERS), ids=lambda a: f"adapters.{a}")
def test_an_adapter_imports_core_the_shared_layer_and_its_own_rooms_only(adapter):
    own = f"rollout_parity.adapters.{adapter}"
    for path in _modules(f"adapters/{adapter}"):
        for name in _imports(path):
            if not name.startswith("rollout_parity") or name == "rollout_parity":  # the root: the version, core's face
                continue
            assert name.startswith(("rollout_parity.core", "rollout_parity.framework_api", "rollout_parity.engines",
                                    "rollout_parity.adapters._", own)), (path.name, name)


@pytest.mark.parametrize("path", _modules("testing"), ids=lambda p: p.name)
def test_testing_helpers_import_core_only(path):
    ours = {n for n in _imports(path) if n.startswith("rollout_parity")}
    assert all(n.startswith(("rollout_parity.core", "rollout_parity.engines", "rollout_parity.testing"))
               or n in ("rollout_parity", "rollout_parity.registry") for n in ours), (path.name, ours)


def test_every_adapter_and_engine_file_is_a_room_of_at_most_400_lines():
    sizes = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines())
             for sub in ("adapters", "engines") for p in (PACKAGE / sub).rglob("*.py")}
    assert {k: v for k, v in sizes.items() if v > 400} == {}
