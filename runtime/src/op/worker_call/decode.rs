//! A worker's answer read back: without Python where nothing but bytes is to be read (the `out`
//! buffers it wrote, a plain array of the declared dtype), else with the GIL held: the value it
//! returned (the one output check then runs on it as on a body's own), or the error it reported.

use candle_core::DType;

use super::errors::worker_error;
use crate::bridge::outputs::{outputs_from_python, placed, OutputCheck, Outputs};
use crate::bridge::shared::{region, reply_value};
use crate::error::{Error, ErrorKind, Result};
use crate::worker::exchange::Answered;
use crate::worker::protocol::Reply;

/// A forward call's outputs from its worker's answer, with the GIL: the `out` buffers it wrote
/// (as [`without_python`] reads them, which a program reads this way until it has NumPy), or the
/// one output check on the value the worker returned (what `without_python` leaves: a pickle, an
/// error, an empty array, an array of another dtype or for other outputs than one, one whose copy
/// the allocation check refuses; and every reply until the program has NumPy). A call that gave
/// `out` buffers and got a value back is refused as in the program.
pub(crate) fn outputs(
    py: pyo3::Python<'_>,
    answer: &Answered,
    worker: u64,
    body: &dyn Fn() -> String,
    check: &OutputCheck<'_>,
    outs: Option<&[(DType, Vec<usize>)]>,
) -> Result<Outputs> {
    if let (Reply::Wrote { outs: places, .. }, Some(outs)) = (&answer.reply, outs) {
        return written(answer, check, outs, places);
    }
    let value = value(py, answer, worker, check.op, body)?;
    match outs {
        None => outputs_from_python(py, check, value),
        Some(_) => Err(crate::bridge::out::returned_instead_of_out(check, &value)),
    }
}

/// A forward call's outputs from its worker's answer without Python, where that gives exactly
/// what the GIL's path gives: the `out` buffers the worker wrote, or a plain array of the one
/// declared output's dtype (the usual reply), copied out of shared memory and put through the
/// output check's own shape and device rule (a large copy without the GIL, should the caller
/// hold it). `None` for any other answer, which [`outputs`] reads with the GIL: so a program's
/// worker calls do not wait for its GIL to read their usual reply, while its other threads'
/// bodies may hold it for milliseconds.
pub(crate) fn without_python(
    answer: &Answered,
    check: &OutputCheck<'_>,
    outs: Option<&[(DType, Vec<usize>)]>,
) -> Option<Result<Outputs>> {
    match (&answer.reply, outs) {
        (Reply::Wrote { outs: places, .. }, Some(outs)) => {
            Some(written(answer, check, outs, places))
        }
        (
            Reply::Array {
                place,
                dtype,
                shape,
                ..
            },
            None,
        ) => {
            let [spec] = check.tout else {
                return None;
            };
            let dtype = wire_dtype(dtype).filter(|&d| d == spec.dtype)?;
            let dims = shape
                .iter()
                .map(|&d| usize::try_from(d).ok())
                .collect::<Option<Vec<usize>>>()?;
            let n = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d))?;
            // (An empty array names no memory; the allocation check's refusal is its error.)
            if n == 0 || crate::alloc::check(Some(n), dtype).is_err() {
                return None;
            }
            let (map, offset, len) = region(answer, *place)?;
            if Some(len) != n.checked_mul(dtype.size_in_bytes()) {
                return None;
            }
            let data = map.as_ptr() as usize + offset;
            let tensor = crate::python::copy_without_gil(len, move || {
                // SAFETY: `offset..offset + len` lies inside a mapping the answer keeps alive
                // (`region`), `len` bytes of `n` elements of `dtype`; the worker has finished
                // writing them (it replied).
                unsafe { crate::alloc::tensor_from_bytes(dtype, data as *const u8, dims) }
            });
            // (Out of memory: the GIL's path says so in its words.)
            let tensor = tensor.ok()?;
            Some(placed(check, 0, spec, tensor).map(|t| smallvec::smallvec![t]))
        }
        _ => None,
    }
}

/// The candle dtype of a plain array's dtype string as a worker sends it (`dtype.str`: byte
/// order, kind, size, checked as the protocol checks it), read by the program's one table
/// (`view::plain_dtype`, as `view::candle_dtype` reads a dtype object): native byte order (one
/// byte has none), bool as u8.
fn wire_dtype(dtype: &str) -> Option<DType> {
    let size = crate::worker::protocol::itemsize(dtype)?;
    let [order, kind, ..] = *dtype.as_bytes() else {
        return None;
    };
    let native = if cfg!(target_endian = "little") {
        b'<'
    } else {
        b'>'
    };
    if !(size == 1 || order == native || order == b'=') {
        return None;
    }
    crate::bridge::view::plain_dtype(kind, usize::try_from(size).ok()?)
}

/// The `out` buffers a worker wrote (`places`), as tensors of their dtypes and shapes (`outs`)
/// on the op's device: each in place in the input arena, or, when the body kept a view of its
/// buffers, the copy the worker made in the result arena (sizes checked against the buffers when
/// the reply was read).
fn written(
    answer: &Answered,
    check: &OutputCheck<'_>,
    outs: &[(DType, Vec<usize>)],
    places: &[crate::worker::protocol::Place],
) -> Result<Outputs> {
    outs.iter()
        .zip(places)
        .map(|((dtype, dims), &at)| {
            let Some((map, offset, len)) = region(answer, at) else {
                return Err(check.error(None, "a worker named memory outside its arena".into()));
            };
            let (dtype, dims, data) = (*dtype, dims.clone(), map.as_ptr() as usize + offset);
            let t = crate::python::copy_without_gil(len, move || {
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
