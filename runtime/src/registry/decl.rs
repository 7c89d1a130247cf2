//! What `#[py_op]` writes for each op: its declaration ([`OpDecl`]) and the static that builds
//! the op on its first call ([`StaticOp`]).

use std::borrow::Cow;
use std::sync::OnceLock;

use candle_core::Device;

use crate::arg::Arg;
use crate::body::source::Source;
use crate::bridge::outputs::Outputs;
use crate::error::{Error, Result};
use crate::op::gradient::RustGradient;
use crate::op::{builder::OpBuilder, CallOptions, PyOp};
use crate::spec::{Batch, Mode, OutSpec};
use crate::stats::OpStats;

/// An op as `#[py_op]` declared it, read with the accessors: [`StaticOp::decl`] gives it
/// (`pyop::op!(name).decl()`, or for every op [`registered_ops`](crate::registered_ops)).
#[derive(Debug)]
pub struct OpDecl(OpDeclParts);

/// What `#[py_op]` writes into an [`OpDecl`]; not a public API (its fields may change in any
/// release).
#[doc(hidden)]
#[derive(Debug)]
pub struct OpDeclParts {
    pub name: &'static str,
    pub module_path: &'static str,
    pub file: &'static str,
    pub line: u32,
    pub source: SourceDecl,
    pub function: &'static str,
    pub mode: Mode,
    pub tout: &'static [OutSpec],
    pub grad: Option<GradDecl>,
    pub params: &'static [&'static str],
    pub timeout_ms: Option<u64>,
    /// `workers = N`: the size of the op's own worker pool (0: the body runs in the program).
    pub workers: usize,
    /// `pool = "name"`: the process-wide pool of that name, shared by every op naming it.
    pub pool: Option<&'static str>,
    /// `dlpack`: numpy mode's inputs as DLPack producers on the op's device.
    pub dlpack: bool,
    /// `batch(max = N, wait_us = T, inputs = [x])`: concurrent calls served by one body call.
    pub batch: Option<Batch>,
}

/// Where a declared op's body comes from.
#[derive(Debug)]
#[non_exhaustive]
pub enum SourceDecl {
    /// `code = "..."`: its text, the `.rs` line where the literal starts, and whether the
    /// literal's lines are the `.rs` file's lines (no `\n` escapes), so that Python's line
    /// numbers can be the file's.
    Code {
        /// The literal's text.
        text: &'static str,
        /// The `.rs` line where the literal starts.
        line: u32,
        /// Whether the literal's lines are the `.rs` file's lines.
        lines_match: bool,
    },
    /// `file = "..."`: the path as written, its absolute path, and its text embedded at compile
    /// time.
    File {
        /// The path as written.
        path: &'static str,
        /// Its absolute path.
        abs: &'static str,
        /// Its text, embedded at compile time.
        text: &'static str,
    },
    /// `module = "..."`.
    Module(&'static str),
    /// `package = "py/mylib"`: a folder of Python embedded at compile time, importable as the
    /// package named after the folder; the body is looked up in `module` (the package itself,
    /// or a module in it given with `module = "mylib.ops"`).
    Package {
        /// The folder as written.
        path: &'static str,
        /// Its absolute path.
        abs: &'static str,
        /// The package's name (the folder's).
        name: &'static str,
        /// The module the body is looked up in.
        module: &'static str,
        /// Each file's path relative to the folder (`/`-separated) and its text.
        files: &'static [(&'static str, &'static str)],
    },
}

/// A declared gradient.
#[derive(Debug)]
#[non_exhaustive]
pub enum GradDecl {
    /// `grad = "name"`: a Python function in the op's source.
    Python(&'static str),
    /// `grad = path`: a Rust function, and its path as written.
    Rust(RustGradient, &'static str),
}

impl OpDecl {
    #[doc(hidden)]
    pub const fn __new(parts: OpDeclParts) -> Self {
        OpDecl(parts)
    }

    /// The Rust function's name (also the op's name in errors).
    pub fn name(&self) -> &'static str {
        self.0.name
    }

    /// `module_path!()` of the declaration.
    pub fn module_path(&self) -> &'static str {
        self.0.module_path
    }

    /// `module::path::name` of the Rust function: the registry's key.
    pub fn rust_path(&self) -> String {
        format!("{}::{}", self.0.module_path, self.0.name)
    }

    /// The Rust file of the declaration, as `file!()` gives it.
    pub fn file(&self) -> &'static str {
        self.0.file
    }

    /// The line of the declaration.
    pub fn line(&self) -> u32 {
        self.0.line
    }

    /// The Python function's name.
    pub fn function(&self) -> &'static str {
        self.0.function
    }

    /// Tensor or numpy mode.
    pub fn mode(&self) -> Mode {
        self.0.mode
    }

    /// The declared outputs.
    pub fn tout(&self) -> &'static [OutSpec] {
        self.0.tout
    }

    /// The declared gradient, if any.
    pub fn gradient(&self) -> Option<&GradDecl> {
        self.0.grad.as_ref()
    }

    /// The Rust parameter names passed to Python, in order.
    pub fn params(&self) -> &'static [&'static str] {
        self.0.params
    }

    /// The time limit of every call, if declared (`timeout_ms`).
    pub fn timeout(&self) -> Option<std::time::Duration> {
        self.0.timeout_ms.map(std::time::Duration::from_millis)
    }

    /// The size of the op's own worker pool (`workers = N`), if its body runs in worker
    /// processes.
    pub fn workers(&self) -> Option<usize> {
        (self.0.workers > 0).then_some(self.0.workers)
    }

    /// The name of the shared pool the op runs in (`pool = "name"`), if any.
    pub fn pool(&self) -> Option<&'static str> {
        self.0.pool
    }

    /// Whether the op passes its inputs as DLPack producers on their device (`dlpack`).
    pub fn dlpack(&self) -> bool {
        self.0.dlpack
    }

    /// How the op batches concurrent calls (`batch(max = 64, wait_us = 200, inputs = [x])`), if
    /// it does: its `inputs` are indices into [`params`](Self::params).
    pub fn batch(&self) -> Option<&Batch> {
        self.0.batch.as_ref()
    }

    /// Adds where the op was declared to a load error of the op.
    pub(crate) fn annotate(&self, e: Error) -> Error {
        e.append_context(&format!(
            " (op declared as {} at {}:{})",
            self.rust_path(),
            self.0.file,
            self.0.line
        ))
    }

    /// Where the body comes from, as declared.
    pub fn source_decl(&self) -> &SourceDecl {
        &self.0.source
    }

    /// The runtime source of this declaration.
    pub fn source(&self) -> Source {
        let d = &self.0;
        match &d.source {
            SourceDecl::Code {
                text,
                line,
                lines_match: true,
            } => Source::Code {
                code: Cow::Borrowed(text),
                filename: Cow::Borrowed(d.file),
                first_line: *line,
            },
            SourceDecl::Code { text, line, .. } => Source::Code {
                code: Cow::Borrowed(text),
                filename: Cow::Owned(format!("<inline code at {}:{line}>", d.file)),
                first_line: 1,
            },
            SourceDecl::File { abs, text, .. } => Source::File {
                path: relocated(abs),
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
                root: relocated(abs),
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
        let d = &self.0;
        let mut b = OpBuilder::from_source(d.name, self.source())
            .function(d.function)
            .mode(d.mode)
            .tout(d.tout.iter().cloned());
        b = match &d.grad {
            None => b,
            Some(GradDecl::Python(g)) => b.gradient(*g),
            Some(GradDecl::Rust(f, _)) => b.gradient_rust(*f),
        };
        if d.dlpack {
            b = b.dlpack();
        }
        if d.workers > 0 {
            b = match d.pool {
                Some(name) => b.pool(&crate::worker::WorkerPool::named(name, d.workers)),
                None => b.workers(d.workers),
            };
        }
        if let Some(ms) = d.timeout_ms {
            b = b.timeout(std::time::Duration::from_millis(ms));
        }
        if let Some(batch) = &d.batch {
            b = b.batch(batch.clone());
        }
        b.build_in(true).map_err(|e| self.annotate(e))
    }
}

/// Where declared sources are read at run time (hot reload) instead of where they were built:
/// `(build-time folder, run-time folder)`.
static RELOCATED: std::sync::RwLock<Option<(String, std::path::PathBuf)>> =
    std::sync::RwLock::new(None);

/// Declared `file` and `package` sources under `built` are read from under `run` instead, for
/// ops built from now on (a test edits copies of its fixtures rather than tracked files); not a
/// public API.
#[doc(hidden)]
pub fn relocate_sources(built: &str, run: impl Into<std::path::PathBuf>) {
    *RELOCATED.write().unwrap_or_else(|e| e.into_inner()) = Some((built.to_owned(), run.into()));
}

/// `abs`, or where [`relocate_sources`] moved it.
fn relocated(abs: &'static str) -> Cow<'static, str> {
    let moved = RELOCATED.read().unwrap_or_else(|e| e.into_inner());
    match moved.as_ref().and_then(|(built, run)| {
        // By path components: `/a/b` holds `/a/b/x.py`, not `/a/bc/x.py`.
        let rest = std::path::Path::new(abs).strip_prefix(built).ok()?;
        Some(run.join(rest).to_string_lossy().into_owned())
    }) {
        Some(path) => Cow::Owned(path),
        None => Cow::Borrowed(abs),
    }
}

/// The op behind one `#[py_op]` function, built on its first call.
pub struct StaticOp {
    decl: &'static OpDecl,
    op: OnceLock<PyOp>,
}

/// Its declaration's Rust path: `StaticOp(my_crate::ops::zscore)`.
impl std::fmt::Debug for StaticOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StaticOp({})", self.decl.rust_path())
    }
}

impl StaticOp {
    #[doc(hidden)]
    pub const fn __new(decl: &'static OpDecl) -> Self {
        Self {
            decl,
            op: OnceLock::new(),
        }
    }

    /// The op, loading its source on first use. A load that fails is retried on the next call.
    #[inline]
    pub fn get(&self) -> Result<&PyOp> {
        match self.op.get() {
            Some(op) => Ok(op),
            None => self.build(),
        }
    }

    #[cold]
    #[inline(never)]
    fn build(&self) -> Result<&PyOp> {
        // Built without any Rust lock held (it takes the GIL); if two threads race, one wins.
        let built = self.decl.build()?;
        Ok(self.op.get_or_init(|| built))
    }

    /// Calls the op; `device` is the declaration's `&Device` parameter, if any. What the
    /// function `#[py_op]` writes calls; not a public API.
    #[doc(hidden)]
    pub fn __call(&self, args: &[Arg<'_>], device: Option<&Device>) -> Result<Outputs> {
        let options = CallOptions {
            device,
            timeout: None,
        };
        self.get()?.call_outputs(args, &options)
    }

    /// Calls the op as a future ([`PyOp::call_async`]); an op not built yet is built on pyop's
    /// threads first (it takes the GIL). What the `_async` function `#[py_op]` writes calls; not
    /// a public API.
    #[doc(hidden)]
    pub fn __call_async(
        &'static self,
        args: &[Arg<'_>],
        device: Option<&Device>,
    ) -> impl std::future::Future<Output = Result<Outputs>> + Send + 'static + use<> {
        let options = CallOptions {
            device,
            timeout: None,
        };
        let built = self
            .op
            .get()
            .map(|op| op.call_async_outputs(args, &options));
        let later = built
            .is_none()
            .then(|| (crate::arg::OwnedArgs::new(args), device.cloned()));
        async move {
            if let Some(call) = built {
                return call.await;
            }
            let (args, device) = later.expect("kept when the op was not built");
            let op = crate::op::awaited::gil(move || self.get().cloned()).await?;
            let options = CallOptions {
                device: device.as_ref(),
                timeout: None,
            };
            let call = op.call_async_outputs(&args.args(), &options);
            call.await
        }
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
