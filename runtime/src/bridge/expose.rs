//! Rust functions that bodies can call: `pyop.rust.<name>(...)`.
//!
//! A body calls back into Rust through a function registered with [`expose`]. The function runs
//! with the GIL released (it may do candle work, call other ops, block), a panic in it becomes an
//! error of kind [`ErrorKind::Panic`](crate::ErrorKind::Panic), and an error it returns is raised
//! in the body as `pyop.RustError` — which, if the body lets it pass, the calling op reports with
//! its kind kept and the body's traceback added.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use pyo3::exceptions::PyRecursionError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::value::{from_python, to_python, Value};
use super::with_gil;
use crate::error::{panic_message, Error, ErrorKind, Result, NO_OP};
use crate::python::exceptions::{error_to_python, OpTimeout};

/// The stack a nested call through `pyop.rust` must leave: several times what one level of
/// body → Rust → op → body takes in a debug build.
const STACK_MARGIN: usize = 128 * 1024;

type RustFn = dyn Fn(Vec<Value>) -> Result<Value> + Send + Sync;

/// An exposed Rust function as Python sees it.
#[pyclass(frozen, name = "RustFunction", module = "pyop")]
struct RustFunction {
    name: String,
    f: Arc<RustFn>,
}

#[pymethods]
impl RustFunction {
    #[pyo3(signature = (*args))]
    fn __call__(&self, py: Python<'_>, args: &Bound<'_, PyTuple>) -> PyResult<Py<PyAny>> {
        // A body calling Rust calling an op calling a body …: each level takes stack, and a
        // cycle would overflow it long before Python's own recursion limit. Refuse the next
        // level, as Python would, while a margin is left.
        if stacker::remaining_stack().is_some_and(|left| left < STACK_MARGIN) {
            return Err(PyRecursionError::new_err(format!(
                "maximum recursion depth exceeded calling the Rust function `{}`: not enough \
                 stack left for another nested call",
                self.name
            )));
        }
        let values = args
            .iter()
            .map(|a| from_python(py, &a))
            .collect::<PyResult<Vec<_>>>()?;
        let (f, name) = (self.f.clone(), self.name.clone());
        let result = py.detach(move || {
            catch_unwind(AssertUnwindSafe(|| f(values))).unwrap_or_else(|panic| {
                Err(Error::op_failure(
                    &name,
                    ErrorKind::Panic,
                    format!(
                        "the Rust function `{name}` panicked: {}",
                        panic_message(&*panic)
                    ),
                ))
            })
        });
        match result {
            Ok(v) => to_python(py, v).map(Bound::unbind),
            // A time limit that fired in a nested op stays a BaseException all the way out, so
            // `except Exception` in the outer body cannot swallow it.
            Err(e) if e.kind() == ErrorKind::Timeout => Err(OpTimeout::new_err(e.to_string())),
            Err(e) => Err(error_to_python(e.with_op_if_none(&self.name))),
        }
    }

    fn __repr__(&self) -> String {
        format!("<pyop Rust function {}>", self.name)
    }
}

/// Makes `f` callable from every body as `pyop.rust.<name>(...)`; registering a name again
/// replaces the function.
///
/// ```
/// use pyop::candle::{Device, Tensor};
/// use pyop::{expose, py_op, Value};
///
/// #[py_op(code = "import pyop\ndef twice_plus_one(x):\n    return pyop.rust.double(x) + 1", tout = f32)]
/// fn twice_plus_one(x: &Tensor) -> pyop::Result<Tensor>;
///
/// expose("double", |args| Ok(Value::from((args[0].tensor()? * 2.0)?)))?;
/// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// assert_eq!(twice_plus_one(&x)?.to_vec1::<f32>()?, [3.0, 5.0]);
/// # Ok::<(), pyop::Error>(())
/// ```
pub fn expose<F>(name: &str, f: F) -> Result<()>
where
    F: Fn(Vec<Value>) -> Result<Value> + Send + Sync + 'static,
{
    let function = RustFunction {
        name: name.to_owned(),
        f: Arc::new(f),
    };
    with_gil(NO_OP, |py| {
        let run = || -> PyResult<()> {
            let rust = py.import("pyop")?.getattr("rust")?;
            rust.setattr(name, Bound::new(py, function)?)
        };
        run().map_err(|e| crate::python::errors::python_error(py, NO_OP, e))
    })
    .map(|_| ())
}
