//! The runtime behind [pyop](https://docs.rs/pyop): a GIL-aware eager executor for candle ops
//! whose bodies are Python functions. Users depend on the `pyop` facade crate, which re-exports
//! this crate's API and the `#[py_op]` macro.
#![warn(missing_docs)]

// The layers, lowest first. A file uses only its own layer and those below it, and no two files
// use each other (`tests/layers.rs` checks both):
//   L0  model: error, spec, arg, stats, alloc     plain Rust, no pyo3 in the types
//   L1  python/                                   the interpreter: env, errors, exceptions, NumPy, watchdog
//       threads, worker/                          pyop's threads for awaited calls; worker processes
//   L2  bridge/                                   candle ↔ Python: the one GIL door, conversions, pyop.Tensor
//   L3  body/                                     where a body comes from: sources, packages, hot reload
//   L4  op/                                       the executor: PyOp, builder, the call core, autograd
//   L5  registry/, tools/                         #[py_op] declarations; validate, manifest, gradcheck
mod alloc;
mod arg;
mod error;
mod spec;
mod stats;

mod python;
mod threads;
mod worker;

mod bridge;

mod body;

mod op;

mod registry;
mod tools;

pub use arg::Arg;
pub use body::reload::set_hot_reload;
pub use body::source::Source;
pub use bridge::expose::expose;
pub use bridge::python_env;
pub use bridge::tensor::PyTensor;
pub use bridge::value::Value;
pub use error::{Error, ErrorKind, Result};
pub use op::builder::OpBuilder;
pub use op::gradient::{GradientCall, RustGradient};
pub use op::{CallOptions, PyOp};
pub use python::env::{EnvSource, Interpreter, PythonEnv};
pub use python::exceptions::{error_to_python, OpTimeout, RustError};
pub use registry::decl::{GradDecl, OpDecl, SourceDecl, StaticOp};
pub use registry::{op_stats, registered_op, registered_ops};
pub use spec::{numpy_can_hold, Batch, Mode, OutSpec};
pub use stats::{gil_turns, set_timing, GilTurns, OpStats};
pub use tools::gradcheck::{gradcheck, GradCheck, GradReport};
pub use tools::manifest::manifest_json;
pub use tools::validate::{
    validate, validation_report, OpRef, Problem, Validate, ValidationReport,
};
pub use worker::{PoolStats, RayActor, RayPool, WaitStats, WorkerPool};

/// The future of a `#[py_op]` function's `_async` sibling: resolves to what the function
/// returns (`R`, its declared `Result`). `Send` and `'static`; dropping it cancels the call (see
/// [`PyOp::call_async`]).
#[must_use = "a future does nothing unless awaited; dropping it cancels the call"]
pub struct OpFuture<R> {
    call: std::pin::Pin<Box<dyn std::future::Future<Output = Result<__private::Outputs>> + Send>>,
    returns: std::marker::PhantomData<fn() -> R>,
}

impl<R> OpFuture<R> {
    #[doc(hidden)]
    pub fn __new(
        call: impl std::future::Future<Output = Result<__private::Outputs>> + Send + 'static,
    ) -> Self {
        OpFuture {
            call: Box::pin(call),
            returns: std::marker::PhantomData,
        }
    }
}

impl<R: __private::FromCall> std::future::Future for OpFuture<R> {
    type Output = R;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<R> {
        self.call.as_mut().poll(cx).map(R::from_call)
    }
}

impl<R> std::fmt::Debug for OpFuture<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpFuture").finish_non_exhaustive()
    }
}

/// What `#[py_op]` expansions refer to; not a public API.
#[doc(hidden)]
pub mod __private {
    /// How many spare `pyop.Tensor`s and spare NumPy views the calling thread keeps now (the
    /// tests of `bridge::tensor::spare`; not a public API).
    pub fn spares_on_this_thread() -> (usize, usize) {
        crate::bridge::tensor::spare::on_this_thread()
    }

    pub use crate::bridge::outputs::Outputs;
    pub use crate::python::env::BuildEnv;
    pub use crate::registry::decl::{relocate_sources, OpDeclParts};
    pub use crate::registry::{declared_at, Registration};
    pub use crate::{Arg, Batch, GradDecl, Mode, OpDecl, OutSpec, SourceDecl, StaticOp};
    pub use candle_core::{DType, Device, Tensor};
    pub use inventory;

    /// A CPU tensor holding a copy of `src`, in memory got the way pyop gets a numpy-mode body's
    /// returned array into candle: the bench's `memcpy_N` floor.
    pub fn output_copied_from(src: &[f32]) -> Tensor {
        // SAFETY: `src` is readable for its length in bytes.
        let v = unsafe { crate::alloc::copied_from_bytes::<f32>(src.as_ptr().cast(), src.len()) };
        Tensor::from_vec(v.expect("memory"), src.len(), &Device::Cpu).expect("shape")
    }

    /// How many times a spinner of this process (a caller waiting for a worker's reply) found the
    /// CPUs crowded and turned spinning off for a while (the bench prints it).
    pub fn crowded_count() -> u64 {
        #[cfg(target_os = "linux")]
        return crate::worker::pace::crowded_count();
        #[cfg(not(target_os = "linux"))]
        0
    }

    /// Turns a call's result into the declared return type (`Result<T, E>` with `E` made from
    /// pyop's error, as the function's `?` does).
    pub trait FromCall: Sized {
        fn from_call(result: crate::Result<Outputs>) -> Self;
    }

    impl<T: FromOutputs, E: From<crate::Error>> FromCall for std::result::Result<T, E> {
        fn from_call(result: crate::Result<Outputs>) -> Self {
            result.map(T::from_outputs).map_err(E::from)
        }
    }

    /// Turns an op's output list into the declared return type.
    pub trait FromOutputs: Sized {
        fn from_outputs(outputs: Outputs) -> Self;
    }

    impl FromOutputs for () {
        fn from_outputs(_: Outputs) -> Self {}
    }

    impl FromOutputs for Tensor {
        // The one output taken off the end (not an iterator's `next` and a drop of the rest),
        // inlined into the `#[py_op]` function.
        #[inline]
        fn from_outputs(mut outputs: Outputs) -> Self {
            debug_assert_eq!(outputs.len(), 1, "the executor checked the output count");
            outputs
                .pop()
                .expect("the executor checked the output count")
        }
    }

    macro_rules! tuple_outputs {
        ($($t:ident)+) => {
            impl FromOutputs for ($($t,)+) {
                fn from_outputs(outputs: Outputs) -> Self {
                    let mut it = outputs.into_iter();
                    ($({ let x: $t = it.next().expect("the executor checked the output count"); x },)+)
                }
            }
        };
    }
    tuple_outputs!(Tensor);
    tuple_outputs!(Tensor Tensor);
    tuple_outputs!(Tensor Tensor Tensor);
    tuple_outputs!(Tensor Tensor Tensor Tensor);
    tuple_outputs!(Tensor Tensor Tensor Tensor Tensor);
    tuple_outputs!(Tensor Tensor Tensor Tensor Tensor Tensor);
    tuple_outputs!(Tensor Tensor Tensor Tensor Tensor Tensor Tensor);
    tuple_outputs!(Tensor Tensor Tensor Tensor Tensor Tensor Tensor Tensor);
    tuple_outputs!(Tensor Tensor Tensor Tensor Tensor Tensor Tensor Tensor Tensor);
    tuple_outputs!(Tensor Tensor Tensor Tensor Tensor Tensor Tensor Tensor Tensor Tensor);
    tuple_outputs!(Tensor Tensor Tensor Tensor Tensor Tensor Tensor Tensor Tensor Tensor Tensor);
    tuple_outputs!(Tensor Tensor Tensor Tensor Tensor Tensor Tensor Tensor Tensor Tensor Tensor Tensor);
}
