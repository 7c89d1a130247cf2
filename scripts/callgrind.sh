#!/usr/bin/env bash
# Instructions per call of summary-bench cases, counted by callgrind (exact, unlike time on a
# shared machine): each case runs twice under valgrind, with CALLS=1000 and CALLS=3000 (REPS=1:
# one untimed and one timed run of CALLS calls each), and the difference ÷ 4,000 is printed
# (BLAS threads off and a fixed hash seed: their spinning and hashing would vary between runs).
#   scripts/callgrind.sh                       # the floor and the scalar cases
#   scripts/callgrind.sh numpy_ident_1 ...     # named cases
#   scripts/callgrind.sh --profile CASE [CALLS] # where one case's calls spend their instructions:
#                                              # inclusive and exclusive per call, collected inside
#                                              # the call only, functions above 1 %
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "needs valgrind (apt install valgrind)" >&2; exit 1; }
export PYO3_PYTHON=${PYO3_PYTHON:-$PWD/.venv/bin/python} VIRTUAL_ENV=${VIRTUAL_ENV:-$PWD/.venv}
bin=$(cargo bench --bench summary --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "summary" and m.get("executable"):
        print(m["executable"])')
quiet=(OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 PYTHONHASHSEED=0 SIZES=1 REPS=1 ROUNDS=1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
total() { # case calls -> instructions of the whole run
  env "${quiet[@]}" CASES="$1\$" CALLS="$2" valgrind --tool=callgrind \
    --callgrind-out-file="$tmp/out" "$bin" --bench >/dev/null 2>"$tmp/log"
  sed -n 's/^summary: //p' "$tmp/out"
}
if [ "${1:-}" = --profile ]; then
  case=${2:?a case name}
  calls=${3:-5000}
  env "${quiet[@]}" CASES="$case\$" CALLS="$calls" valgrind --tool=callgrind \
    --toggle-collect='*StaticOp*__call*' --callgrind-out-file="$tmp/out" "$bin" --bench \
    >/dev/null 2>&1
  for inclusive in yes no; do
    echo "== per call, inclusive=$inclusive"
    callgrind_annotate --inclusive=$inclusive --threshold=99 "$tmp/out" 2>/dev/null |
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
  exit 0
fi
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(floor_attach_call_1 tensor_ident_1 numpy_ident_1)
for case in "${cases[@]}"; do
  a=$(total "$case" 1000)
  b=$(total "$case" 3000)
  echo "case=$case instructions_per_call=$(((b - a) / 4000))"
done
