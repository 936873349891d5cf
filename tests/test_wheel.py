"""The wheel users install holds what the package loads, declares what pyproject.toml declares, and nothing else.

There is no release on PyPI: users build or install from a checkout (docs/install.md). The wheel is built here
offline, as ``pip wheel --no-deps --no-build-isolation --no-index`` does it, from a copy of the checkout's files as
git sees them (tracked and untracked, not ignored), and read back as a zip. The references are independent of the
build: the package tree itself (every file under ``rollout_parity/``, the ``configs`` link followed), the files the
code opens relative to the package (``configs_dir()``, ``EXPECTED_PATH``), the entry-point groups verl and vLLM read
(their own source), and pyproject.toml's extras. ``bash scripts/install_check.sh`` installs the wheel and the sdist
into verl's and TRL's stacks (it needs the network).
"""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
# Directories a checkout has that are not the package (git-ignored ones never reach the copy).
_SKIP_DIRS = {".git", ".venv", "__pycache__", "build", "dist", ".pytest_cache", ".hypothesis", "doctor-out"}
# Where the package opens a file relative to itself, and what it opens there: a new site fails
# test_every_package_relative_load_is_known until its files are listed here and shipped.
_FILE_RE = re.compile(r"Path\(__file__\)|os\.path\.dirname\((os\.path\.\w+\()?__file__|importlib\.resources|"
                      r"pkgutil\.get_data")


def _loaded_by_the_code() -> dict[str, list[str]]:
    """Package-relative paths each loading module opens, read from the code's own constants."""
    import rollout_parity
    from rollout_parity.check.shared_batch import EXPECTED_PATH, PRESETS
    from rollout_parity.core.config import configs_dir

    package = Path(rollout_parity.__file__).resolve().parent
    configs = configs_dir() if not os.environ.get("ROLLOUT_PARITY_CONFIGS") else package / "configs"
    yamls = sorted(p for p in Path(configs).rglob("*.yaml"))
    presets = [Path(configs) / "presets" / f"{name}.yaml" for name in PRESETS]
    assert yamls and all(p.is_file() for p in presets), f"the checkout's {configs} lacks a preset"
    rel = lambda p: "rollout_parity/configs/" + Path(p).relative_to(configs).as_posix()  # noqa: E731
    return {
        "rollout_parity/core/config.py": sorted({rel(p) for p in (*yamls, *presets)}),
        "rollout_parity/check/shared_batch.py": [
            "rollout_parity/" + EXPECTED_PATH.resolve().relative_to(package).as_posix()],
    }


def _source_files(root: Path) -> list[str]:
    """The checkout's files as git sees them (tracked and untracked, not ignored); a walk where git cannot say."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True,
                             check=True, timeout=60).stdout.decode()
        return [f for f in out.split("\0") if f and os.path.lexists(root / f)]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for top, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
            links = [d for d in dirs if os.path.islink(os.path.join(top, d))]  # rollout_parity/configs: kept a link
            dirs[:] = [d for d in dirs if d not in links]
            files += [os.path.relpath(os.path.join(top, n), root) for n in (*names, *links)]
        return files


def _copy_tree(root: Path, dst: Path) -> None:
    for rel in _source_files(root):
        src, out = root / rel, dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), out)
        elif src.is_file():
            shutil.copy2(src, out)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, zipfile.ZipFile]:
    """The wheel built from a copy of the checkout (the checkout itself gets no build/ or egg-info)."""
    from rollout_parity.testing.stack import missing

    backend = PYPROJECT["build-system"]
    setuptools_req = next(Requirement(r) for r in backend["requires"] if Requirement(r).name == "setuptools")
    if importlib.util.find_spec("pip") is None:
        missing("pip", "building the wheel offline needs pip in this interpreter")
    try:  # read, not imported: importing setuptools after distutils trips its distutils shim
        have = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        missing("setuptools", f"the build backend ({setuptools_req}) is not installed here")
    if not setuptools_req.specifier.contains(Version(have)):
        missing("setuptools", f"{have} installed; the build backend needs {setuptools_req}")
    work = tmp_path_factory.mktemp("wheel")
    src, out = work / "src", work / "dist"
    _copy_tree(ROOT, src)
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(out), str(src)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as zf:
        yield src, zf


def _names(zf: zipfile.ZipFile) -> set[str]:
    return {n for n in zf.namelist() if not n.endswith("/")}


def _dist_info(zf: zipfile.ZipFile) -> str:
    return f"rollout_parity-{PROJECT['version']}.dist-info/"


def _metadata(zf: zipfile.ZipFile):
    return Parser().parsestr(zf.read(_dist_info(zf) + "METADATA").decode())


def test_the_wheel_is_named_and_versioned_as_pyproject_and_the_module_say(built):
    import rollout_parity

    _, zf = built
    meta = _metadata(zf)
    assert Path(zf.filename).name == f"rollout_parity-{PROJECT['version']}-py3-none-any.whl"
    assert meta["Name"] == PROJECT["name"] and meta["Version"] == PROJECT["version"] == rollout_parity.__version__
    assert meta["Requires-Python"] == PROJECT["requires-python"]
    assert zf.read(_dist_info(zf) + "top_level.txt").decode().split() == ["rollout_parity"]


def test_every_file_of_the_package_tree_is_in_the_wheel(built):
    """Every module (a subpackage the finder missed shows here) and every data file under ``rollout_parity/``,
    the ``configs`` link to the top-level ``configs/`` followed."""
    src, zf = built
    tree = set()
    for top, dirs, names in os.walk(src / "rollout_parity", followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        tree |= {Path(top, n).relative_to(src).as_posix() for n in names if not n.endswith((".pyc", ".pyo"))}
    assert "rollout_parity/py.typed" in tree
    missing = sorted(tree - _names(zf))
    assert not missing, f"in the package tree but not in the wheel (pyproject's package-data?): {missing}"


def test_the_files_the_code_opens_relative_to_the_package_are_in_the_wheel(built):
    _, zf = built
    wanted = [f for files in _loaded_by_the_code().values() for f in files] + ["rollout_parity/py.typed"]
    missing = [f for f in wanted if f not in _names(zf)]
    assert not missing, f"the code opens these but the wheel lacks them (pyproject's package-data): {missing}"
    assert {f for f in wanted if "/presets/" in f} <= _names(zf)


def test_every_package_relative_load_is_known():
    """A module that opens a file beside itself (``Path(__file__)``, ``importlib.resources``...) is listed in
    ``_loaded_by_the_code`` with its files, so the two tests above check them."""
    sites = set()
    for path in (ROOT / "rollout_parity").rglob("*.py"):
        text = path.read_text()
        for line in text.splitlines():
            # A frame's file compared with ours, or another package's __file__ (verl's config dir): nothing of ours.
            if _FILE_RE.search(line) and "name == __file__" not in line and ".__file__" not in line:
                sites.add(path.relative_to(ROOT).as_posix())
    assert sites == set(_loaded_by_the_code()), (
        f"modules opening package files: {sorted(sites)}; listed: {sorted(_loaded_by_the_code())}")


def test_the_wheel_ships_no_test_docs_or_script_file(built):
    _, zf = built
    outside = sorted(n for n in _names(zf) if not n.startswith(("rollout_parity/", _dist_info(zf))))
    assert not outside, f"files outside the package: {outside}"
    top_dirs = {p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "rollout_parity"}
    stray = sorted(n for n in _names(zf) if n.split("/")[1] in top_dirs - {"configs"} or
                   re.search(r"(^|/)(conftest\.py|test_[^/]*\.py)$", n) or n.endswith(".md"))
    assert not stray, f"test, docs or script files in the wheel: {stray}"


def _requirements(lines: list[str]) -> set[tuple]:
    """Comparable requirements: canonical name, extras, the specifier set, the marker without ``extra``."""
    out = set()
    for line in lines:
        req = Requirement(line)
        marker = re.sub(r'\s*and\s*extra == "[^"]+"|extra == "[^"]+"\s*(and\s*)?', "", str(req.marker or ""))
        out.add((canonicalize_name(req.name), tuple(sorted(req.extras)), str(req.specifier), marker.strip()))
    return out


def test_the_wheels_dependencies_and_extras_are_pyprojects(built):
    _, zf = built
    meta = _metadata(zf)
    requires = meta.get_all("Requires-Dist") or []
    by_extra: dict[str, list[str]] = {}
    base = []
    for line in requires:
        found = re.search(r'extra == "([^"]+)"', line)
        (by_extra.setdefault(found.group(1), []) if found else base).append(line)
    assert _requirements(base) == _requirements(PROJECT["dependencies"])
    ours = PROJECT["optional-dependencies"]
    assert set(meta.get_all("Provides-Extra")) == {canonicalize_name(e) for e in ours}
    for extra, lines in ours.items():
        assert _requirements(by_extra.get(canonicalize_name(extra), [])) == _requirements(lines), extra


def _entry_points(zf: zipfile.ZipFile) -> dict[str, dict[str, str]]:
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str
    parser.read_string(zf.read(_dist_info(zf) + "entry_points.txt").decode())
    return {group: dict(parser[group]) for group in parser.sections()}


def _group_read_by(package: str, file: str, pattern: str) -> str | None:
    """The entry-point group a framework's own source reads, found without importing it (a top-level spec only:
    finding a submodule's would import the package)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or not (Path(spec.origin).parent / file).is_file():
        return None
    found = re.search(pattern, (Path(spec.origin).parent / file).read_text())
    return found.group(1) if found else None


def test_the_entry_points_are_pyprojects_in_the_groups_verl_and_vllm_read_and_their_targets_exist(built):
    _, zf = built
    eps = _entry_points(zf)
    declared = {"console_scripts": PROJECT["scripts"], **PROJECT["entry-points"]}
    assert eps == declared
    # The groups are the ones the frameworks' own loaders read (verl/__init__.py, vllm/plugins/__init__.py).
    verl_group = _group_read_by("verl", "__init__.py", r'entry_points\(group="([^"]+)"\)') or "verl.plugins"
    vllm_group = _group_read_by("vllm", "plugins/__init__.py",
                                r'DEFAULT_PLUGINS_GROUP\s*=\s*"([^"]+)"') or "vllm.general_plugins"
    assert "rollout_parity" in eps[verl_group] and "rollout_parity" in eps[vllm_group]
    assert "rollout-parity" in eps["console_scripts"]
    names = _names(zf)
    for group, entries in eps.items():
        for name, value in entries.items():
            module, _, attr = value.strip().partition(":")
            base = module.replace(".", "/")
            path = next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in names), None)
            assert path is not None, f"{group} {name} = {value}: {module} is not in the wheel"
            if attr:
                tree = ast.parse(zf.read(path).decode())
                defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                assert attr in defined, f"{group} {name} = {value}: {path} defines no {attr}"
