//! Ops declared with `#[py_op]`: the static declaration the macro writes, the op it builds on
//! first call, and the registry of every declared op in the binary.

use std::borrow::Cow;
use std::sync::OnceLock;

use candle_core::{Device, Tensor};

use crate::convert::Arg;
use crate::error::Result;
use crate::grad::RustGradient;
use crate::op::{CallOptions, OpBuilder, PyOp};
use crate::source::Source;
use crate::spec::{Mode, OutSpec};
use crate::stats::OpStats;

/// An op as `#[py_op]` declared it. The macro builds one as a `static`; read them all with
/// [`registered_ops`].
#[derive(Debug)]
pub struct OpDecl {
    /// The Rust function's name (also the op's name in errors).
    pub name: &'static str,
    /// `module_path!()` of the declaration.
    pub module_path: &'static str,
    /// The Rust file and line of the declaration.
    pub file: &'static str,
    pub line: u32,
    pub source: SourceDecl,
    /// The Python function's name.
    pub function: &'static str,
    pub mode: Mode,
    pub tout: &'static [OutSpec],
    pub grad: Option<GradDecl>,
    /// The Rust parameter names passed to Python, in order.
    pub params: &'static [&'static str],
    /// A time limit for every call, in milliseconds.
    pub timeout_ms: Option<u64>,
}

/// Where a declared op's body comes from.
#[derive(Debug)]
pub enum SourceDecl {
    /// `code = "..."`.
    Code(&'static str),
    /// `file = "..."`: the path as written, its absolute path, and its text embedded at compile
    /// time.
    File {
        path: &'static str,
        abs: &'static str,
        text: &'static str,
    },
    /// `module = "..."`.
    Module(&'static str),
    /// `package = "py/mylib"`: a folder of Python embedded at compile time, importable as the
    /// package named after the folder; the body is looked up in `module` (the package itself,
    /// or a module in it given with `module = "mylib.ops"`).
    Package {
        path: &'static str,
        abs: &'static str,
        name: &'static str,
        module: &'static str,
        /// Each file's path relative to the folder (`/`-separated) and its text.
        files: &'static [(&'static str, &'static str)],
    },
}

/// A declared gradient.
#[derive(Debug)]
pub enum GradDecl {
    /// `grad = "name"`: a Python function in the op's source.
    Python(&'static str),
    /// `grad = path`: a Rust function, and its path as written.
    Rust(RustGradient, &'static str),
}

impl OpDecl {
    /// `module::path::name` of the Rust function: the registry's key.
    pub fn rust_path(&self) -> String {
        format!("{}::{}", self.module_path, self.name)
    }

    /// The runtime source of this declaration.
    pub fn source(&self) -> Source {
        match &self.source {
            SourceDecl::Code(code) => Source::Code {
                code: Cow::Borrowed(code),
                filename: Cow::Owned(format!(
                    "<pyop code of {} at {}:{}>",
                    self.rust_path(),
                    self.file,
                    self.line
                )),
            },
            SourceDecl::File { abs, text, .. } => Source::File {
                path: Cow::Borrowed(abs),
                text: Cow::Borrowed(text),
            },
            SourceDecl::Module(m) => Source::Module(Cow::Borrowed(m)),
            SourceDecl::Package {
                abs,
                name,
                module,
                files,
                ..
            } => Source::Package {
                root: Cow::Borrowed(abs),
                name: Cow::Borrowed(name),
                module: Cow::Borrowed(module),
                files: files
                    .iter()
                    .map(|(p, t)| (Cow::Borrowed(*p), Cow::Borrowed(*t)))
                    .collect(),
            },
        }
    }

    fn build(&self) -> Result<PyOp> {
        let mut b = OpBuilder::from_source(self.name, self.source())
            .function(self.function)
            .mode(self.mode)
            .tout(self.tout.iter().cloned());
        b = match &self.grad {
            None => b,
            Some(GradDecl::Python(g)) => b.gradient(*g),
            Some(GradDecl::Rust(f, _)) => b.gradient_rust(*f),
        };
        if let Some(ms) = self.timeout_ms {
            b = b.timeout(std::time::Duration::from_millis(ms));
        }
        b.build_in(true).map_err(|e| e.at_declaration(self))
    }
}

/// The op behind one `#[py_op]` function, built on its first call.
pub struct StaticOp {
    decl: &'static OpDecl,
    op: OnceLock<PyOp>,
}

impl StaticOp {
    pub const fn new(decl: &'static OpDecl) -> Self {
        Self {
            decl,
            op: OnceLock::new(),
        }
    }

    /// The op, loading its source on first use. A load that fails is retried on the next call.
    pub fn get(&self) -> Result<&PyOp> {
        if let Some(op) = self.op.get() {
            return Ok(op);
        }
        // Built without any Rust lock held (it takes the GIL); if two threads race, one wins.
        let built = self.decl.build()?;
        Ok(self.op.get_or_init(|| built))
    }

    /// Calls the op; `device` is the declaration's `&Device` parameter, if any.
    pub fn call(&self, args: &[Arg<'_>], device: Option<&Device>) -> Result<Vec<Tensor>> {
        let options = CallOptions {
            device,
            timeout: None,
        };
        self.get()?.call_with(args, &options)
    }

    /// The declaration.
    pub fn decl(&self) -> &'static OpDecl {
        self.decl
    }

    /// The op's counters (all zero before its first call).
    pub fn stats(&self) -> OpStats {
        self.op.get().map(PyOp::stats).unwrap_or_default()
    }
}

/// One registry entry; `#[py_op]` submits one per declared op.
#[doc(hidden)]
pub struct Registration(pub &'static StaticOp);

inventory::collect!(Registration);

/// Every op declared with `#[py_op]` in the program, from any crate, sorted by Rust path (the
/// key: two crates' ops of the same name do not collide).
pub fn registered_ops() -> Vec<&'static StaticOp> {
    let mut all: Vec<&'static StaticOp> = inventory::iter::<Registration>
        .into_iter()
        .map(|r| r.0)
        .collect();
    all.sort_by_key(|op| (op.decl.module_path, op.decl.name));
    all
}

/// The declared op whose Rust path is `key` (`my_crate::ops::zscore`), or whose name is `key` if
/// only one op has that name.
pub fn registered_op(key: &str) -> Option<&'static StaticOp> {
    let all = registered_ops();
    if let Some(op) = all.iter().find(|op| op.decl.rust_path() == key) {
        return Some(op);
    }
    let mut named = all.into_iter().filter(|op| op.decl.name == key);
    match (named.next(), named.next()) {
        (Some(op), None) => Some(op),
        _ => None,
    }
}

/// The counters of the declared op `key` (see [`registered_op`]).
pub fn op_stats(key: &str) -> Option<OpStats> {
    registered_op(key).map(StaticOp::stats)
}
