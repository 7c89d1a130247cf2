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

    /// Adds `decl` to the problem of `cause` unless that problem lists it already (an op meets
    /// one cause once), or a new problem with `message`.
    fn add_once(
        &mut self,
        causes: &mut Vec<String>,
        cause: String,
        decl: &OpDecl,
        message: String,
    ) {
        let listed = causes.iter().position(|c| *c == cause).is_some_and(|i| {
            self.problems[i]
                .ops
                .iter()
                .any(|o| o.name == decl.name() && o.line == decl.line())
        });
        if !listed {
            self.add(causes, cause, Some(OpRef::of(decl)), message);
        }
    }

    /// Adds `op` to the problem of `cause`, or a new problem with `message`.
    fn add(&mut self, causes: &mut Vec<String>, cause: String, op: Option<OpRef>, message: String) {
        match causes.iter().position(|c| *c == cause) {
            Some(i) => {
                let ops = &mut self.problems[i].ops;
                if let Some(op) = op.filter(|op| !ops.contains(op)) {
                    ops.push(op);
                }
            }
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
///
/// **Cost:** it imports every op's source, which a first call would do anyway, so it moves
/// that cost to the start rather than adding to it: milliseconds for plain NumPy bodies,
/// seconds for bodies that import SciPy, scikit-learn or JAX. It starts no worker. To check some
/// ops only, or to start a worker for each worker op as well, use [`Validate`].
pub fn validate() -> Result<ValidationReport> {
    Validate::all().check()
}

/// Like [`validate`], but returns the report even when it lists problems.
pub fn validation_report() -> Result<ValidationReport> {
    Validate::all().report()
}

/// What [`validate`] checks, chosen by the program: every declared op or some, and whether a
/// worker op also starts a worker and loads its body there.
///
/// ```
/// use pyop::{py_op, Tensor, Validate};
///
/// #[py_op(code = "def twice(x):\n    return x * 2", tout = f64)]
/// fn twice(x: &Tensor) -> pyop::Result<Tensor>;
///
/// # fn main() -> pyop::Result<()> {
/// // Only the ops this command uses, by their typed handles.
/// Validate::ops([pyop::op!(twice)]).check()?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
#[must_use = "a Validate checks nothing until `check()` or `report()`"]
pub struct Validate {
    ops: Option<Vec<&'static StaticOp>>,
    workers: bool,
}

impl Validate {
    /// Every op declared with `#[py_op]` in the program, as [`validate`] checks them.
    pub fn all() -> Self {
        Self {
            ops: None,
            workers: false,
        }
    }

    /// These ops only (`pyop::op!(name)` is a declared op's handle), and the Python set-up.
    pub fn ops(ops: impl IntoIterator<Item = &'static StaticOp>) -> Self {
        let mut unique: Vec<&'static StaticOp> = Vec::new();
        for op in ops {
            if !unique.iter().any(|u| std::ptr::eq(*u, op)) {
                unique.push(op);
            }
        }
        Self {
            ops: Some(unique),
            workers: false,
        }
    }

    /// Also starts a worker for each op that runs in workers and has it load the op's body and
    /// gradient there (in the environment workers use, which may lack what the program has).
    /// The workers of different ops start side by side, while the program imports the other
    /// sources; the ones started stay in their pools for the first calls. Costs about one
    /// worker start (tens of milliseconds, more with heavy imports) where the ops are checked
    /// in the program already.
    pub fn start_workers(mut self) -> Self {
        self.workers = true;
        self
    }

    /// Checks, and returns the report whatever it found.
    pub fn report(self) -> Result<ValidationReport> {
        let ops = match self.ops {
            Some(ops) => ops,
            None => registered_ops(),
        };
        report(&ops, self.workers)
    }

    /// Checks: `Ok` if nothing is wrong, else an error of kind [`ErrorKind::Validation`] listing
    /// every problem.
    pub fn check(self) -> Result<ValidationReport> {
        self.report()?.check()
    }
}

fn report(ops: &[&'static StaticOp], workers: bool) -> Result<ValidationReport> {
    let checked = with_gil(NO_OP, |py| {
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
        let mut in_workers = Vec::new();
        for op in ops {
            report.checked += 1;
            if check_op(py, op, &mut report, &mut causes, numpy_cause.as_deref()) && workers {
                in_workers.push(*op);
            }
        }
        check_pool_sizes(ops, &mut report, &mut causes);
        Ok((report, causes, numpy_cause, in_workers))
    })?;
    let (mut report, mut causes, numpy_cause, in_workers) = checked;
    // Each worker op's start and load, side by side (separate processes: no GIL between them).
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let checks: Vec<_> = in_workers
            .iter()
            .map(|op| s.spawn(move || check_in_worker(op)))
            .collect();
        checks
            .into_iter()
            .map(|c| c.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    for (op, result) in in_workers.iter().zip(results) {
        let Err(e) = result else { continue };
        let decl = op.decl();
        // NumPy missing in a worker, where the program misses it too, is that one problem.
        let kind = e.kind();
        let message = e.with_op(None).to_string();
        let cause = match (&numpy_cause, kind) {
            (Some(numpy), ErrorKind::PackageUnavailable) => numpy.clone(),
            _ => format!("op {}: {message}", decl.rust_path()),
        };
        report.add_once(&mut causes, cause, decl, message);
    }
    Ok(report)
}

/// An op that runs in workers: one must start with the program's environment and load the body
/// there (where an import the program has may be missing, or NumPy).
fn check_in_worker(op: &StaticOp) -> Result<()> {
    let decl = op.decl();
    let mut functions = vec![decl.function()];
    if let Some(GradDecl::Python(g)) = decl.gradient() {
        functions.push(g);
    }
    let built = op.get()?;
    match &built.inner.workers {
        Some(w) => crate::op::worker_call::check_worker(&built.inner, w, &functions),
        None => Ok(()),
    }
}

/// Declarations that name one pool (`pool = "name"`) must give it one size: the first op built
/// makes it, and the others would silently run with its size.
fn check_pool_sizes(ops: &[&StaticOp], report: &mut ValidationReport, causes: &mut Vec<String>) {
    // A pool the checked ops name, with every declared op that shares it.
    let named: std::collections::BTreeSet<&str> =
        ops.iter().filter_map(|op| op.decl().pool()).collect();
    let mut pools: std::collections::BTreeMap<&str, Vec<&OpDecl>> = Default::default();
    for op in registered_ops() {
        if let Some(name) = op.decl().pool().filter(|n| named.contains(n)) {
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

/// Checks one op in the program; `true` when it loaded and runs in workers (a worker check of
/// it can follow).
fn check_op(
    py: Python<'_>,
    op: &StaticOp,
    report: &mut ValidationReport,
    causes: &mut Vec<String>,
    numpy_cause: Option<&str>,
) -> bool {
    let decl = op.decl();
    let here = || Some(OpRef::of(decl));
    // Each of an op's own problems is one problem (its body's and its gradient's both show).
    let mut own = |report: &mut ValidationReport, message: String| {
        let cause = format!("op {}: {message}", decl.rust_path());
        report.add(causes, cause, here(), message)
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
            report.add_once(causes, cause, decl, message);
            return false;
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
    decl.workers().is_some()
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
