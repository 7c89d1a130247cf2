//! The runtime behind [pyop](https://docs.rs/pyop): a GIL-aware eager executor for candle ops
//! whose bodies are Python functions. Users depend on the `pyop` facade crate, which re-exports
//! this crate's API and the `#[py_op]` macro.

mod convert;
mod error;
mod grad;
mod op;
mod python;
mod source;
mod spec;
mod stats;
mod tensor;
mod timeout;

pub use convert::Arg;
pub use error::{Error, ErrorKind, Result};
pub use grad::{gradcheck, GradCheck, GradReport, GradientCall, RustGradient};
pub use op::{CallOptions, OpBuilder, PyOp};
pub use python::{python_env, PythonEnv};
pub use source::Source;
pub use spec::{numpy_can_hold, tout_to_string, Mode, OutSpec};
pub use stats::OpStats;
pub use tensor::{error_to_python, OpTimeout, PyTensor, RustError};
