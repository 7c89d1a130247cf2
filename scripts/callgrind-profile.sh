#!/usr/bin/env bash
# Where one case's calls spend their instructions (callgrind, collecting inside the call only):
# inclusive and exclusive instructions per call of the functions above 1 %.
#   scripts/callgrind-profile.sh tensor_ident_1 [CALLS]
set -euo pipefail
cd "$(dirname "$0")/.."
case=${1:?a case name}
calls=${2:-5000}
export PYO3_PYTHON=${PYO3_PYTHON:-$PWD/.venv/bin/python} VIRTUAL_ENV=${VIRTUAL_ENV:-$PWD/.venv}
bin=$(cargo bench --bench summary --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "summary" and m.get("executable"):
        print(m["executable"])')
out=$(mktemp)
trap 'rm -f "$out"' EXIT
OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 PYTHONHASHSEED=0 CASES="$case\$" SIZES=1 REPS=1 ROUNDS=1 \
  CALLS=$calls valgrind --tool=callgrind --toggle-collect='*StaticOp*__call*' \
  --callgrind-out-file="$out" "$bin" --bench >/dev/null 2>&1
for inclusive in yes no; do
  echo "== per call, inclusive=$inclusive"
  callgrind_annotate --inclusive=$inclusive --threshold=99 "$out" 2>/dev/null |
    python3 -c '
import re, sys
n = 2 * int(sys.argv[1])
for line in sys.stdin:
    m = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(?:\*\s+)?(\S.*)$", line)
    if not m:
        continue
    ir = int(m.group(1).replace(",", "")) / n
    name = re.sub(r"\s*\[.*\]$", "", m.group(2))
    name = re.sub(r"^(/[^:]*/)?[^:/]*\.(rs|c|h):", "", name)
    if ir >= 10:
        print(f"{ir:8.0f}  {name[:140]}")' "$calls" 2>/dev/null | awk "!seen[\$0]++" | head -"${TOP:-60}" || true
done
