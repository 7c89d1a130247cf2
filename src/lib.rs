//! # pyop — candle ops whose bodies are Python functions
//!
//! `#[py_op]` turns a Rust signature into a typed candle op whose body is Python: from a file
//! embedded at compile time, inline code, or an importable module. It is TensorFlow's
//! `tf.py_function` (tensor mode: the body runs candle ops on the very tensors, and autograd
//! records them) and `tf.numpy_function` (numpy mode: the body gets zero-copy read-only NumPy
//! views) for candle, with the GIL held only while Python runs and declaration mistakes caught at
//! compile time.
//!
//! ```no_run
//! use pyop::{py_op, Tensor};
//!
//! #[py_op(code = "def scale(x, k):\n    return x * k", numpy, tout = f64)]
//! fn scale(x: &Tensor, k: f64) -> pyop::Result<Tensor>;
//!
//! # fn main() -> pyop::Result<()> {
//! let x = Tensor::new(&[1.0f64, 2.0], &pyop::candle::Device::Cpu)?;
//! assert_eq!(scale(&x, 3.0)?.to_vec1::<f64>()?, [3.0, 6.0]);
//! # Ok(()) }
//! ```
//!
//! ## `#[py_op]` options
//!
//! | option | meaning |
//! |---|---|
//! | `file = "ops/x.py"` | body source: a file relative to the crate's `Cargo.toml`, embedded at compile time |
//! | `code = "def f(x): ..."` | body source: inline Python |
//! | `module = "pkg.mod"` | body source: a module imported from `sys.path` on first call |
//! | `name = "f"` | the Python function's name (default: the Rust function's) |
//! | `numpy` | numpy mode (default: tensor mode) |
//! | `tout = f32`, `(f32, i64[_, 3])`, `()` | the outputs: dtypes, optional shapes (`_` = any size) — required |
//! | `grad = "f_grad"` / `grad = path::to::rust_fn` | a registered gradient (Python in the same source, or a [`RustGradient`]) |
//! | `timeout_ms = 500` | interrupt a pure-Python body that runs longer |
//! | `crate = "my::pyop"` | where the generated code finds pyop, for crates that re-export it |
//!
//! Parameters are passed to Python positionally: `&Tensor`, `&[Tensor]` (a list), `f64`, `i64`,
//! `bool`, `&str`, `&[f64]`, `&[i64]`, `Option<…>` of these (`None`), and one optional `&Device`
//! that is not passed but names the outputs' device. The return type is
//! `pyop::Result<Tensor | (Tensor, …) | ()>`.
//!
//! See the README for the rules of output checking, errors, gradients and the executor.

pub use candle_core::Tensor;
pub use pyop_macros::py_op;
pub use pyop_runtime::{
    error_to_python, expose, gradcheck, manifest_json, op_stats, python_env, registered_op,
    registered_ops, set_hot_reload, tout_to_string, validate, validation_report, Arg, CallOptions,
    Error, ErrorKind, GradCheck, GradDecl, GradReport, GradientCall, Mode, OpBuilder, OpDecl,
    OpStats, OutSpec, Problem, PyOp, PyTensor, PythonEnv, Result, RustGradient, Source, SourceDecl,
    StaticOp, ValidationReport, Value,
};

/// candle-core, as pyop uses it.
pub use candle_core as candle;
/// pyo3, as pyop uses it (to expose Rust functions to bodies, or hand bodies Python callables).
pub use pyo3;

#[doc(hidden)]
pub use pyop_runtime::__private;
