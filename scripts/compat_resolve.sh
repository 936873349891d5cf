#!/usr/bin/env bash
# pip's own resolver on our extras beside each framework's vLLM pins (called as `bash scripts/compat.sh resolve`):
#
#   rollout-parity[verl,vllm]  with  verl[vllm]==0.9.1   (vllm==0.24.0, torch==2.11.0, transformers==5.9.0)
#   rollout-parity[trl,vllm]   with  trl[vllm]==1.16.0   (vllm>=0.22.0,<=0.31.0)
#   rollout-parity[vllm]       with  vllm==0.20.0 / vllm==0.25.1   (NeMo RL v0.7.0's / its newest snapshot's pins;
#                                                                  NeMo RL itself is not on PyPI)
#
# `pip install --dry-run --ignore-installed --report` resolves the real GPU packages as a user's pip would (it
# downloads what it must read, installs nothing), in a small venv of its own. One dated line per pair goes to
# compat-results.txt with the versions pip chose. Needs the network; the suite's offline counterpart is
# tests/test_extras_coinstall.py.
set -uo pipefail
{
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="${ROLLOUT_PARITY_COMPAT_DIR:-$HOME/.cache/rollout-parity/compat}"
results="${ROLLOUT_PARITY_COMPAT_RESULTS:-$here/compat-results.txt}"
venv="$root/resolver"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" && "$venv/bin/python" -m pip install -q --upgrade pip || exit 1
fi
status=0
for pair in "verl,vllm|verl[vllm]==0.9.1" "trl,vllm|trl[vllm]==1.16.0" "vllm|vllm==0.20.0" "vllm|vllm==0.25.1"; do
  extras="${pair%%|*}" theirs="${pair#*|}"
  tag="${extras/,/-}-${theirs//[^a-z0-9.]/}"
  report="$venv/report-$tag.json" log="$venv/resolve-$tag.log"
  started=$(date +%s)
  "$venv/bin/python" -m pip install --dry-run --ignore-installed --quiet --report "$report" \
    "rollout-parity[$extras] @ file://$here" "$theirs" >"$log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    chosen="$("$venv/bin/python" - "$report" <<'EOF'
import json, sys
items = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
print(", ".join(f"{n} {items[n]}" for n in ("vllm", "torch", "transformers", "verl", "trl") if n in items))
EOF
)"
    line="$(date -u +%F) resolve rollout-parity[$extras] + $theirs: OK ($chosen); $(( $(date +%s) - started ))s"
  else
    line="$(date -u +%F) resolve rollout-parity[$extras] + $theirs: FAILED ($(grep -m1 -E 'ERROR|conflict' "$log" | cut -c1-200); see $log)"
    status=1
  fi
  echo "$line" | tee -a "$results"
done
exit $status
}
