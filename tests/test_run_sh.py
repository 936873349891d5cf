"""``scripts/run.sh``: one shared stack, each checkout running its own code (issue 32, item 6).

Two copies of this checkout (A and B, as two clones on one machine) run ``scripts/run.sh`` against
one stack. The stack here is a small venv that reaches the packages of the interpreter running
this test through a ``.pth`` file (so nothing is installed, and the stack the suite runs in is only
read; it may itself hold a rollout-parity install from another checkout, the case the layer must
win against). Its stamp matches the copies' ``pyproject.toml`` and constraints, so run.sh installs
nothing into it and makes only each checkout's layer (``.venv``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import json, subprocess, sys, importlib.metadata as md, rollout_parity\n"
         "child = subprocess.run([sys.executable, '-c', 'import rollout_parity; print(rollout_parity.__file__)'],\n"
         "                       capture_output=True, text=True, check=True).stdout.strip()\n"
         "eps = [e for e in md.entry_points(group='verl.plugins') if e.value.startswith('rollout_parity')]\n"
         "print(json.dumps({'module': rollout_parity.__file__, 'child': child, 'executable': sys.executable,\n"
         "                  'plugin_dists': [str(e.dist._path) for e in eps],\n"
         "                  'dist': str(md.distribution('rollout-parity')._path)}))\n")


def _copy_checkout(dest: Path) -> Path:
    """The checkout's tracked and untracked-but-not-ignored files, as a fresh clone would have them."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    dest.mkdir(parents=True)
    archive = dest.parent / f"{dest.name}.tar"
    with tarfile.open(archive, "w") as tar:
        for name in filter(None, files):
            if (ROOT / name).exists() or (ROOT / name).is_symlink():
                tar.add(ROOT / name, arcname=name, recursive=False)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="tar")
    archive.unlink()
    return dest


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    root = tmp_path_factory.mktemp("run_sh")
    a, b = _copy_checkout(root / "A"), _copy_checkout(root / "B")
    stack = root / "stack"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(stack)], check=True)
    site = subprocess.run([str(stack / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages")] or [sysconfig.get_paths()["purelib"]]
    Path(site, "suite_stack.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in ours))
    want = hashlib.sha256((a / "pyproject.toml").read_bytes() + (a / "constraints" / "cpu-stack.txt").read_bytes())
    (stack / ".rollout-parity-stamp").write_text(want.hexdigest() + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ROLLOUT_PARITY_CHECKOUT_VENV")}
    env["ROLLOUT_PARITY_VENV"] = str(stack)
    return a, b, stack, env


def run_sh(checkout: Path, env: dict, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(checkout / "scripts" / "run.sh"), *argv], cwd="/", env=env,
                          capture_output=True, text=True, timeout=600)


def probe(checkout: Path, env: dict) -> dict:
    import json

    proc = run_sh(checkout, env, "python", "-c", PROBE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_each_checkout_runs_its_own_code_whichever_ran_last(machine):
    a, b, stack, env = machine
    first = probe(a, env)
    assert "this checkout's environment" in run_sh(b, env, "python", "-c", "pass").stderr  # B's layer made now
    second, again = probe(b, env), probe(a, env)
    for checkout, got in ((a, first), (b, second), (a, again)):
        layer = checkout / ".venv"
        assert got["module"] == str(checkout / "rollout_parity" / "__init__.py")
        assert got["child"] == got["module"]  # Ray workers and vLLM's subprocesses start sys.executable
        assert got["executable"] == str(layer / "bin" / "python")
        assert got["plugin_dists"] == [got["dist"]] and got["dist"].startswith(str(layer))  # verl.plugins
    # the console script runs the checkout's interpreter; the stack holds no rollout-parity of run.sh's
    assert (a / ".venv" / "bin" / "rollout-parity").read_text().splitlines()[0] == f"#!{a}/.venv/bin/python"
    assert not list(stack.glob("lib/python*/site-packages/*rollout_parity*"))


def test_run_sh_check_and_launch_run_the_checkouts_command(machine):
    a, _, _, env = machine
    check = run_sh(a, env, "check", "--help")
    assert check.returncode == 0 and "usage: rollout-parity check" in check.stdout
    launch = run_sh(a, env, "launch", "--help")
    assert launch.returncode == 0 and "usage: rollout-parity launch" in launch.stdout
    bad = run_sh(a, env, "nothing")
    assert bad.returncode == 2 and "{doctor|check|launch|test|python|freeze}" in bad.stderr


def test_a_venv_of_ones_own_is_not_taken_over(machine, tmp_path):
    a, _, _, env = machine
    theirs = tmp_path / "venv"
    theirs.mkdir()
    (theirs / "keep").write_text("mine")
    proc = run_sh(a, {**env, "ROLLOUT_PARITY_CHECKOUT_VENV": str(theirs)}, "python", "-c", "pass")
    assert proc.returncode == 1 and "is not rollout-parity's checkout environment" in proc.stderr
    assert (theirs / "keep").read_text() == "mine"
