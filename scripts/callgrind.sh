#!/usr/bin/env bash
# Instructions per call of summary-bench cases, counted by callgrind (exact, unlike time on a
# shared machine): each case runs twice under valgrind, with CALLS=1000 and CALLS=3000 (REPS=1:
# one untimed and one timed run of CALLS calls each), and the difference ÷ 4,000 is printed
# (BLAS threads off and a fixed hash seed: their spinning and hashing would vary between runs).
#   scripts/callgrind.sh                       # the floor and the scalar cases
#   scripts/callgrind.sh numpy_ident_1 ...     # named cases
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "needs valgrind (apt install valgrind)" >&2; exit 1; }
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(floor_attach_call_1 tensor_ident_1 numpy_ident_1)
export PYO3_PYTHON=${PYO3_PYTHON:-$PWD/.venv/bin/python} VIRTUAL_ENV=${VIRTUAL_ENV:-$PWD/.venv}
bin=$(cargo bench --bench summary --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "summary" and m.get("executable"):
        print(m["executable"])')
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
total() { # case calls -> instructions of the whole run
  OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 PYTHONHASHSEED=0 CASES="$1\$" SIZES=1 REPS=1 ROUNDS=1 CALLS=$2 valgrind --tool=callgrind \
    --callgrind-out-file="$tmp/out" "$bin" --bench >/dev/null 2>"$tmp/log"
  sed -n 's/^summary: //p' "$tmp/out"
}
for case in "${cases[@]}"; do
  a=$(total "$case" 1000)
  b=$(total "$case" 3000)
  echo "case=$case instructions_per_call=$(((b - a) / 4000))"
done
