//! A forward call's body run, unbatched: the device checked, the inputs prepared outside the GIL
//! (`before`), the body run through the call core in the program (`run_body`) or in a worker
//! (`worker_call`), and the outputs put behind the op's own autograd node (`after`). The public
//! calls (`call`, `awaited`) and a batch's run (`batch`) come here for each body call.

use std::time::Duration;

use std::sync::Arc;

use candle_core::Device;
use pyo3::prelude::*;

use super::autograd;
use super::worker_call;
use super::{CallOptions, OpInner};
use crate::arg::Arg;
use crate::bridge::args::{python_args, Lists};
use crate::bridge::out::out_buffers;
use crate::bridge::outputs::{known_shape, outputs_from_python, OutputCheck, Outputs, Role};
use crate::bridge::prepare::{Passing, Prepared, PreparedInputs};
use crate::bridge::tensor::spare::Made;
use crate::error::Result;
use crate::python::errors::python_error;
use crate::python::timeout::run_limited;
use crate::spec::Mode;

/// One body call: of one call, or of a batch of `batch` calls (`op::batch`).
#[inline(always)]
pub(crate) fn call(
    op: &Arc<OpInner>,
    args: &[Arg<'_>],
    options: &CallOptions<'_>,
    batch: Option<usize>,
) -> Result<Outputs> {
    // Prepared into this frame (~110 bytes not moved through `Result`s: ~60 instructions).
    let mut prepared = PreparedInputs::new();
    let mut settled = None;
    before(
        op,
        args,
        options.device,
        options.timeout,
        &mut prepared,
        &mut settled,
    )?;
    let before = settled.as_ref().expect("settled by `before`");
    if let Some(n) = batch {
        before.span.record("batch", n);
    }
    let _entered = before.span.enter();
    let outputs = match &op.workers {
        Some(workers) => worker_call::run_in_worker(
            op,
            workers,
            args,
            &prepared,
            &before.device,
            before.timeout,
            &before.span,
        )?,
        None => op.run_python(&before.device, |py| {
            run_body(op, py, args, &prepared, &before.device, before.timeout)
        })?,
    };
    after(op, args, before.needs_node, prepared, outputs)
}

/// A forward call's end: the outputs put into the graph behind the op's own node, when it
/// has one and an input is tracked. (Inlined, as `before`: the scalar call's moves of
/// `Before` cost ~1 % of it otherwise.)
#[inline(always)]
pub(crate) fn after(
    op: &Arc<OpInner>,
    args: &[Arg<'_>],
    needs_node: bool,
    prepared: PreparedInputs,
    outputs: Outputs,
) -> Result<Outputs> {
    if needs_node {
        autograd::attach(op, args, prepared, outputs.into_vec())
            .map(Outputs::from_vec)
            .map_err(|e| e.in_op(&op.name))
    } else {
        Ok(outputs)
    }
}

/// What a forward call settles before its body runs (and its prepared inputs, written into the
/// caller's `PreparedInputs`).
pub(crate) struct Before {
    /// The outputs' device.
    pub device: Device,
    /// Whether the outputs go behind a node of the op's own (its gradient is not the body's
    /// candle ops, and an input is tracked); then the prepared inputs are detached.
    pub needs_node: bool,
    pub timeout: Option<Duration>,
    /// The call's trace span (`pyop.call`).
    pub span: tracing::Span,
}

/// The part of a forward call before its body: the device, the inputs prepared into `prepared`
/// (without the GIL), the time limit, written into the caller's `settled` (a `Result<Before>`
/// would be `pyop::Error`'s 112 bytes and more, copied piecewise on the way out).
#[inline(always)]
pub(crate) fn before(
    op: &OpInner,
    args: &[Arg<'_>],
    device: Option<&Device>,
    timeout: Option<Duration>,
    prepared: &mut PreparedInputs,
    settled: &mut Option<Before>,
) -> Result<()> {
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
    {
        let _entered = span.enter();
        op.failed_before_python(crate::python::without_gil(|| {
            crate::bridge::prepare::prepare_inputs(&op.name, op.passing(), args, prepared)
        }))?;
    }
    if needs_node {
        *prepared = autograd::detach_prepared(std::mem::take(prepared));
    }
    *settled = Some(Before {
        device,
        needs_node,
        timeout: timeout.or(op.timeout),
        span,
    });
    Ok(())
}

fn output_device(op: &OpInner, args: &[Arg<'_>], explicit: Option<&Device>) -> Result<Device> {
    // One plain pass (the message is made only on a clash): a scalar call's device in ~20
    // instructions.
    let mut first: Option<&Device> = None;
    for t in args.iter().flat_map(Arg::tensors) {
        match first {
            None => first = Some(t.device()),
            Some(d) if !d.same_device(t.device()) => return Err(devices_clash(op, d, t)),
            Some(_) => {}
        }
    }
    Ok(explicit.or(first).cloned().unwrap_or(Device::Cpu))
}

#[cold]
fn devices_clash(op: &OpInner, d: &Device, t: &candle_core::Tensor) -> crate::error::Error {
    crate::error::Error::op_failure(
        &*op.name,
        crate::error::ErrorKind::DeviceMismatch,
        format!(
            "inputs are on different devices ({:?} and {:?}); move them to one device before the call",
            d.location(),
            t.device().location()
        ),
    )
}

/// The body's part of a forward call, with the GIL held: the Python arguments, the body (with
/// `out` buffers when it takes them and every output's shape is known), the output check.
#[inline(always)]
fn run_body(
    op: &OpInner,
    py: Python<'_>,
    args: &[Arg<'_>],
    prepared: &[Prepared],
    device: &Device,
    timeout: Option<Duration>,
) -> Result<Outputs> {
    // The limit covers the body and the check of its outputs (not the wait for the GIL).
    let _deadline = crate::python::timeout::Deadline::enter(timeout);
    let passing = op.passing();
    if passing == Passing::Views {
        crate::python::numpy::ensure_numpy(py, Some(&op.name))?;
    }
    let tout = op.resolved_tout(args)?;
    let tout = &*tout;
    // `_made` outlives the outputs' check (see `python_args`).
    let mut _made = Made::default();
    let py_args = python_args(py, passing, args, prepared, Lists::AsLists, &mut _made)
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
            crate::bridge::args::call(&body, py_args, Some(&out.arg))
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
    let returned = run_limited(py, &op.name, timeout, || {
        crate::bridge::args::call(&body, py_args, None)
    })?;
    outputs_from_python(py, &check, returned)
}
