//! Start-up validation of every declared op, and the manifest of the registry.

use std::fmt::{self, Write as _};

use pyo3::prelude::*;

use crate::decl::{registered_ops, GradDecl, OpDecl, SourceDecl};
use crate::error::{Error, ErrorKind, Result};
use crate::python::{self, with_gil};
use crate::source;
use crate::spec::{tout_to_string, Mode};

/// One thing wrong with a declared op.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The op's name.
    pub op: String,
    /// `module::path::name` of the declaration, and where it is.
    pub rust_path: String,
    pub file: &'static str,
    pub line: u32,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}:{}): {}",
            self.rust_path, self.file, self.line, self.message
        )
    }
}

/// What [`validate`] found.
#[derive(Clone, Debug, Default)]
pub struct ValidationReport {
    /// How many ops were checked.
    pub checked: usize,
    /// Everything wrong, every op's problems, not just the first.
    pub problems: Vec<Problem>,
    /// Checks that could not be made (a builtin or ufunc without a signature), one line each.
    pub skipped: Vec<String>,
}

impl ValidationReport {
    /// `Ok` if nothing is wrong, else an error of kind [`ErrorKind::Validation`] listing every
    /// problem.
    pub fn check(self) -> Result<Self> {
        if self.problems.is_empty() {
            return Ok(self);
        }
        let mut msg = format!("{} problem(s) in declared ops:", self.problems.len());
        for p in &self.problems {
            let _ = write!(msg, "\n  {p}");
        }
        Err(Error::op_failure("validate", ErrorKind::Validation, msg))
    }
}

/// Checks every op declared with `#[py_op]` without running it: its source compiles (or its
/// module imports), its function and gradient exist and accept the declared arguments (by
/// `inspect.signature`), NumPy imports where numpy mode needs it, and the running Python is the
/// version the program was built against. Call it first thing in `main`:
///
/// ```no_run
/// fn main() -> pyop_runtime::Result<()> {
///     pyop_runtime::validate()?;
///     // ...
///     Ok(())
/// }
/// ```
pub fn validate() -> Result<ValidationReport> {
    validation_report()?.check()
}

/// Like [`validate`], but returns the report even when it lists problems.
pub fn validation_report() -> Result<ValidationReport> {
    with_gil("validate", |py| {
        let mut report = ValidationReport::default();
        let built = env!("PYOP_BUILT_PYTHON");
        let running: String = py
            .import("sys")
            .and_then(|s| s.getattr("version_info"))
            .and_then(|v| v.extract::<(u32, u32, u32, String, u32)>())
            .map(|v| format!("{}.{}", v.0, v.1))
            .unwrap_or_default();
        if running != built {
            report.problems.push(Problem {
                op: String::new(),
                rust_path: "the program".into(),
                file: file!(),
                line: line!(),
                message: format!(
                    "built against Python {built} but running Python {running}; rebuild with \
                     PYO3_PYTHON pointing at the Python it runs with"
                ),
            });
        }
        for op in registered_ops() {
            report.checked += 1;
            check_op(py, op.decl(), &mut report);
        }
        Ok(report)
    })
    .map(|(r, _)| r)
}

fn check_op(py: Python<'_>, decl: &'static OpDecl, report: &mut ValidationReport) {
    let problem = |message: String| Problem {
        op: decl.name.to_owned(),
        rust_path: decl.rust_path(),
        file: decl.file,
        line: decl.line,
        message,
    };
    if decl.mode == Mode::Numpy {
        if let Err(e) = python::ensure_numpy(py, decl.name) {
            report.problems.push(problem(e.to_string()));
        }
    }
    let src = decl.source();
    let module = match source::shared_module(py, decl.name, &src) {
        Ok(m) => m,
        Err(e) => {
            report.problems.push(problem(e.to_string()));
            return;
        }
    };
    let params = decl.params.join(", ");
    match source::function(&module, decl.name, decl.function, &src, "function") {
        Err(e) => report.problems.push(problem(e.to_string())),
        Ok(f) => match accepts(py, &f, decl.params.len()) {
            Ok(true) => {}
            Ok(false) => report.skipped.push(format!(
                "{}: `{}` has no signature (a builtin or ufunc); its arguments were not checked",
                decl.rust_path(),
                decl.function
            )),
            Err(msg) => report.problems.push(problem(format!(
                "the function `{}` does not accept the declared arguments ({params}): {msg}",
                decl.function
            ))),
        },
    }
    if let Some(GradDecl::Python(g)) = &decl.grad {
        match source::function(&module, decl.name, g, &src, "gradient") {
            Err(e) => report.problems.push(problem(e.to_string())),
            Ok(f) => match accepts(py, &f, 3) {
                Ok(true) => {}
                Ok(false) => report.skipped.push(format!(
                    "{}: the gradient `{g}` has no signature; its arguments were not checked",
                    decl.rust_path()
                )),
                Err(msg) => report.problems.push(problem(format!(
                    "the gradient `{g}` does not accept (inputs, outputs, grads): {msg}"
                ))),
            },
        }
    }
}

/// Whether `f` accepts `n` positional arguments: `Ok(false)` when it has no signature to check.
fn accepts(py: Python<'_>, f: &Bound<'_, PyAny>, n: usize) -> std::result::Result<bool, String> {
    let inspect = py.import("inspect").map_err(|e| python::describe(py, &e))?;
    let Ok(sig) = inspect.call_method1("signature", (f,)) else {
        return Ok(false);
    };
    let args = pyo3::types::PyTuple::new(py, (0..n).map(|_| py.None()))
        .map_err(|e| python::describe(py, &e))?;
    match sig.call_method1("bind", args) {
        Ok(_) => Ok(true),
        Err(e) => Err(python::describe(py, &e)),
    }
}

/// Every declared op as JSON: name, Rust path and location, mode, `tout`, gradient, where its
/// source came from, and a hash of the source's text (FNV-1a, 64 bits).
pub fn manifest_json() -> String {
    let mut out = String::from("[");
    for (i, op) in registered_ops().iter().enumerate() {
        let d = op.decl();
        if i > 0 {
            out.push(',');
        }
        let (kind, origin, text) = match &d.source {
            SourceDecl::Code(code) => ("code", String::new(), Some(*code)),
            SourceDecl::File { path, text, .. } => ("file", (*path).to_owned(), Some(*text)),
            SourceDecl::Package { path, module, .. } => {
                ("package", format!("{path}:{module}"), None)
            }
            SourceDecl::Module(m) => ("module", (*m).to_owned(), None),
        };
        let hash = match (&d.source, text) {
            (SourceDecl::Package { files, .. }, _) => Some(fnv1a(
                files.iter().flat_map(|(n, t)| n.bytes().chain(t.bytes())),
            )),
            (_, Some(t)) => Some(fnv1a(t.bytes())),
            _ => None,
        };
        let grad = match &d.grad {
            None => "null".to_owned(),
            Some(GradDecl::Python(g)) => {
                format!("{{\"kind\":\"python\",\"name\":{}}}", json_str(g))
            }
            Some(GradDecl::Rust(_, path)) => {
                format!("{{\"kind\":\"rust\",\"path\":{}}}", json_str(path))
            }
        };
        let _ = write!(
            out,
            "\n  {{\"name\":{},\"rust_path\":{},\"file\":{},\"line\":{},\"mode\":{},\"function\":{},\"tout\":{},\"grad\":{},\"source\":{{\"kind\":{},\"origin\":{},\"hash\":{}}}}}",
            json_str(d.name),
            json_str(&d.rust_path()),
            json_str(d.file),
            d.line,
            json_str(d.mode.as_str()),
            json_str(d.function),
            json_str(&tout_to_string(d.tout)),
            grad,
            json_str(kind),
            json_str(&origin),
            hash.map_or("null".to_owned(), |h| format!("\"{h:016x}\"")),
        );
    }
    out.push_str("\n]");
    out
}

fn fnv1a(bytes: impl Iterator<Item = u8>) -> u64 {
    bytes.fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
