//! NumPy's presence: checked once before numpy mode needs it (rust-numpy panics without it), and
//! the few NumPy objects the conversion layer uses, looked up once.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use super::describe;
use crate::error::{Error, ErrorKind, Result};

static NUMPY: PyOnceLock<()> = PyOnceLock::new();

/// Set once [`ensure_numpy`] has imported NumPy: read without the GIL.
static IMPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether NumPy has been imported here already (an import takes milliseconds: an awaited call
/// leaves it to pyop's threads).
pub(crate) fn imported() -> bool {
    IMPORTED.load(std::sync::atomic::Ordering::Acquire)
}

/// Checks that NumPy imports, once per process; rust-numpy panics if it does not.
pub(crate) fn ensure_numpy(py: Python<'_>, op: Option<&str>) -> Result<()> {
    if NUMPY.get(py).is_some() {
        return Ok(());
    }
    // Pyop's imports in turns first, then the once: always in that order, so a thread loading
    // a body (its turn taken) whose top level calls a numpy-mode op cannot wait on this once
    // while the thread inside it waits for the turn.
    let _importing = super::importing::Importing::begin(py);
    NUMPY
        .get_or_try_init(py, || match import_numpy(py) {
            Ok(_) => {
                IMPORTED.store(true, std::sync::atomic::Ordering::Release);
                Ok(())
            }
            Err(e) => {
                let (used, fix, note) = match super::env::current(py) {
                    Some(env) => (
                        env.describe(),
                        env.pip_install("numpy"),
                        env.problems_note(),
                    ),
                    None => (
                        String::new(),
                        "`pip install numpy`".to_owned(),
                        String::new(),
                    ),
                };
                Err(Error::op_failure(
                    op,
                    ErrorKind::PackageUnavailable,
                    format!(
                        "{} needs NumPy, which the embedded Python cannot import ({}); \
                         pyop uses {used}: install it with {fix}, or point PYOP_PYTHON_ENV at a \
                         venv that has it{note}",
                        if op.is_none() {
                            "`Tensor.numpy()`"
                        } else {
                            "numpy mode"
                        },
                        describe(py, &e)
                    ),
                ))
            }
        })
        .copied()
}

/// What the conversion layer needs of NumPy, looked up once.
pub(crate) struct NumpyRefs {
    /// `numpy.generic`, the type of NumPy scalars.
    pub generic: Py<PyAny>,
    /// `numpy.asarray`.
    pub asarray: Py<PyAny>,
}

static NUMPY_REFS: PyOnceLock<NumpyRefs> = PyOnceLock::new();

/// Whether [`numpy_if_loaded`] has found NumPy loaded (one load: what a call's usual output
/// check asks before it reads an array).
#[inline]
pub(crate) fn known_loaded(py: Python<'_>) -> bool {
    NUMPY_REFS.get(py).is_some()
}

/// NumPy, if something already imported it (tensor mode never imports NumPy itself). Once it
/// is, the answer is cached: this runs on every output conversion.
pub(crate) fn numpy_if_loaded(py: Python<'_>) -> PyResult<Option<&'static NumpyRefs>> {
    if let Some(refs) = NUMPY_REFS.get(py) {
        return Ok(Some(refs));
    }
    let modules = py.import("sys")?.getattr("modules")?;
    let np = modules.call_method1("get", ("numpy",))?;
    if np.is_none() || !np.hasattr("ndarray")? {
        return Ok(None); // absent, or still being imported
    }
    let refs = NumpyRefs {
        generic: np.getattr("generic")?.unbind(),
        asarray: np.getattr("asarray")?.unbind(),
    };
    Ok(Some(NUMPY_REFS.get_or_init(py, || refs)))
}

/// Imports NumPy where no time limit can interrupt it, in turns with pyop's other imports
/// (`importing`).
pub(crate) fn import_numpy(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    let _importing = super::importing::Importing::begin(py);
    py.import("numpy")
}
