#!/usr/bin/env bash
# Build (once) the Python 3.12 virtual environment that runs NeMo Gym's own servers for the
# live multi-turn test (integration_tests/test_nemo_gym_multiturn.py), and print its python.
#
#   bash scripts/nemo_gym_venv.sh          # builds on first use (~7 min, ~1.5 GB), then reuses
#   NEMO_GYM_VENV=/path bash scripts/...    # another location
#
# NeMo Gym needs Python >= 3.12 and pulls Ray, MLflow, W&B, ...: it cannot share the
# project's 3.11 venv, so it lives beside it, outside the checkout, and is rebuilt only when
# the pinned version or scripts/nemo_gym_constraints.txt changes (a stamp records what was
# installed). The test's
# session fixture calls this script, so `bash scripts/run.sh test` builds it when missing.
#
# nemo-gym 0.4.0 is the newest release pip can install on Python 3.12 (and 3.13.0) here:
# newer releases listed on the registry are not offered for these interpreters.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
version="${NEMO_GYM_VERSION:-0.4.0}"
venv="${NEMO_GYM_VENV:-$HOME/.cache/rollout-parity/nemo-gym-venv}"
constraints="$here/nemo_gym_constraints.txt"   # the measured stack, as run.sh pins the project's
stamp="$venv/.rollout-parity-nemo-gym-stamp"
want="nemo-gym==$version $(sha256sum "$constraints" | cut -d' ' -f1)"

find_python312() {
  if [ -n "${NEMO_GYM_PYTHON:-}" ]; then echo "$NEMO_GYM_PYTHON"; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    for v in "$(pyenv root)"/versions/3.12.*/bin/python3.12; do
      [ -x "$v" ] && { echo "$v"; return; }
    done
  fi
  command -v python3.12 || true
}

if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "$venv/bin/python"
  exit 0
fi

py312="$(find_python312)"
if [ -z "$py312" ] || [ ! -x "$py312" ]; then
  echo "[nemo_gym_venv.sh] no Python 3.12 interpreter found (pyenv 3.12.x, python3.12, or NEMO_GYM_PYTHON)" >&2
  exit 3
fi
echo "[nemo_gym_venv.sh] building $venv with nemo-gym==$version ($py312; first run: several minutes)" >&2
rm -rf "$venv"
"$py312" -m venv "$venv"
log="$(mktemp)"
if ! { "$venv/bin/python" -m pip install -q --upgrade pip &&
       "$venv/bin/python" -m pip install -q -c "$constraints" "nemo-gym==$version"; } >"$log" 2>&1; then
  cat "$log" >&2; rm -f "$log"; rm -rf "$venv"
  echo "[nemo_gym_venv.sh] pip install nemo-gym==$version failed" >&2
  exit 1
fi
rm -f "$log"
# The check the test relies on: NeMo Gym's own vllm_model server imports.
"$venv/bin/python" -c "import nemo_gym, responses_api_models.vllm_model.app" >&2
echo "$want" > "$stamp"
echo "$venv/bin/python"
