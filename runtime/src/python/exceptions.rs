//! pyop's Python exceptions, and pyop errors carried through Python: a Rust function called by a
//! body that fails raises `pyop.RustError` holding the error's kind, so an op whose body lets it
//! pass reports that kind.

use pyo3::prelude::*;

use crate::error::{Error, ErrorKind};

pyo3::create_exception!(
    pyop,
    OpTimeout,
    pyo3::exceptions::PyBaseException,
    "Raised inside a body that ran past its time limit."
);
pyo3::create_exception!(
    pyop,
    RustError,
    pyo3::exceptions::PyException,
    "An error from Rust code called by a body (a nested op, an exposed Rust function)."
);

pyo3::create_exception!(
    pyop,
    RustPanic,
    pyo3::exceptions::PyBaseException,
    "A panic in Rust code a body called (a tensor method, a kernel): the op fails with kind Panic."
);

/// The kind of the pyop error a `pyop.RustError` carries.
#[pyclass(frozen)]
struct ErrorKindBox(ErrorKind);

/// A Python exception (`pyop.RustError`) carrying `err`, for Rust code called from a body: an op
/// whose body lets it pass reports it with its kind kept and the body's traceback added.
pub fn error_to_python(err: Error) -> PyErr {
    super::attach(|py| {
        let e = RustError::new_err(err.to_string());
        if let Ok(b) = Bound::new(py, ErrorKindBox(err.kind())) {
            let _ = e.value(py).setattr("_pyop_kind", b);
        }
        e
    })
}

/// The kind of the pyop error inside a `pyop.RustError`, if `err` is one.
pub(crate) fn rust_error_kind(py: Python<'_>, err: &PyErr) -> Option<ErrorKind> {
    if !err.is_instance_of::<RustError>(py) {
        return None;
    }
    let boxed = err.value(py).getattr("_pyop_kind").ok()?;
    Some(boxed.cast::<ErrorKindBox>().ok()?.get().0)
}

/// Whether `err` is a caught Rust panic (`pyop.RustPanic`).
pub(crate) fn is_panic(py: Python<'_>, err: &PyErr) -> bool {
    err.is_instance_of::<RustPanic>(py) || err.is_instance_of::<pyo3::panic::PanicException>(py)
}

/// Whether `err` is the watchdog's `pyop.OpTimeout`.
pub(crate) fn is_timeout(py: Python<'_>, err: &PyErr) -> bool {
    err.is_instance_of::<OpTimeout>(py)
}
