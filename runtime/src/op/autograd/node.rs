//! The node candle's graph holds for an op: what it keeps of a forward call (the op, the
//! arguments, the prepared inputs and the outputs) for the gradient. Its behaviour as candle's
//! `CustomOp1` is `backward`.

use candle_core::{DType, Shape, Tensor};

use super::pack::Slot;
use crate::bridge::prepare::PreparedInputs;
use crate::op::PyOp;

pub(super) struct Node {
    pub(super) op: PyOp,
    pub(super) values: Vec<SavedArg>,
    pub(super) prepared: PreparedInputs,
    pub(super) outputs: Vec<Tensor>,
    pub(super) tracked_in: Vec<usize>,
    pub(super) float_out: Vec<usize>,
    pub(super) dtype: DType,
    /// The shapes of the packed input and output.
    pub(super) in_shape: Shape,
    pub(super) out_shape: Shape,
    pub(super) slot: Slot,
}

/// What a node keeps of an argument, to pass it to the gradient again: its plain values, and
/// for a tensor or a list only their place (the node keeps the tensors apart, prepared).
pub(super) type SavedArg = crate::arg::Kept<(), usize>;
