//! The runtime behind [pyop](https://docs.rs/pyop): a GIL-aware eager executor for candle ops
//! whose bodies are Python functions. Users depend on the `pyop` facade crate, which re-exports
//! this crate's API and the `#[py_op]` macro.

mod alloc;
mod convert;
mod decl;
mod env;
mod error;
mod expose;
mod grad;
mod op;
mod python;
mod reload;
mod source;
mod spec;
mod stats;
mod tensor;
mod timeout;
mod validate;

pub use convert::Arg;
pub use decl::{op_stats, registered_op, registered_ops, GradDecl, OpDecl, SourceDecl, StaticOp};
pub use env::{EnvSource, Interpreter, PythonEnv};
pub use error::{Error, ErrorKind, Result};
pub use expose::{expose, Value};
pub use grad::{gradcheck, GradCheck, GradReport, GradientCall, RustGradient};
pub use op::{CallOptions, OpBuilder, PyOp};
pub use python::python_env;
pub use reload::set_hot_reload;
pub use source::Source;
pub use spec::{numpy_can_hold, Mode, OutSpec};
pub use stats::OpStats;
pub use tensor::{error_to_python, OpTimeout, PyTensor, RustError};
pub use validate::{manifest_json, validate, validation_report, OpRef, Problem, ValidationReport};

/// What `#[py_op]` expansions refer to; not a public API.
#[doc(hidden)]
pub mod __private {
    pub use crate::decl::{OpDeclParts, Registration};
    pub use crate::env::BuildEnv;
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
