//! A numpy-mode op's call in a worker process (`crate::worker`), top to bottom in
//! [`run_in_worker`]: the request (inputs as the storage they view, arguments as the
//! protocol's types), the exchange without the GIL (a worker leased, the inputs written into its
//! shared memory, the reply read and checked against the protocol), then the reply read back and
//! the one output check on it (without the GIL where only bytes are read). Each step's detail
//! has its own file: finding the interpreter (`launch`), loading the body (`load`), encoding the
//! call (`encode`), reading the reply (`decode`) and what failures become (`errors`).

pub(crate) mod decode;
pub(crate) mod encode;
mod errors;
pub(crate) mod launch;
pub(crate) mod load;

use std::time::{Duration, Instant};

use candle_core::{DType, Device};

use self::encode::{Group, WireInputs};
use self::errors::{lost_call, missing_functions, start_error, worker_error};
use self::launch::launch;
use self::load::Workers;
use crate::arg::Arg;
use crate::body::source::Source;
use crate::bridge::outputs::{known_shape, OutputCheck, Outputs, Role};
use crate::bridge::prepare::Prepared;
use crate::bridge::with_gil;
use crate::error::Result;
use crate::op::{OpInner, PyOp};
use crate::spec::OutSpec;
use crate::worker::exchange::{Answered, Exchange, Load, LOAD_TIMEOUT};
use crate::worker::protocol::{Phase, Reply};
use crate::worker::Lease;

/// A worker's answer, and the worker it came from. It holds the worker until it is dropped: the
/// worker's next call would overwrite the shared memory the answer's values are read from.
pub(crate) struct Answer {
    pub answered: Answered,
    pub worker: u64,
    /// For a Ray actor, its node's address.
    pub node: Option<String>,
    _lease: Option<Lease>,
    /// The call's deadline, from its exchange with the worker to the end of its output check
    /// (the program's reading of a reply in Python counts against it too).
    deadline: Option<Instant>,
}

/// One call to make in a worker: the function, its inputs and argument groups, `out` buffers.
struct Call<'a> {
    function: &'a str,
    inputs: &'a WireInputs,
    groups: &'a [(&'a [Arg<'a>], Group)],
    outs: Option<&'a [(DType, Vec<usize>)]>,
    timeout: Option<Duration>,
    reloaded: Option<Source>,
}

/// What a forward call sends a worker, made before the exchange: the outputs expected, the
/// source to load (with hot reload), the `out` buffers' shapes, the inputs' spans.
pub(crate) struct Request {
    pub tout: Vec<OutSpec>,
    reloaded: Option<Source>,
    outs: Option<Vec<(DType, Vec<usize>)>>,
    inputs: WireInputs,
}

/// The body's part of a forward call run in a worker process.
pub(crate) fn run_in_worker(
    op: &OpInner,
    workers: &Workers,
    args: &[Arg<'_>],
    prepared: &[Prepared],
    device: &Device,
    timeout: Option<Duration>,
    span: &tracing::Span,
) -> Result<Outputs> {
    // 1. The request. Hot reload may have given the body a new source, and an `out`
    // parameter or taken it away.
    let request = worker_request(op, args, prepared, worker_body_now(op))?;
    // 2. The exchange, without the GIL.
    let groups = [(args, Group::List)];
    let answer = op.failed_before_python(call_in_worker(
        op,
        workers,
        forward_call(op, &groups, &request, timeout),
    ))?;
    // 3. The reply read back and checked: as bytes without the GIL, or with it.
    worker_outputs(op, args, &request, &answer, device, span)
}

/// Step 1 of a forward call in a worker: its request, with the body as `body_now` says
/// (`worker_body_now`).
pub(crate) fn worker_request(
    op: &OpInner,
    args: &[Arg<'_>],
    prepared: &[Prepared],
    (reloaded, accepts_out): (Option<Source>, bool),
) -> Result<Request> {
    let tout = op.failed_before_python(op.resolved_tout(args))?;
    let outs = if accepts_out {
        out_shapes(&tout, args)
    } else {
        None
    };
    let inputs = op.failed_before_python(WireInputs::new(&op.name, prepared))?;
    Ok(Request {
        tout: tout.into_owned(),
        reloaded,
        outs,
        inputs,
    })
}

/// Step 3 of a forward call in a worker: the reply read back and checked, without the GIL
/// where only bytes are read ([`worker_outputs_without_python`]), else with it
/// ([`worker_outputs_with_gil`]).
pub(crate) fn worker_outputs(
    op: &OpInner,
    args: &[Arg<'_>],
    request: &Request,
    answer: &Answer,
    device: &Device,
    span: &tracing::Span,
) -> Result<Outputs> {
    record_worker(answer, span);
    match worker_outputs_without_python(op, args, request, answer, device) {
        Some(outputs) => outputs,
        None => worker_outputs_with_gil(op, args, request, answer, device),
    }
}

/// The worker (and its node) in the call's span, once it answered.
pub(crate) fn record_worker(answer: &Answer, span: &tracing::Span) {
    span.record("worker", answer.worker);
    if let Some(node) = &answer.node {
        span.record("node", node.as_str());
    }
}

/// Step 3 where it needs no Python (`decode::without_python`: the usual array, `out` buffers,
/// read as bytes, which the call's time limit does not cut short, as a copy in the program):
/// the outputs, the call counted (no time with the GIL); `None` for a reply read with the GIL.
/// A worker call then does not wait for the program's GIL, which its other threads' bodies may
/// hold for milliseconds. Only once the program has NumPy: until then the GIL's path imports it
/// (and says so when it cannot), as for every reply.
pub(crate) fn worker_outputs_without_python(
    op: &OpInner,
    args: &[Arg<'_>],
    request: &Request,
    answer: &Answer,
    device: &Device,
) -> Option<Result<Outputs>> {
    if !crate::python::numpy::imported() {
        return None;
    }
    let check = output_check(op, args, request, device);
    let outputs = decode::without_python(&answer.answered, &check, request.outs.as_deref())?;
    Some(op.finished_without_python(outputs))
}

/// Step 3 with the GIL: the reply read back as Python values and checked as a body's own.
pub(crate) fn worker_outputs_with_gil(
    op: &OpInner,
    args: &[Arg<'_>],
    request: &Request,
    answer: &Answer,
    device: &Device,
) -> Result<Outputs> {
    let _deadline = crate::python::timeout::Deadline::until(answer.deadline);
    op.run_python(device, |py| {
        crate::python::numpy::ensure_numpy(py, Some(&op.name))?;
        decode::outputs(
            py,
            &answer.answered,
            answer.worker,
            &|| body_named(op),
            &output_check(op, args, request, device),
            request.outs.as_deref(),
        )
    })
}

/// What a forward call's outputs are checked against.
fn output_check<'a>(
    op: &'a OpInner,
    args: &'a [Arg<'a>],
    request: &'a Request,
    device: &'a Device,
) -> OutputCheck<'a> {
    OutputCheck {
        op: &op.name,
        tout: &request.tout,
        device,
        role: Role::Output,
        args,
    }
}

/// A registered Python gradient run in a worker, with the same arguments as in the program:
/// the inputs', outputs' and incoming gradients' tuples. Returns what `check` makes of the
/// value it returned, with the GIL held.
pub(crate) fn gradient_in_worker<T>(
    op: &OpInner,
    workers: &Workers,
    function: &str,
    prepared: [&[Prepared]; 3],
    groups: [&[Arg<'_>]; 3],
    device: &Device,
    check: impl FnOnce(pyo3::Python<'_>, &pyo3::Bound<'_, pyo3::PyAny>) -> Result<T>,
) -> Result<T> {
    let inputs =
        op.failed_before_python(WireInputs::new(&op.name, prepared.into_iter().flatten()))?;
    let [a, b, c] = groups;
    let answer = op.failed_before_python(call_in_worker(
        op,
        workers,
        Call {
            function,
            inputs: &inputs,
            groups: &[(a, Group::Tuple), (b, Group::Tuple), (c, Group::Tuple)],
            outs: None,
            timeout: op.timeout,
            reloaded: worker_body_now(op).0,
        },
    ))?;
    let _deadline = crate::python::timeout::Deadline::until(answer.deadline);
    op.run_python(device, |py| {
        let returned = decode::value(py, &answer.answered, answer.worker, &op.name, &|| {
            body_named(op)
        })?;
        check(py, &returned)
    })
}

/// Runs one call in a worker of the op's pool, without the GIL, and returns its answer; the
/// time it took (waiting for a worker included) and the bytes it copied are counted.
fn call_in_worker(op: &OpInner, workers: &Workers, call: Call<'_>) -> Result<Answer> {
    let name = op.name.as_str();
    let launch = launch(name)?;
    let load = workers.load(name, call.reloaded.clone());
    let started = Instant::now();
    let answer = crate::python::without_gil(|| {
        let mut lease = lease(op, workers, launch)?;
        let (exchange, deadline, span) = exchange(op, &call, &load, &mut lease)?;
        let result = span.in_scope(|| lease.worker().call(exchange));
        answered(op, lease, result, deadline, call.timeout)
    });
    op.counters.record_worker(started.elapsed());
    answer
}

/// [`call_in_worker`](call_in_worker) for an awaited forward call: the worker waited
/// for, and its reply, as a task (`WorkerPool::checkout_async`, `Lease::call_async`).
#[cfg(target_os = "linux")]
pub(crate) async fn call_in_worker_async(
    op: &OpInner,
    workers: &Workers,
    args: &[Arg<'_>],
    request: &Request,
    timeout: Option<Duration>,
    launch: &'static crate::worker::exchange::Launch,
) -> Result<Answer> {
    let groups = [(args, Group::List)];
    let call = forward_call(op, &groups, request, timeout);
    let name = op.name.as_str();
    let load = workers.load(name, call.reloaded.clone());
    let started = Instant::now();
    let answer = async {
        let mut lease = workers
            .pool
            .checkout_async(launch)
            .await
            .map_err(|e| start_error(&op.name, launch, e))?;
        lease.count_call();
        let (exchange, deadline, span) = exchange(op, &call, &load, &mut lease)?;
        let result = tracing::Instrument::instrument(lease.call_async(exchange), span).await;
        answered(op, lease, result, deadline, call.timeout)
    }
    .await;
    op.counters.record_worker(started.elapsed());
    op.failed_before_python(answer)
}

/// The exchange of `call` with the leased worker, the call's deadline (from now), and the
/// exchange's trace span.
fn exchange<'c>(
    op: &OpInner,
    call: &'c Call<'c>,
    load: &Load,
    lease: &mut Lease,
) -> Result<(Exchange<'c>, Option<Instant>, tracing::Span)> {
    // Encoded once a worker is had: the request says whether the worker may check for its
    // next one after replying, by the machine's load now, not before a wait.
    let encoded = encode::call(
        &op.name,
        &load.key,
        call.function,
        call.inputs,
        call.groups,
        call.outs,
    )?;
    let worker = lease.worker();
    let span = tracing::trace_span!(
        "pyop.worker",
        op = op.name.as_str(),
        worker = worker.id,
        pid = worker.pid,
        node = worker.actor.as_ref().map(|a| a.ip.as_str())
    );
    let deadline = call.timeout.and_then(|t| Instant::now().checked_add(t));
    Ok((
        Exchange {
            load: load.clone(),
            function: call.function,
            call: encoded.call,
            inputs: encoded.inputs,
            arena_len: encoded.arena_len,
            outs: encoded.out_sizes,
            timeout: call.timeout,
        },
        deadline,
        span,
    ))
}

/// The answer of an exchange with the leased worker, or its failure as an error (the worker
/// given up).
fn answered(
    op: &OpInner,
    lease: Lease,
    result: std::result::Result<Answered, crate::worker::exchange::Failure>,
    deadline: Option<Instant>,
    timeout: Option<Duration>,
) -> Result<Answer> {
    let name = op.name.as_str();
    let (id, node) = {
        let w = lease.peek();
        (w.id, w.actor.as_ref().map(|a| a.ip.clone()))
    };
    match result {
        Ok(answered) => {
            lease.count_answer(&answered);
            op.counters
                .record_worker_bytes(answered.copied_in, answered.copied_out);
            // A worker whose own machinery failed has said so and exits: not reused.
            let lease = match &answered.reply {
                Reply::Raised { exc, .. } if exc.phase == Phase::Worker => {
                    lease.discard(false);
                    None
                }
                _ => Some(lease),
            };
            Ok(Answer {
                answered,
                worker: id,
                node,
                _lease: lease,
                deadline,
            })
        }
        Err(f) => Err(lost_call(name, lease, f, timeout)),
    }
}

/// With hot reload on, the source workers load now (the program's check, which takes the
/// GIL, may have found a new one) and whether the body takes `out`; without it, neither
/// costs anything.
pub(crate) fn worker_body_now(op: &OpInner) -> (Option<Source>, bool) {
    let Some(r) = &op.reload else {
        return (None, op.accepts_out);
    };
    let accepts_out = with_gil(&op.name, |py| Ok(op.body_now(py).1)).unwrap_or(op.accepts_out);
    (Some(r.source()), accepts_out)
}

/// The body's source as errors name it.
fn body_named(op: &OpInner) -> String {
    op.source
        .as_ref()
        .map_or_else(|| "the body".to_owned(), Source::describe)
}

/// A worker of the op's pool for one call, started if none is idle (without the GIL).
pub(crate) fn lease(
    op: &OpInner,
    workers: &Workers,
    launch: &crate::worker::exchange::Launch,
) -> Result<Lease> {
    let lease = workers
        .pool
        .checkout(launch)
        .map_err(|e| start_error(&op.name, launch, e))?;
    lease.count_call();
    Ok(lease)
}

/// Checks that a worker starts and loads the body, with its functions (for `validate()`).
pub(crate) fn check_worker(op: &OpInner, workers: &Workers, functions: &[&str]) -> Result<()> {
    let name = op.name.as_str();
    let launch = launch(name)?;
    let load = workers.load(name, None);
    let (worker, where_, reply) = crate::python::without_gil(|| {
        let mut lease = lease(op, workers, launch)?;
        let worker = lease.worker().id;
        let where_ = if lease.worker().actor.is_some() {
            "on a Ray actor"
        } else {
            "in a worker"
        };
        match lease.worker().ask(&load, functions, LOAD_TIMEOUT) {
            Ok(reply) => Ok((worker, where_, reply)),
            Err(f) => Err(lost_call(name, lease, f, Some(LOAD_TIMEOUT))),
        }
    })?;
    let missing = match reply {
        Reply::Pong { missing, .. } => missing,
        Reply::LoadFailed { exc } => {
            let body = body_named(op);
            return Err(with_gil(name, |py| {
                Ok(worker_error(py, name, &body, worker, &exc))
            })?);
        }
        other => unreachable!("`ask` answers pong or load_failed, not {}", other.kind()),
    };
    if !missing.is_empty() {
        return Err(missing_functions(name, &body_named(op), where_, &missing));
    }
    Ok(())
}

impl PyOp {
    /// Starts the workers of the op's pool now, side by side, rather than on the first calls
    /// that need them (each costs an interpreter start and NumPy's import, about 70 ms). A no-op
    /// for an op that runs in the program.
    pub fn start_workers(&self) -> Result<()> {
        let op = &*self.inner;
        let Some(workers) = &op.workers else {
            return Ok(());
        };
        let launch = launch(&op.name)?;
        crate::python::without_gil(|| workers.pool.fill(launch))
            .map_err(|e| start_error(&op.name, launch, e))
    }
}

/// The call a forward `request` makes, with the call's arguments as `groups`.
fn forward_call<'a>(
    op: &'a OpInner,
    groups: &'a [(&'a [Arg<'a>], Group)],
    request: &'a Request,
    timeout: Option<Duration>,
) -> Call<'a> {
    Call {
        function: &op.function,
        inputs: &request.inputs,
        groups,
        outs: request.outs.as_deref(),
        timeout,
        reloaded: request.reloaded.clone(),
    }
}

/// Shapes of `out` buffers for a worker call (the same rule as in the program: every output's
/// shape known before the call).
fn out_shapes(tout: &[OutSpec], args: &[Arg<'_>]) -> Option<Vec<(DType, Vec<usize>)>> {
    if tout.is_empty() {
        return None;
    }
    tout.iter()
        .map(|o| known_shape(o, args).map(|s| (o.dtype, s)))
        .collect()
}
