//! A worker's reply as Python values in the program: its pickle loaded with its large buffers
//! read in place from shared memory (read-only views that keep the mapping alive), and its
//! exceptions rebuilt with their kind, message and the worker's traceback. The output check then
//! runs on these values exactly as on a body's own (`bridge::outputs`).

use std::ffi::c_int;
use std::sync::Arc;

use memmap2::MmapRaw;
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::error::{Error, ErrorKind, IntoOpName};
use crate::python::errors::{python_error, run_pyop_code};
use crate::worker::exchange::Answered;
use crate::worker::protocol::{ExcInfo, Place, Region, Reply};

/// Bytes of a worker arena, exported read-only through the buffer protocol. Every view NumPy
/// makes of them holds this object, and this object holds the mapping: the memory stays mapped
/// for as long as any view of it exists, whatever happens to the arena.
#[pyclass(frozen, name = "SharedBytes", module = "pyop")]
pub(crate) struct SharedBytes {
    map: Arc<MmapRaw>,
    offset: usize,
    len: usize,
}

#[pymethods]
impl SharedBytes {
    /// Read-only, one-dimensional bytes.
    ///
    /// # Safety
    /// Called by Python with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if flags & pyo3::ffi::PyBUF_WRITABLE == pyo3::ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err("a worker's reply is read-only"));
        }
        let this = slf.get();
        // SAFETY: `offset + len` lies inside the mapping (checked in `buffers`), which `slf`
        // keeps alive; PyBuffer_FillInfo takes a new reference to `slf` for the view.
        let ret = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                this.map.as_mut_ptr().add(this.offset).cast(),
                this.len as pyo3::ffi::Py_ssize_t,
                1,
                flags,
            )
        };
        if ret == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }
}

static GLUE: PyOnceLock<Py<PyDict>> = PyOnceLock::new();

fn glue(py: Python<'_>) -> PyResult<&Bound<'_, PyDict>> {
    GLUE.get_or_try_init(py, || {
        let namespace = PyDict::new(py);
        run_pyop_code(py, crate::worker::python::PICKLE_NAMES_PY, &namespace)?;
        run_pyop_code(py, include_str!("python/reply.py"), &namespace)?;
        Ok(namespace.unbind())
    })
    .map(|g| g.bind(py))
}

fn glue_fn<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    Ok(glue(py)?
        .get_item(name)?
        .expect("reply.py defines its functions"))
}

/// The value a worker returned: a plain array it sent as dtype, shape and bytes, or its pickle,
/// with buffers read in place. `None` for a reply that carries no value.
pub(crate) fn reply_value<'py>(
    py: Python<'py>,
    answer: &Answered,
) -> Option<PyResult<Bound<'py, PyAny>>> {
    match &answer.reply {
        Reply::Array {
            place,
            dtype,
            shape,
            ..
        } => Some(
            shared_bytes(py, answer, *place)
                .and_then(|bytes| array_value(py, dtype, shape.clone(), bytes)),
        ),
        Reply::Pickled { bufs, .. } => Some((|| {
            let buffers = PyList::empty(py);
            for buf in bufs {
                buffers.append(shared_bytes(py, answer, *buf)?)?;
            }
            pickled_value(py, PyBytes::new(py, &answer.payload), buffers)
        })()),
        _ => None,
    }
}

/// A plain array sent as its dtype's string, shape and bytes: a read-only view of the bytes (a
/// dtype with objects or fields is refused, as in a pickle).
fn array_value<'py>(
    py: Python<'py>,
    dtype: &str,
    shape: impl IntoPyObject<'py>,
    bytes: Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    glue_fn(py, "_array")?.call1((dtype, shape, bytes))
}

/// A pickle with its out-of-band buffers, read by the restricted unpickler (only the plain
/// types' constructors and pyop's own).
fn pickled_value<'py>(
    py: Python<'py>,
    payload: impl IntoPyObject<'py>,
    buffers: impl IntoPyObject<'py>,
) -> PyResult<Bound<'py, PyAny>> {
    glue_fn(py, "loads")?.call1((payload, buffers))
}

/// Where a place of a checked answer lies: the mapping, the offset and the length (checked again
/// against the mappings the answer holds; `None` outside them).
pub(crate) fn region(answer: &Answered, at: Place) -> Option<(&Arc<MmapRaw>, usize, usize)> {
    let len = |m: &Option<Arc<MmapRaw>>| m.as_ref().map_or(0, |m| m.len());
    let Region { arena, offset, len } = at
        .check("place", [len(&answer.input), len(&answer.result)])
        .ok()?;
    let map = match arena {
        0 => answer.input.as_ref(),
        _ => answer.result.as_ref(),
    };
    map.map(|m| (m, offset, len))
}

/// The bytes a reply names (`region`), as a read-only buffer over the arena.
fn shared_bytes<'py>(py: Python<'py>, answer: &Answered, at: Place) -> PyResult<Bound<'py, PyAny>> {
    if at.2 == 0 {
        return Ok(PyBytes::new(py, b"").into_any());
    }
    let Some((map, offset, len)) = region(answer, at) else {
        return Err(PyBufferError::new_err(
            "a worker named a buffer outside its shared memory",
        ));
    };
    Ok(Bound::new(
        py,
        SharedBytes {
            map: Arc::clone(map),
            offset,
            len,
        },
    )?
    .into_any())
}

/// The error a worker's exception (`exc` of its reply) becomes: the same kind, exception name
/// and message the body's exception would give in the program, with the worker's traceback.
pub(crate) fn worker_exception(py: Python<'_>, op: impl IntoOpName + Copy, exc: &ExcInfo) -> Error {
    let rebuilt = glue_fn(py, "exception").and_then(|f| {
        f.call1((
            exc.type_name.as_str(),
            exc.module.as_str(),
            exc.bases.clone(),
            exc.message.as_str(),
            exc.name.as_deref(),
        ))
    });
    let err = match rebuilt {
        Ok(e) => python_error(py, op, PyErr::from_value(e)),
        Err(e) => python_error(py, op, e),
    };
    match err {
        Error::Python {
            op,
            kind,
            exception,
            mut message,
            ..
        } => {
            let mut traceback = exc.traceback.clone();
            if let Some(syntax) = &exc.syntax {
                message = syntax.msg.clone();
                traceback.push_str(&syntax.location);
            }
            Error::Python {
                op,
                kind,
                exception,
                message,
                traceback,
            }
        }
        other => other,
    }
}

/// Kinds a worker's failures take that no Python exception has.
pub(crate) fn result_not_sent(op: impl IntoOpName, exc: &ExcInfo) -> Error {
    Error::mismatch(
        op,
        ErrorKind::OutputMismatch,
        None,
        format!(
            "the body's result could not be sent back from its worker: {}: {}",
            exc.type_name, exc.message
        ),
    )
}
