//! Start-up validation of every declared op and of the Python set-up; problems grouped by cause.

use std::fmt::{self, Write as _};

use pyo3::prelude::*;

use crate::body::source;
use crate::bridge::prepare::Passing;
use crate::bridge::with_gil;
use crate::error::{Error, ErrorKind, Result, NO_OP};
use crate::registry::decl::{GradDecl, OpDecl, StaticOp};
use crate::registry::registered_ops;

/// One thing wrong: with the program's Python set-up, or with one or more declared ops. One root
/// cause is one problem, listing every op it affects.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Problem {
    /// What is wrong, and how to fix it.
    pub message: String,
    /// The ops it affects, in registry order; empty for a problem of the set-up as a whole that
    /// affects no op in particular.
    pub ops: Vec<OpRef>,
    /// A problem of the Python set-up (listed with the ops it affects), not of one declaration.
    set_up: bool,
}

/// A declared op, as a [`Problem`] names it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct OpRef {
    /// The op's name.
    pub name: &'static str,
    /// `module::path::name` of the declaration.
    pub rust_path: String,
    /// The Rust file of the declaration, as `file!()` gives it.
    pub file: &'static str,
    /// The line of the declaration.
    pub line: u32,
}

impl OpRef {
    fn of(decl: &OpDecl) -> Self {
        OpRef {
            name: decl.name(),
            rust_path: decl.rust_path(),
            file: decl.file(),
            line: decl.line(),
        }
    }
}

impl fmt::Display for OpRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}:{})", self.rust_path, self.file, self.line)
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.ops.as_slice() {
            [] => f.write_str(&self.message),
            [op] if !self.set_up => write!(f, "{op}: {}", self.message),
            ops => {
                let s = if ops.len() == 1 { "" } else { "s" };
                write!(f, "{}\n    affects {} op{s}:", self.message, ops.len())?;
                for op in ops {
                    write!(f, "\n      {op}")?;
                }
                Ok(())
            }
        }
    }
}

/// What [`validate`] found.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ValidationReport {
    /// How many ops were checked.
    pub checked: usize,
    /// Everything wrong, one entry per root cause.
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
        let mut msg = format!(
            "validate() found {} problem(s) in the Python set-up or the declared ops:",
            self.problems.len()
        );
        for p in &self.problems {
            let _ = write!(msg, "\n  - {}", p.to_string().replace('\n', "\n    "));
        }
        Err(Error::op_failure(NO_OP, ErrorKind::Validation, msg))
    }

    /// Adds `op` to the problem of `cause`, or a new problem with `message`.
    fn add(&mut self, causes: &mut Vec<String>, cause: String, op: Option<OpRef>, message: String) {
        match causes.iter().position(|c| *c == cause) {
            Some(i) => self.problems[i].ops.extend(op),
            None => {
                let set_up = op.is_none() || cause == "numpy" || cause.starts_with("module ");
                causes.push(cause);
                self.problems.push(Problem {
                    set_up,
                    message,
                    ops: op.into_iter().collect(),
                });
            }
        }
    }
}

/// Checks every op declared with `#[py_op]` without running it: its source compiles (or its
/// module imports), its function and gradient exist and accept the declared arguments (by
/// `inspect.signature`), NumPy imports where numpy mode needs it, and the interpreter and
/// environment are the ones the program was built for. Call it first thing in `main`:
///
/// ```
/// fn main() -> pyop::Result<()> {
///     pyop::validate()?;
///     // ...
///     Ok(())
/// }
/// ```
///
/// Problems are grouped by cause: NumPy missing is one problem listing every numpy-mode op.
pub fn validate() -> Result<ValidationReport> {
    validation_report()?.check()
}

/// Like [`validate`], but returns the report even when it lists problems.
pub fn validation_report() -> Result<ValidationReport> {
    with_gil(NO_OP, |py| {
        let mut report = ValidationReport::default();
        // One entry per problem: what it is about, for grouping.
        let mut causes: Vec<String> = Vec::new();
        let env = crate::python::env::current(py);
        for (i, p) in env
            .map(|e| e.problems.as_slice())
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            report.add(&mut causes, format!("set-up {i}"), None, p.clone());
        }
        let ops = registered_ops();
        let numpy_ops: Vec<&OpDecl> = ops
            .iter()
            .map(|op| op.decl())
            // Only NumPy views need NumPy: a `dlpack` op's body may use torch or CuPy instead.
            .filter(|d| Passing::of(d.mode(), d.dlpack()) == Passing::Views)
            .collect();
        let mut numpy_cause = None;
        if let Some(first) = numpy_ops.first() {
            if let Err(e) = crate::python::numpy::ensure_numpy(py, NO_OP) {
                // NumPy missing because of the set-up (a venv of another Python) is that
                // problem's consequence, not a problem of its own.
                let cause = match causes.len() {
                    0 => "numpy".to_owned(),
                    n => causes[n - 1].clone(),
                };
                if cause != "numpy" {
                    let last = report.problems.len() - 1;
                    report.problems[last].message.push_str(
                        ". Because of it, NumPy cannot be imported, which these ops need",
                    );
                }
                let message = e.to_string().replace("`Tensor.numpy()`", "numpy mode");
                report.add(&mut causes, cause.clone(), Some(OpRef::of(first)), message);
                for d in &numpy_ops[1..] {
                    report.add(
                        &mut causes,
                        cause.clone(),
                        Some(OpRef::of(d)),
                        String::new(),
                    );
                }
                numpy_cause = Some(cause);
            }
        }
        for op in &ops {
            report.checked += 1;
            check_op(py, op, &mut report, &mut causes, numpy_cause.as_deref());
        }
        check_pool_sizes(&ops, &mut report, &mut causes);
        Ok(report)
    })
    .map(|(r, _)| r)
}

/// Declarations that name one pool (`pool = "name"`) must give it one size: the first op built
/// makes it, and the others would silently run with its size.
fn check_pool_sizes(ops: &[&StaticOp], report: &mut ValidationReport, causes: &mut Vec<String>) {
    let mut pools: std::collections::BTreeMap<&str, Vec<&OpDecl>> = Default::default();
    for op in ops {
        if let Some(name) = op.decl().pool() {
            pools.entry(name).or_default().push(op.decl());
        }
    }
    for (name, decls) in pools {
        let mut sizes: Vec<usize> = decls.iter().filter_map(|d| d.workers()).collect();
        sizes.sort_unstable();
        sizes.dedup();
        if sizes.len() > 1 {
            let cause = format!("pool {name}");
            let message = format!(
                "the ops sharing the worker pool `{name}` declare different sizes ({}): give \
                 them one `workers = N`",
                sizes
                    .iter()
                    .map(|s| s.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            for d in decls {
                report.add(causes, cause.clone(), Some(OpRef::of(d)), message.clone());
            }
        }
    }
}

/// The package an import error is about: the module of a "No module named 'x'", or `numpy` for
/// any import error whose text or traceback goes through NumPy.
fn missing_module(e: &Error) -> Option<String> {
    let Error::Python {
        exception,
        message,
        traceback,
        ..
    } = e
    else {
        return None;
    };
    if exception != "ModuleNotFoundError" && exception != "ImportError" {
        return None;
    }
    if let Some(at) = message.find("No module named '") {
        let rest = &message[at + 17..];
        let name = &rest[..rest.find('\'')?];
        return Some(name.split('.').next().unwrap_or(name).to_owned());
    }
    (traceback.contains("/numpy/") || message.contains("numpy")).then(|| "numpy".to_owned())
}

fn check_op(
    py: Python<'_>,
    op: &StaticOp,
    report: &mut ValidationReport,
    causes: &mut Vec<String>,
    numpy_cause: Option<&str>,
) {
    let decl = op.decl();
    let here = || Some(OpRef::of(decl));
    let mut own = |report: &mut ValidationReport, message: String| {
        report.add(causes, format!("op {}", decl.rust_path()), here(), message)
    };
    let src = decl.source();
    let module = match source::shared_module(py, decl.name(), &src) {
        Ok(m) => m,
        Err(e) => {
            let module = missing_module(&e);
            let message = e.with_op(None).to_string();
            let cause = match (module, numpy_cause) {
                // NumPy missing is one problem, whichever way an op meets it.
                (Some(m), Some(numpy)) if m == "numpy" => numpy.to_owned(),
                (Some(m), _) => format!("module {m}"),
                // Ops sharing one source share its load error.
                (None, _) => format!("source {}", src.describe()),
            };
            let listed = causes.iter().position(|c| *c == cause).is_some_and(|i| {
                report.problems[i]
                    .ops
                    .iter()
                    .any(|o| o.name == decl.name() && o.line == decl.line())
            });
            if !listed {
                report.add(causes, cause, here(), message);
            }
            return;
        }
    };
    let params = decl.params().join(", ");
    match source::function(
        &module,
        decl.name(),
        decl.function(),
        &src,
        source::FnRole::Body,
    ) {
        Err(e) => own(report, e.with_op(None).to_string()),
        Ok(f) => match accepts(py, &f, decl.params().len()) {
            Ok(true) => {}
            Ok(false) => report.skipped.push(format!(
                "{}: `{}` has no signature (a builtin or ufunc); its arguments were not checked",
                decl.rust_path(),
                decl.function()
            )),
            Err(msg) => own(
                report,
                format!(
                    "the function `{}` does not accept the declared arguments ({params}): {msg}",
                    decl.function()
                ),
            ),
        },
    }
    if let Some(GradDecl::Python(g)) = decl.gradient() {
        match source::function(&module, decl.name(), g, &src, source::FnRole::Gradient) {
            Err(e) => own(report, e.with_op(None).to_string()),
            Ok(f) => match accepts(py, &f, 3) {
                Ok(true) => {}
                Ok(false) => report.skipped.push(format!(
                    "{}: the gradient `{g}` has no signature; its arguments were not checked",
                    decl.rust_path()
                )),
                Err(msg) => own(
                    report,
                    format!("the gradient `{g}` does not accept (inputs, outputs, grads): {msg}"),
                ),
            },
        }
    }
    // An op that runs in workers: one must start with the program's environment and load the
    // body there (where an import the program has may be missing, or NumPy).
    if decl.workers().is_some() {
        let mut functions = vec![decl.function()];
        if let Some(GradDecl::Python(g)) = decl.gradient() {
            functions.push(g);
        }
        let checked = op.get().and_then(|built| match &built.inner.workers {
            Some(w) => built.inner.check_worker(w, &functions),
            None => Ok(()),
        });
        if let Err(e) = checked {
            own(report, e.with_op(None).to_string());
        }
    }
}

/// Whether `f` accepts `n` positional arguments: `Ok(false)` when it has no signature to check.
fn accepts(py: Python<'_>, f: &Bound<'_, PyAny>, n: usize) -> std::result::Result<bool, String> {
    let inspect = py
        .import("inspect")
        .map_err(|e| crate::python::describe(py, &e))?;
    let Ok(sig) = inspect.call_method1("signature", (f,)) else {
        return Ok(false);
    };
    let args = pyo3::types::PyTuple::new(py, (0..n).map(|_| py.None()))
        .map_err(|e| crate::python::describe(py, &e))?;
    match sig.call_method1("bind", args) {
        Ok(_) => Ok(true),
        Err(e) => Err(crate::python::describe(py, &e)),
    }
}
