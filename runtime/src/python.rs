//! The one place that takes the GIL, and the set-up of the embedded interpreter.
//!
//! Everything in pyop that needs Python goes through [`with_gil`]: it starts the interpreter on
//! first use, adds the user's Python environment to `sys.path`, registers the `pyop` Python module
//! and measures how long the caller waited for the GIL. Python errors are turned into
//! [`Error`]s here too, while the GIL is still held (a traceback cannot be formatted later).

use std::time::{Duration, Instant};

use pyo3::exceptions::{
    PyKeyboardInterrupt, PyMemoryError, PyNotImplementedError, PyStopIteration, PySystemExit,
    PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyTracebackMethods;

use crate::env::PythonEnv;
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

/// Line-buffers Python's stdout and stderr, then finds and checks the environment.
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
    crate::env::set_up(py)
}

/// The environment, once the interpreter is set up.
pub(crate) fn current_env(py: Python<'_>) -> Option<&'static PythonEnv> {
    READY.get(py)
}

static NUMPY: PyOnceLock<()> = PyOnceLock::new();

/// Checks that NumPy imports, once per process; rust-numpy panics if it does not.
pub(crate) fn ensure_numpy(py: Python<'_>, op: &str) -> Result<()> {
    NUMPY
        .get_or_try_init(py, || match py.import("numpy") {
            Ok(_) => Ok(()),
            Err(e) => {
                let (used, fix, note) = match READY.get(py) {
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
                        if op.is_empty() {
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
    let mut traceback = err
        .traceback(py)
        .map(|tb| format_traceback(py, &tb))
        .unwrap_or_default();
    if err.is_instance_of::<pyo3::exceptions::PySyntaxError>(py) {
        // `str()` of a SyntaxError ends in "(file, line N)", naming only the file's last part;
        // the location is given in full, with the source line and a caret, instead.
        if let Ok(msg) = err.value(py).getattr("msg").and_then(|m| m.extract()) {
            message = msg;
        }
        if let Some(location) = syntax_error_location(py, &err) {
            traceback.push_str(&location);
        }
    }
    Error::Python {
        op: op.to_owned(),
        kind,
        exception,
        message,
        traceback,
    }
}

/// The file name of pyop's own Python code (the `pyop` module's glue, the embedded importer):
/// its frames are left out of the tracebacks users see.
pub(crate) const PYOP_FRAMES: &str = "<pyop>";

/// Formats a traceback with Python's `traceback` module, which reads source lines through
/// `linecache` (where pyop puts embedded and inline sources), unlike `PyTraceBack_Print`. Frames
/// of pyop's own code and of the import machinery are left out: they say nothing about the
/// user's code.
fn format_traceback(py: Python<'_>, tb: &Bound<'_, pyo3::types::PyTraceback>) -> String {
    let formatted = (|| -> PyResult<String> {
        let traceback = py.import("traceback")?;
        let frames = traceback.call_method1("extract_tb", (tb,))?;
        let kept = pyo3::types::PyList::empty(py);
        for frame in frames.try_iter()? {
            let frame = frame?;
            let file: String = frame.getattr("filename")?.extract()?;
            if file != PYOP_FRAMES && !file.starts_with("<frozen importlib") {
                kept.append(frame)?;
            }
        }
        if kept.is_empty() {
            return Ok(String::new());
        }
        let lines = traceback.call_method1("format_list", (kept,))?;
        "".into_pyobject(py)?
            .call_method1("join", (lines,))?
            .extract()
    })();
    match formatted {
        Ok(body) if body.is_empty() => String::new(),
        Ok(body) => format!("Traceback (most recent call last):\n{body}"),
        Err(_) => tb.format().unwrap_or_default(),
    }
}

/// Where a syntax error is, as Python shows it: the file and line, the source line, and a caret.
fn syntax_error_location(py: Python<'_>, err: &PyErr) -> Option<String> {
    let lines = py
        .import("traceback")
        .ok()?
        .call_method1("format_exception_only", (err.value(py),))
        .ok()?;
    let mut lines: Vec<String> = lines.extract().ok()?;
    lines.pop(); // "SyntaxError: message", which the error's own text says
    let text: String = lines.concat();
    (!text.trim().is_empty()).then_some(text)
}

/// What to do about a package a body imports that is not installed.
fn missing_package_hint(py: Python<'_>, err: &PyErr) -> String {
    let name: String = err
        .value(py)
        .getattr("name")
        .and_then(|n| n.extract())
        .unwrap_or_default();
    let top = name.split('.').next().unwrap_or_default();
    match READY.get(py) {
        Some(env) => format!(
            " (pyop uses {}: install it with {}{})",
            env.describe(),
            env.pip_install(top),
            env.problems_note()
        ),
        None => format!(" (install it: `pip install {top}`)"),
    }
}
