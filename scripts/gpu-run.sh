#!/usr/bin/env bash
# Runs the GPU kit (scripts/gpu-kit.sh) on a machine with no Rust: the device, tensor, gradient
# and DLPack tests (each device test on the CPU and on CUDA when there is one), the `gpu`
# example, and the summary bench's GPU cases. Well under 10 minutes. Writes gpu-run.log (and the
# bench's lines, bench.txt) into LOG_DIR and exits non-zero if any step failed.
#
#   scripts/gpu-run.sh LOG_DIR [KIT]      # KIT defaults to .gpu-kit/kit.tar.xz
#
# It sets up what the kit needs itself: its own Python (PYTHONHOME, LD_LIBRARY_PATH), the CUDA 13
# libraries found on the machine (the driver's libcuda; cuBLAS, cuRAND and NVRTC from the NVIDIA
# wheels of a Python environment, e.g. /opt/torch/.venv, or a CUDA installation), and that
# environment for the bodies (PYOP_PYTHON_ENV), so torch and CuPy are importable there.
set -uo pipefail
log_dir=${1:?usage: scripts/gpu-run.sh LOG_DIR [KIT]}
here=$(cd "$(dirname "$0")/.." && pwd)
kit=${2:-$here/.gpu-kit/kit.tar.xz}
mkdir -p "$log_dir"
log_dir=$(cd "$log_dir" && pwd)
exec > >(tee "$log_dir/gpu-run.log") 2>&1
start=$(date +%s)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if command -v xz >/dev/null 2>&1; then
  tar -C "$work" -xJf "$kit"
else
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$kit" "$work"
fi
echo "== kit: $(tr '\n' ' ' < "$work/KIT")"

# The kit's Python, and nothing of the machine's.
export PYTHONHOME="$work/python"
unset PYTHONPATH VIRTUAL_ENV CONDA_PREFIX
lib_path="$work/python/lib"

# The CUDA 13 libraries candle links, by SONAME.
cuda=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  cuda=1
  nvidia-smi -L
  env_root=${PYOP_GPU_ENV:-}
  [ -z "$env_root" ] && [ -d /opt/torch/.venv ] && env_root=/opt/torch/.venv
  search=()
  [ -n "$env_root" ] && search+=("$env_root")
  for d in /usr/local/cuda /usr/local/cuda-13.0 /usr/lib/x86_64-linux-gnu; do
    [ -d "$d" ] && search+=("$d")
  done
  for so in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
    found=$(find "${search[@]}" -name "$so" 2>/dev/null | head -1)
    if [ -n "$found" ]; then
      lib_path="$lib_path:$(dirname "$found")"
      echo "   $so: $found"
    else
      echo "   $so: NOT FOUND under ${search[*]} (set PYOP_GPU_ENV to an environment with the CUDA 13 wheels)"
    fi
  done
  if [ -n "$env_root" ]; then
    export PYOP_PYTHON_ENV="$env_root"
  fi
else
  echo "== no GPU here: the CPU cases only"
  export PYOP_PYTHON_ENV=none
  if [ -d "$work/cuda-stubs" ]; then
    # A CUDA kit: its binaries need the CUDA libraries to load; the kit's stubs report no device.
    echo "   (the CUDA libraries are the kit's stubs, which report no device)"
    lib_path="$lib_path:$work/cuda-stubs"
  fi
fi
export LD_LIBRARY_PATH="$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

failed=()
step() {
  local name=$1; shift
  echo
  echo "== $name"
  local t0; t0=$(date +%s)
  local out; out=$(mktemp)
  # A test filter that matches nothing passes with nothing run: that is a failure here.
  # (pipefail: the pipeline fails when the step does.)
  if timeout 240 "$@" 2>&1 | tee "$out" && ! grep -q '^running 0 tests$' "$out"; then
    echo "-- $name: passed ($(( $(date +%s) - t0 )) s)"
  else
    echo "-- $name: FAILED ($(( $(date +%s) - t0 )) s)"
    failed+=("$name")
  fi
  rm -f "$out"
}

cd "$work"
if [ "$cuda" = 1 ]; then
  step "device tests (CPU and CUDA)" ./bin/in_process device_tests:: --test-threads=1
else
  # A CUDA kit's device tests include CUDA cases, which need a GPU.
  step "device tests (CPU)" ./bin/in_process device_tests:: --test-threads=1 --skip cuda --skip two_devices
fi
step "tensor tests" ./bin/in_process tensor_tests::
step "gradient tests" ./bin/in_process grad_tests::
step "DLPack tests (NumPy; torch and CuPy on CUDA)" ./bin/in_process dlpack_tests:: --nocapture
# First calls from many threads at once (races show where there are many cores: this step's
# NumPy import race was found on a 16-core GPU machine).
step "first calls from many threads (3 fresh processes)" ./bin/in_process executor_tests::first_calls
step "gpu example" ./bin/gpu

echo
if [ "$cuda" = 1 ]; then
  echo "== benchmark on the GPU (DEVICE=cuda, medians of 5, microseconds per call)"
  bench_env=(DEVICE=cuda SIZES=1,16777216 REPS=5)
else
  echo "== benchmark on the CPU (a short run: SIZES=1, REPS=3)"
  bench_env=(SIZES=1 REPS=3 ROUNDS=1)
fi
if env "${bench_env[@]}" timeout 300 ./bin/summary --bench > "$log_dir/bench.txt"; then
  grep -E '^case=(numpy|tensor|candle|worker|dlpack)_(ident|plus1)_' "$log_dir/bench.txt"
  echo "-- benchmark: passed"
else
  tail -20 "$log_dir/bench.txt"
  echo "-- benchmark: FAILED"
  failed+=("benchmark")
fi

echo
echo "== done in $(( $(date +%s) - start )) s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all passed"
