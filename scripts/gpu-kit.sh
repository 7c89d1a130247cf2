#!/usr/bin/env bash
# Builds the GPU kit: release binaries of the GPU-relevant tests, the `gpu` example and the summary
# bench, built here with `--features cuda` for sm_90 (an H100/H200), packed with a trimmed copy of
# the Python they were built against and NumPy, into one file under 64 MiB that travels to a GPU
# machine with no Rust and no network, where scripts/gpu-run.sh runs it.
#
#   scripts/gpu-kit.sh            # the CUDA kit: .gpu-kit/kit.tar.xz
#   scripts/gpu-kit.sh --cpu      # the same kit without CUDA (no nvcc needed): what CI builds
#   scripts/gpu-kit.sh --verify   # then unpack it in a temp folder and run it here, with a clean
#                                 # environment (CPU cases), as scripts/gpu-run.sh does there
#
# The CUDA toolkit comes from PyPI wheels pinned to 13.0 (the GPU machine's driver is CUDA 13.0;
# PTX from a newer nvcc would be refused by its JIT), installed into .gpu-kit/cuda once. candle
# links cuBLAS, cuRAND, NVRTC and the driver (cudarc's dynamic linking): the binaries are linked
# here against stub libraries with those libraries' SONAMEs, made from cudarc's own bindings,
# and find the real ones at run time (the driver's libcuda, the CUDA 13 wheels torch brings).
# The interpreter is Python 3.12 (what the GPU machine runs): PYTHON312, else pyenv's 3.12, else
# python3.12 on PATH; the CPU kit falls back to python3.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cuda=1
verify=0
for arg in "$@"; do
  case "$arg" in
    --cpu) cuda=0 ;;
    --verify) verify=1 ;;
    *) echo "usage: scripts/gpu-kit.sh [--cpu] [--verify]" >&2; exit 2 ;;
  esac
done
kit_dir=.gpu-kit
mkdir -p "$kit_dir"
limit=$((64 * 1024 * 1024))

# --- the interpreter -------------------------------------------------------------------------
python=${PYTHON312:-}
if [ -z "$python" ] && command -v pyenv >/dev/null 2>&1; then
  prefix=$(pyenv prefix 3.12 2>/dev/null | head -1 || true)
  [ -n "$prefix" ] && [ -x "$prefix/bin/python3.12" ] && python="$prefix/bin/python3.12"
fi
[ -z "$python" ] && command -v python3.12 >/dev/null 2>&1 && python=$(command -v python3.12)
if [ -z "$python" ]; then
  if [ "$cuda" = 1 ]; then
    echo "gpu-kit: the GPU machine runs Python 3.12; set PYTHON312 to a python3.12 built with --enable-shared" >&2
    exit 1
  fi
  python=$(command -v python3)
fi
python=$("$python" -c 'import sys; print(sys.executable)')
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
echo "gpu-kit: Python $pyver ($python), CUDA: $([ "$cuda" = 1 ] && echo yes || echo no)"

# --- the CUDA toolkit and the link stubs ------------------------------------------------------
features=()
# Without CUDA the kit is the workspace's own release build (the one `dev.sh test`'s release
# hardening run makes): its dependencies are built once, not in a tree of their own.
target_dir=${CARGO_TARGET_DIR:-target}
rustflags=${RUSTFLAGS:-}
if [ "$cuda" = 1 ]; then
  features=(--features cuda)
  target_dir=target/gpu-kit
  toolkit="$root/$kit_dir/cuda"
  if [ ! -x "$toolkit/nvidia/cu13/bin/nvcc" ]; then
    echo "gpu-kit: installing the CUDA 13.0 toolkit wheels into $toolkit (once)"
    rm -rf "$toolkit"
    # One `pip install --target`: a second one into the same folder would replace nvidia/.
    "$python" -m pip install --disable-pip-version-check --quiet --target "$toolkit" \
      nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 \
      nvidia-cuda-crt==13.0.88 'nvidia-cuda-cccl==13.0.*'
  fi
  export CUDA_ROOT="$toolkit/nvidia/cu13" CUDA_PATH="$toolkit/nvidia/cu13"
  export PATH="$CUDA_ROOT/bin:$PATH" CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
  nvcc --version | tail -2
  stubs="$root/$kit_dir/stubs"
  cudarc=$(cargo metadata --format-version 1 --features cuda 2>/dev/null | "$python" -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "cudarc":
        print(p["manifest_path"].rsplit("/", 1)[0]); break')
  "$python" scripts/cuda_stubs.py "$cudarc" "$stubs"
  # candle's MoE kernels are a static library that calls the CUDA runtime: link the real
  # libcudart from the toolkit wheel (its SONAME, libcudart.so.13, is what torch's wheels bring).
  cudart=$(ls "$CUDA_ROOT"/lib/libcudart.so.* | head -1)
  ln -sf "$cudart" "$stubs/libcudart.so"
  rustflags="$rustflags -L native=$stubs"
fi

# --- build ----------------------------------------------------------------------------------------
export PYO3_PYTHON="$python" CARGO_TERM_COLOR=never
# The CUDA kit builds in a tree of its own, apart from any venv. Without CUDA it shares the
# workspace's release tree, and the venv stays as `dev.sh` set it: the facade's build script
# reads it, and a change would rebuild the facade and all that uses it.
if [ "$cuda" = 1 ]; then unset VIRTUAL_ENV; fi
tests=(in_process)  # its device_tests, tensor_tests, grad_tests and dlpack_tests modules run there
build_args=(--release "${features[@]}" --example gpu --bench summary)
for t in "${tests[@]}"; do build_args+=(--test "$t"); done
echo "gpu-kit: building ${tests[*]}, the gpu example and the summary bench (release)"
RUSTFLAGS="$rustflags" CARGO_TARGET_DIR="$target_dir" \
  cargo build "${build_args[@]}" --message-format=json-render-diagnostics > "$kit_dir/build.json"

# --- assemble ------------------------------------------------------------------------------------
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin"
"$python" - "$kit_dir/build.json" "$stage/bin" <<'EOF'
import json, shutil, sys, os
wanted = {"in_process", "gpu", "summary"}
for line in open(sys.argv[1]):
    msg = json.loads(line)
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    name = msg["target"]["name"]
    if name in wanted:
        shutil.copy2(msg["executable"], os.path.join(sys.argv[2], name))
        wanted.discard(name)
if wanted:
    sys.exit("gpu-kit: not built: %s" % ", ".join(sorted(wanted)))
EOF
strip "$stage"/bin/*
if [ "$cuda" = 1 ]; then
  # For a machine without a GPU (this one, when verifying): stubs that report no device, and the
  # CUDA runtime, under the names the loader asks for.
  mkdir -p "$stage/cuda-stubs"
  for f in "$stubs"/lib*.so.*; do cp -L "$f" "$stage/cuda-stubs/"; done
  cp -L "$stubs/libcudart.so" "$stage/cuda-stubs/$(basename "$cudart")"
fi
"$python" scripts/pack_python.py "$stage/python" "$root/.venv/bin/python"
printf '%s\n' "python $pyver" "cuda $cuda" "commit $(git rev-parse --short HEAD 2>/dev/null || echo none)" \
  > "$stage/KIT"
# xz -3 on every CPU: 6 s here against 27 s for the default -6 on one, for 15 MiB instead of 13.
tar -C "$stage" -I 'xz -T0 -3' -cf "$kit_dir/kit.tar.xz.new" .
mv "$kit_dir/kit.tar.xz.new" "$kit_dir/kit.tar.xz"
size=$(stat -c %s "$kit_dir/kit.tar.xz")
echo "gpu-kit: $kit_dir/kit.tar.xz, $((size / 1024 / 1024)) MiB ($size bytes; the limit is 64 MiB)"
du -sh "$stage"/bin/* "$stage/python" | sed 's/^/  unpacked: /'
if [ "$size" -ge "$limit" ]; then
  echo "gpu-kit: the kit is over 64 MiB" >&2
  exit 1
fi

# --- verify here -----------------------------------------------------------------------------------
if [ "$verify" = 1 ]; then
  logs=$(mktemp -d)
  echo "gpu-kit: running the kit from a temp folder with a clean environment (logs in $logs)"
  env -i HOME="$HOME" PATH=/usr/local/bin:/usr/bin:/bin TMPDIR="${TMPDIR:-/tmp}" \
    bash scripts/gpu-run.sh "$logs" "$root/$kit_dir/kit.tar.xz"
fi
