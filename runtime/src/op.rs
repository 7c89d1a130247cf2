//! Ops: what a body is and how one call runs.
//!
//! The path of a call ([`PyOp::call`]): pick the device and check the inputs are on it → prepare
//! the inputs without the GIL (snapshot `Var`s, move to host for numpy mode) → take the GIL once
//! ([`crate::bridge::with_gil`]), build the Python arguments, run the body, check its outputs
//! against `tout` ([`crate::bridge::outputs::outputs_from_python`]) → release the GIL → put the outputs
//! into candle's autograd when the op has a registered gradient or runs in numpy mode
//! ([`crate::grad`]).

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arg::Arg;
use crate::body::source::{self, Source};
use crate::bridge::outputs::OutputCheck;
use crate::bridge::with_gil;
use crate::error::{bail, Error, ErrorKind, Result};
use crate::grad::{self, Gradient, RustGradient};
use crate::spec::{numpy_can_hold, Mode, OutSpec};
use crate::stats::{Counters, OpStats};

/// An op whose body is a Python function: built at run time with [`PyOp::builder`], or declared
/// with `#[py_op]` (which builds one on first call). Cloning is cheap and shares the op.
#[derive(Clone)]
pub struct PyOp {
    pub(crate) inner: Arc<OpInner>,
}

pub(crate) struct OpInner {
    pub name: String,
    pub mode: Mode,
    pub tout: Vec<OutSpec>,
    pub source: Option<Source>,
    pub body: Py<PyAny>,
    pub gradient: Option<Gradient>,
    pub timeout: Option<Duration>,
    /// Whether the body takes an `out` keyword (numpy mode): see `bridge::out::OutBuffers`.
    accepts_out: bool,
    /// Set when hot reload watches the body's files.
    reload: Option<crate::body::reload::Reload>,
    function: String,
    gradient_name: Option<String>,
    pub counters: Counters,
    /// Whether the op's inline code lines in `linecache` are its own to remove on drop.
    owns_lines: bool,
    /// Keeps a run-time op's private namespace alive for as long as the op.
    _module: Option<Py<PyAny>>,
}

impl std::fmt::Debug for PyOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PyOp")
            .field("name", &self.inner.name)
            .field("mode", &self.inner.mode)
            .field("tout", &crate::spec::tout_to_string(&self.inner.tout))
            .finish_non_exhaustive()
    }
}

/// Per-call options of [`PyOp::call_with`].
///
/// ```
/// use std::time::Duration;
/// use pyop::candle::{DType, Device, Tensor};
/// use pyop::{Arg, CallOptions, ErrorKind, OutSpec, PyOp};
///
/// let spin = PyOp::builder("spin")
///     .code("def spin(x):\n    while True:\n        pass")
///     .tout([OutSpec::new(DType::F32)])
///     .build()?;
/// let x = Tensor::new(&[1f32], &Device::Cpu)?;
/// let options = CallOptions::new().timeout(Duration::from_millis(50));
/// let err = spin.call_with(&[Arg::from(&x)], &options).unwrap_err();
/// assert_eq!(err.kind(), ErrorKind::Timeout);
/// # Ok::<(), pyop::Error>(())
/// ```
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct CallOptions<'a> {
    /// The outputs' device; default: the inputs' device, or the CPU without tensor inputs.
    pub device: Option<&'a Device>,
    /// A time limit for this call, overriding the op's own.
    pub timeout: Option<Duration>,
}

impl<'a> CallOptions<'a> {
    /// No options: the inputs' device, the op's own time limit.
    pub fn new() -> Self {
        Self::default()
    }

    /// Puts the outputs on `device`.
    pub fn device(mut self, device: &'a Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Interrupts this call's body after `limit`.
    pub fn timeout(mut self, limit: Duration) -> Self {
        self.timeout = Some(limit);
        self
    }
}

impl PyOp {
    /// Starts building an op named `name` (the name errors and counters show).
    pub fn builder(name: impl Into<String>) -> OpBuilder {
        OpBuilder {
            name: name.into(),
            body: BodySpec::None,
            function: None,
            mode: Mode::Tensor,
            tout: None,
            gradient: None,
            timeout: None,
        }
    }

    /// The op's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The op's mode.
    pub fn mode(&self) -> Mode {
        self.inner.mode
    }

    /// The op's declared outputs.
    pub fn tout(&self) -> &[OutSpec] {
        &self.inner.tout
    }

    /// Why the last hot reload of the body failed, if it did (see `PYOP_HOT_RELOAD`).
    pub fn last_reload_error(&self) -> Option<String> {
        self.inner.reload.as_ref().and_then(|r| r.last_error())
    }

    /// Where the body came from (`None` for a body given as a callable).
    pub fn source(&self) -> Option<&Source> {
        self.inner.source.as_ref()
    }

    /// What the op has cost so far.
    pub fn stats(&self) -> OpStats {
        self.inner.counters.snapshot()
    }

    /// Calls the op: one output tensor per `tout` entry, on the inputs' device. Arguments are
    /// passed to the body positionally, each made with `Arg::from` (or `Arg::None` for `None`).
    ///
    /// ```
    /// use pyop::candle::{DType, Device, Tensor};
    /// use pyop::{Arg, OutSpec, PyOp};
    ///
    /// let clip = PyOp::builder("clip")
    ///     .code("import numpy as np\ndef clip(x, lo, hi):\n    return np.clip(x, lo, hi)")
    ///     .numpy()
    ///     .tout([OutSpec::new(DType::F64)])
    ///     .build()?;
    /// let x = Tensor::new(&[-2f64, 0.5, 3.], &Device::Cpu)?;
    /// let y = clip.call(&[Arg::from(&x), Arg::from(-1.0), Arg::from(1.0)])?;
    /// assert_eq!(y[0].to_vec1::<f64>()?, [-1.0, 0.5, 1.0]);
    /// # Ok::<(), pyop::Error>(())
    /// ```
    pub fn call(&self, args: &[Arg<'_>]) -> Result<Vec<Tensor>> {
        self.call_with(args, &CallOptions::default())
    }

    /// Calls the op with per-call options.
    pub fn call_with(&self, args: &[Arg<'_>], options: &CallOptions<'_>) -> Result<Vec<Tensor>> {
        let op = &*self.inner;
        let device = output_device(op, args, options.device)
            .inspect_err(|_| op.counters.record(false, Duration::ZERO, Duration::ZERO))?;
        let span = tracing::trace_span!(
            "pyop.call",
            op = %op.name,
            mode = op.mode.as_str(),
            device = ?device.location()
        );
        let _entered = span.enter();

        // Inputs that autograd tracks, when the op's gradient is not the body's own candle ops.
        let needs_node =
            (op.mode == Mode::Numpy || op.gradient.is_some()) && grad::any_tracked(args);
        let prepared = crate::python::without_gil(|| {
            crate::bridge::prepare::prepare_inputs(&op.name, op.mode, args)
        })
        .map_err(|e| e.in_op(&op.name));
        let prepared =
            prepared.inspect_err(|_| op.counters.record(false, Duration::ZERO, Duration::ZERO))?;
        let prepared = if needs_node {
            grad::detach_prepared(prepared)
        } else {
            prepared
        };

        let started = Instant::now();
        let timeout = options.timeout.or(op.timeout);
        let result = with_gil(&op.name, |py| {
            let _device = crate::bridge::tensor::device::DeviceScope::enter(&device);
            if op.mode == Mode::Numpy {
                crate::python::numpy::ensure_numpy(py, Some(&op.name))?;
            }
            let py_args = crate::bridge::args::python_args(
                py,
                op.mode,
                args,
                &prepared,
                crate::bridge::args::Lists::AsLists,
            )
            .map_err(|e| crate::python::errors::python_error(py, &op.name, e))?;
            let check = OutputCheck {
                op: &op.name,
                tout: &op.tout,
                device: &device,
                what: "output",
                args,
            };
            // A numpy-mode body that takes `out` writes into candle memory when every output's
            // shape is known before the call.
            let (body, accepts_out) = op.body_now(py);
            let shapes = if accepts_out && !op.tout.is_empty() {
                op.tout
                    .iter()
                    .map(|o| crate::bridge::outputs::known_shape(o, args))
                    .collect::<Option<Vec<_>>>()
            } else {
                None
            };
            if let Some(shapes) = shapes {
                let out = crate::bridge::out::out_buffers(py, &op.tout, shapes)
                    .map_err(|e| e.with_op(Some(&op.name)))?;
                let kwargs = PyDict::new(py);
                kwargs
                    .set_item(pyo3::intern!(py, "out"), &out.arg)
                    .map_err(|e| crate::python::errors::python_error(py, &op.name, e))?;
                let returned = crate::python::timeout::run_limited(py, &op.name, timeout, || {
                    body.call(py_args, Some(&kwargs))
                })?;
                drop(kwargs);
                return out.finish(&check, returned);
            }
            let returned =
                crate::python::timeout::run_limited(py, &op.name, timeout, || body.call1(py_args))?;
            crate::bridge::outputs::outputs_from_python(py, &check, &returned)
        })
        .map_err(|e| e.in_op(&op.name));
        let (outputs, waited) = match result {
            Ok((outputs, waited)) => (outputs, waited),
            Err(e) => {
                op.counters.record(false, started.elapsed(), Duration::ZERO);
                return Err(e);
            }
        };
        op.counters
            .record(true, started.elapsed().saturating_sub(waited), waited);
        if needs_node {
            grad::attach(&self.inner, args, prepared, outputs).map_err(|e| e.in_op(&op.name))
        } else {
            Ok(outputs)
        }
    }
}

/// Whether `f` has a parameter named `out` (a builtin without a signature has not).
fn takes_out(f: &Bound<'_, PyAny>) -> bool {
    let py = f.py();
    py.import("inspect")
        .and_then(|i| i.call_method1("signature", (f,)))
        .and_then(|sig| sig.getattr("parameters"))
        .and_then(|params| params.contains("out"))
        .unwrap_or(false)
}

fn output_device(op: &OpInner, args: &[Arg<'_>], explicit: Option<&Device>) -> Result<Device> {
    let mut first: Option<&Device> = None;
    let mut clash = None;
    for arg in args {
        arg.for_each_tensor(|t| match first {
            None => first = Some(t.device()),
            Some(d) if !d.same_device(t.device()) && clash.is_none() => {
                clash = Some(format!(
                    "inputs are on different devices ({:?} and {:?})",
                    d.location(),
                    t.device().location()
                ))
            }
            _ => {}
        });
    }
    if let Some(msg) = clash {
        bail!(
            &op.name,
            DeviceMismatch,
            "{msg}; move them to one device before the call"
        );
    }
    Ok(explicit.or(first).cloned().unwrap_or(Device::Cpu))
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
    tout: Option<Vec<OutSpec>>,
    gradient: Option<GradientSpec>,
    timeout: Option<Duration>,
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

    /// A time limit for every call (see [`CallOptions::timeout`] for one call).
    pub fn timeout(mut self, limit: Duration) -> Self {
        self.timeout = Some(limit);
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
        if self.mode == Mode::Numpy {
            if let Some((i, o)) = tout
                .iter()
                .enumerate()
                .find(|(_, o)| !numpy_can_hold(o.dtype))
            {
                bail!(
                    &name,
                    InvalidArgument,
                    "output {i} is {}, which NumPy cannot hold; use tensor mode",
                    o.dtype.as_str()
                );
            }
        }
        let function = self.function.unwrap_or_else(|| name.clone());
        let mode = self.mode;
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
                    let body = source::function(&module, &name, &function, &src, "function")?;
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
                        source::function(module, &name, &g, src, "gradient")?.unbind(),
                    ))
                }
            };
            let accepts_out = mode == Mode::Numpy && takes_out(body.bind(py));
            let keep = if shared {
                None
            } else {
                module.map(Bound::unbind)
            };
            Ok((body, keep, gradient, source, accepts_out))
        })?
        .0;
        let reload = source
            .as_ref()
            .and_then(|s| crate::body::reload::Reload::for_source(s, shared));
        Ok(PyOp {
            inner: Arc::new(OpInner {
                name,
                mode,
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
                _module: module,
            }),
        })
    }
}

impl OpInner {
    /// The body to call now (hot reload may have replaced the one the op was built with).
    pub(crate) fn body_now<'py>(&self, py: Python<'py>) -> (Bound<'py, PyAny>, bool) {
        match &self.reload {
            None => (self.body.bind(py).clone(), self.accepts_out),
            Some(r) => {
                let body = self.reloaded(py, r).body;
                // A reloaded body may have gained or dropped its `out` parameter.
                let out = self.mode == Mode::Numpy && takes_out(&body);
                (body, out)
            }
        }
    }

    /// The Python gradient to call now.
    pub(crate) fn python_gradient_now<'py>(
        &self,
        py: Python<'py>,
        built: &Py<PyAny>,
    ) -> Bound<'py, PyAny> {
        match &self.reload {
            None => built.bind(py).clone(),
            Some(r) => self
                .reloaded(py, r)
                .gradient
                .unwrap_or_else(|| built.bind(py).clone()),
        }
    }

    fn reloaded<'py>(
        &self,
        py: Python<'py>,
        r: &crate::body::reload::Reload,
    ) -> crate::body::reload::Current<'py> {
        let built_grad = match &self.gradient {
            Some(Gradient::Python(g)) => Some(g),
            _ => None,
        };
        let grad_name = self.gradient_name.as_deref();
        r.current(
            py,
            &self.name,
            &self.function,
            grad_name,
            (&self.body, built_grad),
        )
    }
}

impl Drop for OpInner {
    fn drop(&mut self) {
        // Python references are released with the GIL held, now, rather than left to pyo3's
        // deferred pool: a dropped run-time op leaves nothing behind in Python.
        if unsafe { pyo3::ffi::Py_IsInitialized() } != 0 {
            Python::attach(|py| {
                if self.owns_lines {
                    if let Some(src) = &self.source {
                        source::forget_lines(py, src);
                    }
                }
                self._module.take();
                self.gradient.take();
                let body = std::mem::replace(&mut self.body, py.None());
                drop(body);
            });
        }
    }
}
