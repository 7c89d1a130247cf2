//! The `pyop` Python module: `pyop.Tensor` wraps a candle tensor for tensor-mode bodies.

use candle_core::Tensor;
use pyo3::prelude::*;
use pyo3::types::PyModule;

use crate::error::Error;

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

/// A candle tensor as Python sees it. Holds the tensor itself: same storage, same device.
#[pyclass(name = "Tensor", module = "pyop", frozen)]
pub struct PyTensor {
    tensor: Tensor,
}

impl PyTensor {
    pub(crate) fn new(tensor: Tensor) -> Self {
        Self { tensor }
    }

    /// The wrapped tensor.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }
}

/// Carries a pyop [`Error`] through a Python exception raised by Rust code.
#[pyclass(frozen)]
struct ErrorBox(std::sync::Mutex<Option<Error>>);

/// A Python exception (`pyop.RustError`) carrying `err`, for Rust code called from a body.
pub fn error_to_python(err: Error) -> PyErr {
    Python::attach(|py| {
        let e = RustError::new_err(err.to_string());
        let value = e.value(py);
        if let Ok(b) = Bound::new(py, ErrorBox(std::sync::Mutex::new(Some(err)))) {
            let _ = value.setattr("_pyop_error", b);
        }
        e
    })
}

/// The pyop error inside a `pyop.RustError`, re-labelled as raised in `op`'s body (its kind kept,
/// Python's traceback added).
pub(crate) fn take_rust_error(py: Python<'_>, err: &PyErr) -> Option<Error> {
    let value = err.value(py);
    let boxed = value.getattr("_pyop_error").ok()?;
    let boxed = boxed.cast::<ErrorBox>().ok()?;
    let inner = boxed.get().0.lock().ok()?.take()?;
    Some(inner)
}

pub(crate) fn is_timeout(py: Python<'_>, err: &PyErr) -> bool {
    err.is_instance_of::<OpTimeout>(py)
}

/// NumPy's module if something already imported it; tensor mode never imports NumPy itself.
pub(crate) fn numpy_if_loaded(py: Python<'_>) -> PyResult<Option<Bound<'_, PyAny>>> {
    let modules = py.import("sys")?.getattr("modules")?;
    modules.call_method1("get", ("numpy",)).map(|m| (!m.is_none()).then_some(m))
}

/// Creates the `pyop` module and puts it in `sys.modules`.
pub(crate) fn register_module(py: Python<'_>) -> PyResult<()> {
    let m = PyModule::new(py, "pyop")?;
    m.add_class::<PyTensor>()?;
    m.add("OpTimeout", py.get_type::<OpTimeout>())?;
    m.add("RustError", py.get_type::<RustError>())?;
    py.import("sys")?.getattr("modules")?.set_item("pyop", m)?;
    Ok(())
}
