//! The gradient an op declares, as types: a Python function or a Rust one, and what a Rust
//! gradient is given.

use candle_core::Tensor;
use pyo3::prelude::*;

use crate::arg::Arg;
use crate::error::Result;

/// A gradient written in Rust: given the op's arguments, outputs and the gradient arriving at each
/// output, return one entry per tensor input (tensors of a `&[Tensor]` argument counted one by
/// one, in order), `None` meaning no gradient. Each gradient must have its input's shape and dtype.
pub type RustGradient = fn(&GradientCall<'_>) -> Result<Vec<Option<Tensor>>>;

/// What a [`RustGradient`] is called with.
#[derive(Debug)]
pub struct GradientCall<'a> {
    /// The op's name.
    pub op: &'a str,
    /// All the op's arguments in declaration order, plain values included.
    pub args: &'a [Arg<'a>],
    /// The op's outputs.
    pub outputs: &'a [Tensor],
    /// The gradient arriving at each output (zeros for one that received none).
    pub grads: &'a [Tensor],
}

pub(crate) enum Gradient {
    Python(Py<PyAny>),
    Rust(RustGradient),
}
