//! The `pyop` Python module: created once, when the interpreter is set up, and put in
//! `sys.modules` so every body can `import pyop`.

use pyo3::prelude::*;
use pyo3::types::PyModule;

use super::functions::*;
use super::PyTensor;
use crate::python::exceptions::{OpTimeout, RustError, RustPanic};

/// Module-level forms of the methods (`pyop.log(x)` as well as `x.log()`); numbers become tensors.
const MODULE_GLUE: &str = include_str!("python/tensor_helpers.py");

/// Creates the `pyop` module and puts it in `sys.modules`.
pub(crate) fn install(py: Python<'_>) -> PyResult<()> {
    let m = PyModule::new(py, "pyop")?;
    m.add_class::<PyTensor>()?;
    m.add("OpTimeout", py.get_type::<OpTimeout>())?;
    m.add("RustError", py.get_type::<RustError>())?;
    m.add("RustPanic", py.get_type::<RustPanic>())?;
    m.add_function(wrap_pyfunction!(tensor, &m)?)?;
    m.add_function(wrap_pyfunction!(zeros, &m)?)?;
    m.add_function(wrap_pyfunction!(ones, &m)?)?;
    m.add_function(wrap_pyfunction!(full, &m)?)?;
    m.add_function(wrap_pyfunction!(zeros_like, &m)?)?;
    m.add_function(wrap_pyfunction!(ones_like, &m)?)?;
    m.add_function(wrap_pyfunction!(arange, &m)?)?;
    m.add_function(wrap_pyfunction!(cat, &m)?)?;
    m.add_function(wrap_pyfunction!(stack, &m)?)?;
    m.add_function(wrap_pyfunction!(where_, &m)?)?;
    // Compiled under the name `<pyop>`, so that tracebacks can leave pyop's own frames out.
    crate::python::errors::run_pyop_code(py, MODULE_GLUE, &m.dict())?;
    let rust = PyModule::new(py, "pyop.rust")?;
    rust.setattr(
        "__doc__",
        "Rust functions exposed to bodies with pyop::expose.",
    )?;
    m.add("rust", &rust)?;
    let modules = py.import("sys")?.getattr("modules")?;
    modules.set_item("pyop.rust", rust)?;
    modules.set_item("pyop", m)?;
    Ok(())
}
