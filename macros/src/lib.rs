//! The `#[py_op]` attribute of [pyop](https://docs.rs/pyop). Use it through the `pyop` crate.
//!
//! The pipeline, one file a stage: `attr` parses the attribute's options, `ast` parses the
//! function signature into a typed model, `valid` checks the two against each other, and
//! `expand` writes the wrapper; every mistake is collected in a `ctxt::Ctxt` and reported at
//! once, each on its own token, next to a fallback copy of the user's function.
#![warn(missing_docs)]

mod ast;
mod attr;
mod ctxt;
mod expand;
mod package;
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
/// The options, and the parameter and return types a declaration may use (this part is the
/// guide's reference chapter, `docs/src/reference/options.md`, written once for both):
///
#[doc = include_str!("../../docs/src/reference/options.md")]
///
/// For example, a declaration returning `candle_core::Result`:
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
/// Batching, `batch(max = 64, wait_us = 200, inputs = [x])`: concurrent calls from different
/// threads are served by one body call on their inputs stacked along axis 0, each caller getting
/// its own rows of every output (see `pyop::Batch`). `max` (required, at least 1) is the most
/// calls one body call serves; `wait_us` (default 0) how long, in microseconds, a call that found
/// no company waits for more; `inputs` (default: every `&Tensor` parameter) the parameters
/// stacked, the others being the same for every call of a batch. A declared output shape leaves
/// axis 0, the rows, free:
///
/// ```
/// use pyop::{py_op, Tensor};
///
/// #[py_op(code = "def project(x, w):\n    return x @ w", numpy,
///         batch(max = 64, wait_us = 200, inputs = [x]), tout = f32[_, 2])]
/// fn project(x: &Tensor, w: &Tensor) -> pyop::Result<Tensor>;
///
/// let batch = pyop::op!(project).decl().batch().unwrap();
/// assert_eq!((batch.max, batch.wait.as_micros()), (64, 200));
/// assert_eq!(batch.inputs.as_deref(), Some(&[0][..])); // `x`, stacked; `w` shared
/// ```
///
/// # Checked at compile time
///
/// Every mistake in the declaration is a compile error on the offending token, all reported at
/// once: unknown or duplicate keys, unknown dtypes, two sources or none, `tout` arity against
/// the return type, malformed shapes, unsupported parameter or return types, generics, `async`,
/// `self`, a body, a missing `file` or `package` folder, dtypes NumPy cannot hold (bf16, f8)
/// in numpy mode, and for `batch(...)`: a missing or zero `max`, an unknown setting, `inputs`
/// naming anything but a `&Tensor` parameter given on every call (or a batching op without one),
/// and an output shape whose axis 0 is fixed or that has no axis (`f32[3, 4]`, `f32[]`).
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

/// The op behind a `#[py_op]` function, typed: `pyop::op!(softclip)` is its
/// [`StaticOp`](https://docs.rs/pyop/latest/pyop/struct.StaticOp.html), checked by the compiler
/// where `pyop::registered_op("softclip")` could only be `None` at run time.
///
/// Name the function by any path that reaches it: `op!(softclip)`, `op!(ops::softclip)`, or in
/// an `impl`, `op!(Model::softclip)` or `op!(Self::softclip)`. A name that is no `#[py_op]`
/// function is a compile error (no function `__pyop_op_<name>`).
///
/// ```
/// use pyop::{py_op, Tensor};
///
/// #[py_op(code = "def twice(x):\n    return x * 2", tout = f64)]
/// fn twice(x: &Tensor) -> pyop::Result<Tensor>;
///
/// let op: &'static pyop::StaticOp = pyop::op!(twice);
/// assert_eq!(op.decl().name(), "twice");
/// assert_eq!(op.stats().calls, 0);
/// ```
#[proc_macro]
pub fn op(input: TokenStream) -> TokenStream {
    let mut path = syn::parse_macro_input!(input as syn::Path);
    match path.segments.last_mut() {
        Some(last) => last.ident = expand::handle_ident(&last.ident),
        None => {
            return syn::Error::new_spanned(&path, "name a #[py_op] function")
                .to_compile_error()
                .into()
        }
    }
    quote::quote!(#path()).into()
}
