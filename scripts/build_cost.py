#!/usr/bin/env python3
"""What the build-time Python checks of #[py_op] bodies cost a crate's build.

    scripts/build_cost.py            # REPS=3 OPS=50

Generates a crate with OPS ops (half inline `code`, half `file` bodies, a few with gradients) in
target/build-cost/, builds its dependencies once, then times, with the checks on and with
`PYOP_BUILD_CHECKS=0` (what a build cost before them), the median of REPS runs of:
  - a full build of the crate itself (`cargo clean -p build-cost` first; dependencies stay built);
  - an incremental rebuild after editing one body file.
Prints one line per measurement and the ratios the README quotes.
"""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REPS = int(os.environ.get("REPS", "3"))
OPS = int(os.environ.get("OPS", "50"))
CRATE = REPO / "target" / "build-cost"


def generate():
    (CRATE / "src").mkdir(parents=True, exist_ok=True)
    (CRATE / "ops").mkdir(exist_ok=True)
    (CRATE / "Cargo.toml").write_text(
        '[package]\nname = "build-cost"\nversion = "0.0.0"\nedition = "2021"\npublish = false\n\n'
        f'[dependencies]\npyop = {{ path = "{REPO}" }}\n\n'
        f'[build-dependencies]\npyop-build = {{ path = "{REPO}/build" }}\n\n[workspace]\n'
    )
    (CRATE / "build.rs").write_text("fn main() {\n    pyop_build::link_libpython();\n}\n")
    lines = ["use pyop::candle::Tensor;", "use pyop::py_op;", ""]
    for i in range(OPS):
        if i % 2 == 0:
            grad = f', grad = "op{i}_grad"' if i % 10 == 0 else ""
            body = f"def op{i}(x, k):\n    y = x * k + {i}\n    return y\n" + (
                f"\ndef op{i}_grad(inputs, outputs, grads):\n    return grads[0] * inputs[1], None\n"
                if i % 10 == 0
                else ""
            )
            lines += [
                f'#[py_op(code = r#"\n{body}"#, numpy, tout = f32[x]{grad})]',
                f"pub fn op{i}(x: &Tensor, k: f64) -> pyop::Result<Tensor>;",
                "",
            ]
        else:
            (CRATE / "ops" / f"op{i}.py").write_text(
                f"import numpy as np\n\n\ndef op{i}(x, k):\n    return np.tanh(x) * k + {i}\n"
            )
            lines += [
                f'#[py_op(file = "ops/op{i}.py", numpy, tout = f32[x])]',
                f"pub fn op{i}(x: &Tensor, k: f64) -> pyop::Result<Tensor>;",
                "",
            ]
    lines += [
        "fn main() {",
        '    pyop::validate().expect("valid");',
        "    let x = Tensor::new(&[1f32, 2.], &pyop::candle::Device::Cpu).unwrap();",
        '    println!("{:?}", op1(&x, 2.0).unwrap().to_vec1::<f32>().unwrap());',
        "}",
        "",
    ]
    (CRATE / "src" / "main.rs").write_text("\n".join(lines))


def cargo(*args, checks=True):
    env = dict(os.environ)
    env["CARGO_TARGET_DIR"] = str(CRATE / "target")
    if not checks:
        env["PYOP_BUILD_CHECKS"] = "0"
    t = time.perf_counter()
    subprocess.run(
        ["cargo", *args],
        cwd=CRATE,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - t


def full(checks):
    cargo("clean", "-p", "build-cost", "--quiet")
    return cargo("build", "--quiet", checks=checks)


def incremental(checks, n):
    edit = 100 + n + (REPS if checks else 0)  # a new text every time
    (CRATE / "ops" / "op1.py").write_text(
        f"import numpy as np\n\n\ndef op1(x, k):\n    return np.tanh(x) * k + {edit}\n"
    )
    return cargo("build", "--quiet", checks=checks)


def main():
    generate()
    cargo("build", "--quiet")  # dependencies, once
    results = {}
    for checks in (False, True):
        label = "checks" if checks else "no checks"
        fulls = [full(checks) for _ in range(REPS)]
        incs = [incremental(checks, n) for n in range(REPS)]
        results[checks] = (statistics.median(fulls), statistics.median(incs))
        print(
            f"{label:>9}: full build of a crate of {OPS} ops {results[checks][0]:.2f} s, "
            f"rebuild after editing one body {results[checks][1]:.2f} s (medians of {REPS})",
            flush=True,
        )
    (f0, i0), (f1, i1) = results[False], results[True]
    print(f"full build {f1 / f0:.3f}x ({(f1 / f0 - 1) * 100:+.1f} %), incremental {i1 - i0:+.2f} s")


if __name__ == "__main__":
    sys.exit(main())
