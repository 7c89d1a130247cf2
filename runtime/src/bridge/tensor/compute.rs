//! Running candle work for `pyop.Tensor`'s methods and the module's functions: with the GIL
//! released for large tensors, a panic raised as `pyop.RustPanic`, candle's errors as
//! `ValueError`s.

use candle_core::Tensor;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::error::candle_message;
use crate::python::exceptions::RustPanic;

use super::PyTensor;

/// Tensors at least this large are computed with the GIL released.
pub(super) const RELEASE_GIL_AT: usize = 1 << 15;

pub(super) type CResult<T> = candle_core::Result<T>;

pub(super) fn value_error(e: candle_core::Error) -> PyErr {
    PyValueError::new_err(candle_message(&e))
}

/// Runs candle work, with the GIL released when the tensor is large. A panic in it is caught
/// and raised as `pyop.RustPanic` (a BaseException): the body's op then fails with kind
/// `Panic` and the body's traceback, and the executor goes on.
pub(super) fn compute<T: Send>(
    py: Python<'_>,
    elems: usize,
    f: impl FnOnce() -> CResult<T> + Send,
) -> PyResult<T> {
    let run = || std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    let result = if elems >= RELEASE_GIL_AT {
        py.detach(run)
    } else {
        run()
    };
    match result {
        Ok(r) => r.map_err(value_error),
        Err(panic) => Err(RustPanic::new_err(format!(
            "candle panicked: {}",
            crate::error::panic_message(&*panic)
        ))),
    }
}

pub(super) fn wrap(t: Tensor) -> PyTensor {
    PyTensor::new(t)
}
