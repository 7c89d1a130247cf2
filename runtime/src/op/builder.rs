//! [`OpBuilder`]: an op made at run time, like `tf.py_function` taking a function at call time;
//! `#[py_op]` declarations build theirs the same way.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;

use super::gradient::{Gradient, RustGradient};
use super::worker_call::load::Workers;
use super::{offers_out, OpInner, PyOp};
use crate::body::source::{self, Source};
use crate::bridge::prepare::Passing;
use crate::bridge::with_gil;
use crate::error::{bail, Error, ErrorKind, Result};
use crate::spec::{Mode, OutSpec};
use crate::stats::Counters;
use crate::worker::WorkerPool;

impl PyOp {
    /// Starts building an op named `name` (the name errors and counters show).
    pub fn builder(name: impl Into<String>) -> OpBuilder {
        OpBuilder {
            name: name.into(),
            body: BodySpec::None,
            function: None,
            mode: Mode::Tensor,
            dlpack: false,
            tout: None,
            gradient: None,
            timeout: None,
            pool: None,
            batch: None,
        }
    }
}

enum BodySpec {
    None,
    Source(Source),
    Callable(Py<PyAny>),
}

/// Builds a [`PyOp`] at run time, like `tf.py_function` taking a function at call time.
///
/// ```
/// use pyop::candle::{DType, Device, Tensor};
/// use pyop::{Arg, OutSpec, PyOp};
///
/// let op = PyOp::builder("double")
///     .code("def double(x):\n    return x * 2")
///     .numpy()
///     .tout([OutSpec::new(DType::F32)])
///     .build()?;
/// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let y = op.call(&[Arg::from(&x)])?;
/// assert_eq!(y[0].to_vec1::<f32>()?, [2.0, 4.0]);
/// # Ok::<(), pyop::Error>(())
/// ```
#[must_use]
pub struct OpBuilder {
    name: String,
    body: BodySpec,
    function: Option<String>,
    mode: Mode,
    dlpack: bool,
    tout: Option<Vec<OutSpec>>,
    gradient: Option<GradientSpec>,
    timeout: Option<Duration>,
    pool: Option<WorkerPool>,
    batch: Option<crate::spec::Batch>,
}

enum GradientSpec {
    Python(String),
    Callable(Py<PyAny>),
    Rust(RustGradient),
}

impl OpBuilder {
    pub(crate) fn from_source(name: &str, source: Source) -> Self {
        let mut b = PyOp::builder(name);
        b.body = BodySpec::Source(source);
        b
    }

    /// The body is defined in `code`; the function's name defaults to the op's.
    pub fn code(mut self, code: impl Into<String>) -> Self {
        // Unique, so that the lines this op puts in `linecache` are its own.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let filename = format!("<pyop op `{}` #{n}>", self.name);
        self.body = BodySpec::Source(Source::Code {
            code: Cow::Owned(code.into()),
            filename: Cow::Owned(filename),
            first_line: 1,
        });
        self
    }

    /// The body is defined in a source read now from `path`.
    pub fn file(mut self, path: impl AsRef<std::path::Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::op_failure(
                &self.name,
                ErrorKind::Source,
                format!("cannot read {}: {e}", path.display()),
            )
        })?;
        self.body = BodySpec::Source(Source::File {
            path: Cow::Owned(path.display().to_string()),
            text: Cow::Owned(text),
        });
        Ok(self)
    }

    /// The body is in `module` of the package whose folder is `root` (named after the folder),
    /// read now and served from memory, like `#[py_op(package = ...)]`.
    pub fn package(
        mut self,
        root: impl AsRef<std::path::Path>,
        module: impl Into<String>,
    ) -> Result<Self> {
        let root = root.as_ref();
        let name = root
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let files = crate::body::package::read(root).map_err(|e| {
            Error::op_failure(
                &self.name,
                ErrorKind::Source,
                format!("cannot read the package {}: {e}", root.display()),
            )
        })?;
        self.body = BodySpec::Source(Source::Package {
            root: Cow::Owned(root.display().to_string()),
            name: Cow::Owned(name),
            module: Cow::Owned(module.into()),
            files,
        });
        Ok(self)
    }

    /// The body is in the module `name`, imported from `sys.path`.
    pub fn module(mut self, name: impl Into<String>) -> Self {
        self.body = BodySpec::Source(Source::Module(Cow::Owned(name.into())));
        self
    }

    /// The body is this Python callable.
    pub fn callable(mut self, f: Py<PyAny>) -> Self {
        self.body = BodySpec::Callable(f);
        self
    }

    /// The name of the body's function in its source (default: the op's name).
    pub fn function(mut self, name: impl Into<String>) -> Self {
        self.function = Some(name.into());
        self
    }

    /// Numpy mode: inputs are read-only NumPy views.
    pub fn numpy(self) -> Self {
        self.mode(Mode::Numpy)
    }

    /// Numpy mode's DLPack option: tensor inputs stay on the op's device (CPU or CUDA) and reach
    /// the body as `pyop.Tensor`s, DLPack producers, instead of NumPy views of host copies. The
    /// body takes them with its array library's `from_dlpack` (`np.from_dlpack(x)` on the CPU,
    /// `cupy.from_dlpack(x)` or `torch.from_dlpack(x)` on CUDA), without a copy, and may return
    /// any DLPack producer, read back device to device. Gradients registered in Python get their
    /// tensors the same way; outputs may be any dtype DLPack carries (bf16 too). Not with worker
    /// processes, and no `out` buffers.
    ///
    /// ```
    /// use pyop::candle::{DType, Device, Tensor};
    /// use pyop::{Arg, OutSpec, PyOp};
    ///
    /// let op = PyOp::builder("double")
    ///     .code("import numpy as np\ndef double(x):\n    return np.from_dlpack(x) * 2")
    ///     .numpy()
    ///     .dlpack()
    ///     .tout([OutSpec::new(DType::F32)])
    ///     .build()?;
    /// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
    /// assert_eq!(op.call(&[Arg::from(&x)])?[0].to_vec1::<f32>()?, [2.0, 4.0]);
    /// # Ok::<(), pyop::Error>(())
    /// ```
    pub fn dlpack(mut self) -> Self {
        self.dlpack = true;
        self
    }

    /// Sets the mode (default: [`Mode::Tensor`]).
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// The declared outputs (required; empty for an op with no outputs).
    pub fn tout(mut self, tout: impl IntoIterator<Item = OutSpec>) -> Self {
        self.tout = Some(tout.into_iter().collect());
        self
    }

    /// A gradient function named `name` in the body's source.
    pub fn gradient(mut self, name: impl Into<String>) -> Self {
        self.gradient = Some(GradientSpec::Python(name.into()));
        self
    }

    /// A gradient given as a Python callable.
    pub fn gradient_callable(mut self, f: Py<PyAny>) -> Self {
        self.gradient = Some(GradientSpec::Callable(f));
        self
    }

    /// A gradient written in Rust.
    pub fn gradient_rust(mut self, f: RustGradient) -> Self {
        self.gradient = Some(GradientSpec::Rust(f));
        self
    }

    /// A time limit for every call (see [`CallOptions::timeout`](crate::CallOptions::timeout) for one call).
    pub fn timeout(mut self, limit: Duration) -> Self {
        self.timeout = Some(limit);
        self
    }

    /// Runs the body (and a Python gradient) in a pool of `n` worker processes of the op's own
    /// (numpy mode only): see [`WorkerPool`]. Bodies that spend their time in Python then run in
    /// parallel, a crash or a hang in C code fails only its call, and a time limit kills the
    /// worker.
    pub fn workers(self, n: usize) -> Self {
        self.pool(&WorkerPool::new(n))
    }

    /// Runs the body in the workers of `pool`, shared with the other ops given it (numpy mode
    /// only): see [`WorkerPool`].
    pub fn pool(mut self, pool: &WorkerPool) -> Self {
        self.pool = Some(pool.clone());
        self
    }

    /// Serves concurrent calls from different threads with one body call on their stacked
    /// inputs (dynamic micro-batching, see [`Batch`](crate::Batch) and the guide's chapter on
    /// batching). Each caller gets exactly its own rows of every output, checked against its own
    /// `tout`; the body must treat rows independently.
    ///
    /// ```
    /// use std::time::Duration;
    /// use pyop::candle::{DType, Device, Tensor};
    /// use pyop::{Arg, Batch, OutSpec, PyOp};
    ///
    /// let op = PyOp::builder("scale")
    ///     .code("def scale(x):\n    return x * 2")
    ///     .numpy()
    ///     .batch(Batch::new(64).wait(Duration::from_micros(200)))
    ///     .tout([OutSpec::with_shape(DType::F32, &[None, Some(3)])])
    ///     .build()?;
    /// let rows = std::thread::scope(|s| {
    ///     let calls: Vec<_> = (0..4)
    ///         .map(|i| {
    ///             let op = &op;
    ///             s.spawn(move || {
    ///                 let x = Tensor::new(&[[i as f32; 3]], &Device::Cpu)?;
    ///                 op.call(&[Arg::from(&x)])
    ///             })
    ///         })
    ///         .collect();
    ///     calls.into_iter().map(|c| c.join().unwrap()).collect::<Result<Vec<_>, _>>()
    /// })?;
    /// assert_eq!(rows[3][0].to_vec2::<f32>()?, [[6.0, 6.0, 6.0]]);
    /// assert!(op.stats().batches >= 1);
    /// # Ok::<(), pyop::Error>(())
    /// ```
    pub fn batch(mut self, batch: crate::spec::Batch) -> Self {
        self.batch = Some(batch);
        self
    }

    /// Loads the source (in a namespace of the op's own) and finds the body and gradient.
    pub fn build(self) -> Result<PyOp> {
        self.build_in(false)
    }

    pub(crate) fn build_in(self, shared: bool) -> Result<PyOp> {
        let name = self.name;
        let Some(tout) = self.tout else {
            bail!(
                &name,
                InvalidArgument,
                "no `tout`: declare the op's outputs"
            );
        };
        if self.dlpack {
            if self.mode != Mode::Numpy {
                bail!(
                    &name,
                    InvalidArgument,
                    "`dlpack` is numpy mode's option (tensor mode already passes pyop.Tensor, a \
                     DLPack producer): add `.numpy()` or drop `.dlpack()`"
                );
            }
            if self.pool.is_some() {
                bail!(
                    &name,
                    InvalidArgument,
                    "`dlpack` keeps inputs on the op's device, which a worker process cannot \
                     reach: drop the pool or `.dlpack()`"
                );
            }
        }
        let passing = Passing::of(self.mode, self.dlpack);
        if let Some((i, o, why)) = tout.iter().enumerate().find_map(|(i, o)| {
            let why = passing.refuses(o.dtype).filter(|_| o.dtype_of.is_none())?;
            Some((i, o, why))
        }) {
            bail!(
                &name,
                InvalidArgument,
                "output {i} is {}, which {why}; use tensor mode",
                o.dtype.as_str()
            );
        }
        if self.pool.is_some() {
            if self.mode != Mode::Numpy {
                bail!(
                    &name,
                    InvalidArgument,
                    "worker processes run numpy-mode ops only (a tensor-mode body needs the \
                     program's candle tensors): add `.numpy()` or drop the pool"
                );
            }
            if matches!(self.body, BodySpec::Callable(_))
                || matches!(self.gradient, Some(GradientSpec::Callable(_)))
            {
                bail!(
                    &name,
                    InvalidArgument,
                    "a body or gradient given as a Python callable cannot run in a worker \
                     process: give its source (code, a file, a package or a module)"
                );
            }
        }
        if let Some(batch) = &self.batch {
            if batch.max == 0 {
                bail!(
                    &name,
                    InvalidArgument,
                    "a batch of at most 0 calls: give `max` of 1 or more"
                );
            }
            if let Some((i, o)) = tout.iter().enumerate().find(|(_, o)| {
                o.shape
                    .as_ref()
                    .is_some_and(|s| s.first().is_none_or(Option::is_some))
            }) {
                bail!(
                    &name,
                    InvalidArgument,
                    "output {i} is declared `{o}`, but a batching op's outputs have the batch's \
                     rows along axis 0: declare that axis `_`"
                );
            }
            if let (Some(inputs), Some((i, j))) = (
                &batch.inputs,
                tout.iter()
                    .enumerate()
                    .find_map(|(i, o)| o.like.map(|j| (i, j))),
            ) {
                if !inputs.contains(&j) {
                    bail!(
                        &name,
                        InvalidArgument,
                        "output {i} takes the shape of argument {j}, which the batch does not \
                         stack: its axis 0 would not be the batch's rows"
                    );
                }
            }
        }
        let function = self.function.unwrap_or_else(|| name.clone());
        let mode = self.mode;
        let dlpack = self.dlpack;
        let gradient_name = match &self.gradient {
            Some(GradientSpec::Python(g)) => Some(g.clone()),
            _ => None,
        };
        let (body, module, gradient, source, accepts_out) = with_gil(&name, |py| {
            let (module, body, source) = match self.body {
                BodySpec::None => bail!(
                    &name,
                    InvalidArgument,
                    "no body: give code, a file, a module or a callable"
                ),
                BodySpec::Callable(f) => {
                    if !f.bind(py).is_callable() {
                        bail!(
                            &name,
                            MissingFunction,
                            "the body is not callable (it is {})",
                            crate::bridge::numbers::describe_value(f.bind(py))
                        );
                    }
                    (None, f, None)
                }
                BodySpec::Source(src) => {
                    let module = if shared {
                        source::shared_module(py, &name, &src)?
                    } else {
                        source::private_module(py, &name, &src)?
                    };
                    let body =
                        source::function(&module, &name, &function, &src, source::FnRole::Body)?;
                    (Some(module), body.unbind(), Some(src))
                }
            };
            let gradient = match self.gradient {
                None => None,
                Some(GradientSpec::Rust(f)) => Some(Gradient::Rust(f)),
                Some(GradientSpec::Callable(f)) => Some(Gradient::Python(f)),
                Some(GradientSpec::Python(g)) => {
                    let (Some(module), Some(src)) = (&module, &source) else {
                        bail!(
                            &name,
                            MissingFunction,
                            "gradient `{g}` named, but the body has no source to find it in"
                        );
                    };
                    Some(Gradient::Python(
                        source::function(module, &name, &g, src, source::FnRole::Gradient)?
                            .unbind(),
                    ))
                }
            };
            let accepts_out = offers_out(Passing::of(mode, dlpack), body.bind(py));
            let keep = if shared {
                None
            } else {
                module.map(Bound::unbind)
            };
            Ok((body, keep, gradient, source, accepts_out))
        })?;
        // A batch is one request: as many may run at once as the pool has workers.
        let batches_side_by_side = self.pool.as_ref().map_or(1, WorkerPool::size);
        let workers = match (self.pool, &source) {
            (Some(pool), Some(src)) => Some(Workers::new(pool, &name, src)),
            _ => None,
        };
        let reload = source
            .as_ref()
            .and_then(|s| crate::body::reload::Reload::for_source(s, shared));
        Ok(PyOp {
            inner: Arc::new(OpInner {
                name,
                mode,
                dlpack,
                tout,
                source,
                body,
                gradient,
                timeout: self.timeout,
                counters: Counters::default(),
                owns_lines: !shared,
                accepts_out,
                reload,
                function,
                gradient_name,
                workers,
                batcher: self
                    .batch
                    .map(|b| super::batcher::Batcher::new(b, batches_side_by_side)),
                _module: module,
            }),
        })
    }
}
