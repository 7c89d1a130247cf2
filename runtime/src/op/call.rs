//! The forward call: device check, inputs prepared outside the GIL, the body run through the call
//! core, outputs checked, and the autograd node attached when the op has its own gradient.

use std::time::Duration;

use candle_core::{Device, Tensor};
use pyo3::prelude::*;

use super::autograd;
use super::{CallOptions, OpInner, PyOp};
use crate::arg::Arg;
use crate::bridge::args::{call, python_args, Lists};
use crate::bridge::out::out_buffers;
use crate::bridge::outputs::{known_shape, outputs_from_python, OutputCheck, Outputs, Role};
use crate::bridge::prepare::{Passing, Prepared, PreparedInputs};
use crate::error::{bail, Error, ErrorKind, Result};
use crate::python::errors::python_error;
use crate::python::timeout::run_limited;
use crate::spec::{Mode, OutSpec};

impl PyOp {
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
        self.call_outputs(args, options).map(Outputs::into_vec)
    }

    /// [`call_with`](Self::call_with), the outputs held inline (what `#[py_op]` functions use).
    pub(crate) fn call_outputs(
        &self,
        args: &[Arg<'_>],
        options: &CallOptions<'_>,
    ) -> Result<Outputs> {
        let taken = crate::python::acquisitions();
        let result = self.call_counted(args, options);
        let taken = crate::python::acquisitions() - taken;
        self.inner.counters.record_gil(taken);
        result
    }

    /// The call itself; `call_outputs` counts the GIL acquisitions it makes.
    fn call_counted(&self, args: &[Arg<'_>], options: &CallOptions<'_>) -> Result<Outputs> {
        match &self.inner.batcher {
            Some(batcher) => self.call_batched(batcher, args, options),
            None => self.call_unbatched(args, options, None),
        }
    }

    /// One body call: of one call, or of a batch of `batch` calls (`op::batch`).
    pub(super) fn call_unbatched(
        &self,
        args: &[Arg<'_>],
        options: &CallOptions<'_>,
        batch: Option<usize>,
    ) -> Result<Outputs> {
        let op = &*self.inner;
        let before = op.before(args, options.device, options.timeout)?;
        if let Some(n) = batch {
            before.span.record("batch", n);
        }
        let _entered = before.span.enter();
        let outputs = match &op.workers {
            Some(workers) => op.run_in_worker(
                workers,
                args,
                &before.prepared,
                &before.device,
                before.timeout,
                &before.span,
            )?,
            None => op.run_python(&before.device, |py| {
                op.run_body(py, args, &before.prepared, &before.device, before.timeout)
            })?,
        };
        self.after(args, before.needs_node, before.prepared, outputs)
    }

    /// A forward call's end: the outputs put into the graph behind the op's own node, when it
    /// has one and an input is tracked. (Inlined, as `before`: the scalar call's moves of
    /// `Before` cost ~1 % of it otherwise.)
    #[inline(always)]
    pub(crate) fn after(
        &self,
        args: &[Arg<'_>],
        needs_node: bool,
        prepared: PreparedInputs,
        outputs: Outputs,
    ) -> Result<Outputs> {
        if needs_node {
            autograd::attach(&self.inner, args, prepared, outputs.into_vec())
                .map(Outputs::from_vec)
                .map_err(|e| e.in_op(&self.inner.name))
        } else {
            Ok(outputs)
        }
    }
}

/// What a forward call settles before its body runs.
pub(crate) struct Before {
    /// The outputs' device.
    pub device: Device,
    /// Whether the outputs go behind a node of the op's own (its gradient is not the body's
    /// candle ops, and an input is tracked); then `prepared` is detached.
    pub needs_node: bool,
    pub prepared: PreparedInputs,
    pub timeout: Option<Duration>,
    /// The call's trace span (`pyop.call`).
    pub span: tracing::Span,
}

impl OpInner {
    /// The part of a forward call before its body: the device, the inputs prepared (without the
    /// GIL), the time limit.
    #[inline(always)]
    pub(crate) fn before(
        &self,
        args: &[Arg<'_>],
        device: Option<&Device>,
        timeout: Option<Duration>,
    ) -> Result<Before> {
        let op = self;
        let device = op.failed_before_python(output_device(op, args, device))?;
        let span = tracing::trace_span!(
            "pyop.call",
            op = %op.name,
            mode = op.mode.as_str(),
            device = ?device.location(),
            worker = tracing::field::Empty,
            node = tracing::field::Empty,
            batch = tracing::field::Empty
        );
        // Inputs that autograd tracks, when the op's gradient is not the body's own candle ops.
        let needs_node =
            (op.mode == Mode::Numpy || op.gradient.is_some()) && autograd::any_tracked(args);
        let prepared = span.in_scope(|| {
            op.failed_before_python(crate::python::without_gil(|| {
                crate::bridge::prepare::prepare_inputs(&op.name, op.passing(), args)
            }))
        })?;
        let prepared = if needs_node {
            autograd::detach_prepared(prepared)
        } else {
            prepared
        };
        Ok(Before {
            device,
            needs_node,
            prepared,
            timeout: timeout.or(op.timeout),
            span,
        })
    }
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

impl OpInner {
    /// The outputs of this call: those declared with an argument's dtype (`tout = x.dtype`) get
    /// it now (in numpy mode that input was checked to be a dtype NumPy holds).
    pub(super) fn resolved_tout<'t>(
        &'t self,
        args: &[Arg<'_>],
    ) -> Result<std::borrow::Cow<'t, [OutSpec]>> {
        OutSpec::resolve(&self.tout, args).map_err(|msg| {
            Error::op_failure(Some(self.name.as_str()), ErrorKind::InvalidArgument, msg)
        })
    }

    /// The body's part of a forward call, with the GIL held: the Python arguments, the body (with
    /// `out` buffers when it takes them and every output's shape is known), the output check.
    fn run_body(
        &self,
        py: Python<'_>,
        args: &[Arg<'_>],
        prepared: &[Prepared],
        device: &Device,
        timeout: Option<Duration>,
    ) -> Result<Outputs> {
        let op = self;
        // The limit covers the body and the check of its outputs (not the wait for the GIL).
        let _deadline = crate::python::timeout::Deadline::enter(timeout);
        let passing = op.passing();
        if passing == Passing::Views {
            crate::python::numpy::ensure_numpy(py, Some(&op.name))?;
        }
        let tout = op.resolved_tout(args)?;
        let tout = &*tout;
        let py_args = python_args(py, passing, args, prepared, Lists::AsLists)
            .map_err(|e| python_error(py, &op.name, e))?;
        let check = OutputCheck {
            op: &op.name,
            tout,
            device,
            role: Role::Output,
            args,
        };
        // A numpy-mode body that takes `out` writes into candle memory when every output's
        // shape is known before the call.
        let (body, accepts_out) = op.body_now(py);
        let shapes = if accepts_out && !tout.is_empty() {
            tout.iter()
                .map(|o| known_shape(o, args))
                .collect::<Option<Vec<_>>>()
        } else {
            None
        };
        if let Some(shapes) = shapes {
            let out = out_buffers(py, tout, shapes).map_err(|e| e.with_op(Some(&op.name)))?;
            let returned = run_limited(py, &op.name, timeout, || {
                call(&body, py_args, Some(&out.arg))
            })?;
            return out.finish(&check, returned);
        }
        // Large arrays a numpy-mode body makes come from the allocator candle frees into, with
        // the alignment of the first output's dtype, so a returned one becomes a tensor without
        // a copy (`bridge::numbers::adopted`).
        let _align = (passing != Passing::Tensors).then(|| {
            let align = tout.first().map_or(16, |o| o.dtype.size_in_bytes());
            crate::python::numpy_alloc::enter(py, align)
        });
        let returned = run_limited(py, &op.name, timeout, || call(&body, py_args, None))?;
        outputs_from_python(py, &check, returned)
    }
}
