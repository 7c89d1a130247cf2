//! The executor: [`PyOp`] (an op with its body, outputs, gradient and counters), built by
//! [`OpBuilder`] (`builder`), called through the one call core (`run`) by a forward call
//! (`call` and `awaited`, the public calls; `batch`, a batch's run; `forward`, one body call,
//! in the program or in a worker through `worker_call`) and by the autograd node's backward
//! Python call (`autograd`). `OpInner`'s methods are here (accessors) and in `run` only; the
//! conductors are free functions taking it, so a call between files is a path
//! (`runtime/tests/layers.rs`).

pub(crate) mod autograd;
pub(crate) mod awaited;
pub(crate) mod batch;
pub(crate) mod batcher;
pub(crate) mod builder;
pub(crate) mod call;
pub(crate) mod forward;
pub(crate) mod gradient;
pub(crate) mod run;
pub(crate) mod worker_call;

use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;
use pyo3::prelude::*;

use crate::body::source::{self, Source};
use crate::spec::{Mode, OutSpec};
use crate::stats::{Counters, OpStats};
use gradient::Gradient;

/// An op whose body is a Python function: built at run time with [`PyOp::builder`], or declared
/// with `#[py_op]` (which builds one on first call). Cloning is cheap and shares the op.
#[derive(Clone)]
pub struct PyOp {
    pub(crate) inner: Arc<OpInner>,
}

pub(crate) struct OpInner {
    pub name: String,
    pub mode: Mode,
    /// Numpy mode's `dlpack` option: inputs stay on the op's device as DLPack producers.
    pub dlpack: bool,
    pub tout: Vec<OutSpec>,
    pub source: Option<Source>,
    pub body: Py<PyAny>,
    pub gradient: Option<Gradient>,
    pub timeout: Option<Duration>,
    /// Whether the body takes an `out` keyword (numpy mode): see `bridge::out::OutBuffers`.
    pub(crate) accepts_out: bool,
    /// Set when hot reload watches the body's files.
    pub(crate) reload: Option<crate::body::reload::Reload>,
    function: String,
    gradient_name: Option<String>,
    /// The pool the body runs in, when it runs in worker processes.
    pub(crate) workers: Option<worker_call::load::Workers>,
    pub counters: Counters,
    /// Gathers concurrent calls into one body call, when the op batches (`OpBuilder::batch`).
    pub(crate) batcher: Option<batcher::Batcher>,
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

    /// Whether the op passes its inputs as DLPack producers on their own device (numpy mode's
    /// `dlpack` option, [`OpBuilder::dlpack`](crate::OpBuilder::dlpack)).
    pub fn passes_dlpack(&self) -> bool {
        self.inner.dlpack
    }

    /// The worker pool the body runs in, if it runs in worker processes.
    pub fn pool(&self) -> Option<&crate::worker::WorkerPool> {
        self.inner.workers.as_ref().map(|w| &w.pool)
    }

    /// Why the last hot reload of the body failed, if it did (see `PYOP_HOT_RELOAD`).
    pub fn last_reload_error(&self) -> Option<String> {
        self.inner.reload.as_ref().and_then(|r| r.last_error())
    }

    /// Where the body came from (`None` for a body given as a callable).
    pub fn source(&self) -> Option<&Source> {
        self.inner.source.as_ref()
    }

    /// How the op batches concurrent calls, if it does.
    pub fn batching(&self) -> Option<&crate::spec::Batch> {
        self.inner.batcher.as_ref().map(|b| &b.batch)
    }

    /// What the op has cost so far.
    pub fn stats(&self) -> OpStats {
        self.inner.counters.snapshot()
    }
}

impl OpInner {
    /// The outputs of this call: those declared with an argument's dtype (`tout = x.dtype`) get
    /// it now (in numpy mode that input was checked to be a dtype NumPy holds).
    #[inline]
    pub(crate) fn resolved_tout<'t>(
        &'t self,
        args: &[crate::arg::Arg<'_>],
    ) -> crate::error::Result<std::borrow::Cow<'t, [OutSpec]>> {
        OutSpec::resolve(&self.tout, args).map_err(|msg| {
            crate::error::Error::op_failure(
                Some(self.name.as_str()),
                crate::error::ErrorKind::InvalidArgument,
                msg,
            )
        })
    }

    /// How the op's tensors reach Python.
    pub(crate) fn passing(&self) -> crate::bridge::prepare::Passing {
        crate::bridge::prepare::Passing::of(self.mode, self.dlpack)
    }

    /// The body to call now (hot reload may have replaced the one the op was built with).
    #[inline]
    pub(crate) fn body_now<'py>(&self, py: Python<'py>) -> (Bound<'py, PyAny>, bool) {
        match &self.reload {
            None => (self.body.bind(py).clone(), self.accepts_out),
            Some(r) => {
                let body = self.reloaded(py, r).body;
                // A reloaded body may have gained or dropped its `out` parameter.
                let out = offers_out(self.passing(), &body);
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
        // SAFETY: Py_IsInitialized may be called at any time, with or without the GIL.
        if unsafe { pyo3::ffi::Py_IsInitialized() } != 0 {
            crate::python::attach(|py| {
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

/// Whether calls hand `f` `out` buffers: NumPy arrays in host memory, offered only with NumPy
/// views (`passing`), to a body with a parameter named `out` (a builtin without a signature has
/// none).
pub(crate) fn offers_out(passing: crate::bridge::prepare::Passing, f: &Bound<'_, PyAny>) -> bool {
    if passing != crate::bridge::prepare::Passing::Views {
        return false;
    }
    let py = f.py();
    py.import("inspect")
        .and_then(|i| i.call_method1("signature", (f,)))
        .and_then(|sig| sig.getattr("parameters"))
        .and_then(|params| params.contains("out"))
        .unwrap_or(false)
}
