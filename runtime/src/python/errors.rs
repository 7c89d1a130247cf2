//! Python exceptions into [`Error`]s, keeping their kind, message and traceback. Formatted while
//! the GIL is held: a traceback cannot be formatted later.

use pyo3::exceptions::{
    PyKeyboardInterrupt, PyMemoryError, PyNotImplementedError, PyStopIteration, PySystemExit,
    PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::PyTracebackMethods;

use super::exception_parts;
use super::exceptions::{is_panic, is_timeout, rust_error_kind};
use crate::error::{Error, ErrorKind, IntoOpName};

/// Turns a Python exception into an [`Error`], keeping its kind, message and traceback.
pub(crate) fn python_error(py: Python<'_>, op: impl IntoOpName, err: PyErr) -> Error {
    // An error from Rust code the body called (an exposed function, a nested op) keeps its kind.
    let kind = if let Some(kind) = rust_error_kind(py, &err) {
        kind
    } else if err.is_instance_of::<pyo3::exceptions::PyModuleNotFoundError>(py) {
        // A package the body imports is not installed: what NumPy missing is too.
        ErrorKind::PackageUnavailable
    } else if err.is_instance_of::<PyValueError>(py) || err.is_instance_of::<PyTypeError>(py) {
        ErrorKind::InvalidArgument
    } else if err.is_instance_of::<PyStopIteration>(py)
        || err.is_instance_of::<pyo3::exceptions::PyOverflowError>(py)
    {
        ErrorKind::OutOfRange
    } else if err.is_instance_of::<PyMemoryError>(py)
        || err.is_instance_of::<pyo3::exceptions::PyRecursionError>(py)
    {
        ErrorKind::ResourceExhausted
    } else if err.is_instance_of::<PyNotImplementedError>(py) {
        ErrorKind::Unimplemented
    } else if err.is_instance_of::<PyKeyboardInterrupt>(py)
        || err.is_instance_of::<PySystemExit>(py)
    {
        ErrorKind::Cancelled
    } else if is_timeout(py, &err) {
        ErrorKind::Timeout
    } else if is_panic(py, &err) {
        ErrorKind::Panic
    } else {
        ErrorKind::Unknown
    };
    let (exception, mut message) = exception_parts(py, &err);
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
        op: op.into_op_name(),
        kind,
        exception,
        message,
        traceback,
    }
}

/// The file name of pyop's own Python code (the `pyop` module's glue, the embedded importer):
/// its frames are left out of the tracebacks users see.
pub(crate) const PYOP_FRAMES: &str = "<pyop>";

/// Runs pyop's own Python `code` in `namespace`, compiled under [`PYOP_FRAMES`].
pub(crate) fn run_pyop_code(
    py: Python<'_>,
    code: &str,
    namespace: &Bound<'_, pyo3::types::PyDict>,
) -> PyResult<()> {
    let builtins = py.import("builtins")?;
    let compiled = builtins
        .getattr("compile")?
        .call1((code, PYOP_FRAMES, "exec"))?;
    builtins.getattr("exec")?.call1((compiled, namespace))?;
    Ok(())
}

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
            // pyop loads a package by `importlib.import_module`: its frame, before any of the
            // user's, is pyop's machinery (one a body's own call makes comes after its frames).
            let loader =
                kept.is_empty() && std::path::Path::new(&file).ends_with("importlib/__init__.py");
            if file != PYOP_FRAMES && !file.starts_with("<frozen importlib") && !loader {
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
        // The two-argument form: Python 3.9 has no one-argument one.
        .call_method1("format_exception_only", (err.get_type(py), err.value(py)))
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
    let (package, known) = distribution(&name);
    // A name pip may not know under that name is said to be a guess.
    let guess = if known {
        ""
    } else {
        " (the package may have another name on PyPI)"
    };
    match super::env::current(py) {
        Some(env) => format!(
            " (pyop uses {}: install it with {}{guess}{})",
            env.describe(),
            env.pip_install(package),
            env.problems_note()
        ),
        None => format!(" (install it: `pip install {package}`{guess})"),
    }
}

/// Import names and their distributions, sorted by import name (a test checks it).
const TOP: &[(&str, &str)] = &[
    ("Bio", "biopython"),
    ("Crypto", "pycryptodome"),
    ("Levenshtein", "levenshtein"),
    ("MySQLdb", "mysqlclient"),
    ("OpenSSL", "pyOpenSSL"),
    ("PIL", "pillow"),
    ("attr", "attrs"),
    ("bs4", "beautifulsoup4"),
    ("cv2", "opencv-python"),
    ("dateutil", "python-dateutil"),
    ("docx", "python-docx"),
    ("dotenv", "python-dotenv"),
    ("faiss", "faiss-cpu"),
    ("fitz", "PyMuPDF"),
    ("gi", "PyGObject"),
    ("git", "GitPython"),
    ("jax", "jax"),
    ("jwt", "PyJWT"),
    ("magic", "python-magic"),
    ("matplotlib", "matplotlib"),
    ("mpl_toolkits", "matplotlib"),
    ("numba", "numba"),
    ("numpy", "numpy"),
    ("pandas", "pandas"),
    ("pkg_resources", "setuptools"),
    ("pptx", "python-pptx"),
    ("scipy", "scipy"),
    ("serial", "pyserial"),
    ("skimage", "scikit-image"),
    ("sklearn", "scikit-learn"),
    ("tensorflow", "tensorflow"),
    ("tokenizers", "tokenizers"),
    ("torch", "torch"),
    ("transformers", "transformers"),
    ("umap", "umap-learn"),
    ("usb", "pyusb"),
    ("wx", "wxPython"),
    ("yaml", "PyYAML"),
    ("zmq", "pyzmq"),
];

/// The PyPI distribution that provides the module `import` (dotted), and whether that is known
/// rather than guessed: the common packages whose import name differs from their distribution
/// name (`sklearn` is `scikit-learn`, `cv2` is `opencv-python`, …) and the common ones whose
/// names agree; any other name is its own top-level module, a guess.
fn distribution(import: &str) -> (&str, bool) {
    // Dotted names first: a namespace package's top level (`google`) names no distribution.
    const DOTTED: &[(&str, &str)] = &[
        ("google.protobuf", "protobuf"),
        ("ruamel.yaml", "ruamel.yaml"),
    ];
    if let Some(&(_, d)) = DOTTED
        .iter()
        .find(|(m, _)| import == *m || import.strip_prefix(m).is_some_and(|r| r.starts_with('.')))
    {
        return (d, true);
    }
    let top = import.split('.').next().unwrap_or_default();
    match TOP.binary_search_by(|(m, _)| (*m).cmp(top)) {
        Ok(i) => (TOP[i].1, true),
        Err(_) => (top, false),
    }
}

#[cfg(test)]
mod tests {
    use super::{distribution, TOP};

    #[test]
    fn the_table_is_sorted() {
        assert!(TOP.windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn install_hints_name_the_distribution() {
        assert_eq!(distribution("sklearn"), ("scikit-learn", true));
        assert_eq!(distribution("sklearn.isotonic"), ("scikit-learn", true));
        assert_eq!(distribution("cv2"), ("opencv-python", true));
        assert_eq!(distribution("PIL.Image"), ("pillow", true));
        assert_eq!(distribution("yaml"), ("PyYAML", true));
        assert_eq!(distribution("numpy.linalg"), ("numpy", true));
        assert_eq!(distribution("google.protobuf.message"), ("protobuf", true));
        assert_eq!(distribution("ruamel.yaml"), ("ruamel.yaml", true));
        // Unknown: its top level, said to be a guess.
        assert_eq!(distribution("google"), ("google", false));
        assert_eq!(distribution("google.protobufx"), ("google", false));
        assert_eq!(distribution("mylib.helpers"), ("mylib", false));
        assert_eq!(distribution(""), ("", false));
    }
}
