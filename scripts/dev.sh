#!/usr/bin/env bash
# The README's two commands:
#   scripts/dev.sh example   runs the main example (examples/log_huber.rs)
#   scripts/dev.sh test      runs every test, the examples, clippy, rustfmt, ruff, the embedded
#                            Python's pytest suite and mypy (what CI runs), and prints each
#                            step's time
#   scripts/dev.sh test --quick   the edit loop: fmt, ruff, pytest, clippy and the in-process tests
#   scripts/dev.sh mutants [FILE...]   mutation testing of FILEs, or of what this change touches
# Both first make sure the project-local venv `.venv` exists and has NumPy, and point the build
# and the embedded interpreter at it; nothing has to be set up by hand.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
command -v "$python" >/dev/null || { echo "pyop needs Python 3 (python3 on PATH, or PYTHON=...)" >&2; exit 1; }
# pyo3 embeds the interpreter: it needs Python built as a shared library.
if [ "$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("Py_ENABLE_SHARED") or 0)')" != 1 ]; then
  echo "pyop needs a Python built with --enable-shared (libpython3.X.so): on Debian/Ubuntu install" >&2
  echo "python3-dev; with pyenv, PYTHON_CONFIGURE_OPTS=--enable-shared pyenv install <version>" >&2
  exit 1
fi
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')

# The venv must belong to this Python (its site-packages is lib/pythonX.Y) and have NumPy.
if ! { [ -x .venv/bin/python ] \
       && [ "$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "$version" ] \
       && .venv/bin/python -c 'import numpy' 2>/dev/null; }; then
  echo "setting up .venv (Python $version) with NumPy (once)..." >&2
  "$python" -m venv --clear .venv || {
    echo "cannot make a venv: on Debian/Ubuntu install python3-venv" >&2
    exit 1
  }
  .venv/bin/python -m pip install --disable-pip-version-check --quiet 'numpy>=1.22,<3'
fi

# The NumPy wheel of the venv, kept for tests/user_crate.rs: the README's crate installs it from
# here (no network inside `cargo test`).
if ! ls target/wheels/numpy-*-cp"${version/./}"-*.whl >/dev/null 2>&1; then
  .venv/bin/python -m pip download --disable-pip-version-check --quiet --only-binary=:all: \
    --no-deps -d target/wheels "numpy==$(.venv/bin/python -c 'import numpy; print(numpy.__version__)')" \
    || echo "note: no NumPy wheel kept (offline?): tests/user_crate.rs will install from PyPI" >&2
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
    # `test --quick`: the edit loop (fmt, ruff, pytest, clippy, the in-process tests).
    quick=
    if [ "${2:-}" = "--quick" ]; then quick=1; fi
    # The suite sets these itself where it needs them.
    unset PYOP_HOT_RELOAD PYOP_PYTHON_ENV PYOP_BREAKPOINT PYOP_TRACE
    # Some test bodies check with Python `assert`, which PYTHONOPTIMIZE would strip
    # (tests/devx_tests.rs checks that asserts run).
    unset PYTHONOPTIMIZE
    # A clean clone builds everything once: incremental caches would only take disk.
    if [ -n "${CI:-}" ]; then export CARGO_INCREMENTAL=0; fi
    if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
      rustup component add rustfmt clippy
    fi
    # The test tools (from PyPI), into .venv once, in one pip run: ruff, mypy and pytest for the
    # Python; ml_dtypes for the tests of bf16 and fp8 arrays returned by bodies; Ray for the tests
    # of Ray pools, which start a two-node cluster of this machine. (Looked up, not imported.)
    missing=$(.venv/bin/python -c 'import importlib.util as u
want = {"ruff": "ruff>=0.8,<1", "mypy": "mypy>=1.10,<3", "pytest": "pytest>=8,<9",
        "ml_dtypes": "ml_dtypes>=0.4,<1", "ray": "ray>=2.40,<3"}
print(" ".join(spec for mod, spec in want.items() if u.find_spec(mod) is None))')
    # shellcheck disable=SC2086
    [ -z "$missing" ] || .venv/bin/python -m pip install --disable-pip-version-check --quiet $missing
    # Each step's time, printed at the end (also when a step fails).
    steps=()
    started=$SECONDS
    report() {
      echo "--- scripts/dev.sh test${quick:+ --quick}: step times"
      for s in "${steps[@]}"; do echo "$s"; done
      printf '%-44s %5ds\n' "total" $((SECONDS - started))
    }
    # On the way out (also after a failed step or an interrupt): the background jobs still
    # running are ended (each is a process group: `low` and `setsid` below), the compiling lane's
    # output so far is shown, the temp files go, and the step times are printed.
    release_pid= compiling_pid= ray_pid=
    release_log= built_json= compiling_log= artifacts= ray_log=
    finish() {
      local pid
      for pid in "$release_pid" "$compiling_pid" "$ray_pid"; do
        [ -z "$pid" ] || kill -- -"$pid" 2>/dev/null || true
      done
      if [ -n "$compiling_pid" ]; then
        echo "--- trybuild and the user crate (stopped), their output so far:"
        cat "$compiling_log"
      fi
      rm -f ${release_log:+"$release_log"} ${built_json:+"$built_json"} \
        ${compiling_log:+"$compiling_log"} ${artifacts:+"$artifacts"} ${ray_log:+"$ray_log"}
      report
    }
    trap finish EXIT
    step() {
      local name=$1 t0=$SECONDS
      shift
      "$@"
      steps+=("$(printf '%-44s %5ds' "$name" $((SECONDS - t0)))")
    }
    # The release build of the hardening scenarios (whose tree the GPU kit's build below shares)
    # compiles from the start beside the other steps, at a lower priority: cargo locks
    # target/debug and target/release apart, and clippy's and the debug build's serial phases,
    # the tests waiting on workers and child processes, and mypy leave CPUs idle.
    # `"${low[@]}" CMD... &`: CMD in a session of its own (its pid, `$!`, is its process group:
    # ending that ends everything it started) at a lower priority. A new session is a scheduling
    # group of its own where the kernel groups by session (autogroup, on by default): CPUs are
    # shared between groups first and `nice` counts only inside one, so the group is made nice
    # too (with `setsid nice` alone the lane had half the CPUs against the tests).
    low=(setsid sh -c 'echo 10 >/proc/self/autogroup 2>/dev/null; exec nice -n 10 "$@"' low)
    if [ -z "$quick" ]; then
      release_log=$(mktemp)
      # (What the GPU kit's CPU build below builds too: its step then only packs and runs it.)
      "${low[@]}" cargo build --release --test hardening --test in_process --example gpu \
        --bench summary >"$release_log" 2>&1 &
      release_pid=$!
      release_built() {
        local rc=0
        wait "$release_pid" || rc=$?
        release_pid=
        cat "$release_log"
        return "$rc"
      }
    fi
    step "cargo fmt --check" cargo fmt --all -- --check
    # Every Python file here, the ones embedded in the crates included (ruff.toml).
    step "ruff check, ruff format --check" \
      sh -c '.venv/bin/python -m ruff check . && .venv/bin/python -m ruff format --check .'
    # The pure functions of the Python embedded in the crates, on their own (runtime/python-tests:
    # the pickling allow-list, the protocol's fields, the arena layout, the importer, the
    # macro's checker; a second or two).
    step "pytest (embedded Python)" \
      .venv/bin/python -m pytest -q -p no:cacheprovider runtime/python-tests
    step "clippy -D warnings" cargo clippy --workspace --all-targets -- -D warnings
    if [ -n "$quick" ]; then
      # The in-process test files, and every crate's unit tests.
      inprocess=()
      for t in in_process devx_tests leak_tests docs worker_start_tests worker_protocol_tests \
        worker_limits_tests worker_memory_tests; do
        inprocess+=(--test "$t")
      done
      step "in-process tests" cargo test --workspace --lib "${inprocess[@]}"
      exit 0
    fi
    # Every test and bench (as a test), built once. The examples are built here as
    # tests/examples_tests.rs builds them (`--all-targets` would also build each example a second
    # time, as a test harness), so that its own `cargo build` finds nothing to do.
    ray_test=ray_pools_keep_the_contract_on_a_two_node_cluster
    built_json=$(mktemp)
    build_tests() {
      cargo build -p pyop --examples --message-format=json-render-diagnostics >"$built_json"
      cargo test --workspace --lib --bins --tests --benches --no-run \
        --message-format=json-render-diagnostics >>"$built_json"
    }
    step "build the tests, benches and examples" build_tests
    # From cargo's messages: the test files' binaries by name (`name<TAB>path`), printed, and
    # every file of those builds, in $artifacts, for tests/user_crate.rs (its builds must leave
    # them alone).
    artifacts=$(mktemp)
    built=$(.venv/bin/python -c 'import json, sys
with open(sys.argv[2], "w") as files:
    for m in map(json.loads, open(sys.argv[1])):
        if m.get("reason") != "compiler-artifact":
            continue
        exe = m.get("executable")
        print(*m["filenames"], *([exe] if exe else []), sep="\n", file=files)
        if exe and m["target"]["kind"] == ["test"]:
            print(m["target"]["name"], exe, sep="\t")
        elif exe and m["target"]["name"] == "pyop_runtime" and m["profile"]["test"]:
            print("lib:pyop_runtime", exe, sep="\t")' "$built_json" "$artifacts")
    rm -f "$built_json"
    # Two lanes. The tests that mostly compile (trybuild's compile-fail cases, in a target folder
    # of its own, and the README's crate, built for two Pythons apart from the workspace's
    # artifacts: tests/user_crate.rs) run in the background at a lower priority, beside the rest,
    # which mostly wait (on workers, child processes, Python) and leave a CPU idle. The Ray
    # contract test (a two-node cluster of this machine, ~2 minutes of mostly waiting) runs
    # apart, after them, beside the steps after this one, which compile and check but time
    # nothing (the compiling ones at a lower priority: the Ray test has bounds of its own, 10 s
    # and more); the tests here include timing bounds and run without it.
    compiling=(ui user_crate)
    rest=()
    while IFS=$'\t' read -r name _; do
      [[ $name == lib:* || " ${compiling[*]} " == *" $name "* ]] || rest+=(--test "$name")
    done <<<"$built"
    compiling_log=$(mktemp)
    PYOP_TEST_WORKSPACE_ARTIFACTS=$artifacts "${low[@]}" sh -c 'started=$(date +%s)
      cargo test --workspace --test ui && cargo test --workspace --test user_crate
      rc=$?
      echo "(trybuild and the user crate took $(($(date +%s) - started)) s, beside the tests)"
      exit $rc' >"$compiling_log" 2>&1 &
    compiling_pid=$!
    compiling_done() {
      local rc=0
      wait "$compiling_pid" || rc=$?
      compiling_pid=
      cat "$compiling_log"
      return "$rc"
    }
    step "cargo test (every test and bench but these)" \
      cargo test --workspace --lib --bins --benches "${rest[@]}" -- --skip "$ray_test"
    # Numpy mode keeps and refills its input views, writing NumPy's array fields as NumPy lays
    # them out since 1.22 (bridge::view): the numpy-mode tests and the spare views' own again
    # under NumPy 1.x (the venv has 2.x), from a venv of the same Python made once in target/.
    numpy1() {
      local venv=target/venv-numpy1 bin lib
      if ! { [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import numpy' 2>/dev/null; }; then
        "$python" -m venv --clear "$venv"
        if ! "$venv/bin/python" -m pip install --disable-pip-version-check --quiet \
          --only-binary=:all: 'numpy>=1.22,<2'; then
          echo "skipped: NumPy 1.x could not be installed for Python $version (1.26, the last, has wheels up to 3.12)"
          rm -rf "$venv"
          return 0
        fi
      fi
      "$venv/bin/python" -c 'import numpy; print("NumPy", numpy.__version__)'
      bin=$(awk -F '\t' '$1 == "in_process" { print $2 }' <<<"$built")
      lib=$(awk -F '\t' '$1 == "lib:pyop_runtime" { print $2 }' <<<"$built")
      # On several threads, as the tests run everywhere else (the tests that scan
      # `gc.get_objects()` and those that assert nothing else holds what their calls made take
      # turns: tests/common/mod.rs, `gc_scan_lock`).
      VIRTUAL_ENV="$PWD/$venv" "$bin" numpy_tests
      VIRTUAL_ENV="$PWD/$venv" "$lib" bridge::tensor::spare
    }
    step "numpy-mode tests under NumPy 1.x" numpy1
    # The test binary itself (a second cargo would wait for the build lock the steps below take).
    ray_bin=$(awk -F '\t' '$1 == "ray_tests" { print $2 }' <<<"$built")
    ray_log=$(mktemp)
    setsid "$ray_bin" --exact "$ray_test" >"$ray_log" 2>&1 &
    ray_pid=$!
    ray_started=$SECONDS
    ray_done() {
      local rc=0
      wait "$ray_pid" || rc=$?
      ray_pid=
      cat "$ray_log"
      echo "(the Ray test took $((SECONDS - ray_started)) s, beside the steps above)"
      return "$rc"
    }
    step "trybuild, the user crate (what is left)" compiling_done
    # Doc tests link as the crates' own tests do, with an rpath to the libpython built against
    # (cargo passes a build script's link arguments to the doc tests of its own package only).
    libdir=$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
    step "doc tests" nice -n 10 env RUSTDOCFLAGS="-C link-arg=-Wl,-rpath,$libdir" \
      cargo test --workspace --doc
    step "cargo doc -D warnings" nice -n 10 env RUSTDOCFLAGS="-D warnings" \
      cargo doc --workspace --no-deps
    # The repository's Python bodies against the `pyop` stub (build/pyop.pyi): a name or an
    # argument count the module does not have is an error. Then every file embedded in the
    # crates (each in a `python/` folder beside the Rust that includes it) with `--strict`: the
    # files run in one namespace import each other's names for mypy only (`TYPE_CHECKING`, found
    # on MYPYPATH), the tensor helpers read the `pyop` module's names from its stub. Two settings
    # and no exception per file: Ray's own untyped functions may be called (the relay and the
    # actor), and the checks are Python 3.10's, the oldest mypy knows (the files keep to 3.9's
    # syntax and annotations, which ruff's target and FA102 hold; pinned, NumPy's stubs say the
    # same on every machine).
    mypy_all() {
      for bodies in examples/ops tests/py; do
        MYPYPATH=build .venv/bin/python -m mypy --check-untyped-defs \
          --disable-error-code var-annotated --no-error-summary "$bodies"
      done
      MYPYPATH=runtime/src/worker/python:runtime/src/worker/ray/python:build \
        .venv/bin/python -m mypy --strict --python-version 3.10 --untyped-calls-exclude=ray \
        --no-error-summary runtime/src/*/python/*.py runtime/src/*/*/python/*.py \
        macros/src/python/*.py
    }
    step "mypy" mypy_all
    step "release build (the rest of it)" release_built
    # The audit's scenarios again in a release build, where candle's integer arithmetic and
    # shape products would wrap instead of panicking: pyop's checks must hold in both.
    step "release hardening" cargo test --release --test hardening
    # The GPU kit as it is carried to a GPU machine (scripts/gpu-kit.sh), built without CUDA
    # (no nvcc here) and run from a temp folder with a clean environment, as scripts/gpu-run.sh
    # runs it there: it builds, stays under 64 MiB, and its CPU cases pass.
    step "GPU kit (CPU build, verified)" \
      nice -n 10 env PYTHON312="$("$python" -c 'import sys; print(sys.executable)')" \
      scripts/gpu-kit.sh --cpu --verify
    step "Ray contract test (what is left of it)" ray_done
    ;;
  mutants)
    # Mutation testing (cargo-mutants, installed once): every mutant of the given files, or with
    # no files of the lines this change touches (`git diff` against $MUTANTS_BASE, origin/main by
    # default), run against the test files that guard the README's promises. A missed mutant
    # needs a test, or a line in tests/README.md saying why it cannot change behaviour. The tree
    # is copied (your checkout is never edited); MUTANTS_ARGS passes more options (`--in-place`
    # in a disposable clone reuses its build, `-j 2`); MUTANTS_TESTS names the test files to run
    # instead of the default list.
    shift
    command -v cargo-mutants >/dev/null 2>&1 || cargo install --locked cargo-mutants@27.1.0
    guards=()
    for t in ${MUTANTS_TESTS:-in_process hardening worker_start_tests worker_protocol_tests worker_limits_tests worker_memory_tests devx_tests}; do
      guards+=("--cargo-test-arg=--test=$t")
    done
    if [ "$#" -gt 0 ]; then
      select=()
      for f in "$@"; do select+=(-f "$f"); done
    else
      mkdir -p target
      git diff "${MUTANTS_BASE:-origin/main}" -- runtime macros src > target/mutants.diff
      select=(--in-diff target/mutants.diff)
    fi
    # The tests live in the facade package, the code in pyop-runtime: cargo-mutants 27 runs its
    # unmutated baseline with the mutated package's tests only (where no `--test=in_process`
    # exists), so the baseline is skipped and the limits are set instead (a clean run of these
    # tests takes about 30 s here, the in-process binary's reload and tracing children included;
    # a mutant that hangs a body is cut off at 5 minutes).
    # shellcheck disable=SC2086
    exec cargo mutants --workspace --test-workspace=true --no-shuffle "${select[@]}" "${guards[@]}" \
      --baseline=skip --timeout=300 --build-timeout=600 --output target ${MUTANTS_ARGS:-}
    ;;
  true)
    ;;  # only the set-up above (used by scripts/bench.sh)
  guide)
    # The guide (docs/) as HTML in docs/book/, with mdBook, installed once. Optional: `test`
    # checks the guide without it (its code as doctests, its links in tests/docs.rs).
    command -v mdbook >/dev/null 2>&1 || cargo install --locked mdbook@0.5.4
    exec mdbook build docs
    ;;
  *)
    echo "usage: scripts/dev.sh example|test [--quick]|mutants [FILE...]" >&2
    exit 2
    ;;
esac
