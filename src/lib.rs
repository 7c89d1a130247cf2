//! # pyop — candle ops whose bodies are Python functions
//!
//! `#[py_op]` turns a Rust signature into a typed candle op whose body is Python: from a file
//! embedded at compile time, inline code, a package folder, or an importable module. It is
//! TensorFlow's `tf.py_function` (tensor mode: the body runs candle ops on the very tensors, and
//! autograd records them) and `tf.numpy_function` (numpy mode: the body gets zero-copy read-only
//! NumPy views) for candle, with the GIL held only while Python runs and declaration mistakes
//! caught at compile time.
//!
//! ```
//! use pyop::candle::{Device, Var};
//! use pyop::{py_op, Tensor};
//!
//! #[py_op(code = r#"
//! import pyop
//! def log_huber(x, m):
//!     if abs(x) <= m:
//!         return x**2
//!     else:
//!         return m**2 * (1 - 2 * pyop.log(m) + pyop.log(x**2))
//! "#, tout = f32)]
//! fn log_huber(x: &Tensor, m: &Tensor) -> pyop::Result<Tensor>;
//!
//! fn main() -> pyop::Result<()> {
//!     pyop::validate()?; // every declared op, and the Python set-up, checked up front
//!     let x = Var::new(1.0f32, &Device::Cpu)?;
//!     let m = Var::new(2.0f32, &Device::Cpu)?;
//!     let y = log_huber(&x, &m)?;
//!     let grads = y.backward()?;
//!     assert_eq!(y.to_scalar::<f32>()?, 1.0);
//!     assert_eq!(grads.get(&x).unwrap().to_scalar::<f32>()?, 2.0);
//!     Ok(())
//! }
//! ```
//!
//! The options of `#[py_op]` are listed in its own documentation: [`py_op`].
//!
//! ## Setting up your crate
//!
//! pyop embeds CPython through pyo3, so a crate using it needs, once:
//!
//! 1. **A Python 3.9+ built as a shared library** (`libpython3.X.so`: Debian's `python3-dev`,
//!    or pyenv with `PYTHON_CONFIGURE_OPTS=--enable-shared`). pyo3 links the `python3` on
//!    `PATH`, or the one `PYO3_PYTHON` names at build time; set it to pin one.
//! 2. **The dependencies:** `pyop`, and `candle-core` 0.11 if you use candle directly (pyop's
//!    `Tensor` is candle-core 0.11's; `pyop::candle` re-exports it).
//! 3. **A `build.rs`** calling `pyop_build::link_libpython()`, with `pyop-build` as a
//!    build-dependency: it gives your binaries an rpath to the libpython they were built against,
//!    so they start without `LD_LIBRARY_PATH` and never load another libpython of the same name.
//! 4. **A venv with NumPy made by that same interpreter** in your crate's folder (or a parent):
//!    `"$PYO3_PYTHON" -m venv .venv && .venv/bin/python -m pip install numpy`, with the
//!    interpreter the build uses (the one pinned in `.cargo/config.toml`, if any). The embedded
//!    interpreter finds it as `PYOP_PYTHON_ENV`, `VIRTUAL_ENV`, the nearest `.venv` of the current
//!    directory, or the one recorded at build time, in that order ([`python_env`] says which).
//!
//! [`validate`] checks all of this at start-up: the interpreter running is the one built
//! against, the venv was made by the same Python X.Y, NumPy imports; each problem says how to fix
//! it. The README's "Use pyop in your crate" has the exact commands, tested by CI, and the guide
//! (`docs/src/`) explains each, with every set-up message and its fix.
//!
//! ## Errors
//!
//! Every failure is a [`pyop::Error`](Error) with a [`kind`](Error::kind) to match on; it
//! converts to and from `candle_core::Error`, so a declaration may also return
//! `candle_core::Result<Tensor>` or `anyhow::Result<Tensor>` (any `Result<_, E>` with
//! `E: From<pyop::Error>`).
//!
//! ## Interop with pyo3
//!
//! What ties pyop to a pyo3 version lives in [`interop`]; everything else is pyo3-free.
#![warn(missing_docs)]

#[doc(inline)]
pub use pyop_macros::{op, py_op};

#[doc(no_inline)]
pub use candle_core::Tensor;

pub use pyop_runtime::{
    expose, gil_turns, gradcheck, manifest_json, op_stats, python_env, registered_op,
    registered_ops, set_hot_reload, set_timing, validate, validation_report, Arg, Batch,
    CallOptions, EnvSource, Error, ErrorKind, GilTurns, GradCheck, GradDecl, GradReport,
    GradientCall, Interpreter, Mode, OpBuilder, OpDecl, OpFuture, OpRef, OpStats, OutSpec,
    PoolStats, Problem, PyOp, PythonEnv, RayActor, RayPool, Result, RustGradient, Source,
    SourceDecl, StaticOp, Validate, ValidationReport, Value, WaitStats, WorkerPool,
};

/// candle-core 0.11, as pyop uses it: `pyop::candle::{Device, DType, Var, …}`.
#[doc(no_inline)]
pub use candle_core as candle;

/// What ties pyop to pyo3: the `pyo3` it is built with, Python callables as bodies
/// ([`OpBuilder::callable`], [`OpBuilder::gradient_callable`]), and the Python types of the
/// `pyop` module.
///
/// **Semver:** this module follows pyo3, whose 0.x minor releases break its API. A pyop release
/// that moves to a new pyo3 minor version changes what this module exports and is itself a
/// breaking (minor, while pyop is 0.x) release; the rest of pyop's API does not mention pyo3.
pub mod interop {
    #[doc(no_inline)]
    pub use pyo3;
    pub use pyop_runtime::{error_to_python, OpTimeout, PyTensor, RustError};
}

#[doc(hidden)]
pub use pyop_runtime::__private;

/// The README's Rust code blocks, compiled and run as doctests (`cargo test --doc`), so that what
/// it shows builds and does what it says.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The guide's chapters (`docs/src/`), each a module whose Rust code blocks are compiled and run
/// as doctests, as pyo3 tests its guide. `tests/docs.rs` checks that every chapter is here.
#[cfg(doctest)]
pub mod guide {
    macro_rules! chapters {
        ($($name:ident => $path:literal,)*) => {
            $(
                #[doc = include_str!(concat!("../docs/src/", $path))]
                pub mod $name {}
            )*
        };
    }

    chapters! {
        introduction => "introduction.md",
        getting_started => "getting-started.md",
        declaring_ops => "declaring-ops.md",
        modes => "modes.md",
        outputs => "outputs.md",
        gradients => "gradients.md",
        errors => "errors.md",
        executor => "executor.md",
        r#async => "async.md",
        batching => "batching.md",
        tools => "tools.md",
        python_environment => "python-environment.md",
        workers => "workers.md",
        ray => "ray.md",
        dlpack_gpu => "dlpack-gpu.md",
        soundness => "soundness.md",
        performance => "performance.md",
        troubleshooting => "troubleshooting.md",
        limitations => "limitations.md",
        reference_options => "reference/options.md",
        reference_api => "reference/api.md",
    }
}
