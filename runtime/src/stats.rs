//! Per-op counters: what each op cost.
//!
//! Calls, errors and GIL acquisitions are always counted; the time spent in Python and waiting
//! for the GIL only while timing is on ([`set_timing`], or `PYOP_TIMING=1` in the environment):
//! reading the clock three times is a tenth of a scalar call.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};
use std::time::Duration;

/// Whether calls are timed: not yet read from the environment, off, or on.
static TIMING: AtomicU8 = AtomicU8::new(UNREAD);
const UNREAD: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;

/// Turns the timing of calls on or off for the whole process: while on, every op's
/// [`OpStats::python_time`] and [`OpStats::gil_wait`] grow with each call (off by default, unless
/// the environment has `PYOP_TIMING=1`: a scalar call then costs three clock reads more).
///
/// ```
/// pyop::set_timing(true);
/// // ... calls ...
/// # pyop::set_timing(false);
/// ```
pub fn set_timing(on: bool) {
    TIMING.store(if on { ON } else { OFF }, Relaxed);
}

/// Whether calls are timed now (see [`set_timing`]).
pub(crate) fn timing() -> bool {
    match TIMING.load(Relaxed) {
        ON => true,
        OFF => false,
        _ => {
            let on = std::env::var_os("PYOP_TIMING").is_some_and(|v| v == "1");
            // A `set_timing` that ran meanwhile wins.
            let _ = TIMING.compare_exchange(UNREAD, if on { ON } else { OFF }, Relaxed, Relaxed);
            TIMING.load(Relaxed) == ON
        }
    }
}

/// How pyop's op calls took turns on the GIL since the process started (see [`gil_turns`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GilTurns {
    /// Calls that waited for another thread's turn before they started.
    pub waits: u64,
    /// Turns handed over by their owner at the end of a call (asked for by a thread that had
    /// waited a whole turn, or given up by an owner not calling in a loop).
    pub handed_over: u64,
    /// Turns taken by a waiting thread from an owner that started no call for a whole poll
    /// (inside one long body, or no longer calling).
    pub taken_over: u64,
}

/// The counts of [`GilTurns`], kept by the turns themselves (`python::turns`).
pub(crate) static TURN_WAITS: AtomicU64 = AtomicU64::new(0);
pub(crate) static TURNS_HANDED: AtomicU64 = AtomicU64::new(0);
pub(crate) static TURNS_TAKEN: AtomicU64 = AtomicU64::new(0);

/// How op calls have taken turns on the GIL so far: while several threads call at once, one
/// thread at a time has a turn and makes its calls one after another while the others wait in
/// pyop (see the guide's chapter on threads). The counts only grow; compare two readings.
///
/// ```
/// let before = pyop::gil_turns();
/// // ... calls from several threads ...
/// let waits = pyop::gil_turns().waits - before.waits;
/// # let _ = waits;
/// ```
pub fn gil_turns() -> GilTurns {
    GilTurns {
        waits: TURN_WAITS.load(Relaxed),
        handed_over: TURNS_HANDED.load(Relaxed),
        taken_over: TURNS_TAKEN.load(Relaxed),
    }
}

/// Live counters of one op; read them with [`crate::PyOp::stats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    calls: AtomicU64,
    errors: AtomicU64,
    python_ns: AtomicU64,
    gil_wait_ns: AtomicU64,
    gil_taken: AtomicU64,
    worker_ns: AtomicU64,
    worker_bytes_in: AtomicU64,
    worker_bytes_out: AtomicU64,
    batches: AtomicU64,
    batched_calls: AtomicU64,
    max_batch: AtomicU64,
    batch_wait_ns: AtomicU64,
}

/// A snapshot of an op's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OpStats {
    /// Calls made, successful or not (forward calls and gradient calls): body calls, so a batch
    /// of a batching op is one (see [`batched_calls`](Self::batched_calls)).
    pub calls: u64,
    /// Calls that returned an error (a failed batch is one).
    pub errors: u64,
    /// Time spent with the GIL held: converting, running the body, checking its outputs. Counted
    /// only while timing is on ([`set_timing`]); zero otherwise.
    pub python_time: Duration,
    /// Time spent waiting to take the GIL. Counted only while timing is on ([`set_timing`]).
    pub gil_wait: Duration,
    /// Times the calling thread took the GIL during forward calls, from the arguments to the
    /// outputs (one per call; none for a call made while the GIL is held, as from a body, nor
    /// for a worker call whose reply is read as bytes: a non-empty array of its one output's
    /// dtype, or its `out` buffers, once pyop has imported NumPy in the program, which the
    /// first worker call does). Awaited calls are not counted.
    /// Releasing it inside a call — large copies, big tensor work — and taking it back does not
    /// count.
    pub gil_acquisitions: u64,
    /// Time calls spent in worker processes (ops that run in a `WorkerPool`): from writing the
    /// inputs to the reply, waiting for a free worker included.
    pub worker_time: Duration,
    /// Bytes calls copied into worker processes' shared memory (inputs), as
    /// [`PoolStats::bytes_in`](crate::PoolStats::bytes_in) counts them for the op's calls.
    pub worker_bytes_in: u64,
    /// Bytes worker processes copied into shared memory for this op's results (none for a
    /// returned input, a view of one, or an `out` buffer: those are read where they lie).
    pub worker_bytes_out: u64,
    /// Body calls a batching op ([`Batch`](crate::Batch)) made, each for one batch of calls
    /// (a call alone is a batch of one).
    pub batches: u64,
    /// Calls those batches served (`batched_calls / batches` is the mean batch size:
    /// [`mean_batch`](Self::mean_batch)).
    pub batched_calls: u64,
    /// The most calls one batch served.
    pub max_batch: u64,
    /// Time calls of a batching op waited, queued, for their batch's body to start (the wait for
    /// company, and for the batch before theirs).
    pub batch_wait: Duration,
}

impl OpStats {
    /// The mean number of calls a batch served (0 before the first batch).
    pub fn mean_batch(&self) -> f64 {
        if self.batches == 0 {
            0.0
        } else {
            self.batched_calls as f64 / self.batches as f64
        }
    }
}

impl Counters {
    /// Counts one call, and the time it took when it was timed: (in Python, waiting for the GIL).
    pub(crate) fn record(&self, ok: bool, took: Option<(Duration, Duration)>) {
        self.calls.fetch_add(1, Relaxed);
        if !ok {
            self.errors.fetch_add(1, Relaxed);
        }
        if let Some((python, gil_wait)) = took {
            self.python_ns.fetch_add(python.as_nanos() as u64, Relaxed);
            self.gil_wait_ns
                .fetch_add(gil_wait.as_nanos() as u64, Relaxed);
        }
    }

    /// Adds the GIL acquisitions one forward call made on its thread.
    pub(crate) fn record_gil(&self, taken: u64) {
        if taken != 0 {
            self.gil_taken.fetch_add(taken, Relaxed);
        }
    }

    /// Adds the time one call spent in a worker process.
    pub(crate) fn record_worker(&self, took: Duration) {
        self.worker_ns.fetch_add(took.as_nanos() as u64, Relaxed);
    }

    /// Adds the bytes one call copied into and out of a worker's shared memory.
    pub(crate) fn record_worker_bytes(&self, copied_in: u64, copied_out: u64) {
        self.worker_bytes_in.fetch_add(copied_in, Relaxed);
        self.worker_bytes_out.fetch_add(copied_out, Relaxed);
    }

    /// Counts one batch of `calls` calls, which waited `waited` in all before it started.
    pub(crate) fn record_batch(&self, calls: usize, waited: Duration) {
        self.batches.fetch_add(1, Relaxed);
        self.batched_calls.fetch_add(calls as u64, Relaxed);
        self.max_batch.fetch_max(calls as u64, Relaxed);
        if !waited.is_zero() {
            self.batch_wait_ns
                .fetch_add(waited.as_nanos() as u64, Relaxed);
        }
    }

    pub(crate) fn snapshot(&self) -> OpStats {
        OpStats {
            calls: self.calls.load(Relaxed),
            errors: self.errors.load(Relaxed),
            python_time: Duration::from_nanos(self.python_ns.load(Relaxed)),
            gil_wait: Duration::from_nanos(self.gil_wait_ns.load(Relaxed)),
            gil_acquisitions: self.gil_taken.load(Relaxed),
            worker_time: Duration::from_nanos(self.worker_ns.load(Relaxed)),
            worker_bytes_in: self.worker_bytes_in.load(Relaxed),
            worker_bytes_out: self.worker_bytes_out.load(Relaxed),
            batches: self.batches.load(Relaxed),
            batched_calls: self.batched_calls.load(Relaxed),
            max_batch: self.max_batch.load(Relaxed),
            batch_wait: Duration::from_nanos(self.batch_wait_ns.load(Relaxed)),
        }
    }
}
