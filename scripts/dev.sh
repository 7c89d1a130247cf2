#!/usr/bin/env bash
# The README's two commands:
#   scripts/dev.sh example   runs the main example (examples/log_huber.rs)
#   scripts/dev.sh test      runs every test, the examples, clippy and rustfmt (what CI runs)
# Both first make sure the project-local venv `.venv` exists and has NumPy, and point the build
# and the embedded interpreter at it; nothing has to be set up by hand.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
command -v "$python" >/dev/null || { echo "pyop needs Python 3 (python3 on PATH, or PYTHON=...)" >&2; exit 1; }

if ! .venv/bin/python -c 'import numpy' 2>/dev/null; then
  echo "setting up .venv with NumPy (once)..." >&2
  "$python" -m venv .venv
  .venv/bin/python -m pip install --disable-pip-version-check --quiet numpy
fi

# pyo3 links the interpreter that made the venv; the venv's packages are found through
# VIRTUAL_ENV (an embedded interpreter does not honour it by itself: pyop adds its site-packages).
PYO3_PYTHON=$("$python" -c 'import sys; print(sys.executable)')
export PYO3_PYTHON
export VIRTUAL_ENV="$PWD/.venv"
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}

case "${1:-}" in
  example)
    exec cargo run --example log_huber
    ;;
  test)
    cargo fmt --all -- --check
    cargo build --examples            # tests/examples_tests.rs runs them
    cargo test --workspace --all-targets
    cargo test --workspace --doc
    cargo clippy --workspace --all-targets -- -D warnings
    ;;
  true)
    ;;  # only the set-up above (used by scripts/bench.sh)
  *)
    echo "usage: scripts/dev.sh example|test" >&2
    exit 2
    ;;
esac
