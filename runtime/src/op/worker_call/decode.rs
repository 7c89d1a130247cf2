//! A worker's answer read back with the GIL held: the value it returned (the one output check
//! then runs on it as on a body's own), the `out` buffers it wrote, or the error it reported.

use candle_core::DType;

use super::errors::worker_error;
use crate::bridge::outputs::{outputs_from_python, OutputCheck, Outputs};
use crate::bridge::shared::{region, reply_value};
use crate::error::{Error, ErrorKind, Result};
use crate::worker::exchange::Answered;
use crate::worker::protocol::Reply;

/// A forward call's outputs from its worker's answer: the one output check on the values the
/// worker returned, or the `out` buffers it wrote (`outs`: their dtypes and shapes).
pub(crate) fn outputs(
    py: pyo3::Python<'_>,
    answer: &Answered,
    worker: u64,
    body: &dyn Fn() -> String,
    check: &OutputCheck<'_>,
    outs: Option<&[(DType, Vec<usize>)]>,
) -> Result<Outputs> {
    let places = match (&answer.reply, outs) {
        // `Reply::check` refused a `wrote` naming another count of buffers than were sent.
        (Reply::Wrote { outs: places, .. }, Some(_)) => places,
        (_, outs) => {
            let value = value(py, answer, worker, check.op, body)?;
            return match outs {
                None => outputs_from_python(py, check, value),
                Some(_) => Err(crate::bridge::out::returned_instead_of_out(check, &value)),
            };
        }
    };
    // Where each output's bytes are: its `out` buffer in the input arena, or, when the body
    // kept a view of its buffers, the copy the worker made in the result arena (sizes checked
    // against the buffers when the reply was read).
    outs.into_iter()
        .flatten()
        .zip(places)
        .map(|((dtype, dims), &at)| {
            let Some((map, offset, len)) = region(answer, at) else {
                return Err(check.error(None, "a worker named memory outside its arena".into()));
            };
            let (dtype, dims) = (*dtype, dims.clone());
            let data = map.as_ptr() as usize + offset;
            let t = crate::python::copy_detached(py, len, move || {
                // SAFETY: `offset..offset + len` lies inside a mapping the answer keeps alive
                // (`region`), `len` the buffer's size (checked when the reply was read); the
                // worker has finished writing it (it replied), and no view the body kept can reach
                // it (the worker copied it into the result arena if one could).
                unsafe { crate::alloc::tensor_from_bytes(dtype, data as *const u8, dims) }
            })?;
            Ok(t.to_device(check.device)?)
        })
        .collect()
}

/// The value a worker's answer carries, or the error it reports (`body`: the body's source as
/// errors name it, made only for an error).
pub(crate) fn value<'py>(
    py: pyo3::Python<'py>,
    answer: &Answered,
    worker: u64,
    op: &str,
    body: &dyn Fn() -> String,
) -> Result<pyo3::Bound<'py, pyo3::PyAny>> {
    let reply = &answer.reply;
    if let Reply::Raised { exc, .. } | Reply::LoadFailed { exc } = reply {
        return Err(worker_error(py, op, &body(), worker, exc));
    }
    let Some(value) = reply_value(py, answer) else {
        // `wrote` for a call that gave no `out` buffers is refused when the reply is read.
        return Err(Error::op_failure(
            op,
            ErrorKind::WorkerLost,
            format!(
                "worker {worker} sent a `{}` reply where a value was due",
                reply.kind()
            ),
        ));
    };
    value.map_err(|e| {
        Error::mismatch(
            op,
            ErrorKind::OutputMismatch,
            None,
            format!(
                "the body's result could not be read from its worker: {}",
                crate::python::describe(py, &e)
            ),
        )
    })
}
