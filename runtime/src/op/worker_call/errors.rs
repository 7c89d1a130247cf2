//! What a worker call's failures become: a call its worker never answered (timed out, died, or
//! broke the protocol), a worker that could not start, and an exception the worker reported, by
//! the phase it happened in.

use std::time::Duration;

use crate::body::source::cannot_load;
use crate::bridge::shared::{result_not_sent, worker_exception};
use crate::error::{Error, ErrorKind};
use crate::worker::exchange::{Failure, Launch, StartError, LOAD_TIMEOUT};
use crate::worker::protocol::{ExcInfo, Phase};
use crate::worker::Lease;

/// The error of a request its worker never answered (`timeout`: the call's limit), the worker
/// given up: killed if it timed out, reaped if it died.
pub(crate) fn lost_call(
    op: &str,
    mut lease: Lease,
    failure: Failure,
    timeout: Option<Duration>,
) -> Error {
    let (named, noun) = (lease.worker().named(), lease.worker().noun());
    lease.discard(matches!(failure, Failure::TimedOut { .. }));
    match failure {
        Failure::TimedOut { loading: false } => Error::op_failure(
            op,
            ErrorKind::Timeout,
            format!(
                "the body ran past its time limit of {:?} in {named}, which was killed; the next \
                 call starts a new {noun}",
                timeout.unwrap_or_default()
            ),
        ),
        Failure::TimedOut { loading: true } => Error::op_failure(
            op,
            ErrorKind::Timeout,
            format!(
                "loading the body in {named} took over {} s; the {noun} was killed, and the next \
                 call starts a new one",
                LOAD_TIMEOUT.as_secs()
            ),
        ),
        Failure::Lost { how, loading } => {
            let doing = if loading {
                "loading the body"
            } else {
                "running the body"
            };
            Error::op_failure(
                op,
                ErrorKind::WorkerLost,
                format!(
                    "{named} {how} while {doing}; this call failed, and the next call starts a \
                     new {noun}"
                ),
            )
        }
    }
}

/// A worker that could not start: no NumPy there, or anything else.
pub(crate) fn start_error(op: &str, launch: &Launch, e: StartError) -> Error {
    match e {
        StartError::NoNumpy(why) => Error::op_failure(
            op,
            ErrorKind::PackageUnavailable,
            format!(
                "a worker cannot import NumPy ({why}): workers run {} with {}; install it with {}",
                launch.python.display(),
                launch.describe,
                launch.pip_numpy
            ),
        ),
        StartError::Failed(why) => Error::op_failure(
            op,
            ErrorKind::PythonUnavailable,
            format!("cannot start a worker: {why}"),
        ),
        StartError::NoRay(why) => Error::op_failure(op, ErrorKind::PackageUnavailable, why),
        StartError::Cluster(why) => Error::op_failure(op, ErrorKind::ClusterUnavailable, why),
    }
}

/// The error a worker's exception becomes, by the phase it failed in (`body`: the body's source
/// as errors name it).
pub(crate) fn worker_error(
    py: pyo3::Python<'_>,
    op: &str,
    body: &str,
    worker: u64,
    exc: &ExcInfo,
) -> Error {
    match exc.phase {
        Phase::Load => cannot_load(
            worker_exception(py, op, exc),
            &format!("{body} in a worker"),
        ),
        Phase::Result => result_not_sent(op, exc),
        // The worker's own machinery failed (it exits after saying so, and is replaced).
        Phase::Worker | Phase::Start => Error::op_failure(
            op,
            ErrorKind::WorkerLost,
            format!(
                "worker {worker} failed in its own code ({}: {}) and exited; the next call \
                 starts a new worker",
                exc.type_name, exc.message
            ),
        ),
        Phase::Call => worker_exception(py, op, exc),
    }
}

/// A body that lacks functions its op calls (`where_`: "in a worker", "on a Ray actor").
pub(crate) fn missing_functions(op: &str, body: &str, where_: &str, missing: &[String]) -> Error {
    Error::op_failure(
        op,
        ErrorKind::MissingFunction,
        format!(
            "{where_}, {body} defines no callable {}",
            missing
                .iter()
                .map(|m| format!("`{m}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    )
}
