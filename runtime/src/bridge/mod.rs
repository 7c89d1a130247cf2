//! The bridge between candle and Python: the one door op code takes into Python ([`with_gil`]),
//! tensors made ready for Python and turned into NumPy views or `pyop.Tensor`s, Python values
//! turned back into tensors by the one output check, the `pyop` module, and Rust functions
//! exposed to bodies.

pub(crate) mod args;
pub(crate) mod dlpack;
pub(crate) mod expose;
pub(crate) mod ndarray;
pub(crate) mod numbers;
pub(crate) mod out;
pub(crate) mod outputs;
pub(crate) mod prepare;
pub(crate) mod shared;
pub(crate) mod tensor;
pub(crate) mod value;
pub(crate) mod view;

use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::error::{Error, ErrorKind, IntoOpName, Result, NO_OP};
use crate::python::describe;
use crate::python::env::{self, PythonEnv};

/// Runs `f` with the GIL held and returns its result.
///
/// Re-entrant: a thread that already holds the GIL (a body calling back into Rust, or Rust code
/// inside `Python::attach`) gets it again at once.
#[inline(always)]
pub(crate) fn with_gil<R>(
    op: impl IntoOpName + Copy,
    f: impl for<'py> FnOnce(Python<'py>) -> Result<R>,
) -> Result<R> {
    if READY.load(Ordering::Acquire) {
        return crate::python::attach_in_turn(f);
    }
    first_with_gil(op, f)
}

/// [`with_gil`] before the interpreter is ready: once per process (out of line, so that the
/// usual call inlines only the check above).
#[cold]
#[inline(never)]
fn first_with_gil<R>(
    op: impl IntoOpName + Copy,
    f: impl for<'py> FnOnce(Python<'py>) -> Result<R>,
) -> Result<R> {
    env::preflight().map_err(|e| e.with_op(op.into_op_name().as_deref()))?;
    crate::python::attach(|py| {
        ensure_ready(py).map_err(|e| e.with_op(op.into_op_name().as_deref()))?;
        READY.store(true, Ordering::Release);
        f(py)
    })
}

/// Set once the interpreter is started and set up and the `pyop` module installed: what
/// [`ensure_ready`] does once per process, after which no call asks again (none of it is ever
/// undone while the process runs).
static READY: AtomicBool = AtomicBool::new(false);

static MODULE: PyOnceLock<()> = PyOnceLock::new();

/// Starts and sets up the interpreter, and installs the `pyop` module, once per process.
fn ensure_ready(py: Python<'_>) -> Result<&'static PythonEnv> {
    let env = env::init(py)?;
    MODULE.get_or_try_init(py, || {
        tensor::module::install(py).map_err(|e| {
            Error::op_failure(
                NO_OP,
                ErrorKind::PythonUnavailable,
                format!(
                    "cannot register the `pyop` Python module: {}",
                    describe(py, &e)
                ),
            )
        })
    })?;
    Ok(env)
}

/// The Python environment pyop uses, starting the interpreter if needed.
pub fn python_env() -> Result<PythonEnv> {
    env::preflight()?;
    crate::python::attach(|py| ensure_ready(py).cloned())
}
