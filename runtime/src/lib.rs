//! The runtime behind [pyop](https://docs.rs/pyop): a GIL-aware eager executor for candle ops
//! whose bodies are Python functions. Users depend on the `pyop` facade crate, which re-exports
//! this crate's API and the `#[py_op]` macro.

mod alloc;
mod arg;
mod body;
mod bridge;
mod decl;
mod error;
mod grad;
mod op;
mod python;
mod spec;
mod stats;
mod validate;

pub use arg::Arg;
pub use body::reload::set_hot_reload;
pub use body::source::Source;
pub use bridge::expose::expose;
pub use bridge::python_env;
pub use bridge::tensor::PyTensor;
pub use bridge::value::Value;
pub use decl::{op_stats, registered_op, registered_ops, GradDecl, OpDecl, SourceDecl, StaticOp};
pub use error::{Error, ErrorKind, Result};
pub use grad::{gradcheck, GradCheck, GradReport, GradientCall, RustGradient};
pub use op::{CallOptions, OpBuilder, PyOp};
pub use python::env::{EnvSource, Interpreter, PythonEnv};
pub use python::exceptions::{error_to_python, OpTimeout, RustError};
pub use spec::{numpy_can_hold, Mode, OutSpec};
pub use stats::OpStats;
pub use validate::{manifest_json, validate, validation_report, OpRef, Problem, ValidationReport};

/// What `#[py_op]` expansions refer to; not a public API.
#[doc(hidden)]
pub mod __private {
    pub use crate::decl::{OpDeclParts, Registration};
    pub use crate::python::env::BuildEnv;
    pub use crate::{Arg, GradDecl, Mode, OpDecl, OutSpec, SourceDecl, StaticOp};
    pub use candle_core::{DType, Device, Tensor};
    pub use inventory;

    /// Turns an op's output list into the declared return type.
    pub trait FromOutputs: Sized {
        fn from_outputs(outputs: Vec<Tensor>) -> Self;
    }

    impl FromOutputs for () {
        fn from_outputs(_: Vec<Tensor>) -> Self {}
    }

    impl FromOutputs for Tensor {
        fn from_outputs(outputs: Vec<Tensor>) -> Self {
            outputs
                .into_iter()
                .next()
                .expect("the executor checked the output count")
        }
    }

    macro_rules! tuple_outputs {
        ($($t:ident)+) => {
            impl FromOutputs for ($($t,)+) {
                fn from_outputs(outputs: Vec<Tensor>) -> Self {
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
