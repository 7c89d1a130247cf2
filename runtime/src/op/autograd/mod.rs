//! Registered gradients, and ops of any arity in candle's autograd.
//!
//! candle's custom ops take at most three inputs and give one output, and only `apply_op*` can
//! put a node with a user backward into the graph. An op call with tracked inputs therefore
//! becomes, after the body has run:
//!
//! ```text
//! x_i (tracked, float) ──flatten·to_dtype(F)──┐
//!                                              cat ─► packed_in ─[Node]─► packed_out ─narrow·reshape·to_dtype─► y_j
//! ```
//!
//! `Node`'s forward hands back the outputs the body already computed (no Python runs under
//! candle's storage locks); its backward unpacks the incoming gradient per output, calls the
//! registered gradient, and packs what it returns per input. `F` is f64 if any tracked value is
//! f64, else f32; each gradient comes back in its input's own dtype through the differentiable
//! casts. Integer inputs get no gradient and integer outputs are not tracked.

mod backward;
mod node;
mod pack;
mod record;

use std::sync::{Arc, Mutex};

use candle_core::{DType, Tensor};

use super::{OpInner, PyOp};
use crate::arg::Arg;
use crate::bridge::prepare::{Prepared, PreparedInputs};
use crate::error::Result;
use node::{Node, SavedArg};
use pack::{cpu_storage, pack, unpack, Slot};
pub(crate) use record::gradients_run;

fn tracked(t: &Tensor) -> bool {
    t.dtype().is_float() && t.track_op()
}

/// Whether any float tensor argument is tracked by autograd.
pub(crate) fn any_tracked(args: &[Arg<'_>]) -> bool {
    let mut any = false;
    for a in args {
        a.for_each_tensor(|t| any |= tracked(t));
    }
    any
}

/// The prepared inputs, detached: the body's own ops must not enter the graph when a registered
/// gradient (or numpy mode) stands for them.
pub(crate) fn detach_prepared(prepared: PreparedInputs) -> PreparedInputs {
    prepared.into_iter().map(Prepared::detached).collect()
}

/// Puts the outputs of a call into the graph behind one node whose backward is the op's gradient.
pub(crate) fn attach(
    op: &Arc<OpInner>,
    args: &[Arg<'_>],
    prepared: PreparedInputs,
    outputs: Vec<Tensor>,
) -> Result<Vec<Tensor>> {
    let mut originals = Vec::new();
    for a in args {
        a.for_each_tensor(|t| originals.push(t.clone()));
    }
    let tracked_in: Vec<usize> = (0..originals.len())
        .filter(|&i| tracked(&originals[i]))
        .collect();
    let float_out: Vec<usize> = (0..outputs.len())
        .filter(|&j| outputs[j].dtype().is_float())
        .collect();
    if float_out.is_empty() {
        return Ok(outputs);
    }
    let wide = tracked_in
        .iter()
        .map(|&i| originals[i].dtype())
        .chain(float_out.iter().map(|&j| outputs[j].dtype()));
    let f = if wide.clone().any(|d| d == DType::F64) {
        DType::F64
    } else {
        DType::F32
    };

    // Packing copies every tracked input and float output into one buffer of dtype `f`: a body
    // may have returned a huge broadcast tensor, so the copy is checked first.
    let elems = tracked_in
        .iter()
        .map(|&i| originals[i].elem_count())
        .chain(float_out.iter().map(|&j| outputs[j].elem_count()))
        .try_fold(0usize, |n, e| n.checked_add(e));
    crate::alloc::check(elems, f).map_err(|refusal| {
        crate::error::Error::op_failure(
            Some(op.name.as_str()),
            crate::error::ErrorKind::ResourceExhausted,
            format!("MemoryError: the tracked inputs and float outputs, packed for the gradient: {refusal}"),
        )
    })?;
    let packed_in = pack(tracked_in.iter().map(|&i| &originals[i]), f)?;
    let packed_out = pack(float_out.iter().map(|&j| &outputs[j]), f)?.detach();
    let out_shape = packed_out.shape().clone();
    let slot = if packed_out.device().is_cpu() {
        Slot::Cpu(Mutex::new(Some(cpu_storage(&packed_out.flatten_all()?)?)))
    } else {
        Slot::Device(packed_out)
    };
    let values = args
        .iter()
        .map(|a| SavedArg::new(a, |_| (), <[Tensor]>::len))
        .collect();
    let node = Node {
        op: PyOp { inner: op.clone() },
        values,
        prepared,
        outputs: outputs.clone(),
        tracked_in,
        float_out: float_out.clone(),
        dtype: f,
        in_shape: packed_in.shape().clone(),
        out_shape,
        slot,
    };
    let result = packed_in.apply_op1(node)?;
    let mut outputs = outputs;
    let mut offset = 0;
    for j in float_out {
        let tracked_y = unpack(&result, offset, &outputs[j])?;
        offset += outputs[j].elem_count();
        outputs[j] = tracked_y;
    }
    Ok(outputs)
}
