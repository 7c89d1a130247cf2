//! The one place that takes the GIL, and the set-up of the embedded interpreter.
//!
//! Everything in pyop that needs Python goes through [`with_gil`]: it starts the interpreter on
//! first use, adds the user's Python environment to `sys.path`, registers the `pyop` Python module
//! and measures how long the caller waited for the GIL. Python errors are turned into
//! [`Error`]s here too, while the GIL is still held (a traceback cannot be formatted later).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pyo3::exceptions::{
    PyKeyboardInterrupt, PyMemoryError, PyNotImplementedError, PyStopIteration, PySystemExit,
    PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyTracebackMethods;

use crate::error::{Error, ErrorKind, Result};

/// Runs `f` with the GIL held; returns its result and how long this thread waited for the GIL.
///
/// Re-entrant: a thread that already holds the GIL (a body calling back into Rust, or Rust code
/// inside `Python::attach`) gets it again at once.
pub(crate) fn with_gil<R>(
    op: &str,
    f: impl for<'py> FnOnce(Python<'py>) -> Result<R>,
) -> Result<(R, Duration)> {
    let asked = Instant::now();
    Python::attach(|py| {
        let waited = asked.elapsed();
        ensure_ready(py).map_err(|e| e.with_op(op))?;
        f(py).map(|r| (r, waited))
    })
}

/// Runs `f`, which must not need Python, with the GIL released if this thread holds it.
///
/// Used around anything that can block on another thread (candle's storage locks): a thread that
/// blocks while holding the GIL can deadlock with a Python body that is waiting for the GIL.
pub(crate) fn without_gil<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    // SAFETY: PyGILState_Check only reads the calling thread's state; Py_IsInitialized first so
    // that it is never asked before the interpreter exists.
    let held = unsafe { pyo3::ffi::Py_IsInitialized() != 0 && pyo3::ffi::PyGILState_Check() == 1 };
    if held {
        Python::attach(|py| py.detach(f))
    } else {
        f()
    }
}

/// Which Python environment the interpreter was given, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PythonEnv {
    /// The environment's root folder, or `None` when only the interpreter's own packages are used.
    pub root: Option<PathBuf>,
    /// The `site-packages` folder added to `sys.path`.
    pub site_packages: Option<PathBuf>,
    /// Why this environment: `PYOP_PYTHON_ENV`, `VIRTUAL_ENV`, `.venv` or `none`.
    pub source: &'static str,
    /// `sys.version` of the running interpreter.
    pub version: String,
}

static READY: PyOnceLock<PythonEnv> = PyOnceLock::new();

fn ensure_ready(py: Python<'_>) -> Result<&'static PythonEnv> {
    READY.get_or_try_init(py, || {
        let env = set_up_environment(py).map_err(|e| {
            Error::op_failure(
                "",
                ErrorKind::PythonUnavailable,
                format!("cannot set up the embedded Python: {}", describe(py, &e)),
            )
        })?;
        crate::tensor::register_module(py).map_err(|e| {
            Error::op_failure(
                "",
                ErrorKind::PythonUnavailable,
                format!(
                    "cannot register the `pyop` Python module: {}",
                    describe(py, &e)
                ),
            )
        })?;
        Ok(env)
    })
}

/// The Python environment pyop uses, starting the interpreter if needed.
pub fn python_env() -> Result<PythonEnv> {
    Python::attach(|py| ensure_ready(py).cloned())
}

/// Finds the environment: `PYOP_PYTHON_ENV`, else `VIRTUAL_ENV`, else the nearest `.venv` in the
/// current folder or one of its parents; an embedded interpreter honours none of these by itself.
fn set_up_environment(py: Python<'_>) -> PyResult<PythonEnv> {
    let sys = py.import("sys")?;
    // Rust's stdout is line-buffered; Python's is block-buffered when not a terminal. Line
    // buffering on both keeps their output in order, line by line, when both print.
    for stream in ["stdout", "stderr"] {
        if let Ok(s) = sys.getattr(stream) {
            if s.hasattr("reconfigure").unwrap_or(false) {
                let kwargs = pyo3::types::PyDict::new(py);
                kwargs.set_item("line_buffering", true)?;
                let _ = s.call_method("reconfigure", (), Some(&kwargs));
            }
        }
    }
    let version: String = sys.getattr("version")?.extract()?;
    let (major, minor): (u32, u32) = sys
        .getattr("version_info")?
        .extract::<(u32, u32, u32, String, u32)>()
        .map(|v| (v.0, v.1))?;
    let found = std::env::var_os("PYOP_PYTHON_ENV")
        .filter(|v| !v.is_empty())
        .map(|v| (PathBuf::from(v), "PYOP_PYTHON_ENV"))
        .or_else(|| {
            std::env::var_os("VIRTUAL_ENV")
                .filter(|v| !v.is_empty())
                .map(|v| (PathBuf::from(v), "VIRTUAL_ENV"))
        })
        .or_else(|| {
            let cwd = std::env::current_dir().ok()?;
            cwd.ancestors()
                .map(|d| d.join(".venv"))
                .find(|d| d.join("pyvenv.cfg").is_file())
                .map(|d| (d, ".venv"))
        });
    let Some((root, source)) = found else {
        return Ok(PythonEnv {
            root: None,
            site_packages: None,
            source: "none",
            version,
        });
    };
    let site_packages = site_packages_of(&root, major, minor);
    if let Some(sp) = &site_packages {
        py.import("site")?
            .call_method1("addsitedir", (sp.to_string_lossy().as_ref(),))?;
    } else {
        tracing::warn!(
            env = %root.display(),
            "pyop: {source} names {} but it has no site-packages for Python {major}.{minor}",
            root.display()
        );
    }
    Ok(PythonEnv {
        root: Some(root),
        site_packages,
        source,
        version,
    })
}

fn site_packages_of(root: &Path, major: u32, minor: u32) -> Option<PathBuf> {
    [
        root.join("lib")
            .join(format!("python{major}.{minor}"))
            .join("site-packages"),
        root.join("Lib").join("site-packages"),
    ]
    .into_iter()
    .find(|p| p.is_dir())
}

static NUMPY: PyOnceLock<()> = PyOnceLock::new();

/// Checks that NumPy imports, once per process; rust-numpy panics if it does not.
pub(crate) fn ensure_numpy(py: Python<'_>, op: &str) -> Result<()> {
    NUMPY
        .get_or_try_init(py, || match py.import("numpy") {
            Ok(_) => Ok(()),
            Err(e) => {
                let env = READY.get(py);
                let where_ = match env.and_then(|e| e.root.as_ref()) {
                    Some(root) => format!("the environment {} ", root.display()),
                    None => "the interpreter's own site-packages ".to_owned(),
                };
                Err(Error::op_failure(
                    op,
                    ErrorKind::PackageUnavailable,
                    format!(
                        "numpy mode needs NumPy, which the embedded Python cannot import ({}); \
                         install it into {where_}(`python3 -m pip install numpy`), or point \
                         PYOP_PYTHON_ENV or VIRTUAL_ENV at a venv that has it",
                        describe(py, &e)
                    ),
                ))
            }
        })
        .copied()
}

/// `TypeName: message` of a Python error, for messages that need no traceback.
pub(crate) fn describe(py: Python<'_>, err: &PyErr) -> String {
    let ty = err
        .get_type(py)
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "Exception".to_owned());
    let msg = err
        .value(py)
        .str()
        .map(|s| s.to_string())
        .unwrap_or_default();
    format!("{ty}: {msg}")
}

/// Turns a Python exception into an [`Error`], keeping its kind, message and traceback.
pub(crate) fn python_error(py: Python<'_>, op: &str, err: PyErr) -> Error {
    // An error from Rust code the body called (an exposed function, a nested op) keeps its kind.
    let kind = if let Some(kind) = crate::tensor::rust_error_kind(py, &err) {
        kind
    } else if err.is_instance_of::<PyValueError>(py) || err.is_instance_of::<PyTypeError>(py) {
        ErrorKind::InvalidArgument
    } else if err.is_instance_of::<PyStopIteration>(py) {
        ErrorKind::OutOfRange
    } else if err.is_instance_of::<PyMemoryError>(py) {
        ErrorKind::ResourceExhausted
    } else if err.is_instance_of::<PyNotImplementedError>(py) {
        ErrorKind::Unimplemented
    } else if err.is_instance_of::<PyKeyboardInterrupt>(py)
        || err.is_instance_of::<PySystemExit>(py)
    {
        ErrorKind::Cancelled
    } else if crate::tensor::is_timeout(py, &err) {
        ErrorKind::Timeout
    } else if err.is_instance_of::<pyo3::panic::PanicException>(py) {
        ErrorKind::Panic
    } else {
        ErrorKind::Unknown
    };
    let exception = err
        .get_type(py)
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "Exception".to_owned());
    let mut message = err
        .value(py)
        .str()
        .map(|s| s.to_string())
        .unwrap_or_default();
    if err.is_instance_of::<pyo3::exceptions::PyModuleNotFoundError>(py) {
        message.push_str(&missing_package_hint(py, &err));
    }
    let traceback = err
        .traceback(py)
        .map(|tb| format_traceback(py, &tb))
        .unwrap_or_default();
    Error::Python {
        op: op.to_owned(),
        kind,
        exception,
        message,
        traceback,
    }
}

/// Formats a traceback with Python's `traceback` module, which reads source lines through
/// `linecache` (where pyop puts embedded and inline sources), unlike `PyTraceBack_Print`.
fn format_traceback(py: Python<'_>, tb: &Bound<'_, pyo3::types::PyTraceback>) -> String {
    let formatted = py
        .import("traceback")
        .and_then(|m| m.call_method1("format_tb", (tb,)))
        .and_then(|lines| "".into_pyobject(py)?.call_method1("join", (lines,)))
        .and_then(|s| s.extract::<String>());
    match formatted {
        Ok(body) => format!("Traceback (most recent call last):\n{body}"),
        Err(_) => tb.format().unwrap_or_default(),
    }
}

/// What to do about a package a body imports that is not installed.
fn missing_package_hint(py: Python<'_>, err: &PyErr) -> String {
    let name: String = err
        .value(py)
        .getattr("name")
        .and_then(|n| n.extract())
        .unwrap_or_default();
    let top = name.split('.').next().unwrap_or_default();
    let into = match READY.get(py).and_then(|e| e.root.as_ref()) {
        Some(root) => format!("into {}", root.display()),
        None => "(no venv is active: set VIRTUAL_ENV or PYOP_PYTHON_ENV, or make a .venv)".into(),
    };
    format!(" (install it {into}: `python3 -m pip install {top}`)")
}
