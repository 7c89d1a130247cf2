//! The `#[py_op]` attribute of [pyop](https://docs.rs/pyop). Use it through the `pyop` crate.
//!
//! The pipeline, one file a stage: `attr` parses the attribute's options, `ast` parses the
//! function signature into a typed model, `valid` checks the two against each other, and
//! `expand` writes the wrapper; every mistake is collected in a `ctxt::Ctxt` and reported at
//! once, each on its own token, next to a fallback copy of the user's function.

mod ast;
mod attr;
mod ctxt;
mod expand;
mod pycheck;
mod valid;

use proc_macro::TokenStream;

/// Declares a candle op whose body is a Python function.
///
/// Write the Rust signature, end it with `;`, and give the body's source and its outputs; the
/// attribute writes the function, which calls the body and checks what it returns:
///
/// ```
/// use pyop::{py_op, Tensor};
/// use pyop::candle::Device;
///
/// // Tensor mode (default): the body gets `pyop.Tensor`s wrapping the very candle tensors.
/// #[py_op(code = r#"
/// def softplus(x, beta):
///     return (1 + (x * beta).exp()).log() / beta
/// "#, tout = f32)]
/// fn softplus(x: &Tensor, beta: f64) -> pyop::Result<Tensor>;
///
/// // Numpy mode: the body gets read-only NumPy views of the candle storage.
/// #[py_op(code = "import numpy as np\ndef cummax(x):\n    return np.maximum.accumulate(x)",
///         numpy, tout = f32[x])]
/// fn cummax(x: &Tensor) -> pyop::Result<Tensor>;
///
/// # fn main() -> pyop::Result<()> {
/// let x = Tensor::new(&[0f32, 3., 1., 4.], &Device::Cpu)?;
/// assert_eq!(cummax(&x)?.to_vec1::<f32>()?, [0., 3., 3., 4.]);
/// let y = softplus(&x, 1.0)?.to_vec1::<f32>()?;
/// assert!((y[0] - std::f32::consts::LN_2).abs() < 1e-6);
/// # Ok(()) }
/// ```
///
/// # Options
///
/// | option | meaning |
/// |---|---|
/// | `file = "py/ops.py"` | body source: a file relative to the crate's `Cargo.toml`, embedded at compile time (editing it rebuilds; the binary needs no Python files) |
/// | `code = "..."` | body source: inline Python (a string literal; raw strings keep tracebacks on the `.rs` file's lines), a `&'static str` constant, or `include_str!("...")` |
/// | `package = "py/mylib"` | body source: a folder embedded at compile time and imported from memory as package `mylib` (bodies can `from . import helpers`); the body is in `mylib`, or in `module = "mylib.sub"` |
/// | `module = "pkg.mod"` | body source: a module imported from `sys.path` on first call |
/// | `name = "f"` | the Python function's name; default: the Rust function's |
/// | `numpy` | numpy mode; default: tensor mode |
/// | `dlpack` | numpy mode only: tensor inputs stay on the op's device (CPU or CUDA) as `pyop.Tensor`s, DLPack producers the body takes with `np.from_dlpack` / `cupy.from_dlpack` / `torch.from_dlpack`, instead of NumPy views of host copies; any DLPack producer may be returned (read back device to device), bf16 included |
/// | `tout = ...` | required: the outputs, `f32`, `(f32, i64)`, `()`; each may carry a shape, `f32[_, 3]` (`_` = any size, `f32[]` = 0-d), or take a tensor parameter's, `f32[x]`; `x.dtype` (with an optional shape) and `like(x)` take a tensor parameter's dtype, and shape |
/// | `grad = "f_grad"` | a gradient in Python, in the same source: `f_grad(inputs, outputs, grads)` |
/// | `grad = path::to_fn` | a gradient in Rust: `fn(&pyop::GradientCall) -> pyop::Result<Vec<Option<Tensor>>>` |
/// | `timeout_ms = 500` | interrupt a pure-Python body that runs longer (`ErrorKind::Timeout`); in a worker, any body (the worker is killed) |
/// | `workers = 4` | numpy mode only: run the body (and a Python gradient) in a pool of 4 Python worker processes of the op's own (`pyop::WorkerPool`): parallel beyond the GIL, a crash fails only its call (`ErrorKind::WorkerLost`) |
/// | `pool = "text"` | with `workers`: run in the process-wide pool `text` (`WorkerPool::named`), shared by every op that names it |
/// | `crate = "my::pyop"` | where the generated code finds pyop, for crates that re-export it |
///
/// One of `file`, `code`, `package` and `module` is required (`module` may also pick a module
/// inside a `package`).
///
/// # Parameters and return type
///
/// Parameters are passed to Python positionally in declaration order: `&Tensor`; `f64`, `f32`,
/// `i64`, `i32`, `u32`, `usize`, `bool`, `&str` (Python `float`, `int`, `bool`, `str`, without
/// loss); `&[Tensor]` (a list); `&[f64]`, `&[f32]`, `&[i64]`, `&[usize]` (lists); `Option<…>` of any of
/// these (`None`); and one optional `&Device`, not passed to Python, naming the outputs' device
/// (default: the inputs' device).
///
/// The return type is `Result<Tensor>`, `Result<(Tensor, …)>` (up to 12) or `Result<()>`, with
/// `pyop::Result`, `candle_core::Result`, `anyhow::Result` or any `Result<_, E>` where
/// `E: From<pyop::Error>`:
///
/// ```
/// use pyop::{py_op, Tensor};
///
/// #[py_op(code = "def halve(x):\n    return x / 2", tout = f64)]
/// fn halve(x: &Tensor) -> pyop::candle::Result<Tensor>;
///
/// fn quarter(x: &Tensor) -> pyop::candle::Result<Tensor> {
///     halve(&halve(x)?)  // `?` in candle code, no conversion needed
/// }
/// # let x = Tensor::new(&[8f64], &pyop::candle::Device::Cpu).unwrap();
/// # assert_eq!(quarter(&x).unwrap().to_vec1::<f64>().unwrap(), [2.0]);
/// ```
///
/// # Checked at compile time
///
/// Every mistake in the declaration is a compile error on the offending token, all reported at
/// once: unknown or duplicate keys, unknown dtypes, two sources or none, `tout` arity against
/// the return type, malformed shapes, unsupported parameter or return types, generics, `async`,
/// `self`, a body, a missing `file` or `package` folder, and dtypes NumPy cannot hold (bf16, f8)
/// in numpy mode.
///
/// The Python is checked at build time as well, by the interpreter pyo3 builds against (it
/// compiles the source without running it): for `code`, `file`, `package` and
/// `code = include_str!(…)` sources, a syntax error, a missing body or gradient function, or one
/// that cannot take the op's positional arguments is a compile error on the source's token.
/// What only running can tell — a `module` source, a `code = CONST`, a name bound by an import,
/// NumPy importing — `pyop::validate()` checks at start-up. `PYOP_BUILD_CHECKS=0` turns the
/// build-time check off.
#[proc_macro_attribute]
pub fn py_op(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::py_op(args.into(), item.into()).into()
}
