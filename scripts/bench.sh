#!/usr/bin/env bash
# Measures pyop and its peers in one run on this machine and prints the README's results table.
#   scripts/bench.sh            # SIZES=1,1048576 REPS=3 to shorten
# pyop: `cargo bench --bench summary`; peers: ../shared/bench/peers.py (TensorFlow and JAX, in a
# venv of their own, .venv-peers, made on first use). Medians of REPS runs; ratios in the table.
set -euo pipefail
cd "$(dirname "$0")/.."
peers=${PEERS:-../shared/bench/peers.py}
[ -f "$peers" ] || { echo "no $peers: pass PEERS=path/to/peers.py" >&2; exit 1; }
if ! .venv-peers/bin/python -c 'import numpy, tensorflow, jax' 2>/dev/null; then
  echo "setting up .venv-peers with tensorflow-cpu and jax (once)..." >&2
  python3 -m venv .venv-peers
  .venv-peers/bin/python -m pip install --disable-pip-version-check --quiet numpy tensorflow-cpu jax
fi
scripts/dev.sh true 2>/dev/null || true   # makes .venv with NumPy if missing
out=$(mktemp -d)
PYO3_PYTHON=$(python3 -c 'import sys; print(sys.executable)') VIRTUAL_ENV="$PWD/.venv" \
  cargo bench --bench summary 2>/dev/null | grep '^case=' | tee "$out/pyop.txt"
.venv-peers/bin/python "$peers" 2>/dev/null | tee "$out/peers.txt"
python3 scripts/bench_table.py "$out/pyop.txt" "$out/peers.txt"
