#!/usr/bin/env bash
# On a machine with a CUDA GPU and nvcc: builds pyop with `--features cuda`, runs the device tests
# (each on the CPU and on CUDA) and the GPU example, and prints a short benchmark: the scalar
# call, 16 Mi identity and 16 Mi x+1, in both modes, on the GPU. Meant to finish in 8 minutes.
#   scripts/gpu-check.sh
# Needs what scripts/dev.sh needs (Rust, Python 3) plus nvcc on PATH (or CUDA_PATH set).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
command -v nvcc >/dev/null || [ -n "${CUDA_PATH:-}" ] || { echo "gpu-check: nvcc not found (install the CUDA toolkit or set CUDA_PATH)" >&2; exit 1; }
command -v nvidia-smi >/dev/null && nvidia-smi -L
scripts/dev.sh true
PYO3_PYTHON=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)'); export PYO3_PYTHON
export VIRTUAL_ENV="$PWD/.venv" CARGO_TERM_COLOR=never
# Parallel kernel compilation for candle's CUDA kernels.
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-$(nproc)}
# CUDA 11 cannot target Hopper's sm_90a, which candle asks for on an H100/H200: build for sm_80
# there (the PTX is JIT-compiled for the GPU at load time).
nvcc_major=$( (nvcc --version 2>/dev/null || true) | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
if [ -n "$nvcc_major" ] && [ "$nvcc_major" -lt 12 ] && [ -z "${CUDA_COMPUTE_CAP:-}" ]; then
  export CUDA_COMPUTE_CAP=80
fi

echo "== build (release, --features cuda)"
cargo build --release --features cuda --tests --examples --benches

echo "== device tests (CPU and CUDA)"
cargo test --release --features cuda --test in_process -- device_tests:: tensor_tests:: grad_tests::

echo "== example"
cargo run --release --features cuda --example gpu

echo "== benchmark on the GPU (medians of 5, microseconds per call)"
# The release profile, already built above (the bench profile would build everything again).
DEVICE=cuda SIZES=1,16777216 REPS=5 cargo bench --profile release --features cuda --bench summary \
  | grep -E 'case=(numpy|tensor|candle)_(ident|plus1)_'
echo "== done in $(( $(date +%s) - start )) s"
