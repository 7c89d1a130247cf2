//! Time limits for bodies: a watchdog thread raises `pyop.OpTimeout` in a body that runs past its
//! limit, as an asynchronous exception delivered at the body's next bytecode.
//!
//! Firing and finishing are decided under the GIL, so an exception is never left pending on a
//! thread whose body has already returned.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use super::errors::python_error;
use super::exceptions::OpTimeout;
use crate::error::{panic_message, Error, ErrorKind, Result};

const RUNNING: u8 = 0;
const DONE: u8 = 1;
const FIRED: u8 = 2;

struct Watch {
    deadline: Instant,
    thread: std::ffi::c_ulong,
    state: Arc<AtomicU8>,
}

fn watchdog() -> &'static mpsc::Sender<Watch> {
    static TX: OnceLock<mpsc::Sender<Watch>> = OnceLock::new();
    TX.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Watch>();
        std::thread::Builder::new()
            .name("pyop-watchdog".into())
            .spawn(move || watch_loop(rx))
            .expect("spawn the pyop watchdog thread");
        tx
    })
}

fn watch_loop(rx: mpsc::Receiver<Watch>) {
    let mut pending: Vec<Watch> = Vec::new();
    loop {
        pending.retain(|w| w.state.load(Ordering::Acquire) == RUNNING);
        let next = pending.iter().map(|w| w.deadline).min();
        let received = match next {
            None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
            Some(at) => rx.recv_timeout(at.saturating_duration_since(Instant::now())),
        };
        match received {
            Ok(w) => pending.push(w),
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        let now = Instant::now();
        for w in pending.iter_mut().filter(|w| w.deadline <= now) {
            super::attach(|py| {
                // A thread inside pyop's own imports (NumPy) is not interrupted: a half-done
                // import breaks the module for the whole process. The limit fires right after.
                if shielded(w.thread) {
                    w.deadline = now + SHIELD_RETRY;
                    return;
                }
                if w.state
                    .compare_exchange(RUNNING, FIRED, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    let exc = py.get_type::<OpTimeout>();
                    // SAFETY: the GIL is held; `exc` is a live exception type.
                    unsafe { pyo3::ffi::PyThreadState_SetAsyncExc(w.thread as _, exc.as_ptr()) };
                }
            });
        }
    }
}

/// How soon a limit that fell due during a shielded import is tried again.
const SHIELD_RETRY: Duration = Duration::from_millis(1);

/// Threads inside a [`Shield`], with how many shields each holds.
static SHIELDED: Mutex<Vec<(std::ffi::c_ulong, u32)>> = Mutex::new(Vec::new());

fn shielded(thread: std::ffi::c_ulong) -> bool {
    SHIELDED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|(t, _)| *t == thread)
}

/// While alive, no time limit interrupts this thread (it fires when the shield is dropped).
pub(crate) struct Shield(std::ffi::c_ulong);

impl Shield {
    pub(crate) fn new() -> Self {
        // SAFETY: only reads the calling thread's identifier.
        let thread = unsafe { pyo3::ffi::PyThread_get_thread_ident() };
        let mut s = SHIELDED.lock().unwrap_or_else(|e| e.into_inner());
        match s.iter_mut().find(|(t, _)| *t == thread) {
            Some((_, n)) => *n += 1,
            None => s.push((thread, 1)),
        }
        Shield(thread)
    }
}

impl Drop for Shield {
    fn drop(&mut self) {
        let mut s = SHIELDED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = s.iter().position(|(t, _)| *t == self.0) {
            s[i].1 -= 1;
            if s[i].1 == 0 {
                s.swap_remove(i);
            }
        }
    }
}

/// While any limit is armed, the interpreter switches threads at least this often (it is 5 ms by
/// default): the watchdog needs the GIL to raise the interrupt, and a busy body gives it up only
/// at a switch.
const ARMED_SWITCH_INTERVAL: f64 = 0.0005;

/// How many limits are armed, and the switch interval to restore when none is. Changed only
/// with the GIL held, which orders the changes.
static SWITCH: Mutex<(usize, f64)> = Mutex::new((0, 0.0));

/// Shortens the interpreter's switch interval while a limit is armed (see
/// [`ARMED_SWITCH_INTERVAL`]), and restores it when the last one is disarmed.
fn switch_interval(py: Python<'_>, arming: bool) {
    let set = {
        let mut s = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
        if arming {
            s.0 += 1;
            if s.0 > 1 {
                return;
            }
            None
        } else {
            s.0 = s.0.saturating_sub(1);
            if s.0 > 0 {
                return;
            }
            Some(s.1)
        }
    };
    let Ok(sys) = py.import("sys") else {
        return;
    };
    match set {
        Some(saved) => {
            let _ = sys.call_method1("setswitchinterval", (saved,));
        }
        None => {
            let current: f64 = sys
                .call_method0("getswitchinterval")
                .and_then(|v| v.extract())
                .unwrap_or(0.005);
            SWITCH.lock().unwrap_or_else(|e| e.into_inner()).1 = current;
            if current > ARMED_SWITCH_INTERVAL {
                let _ = sys.call_method1("setswitchinterval", (ARMED_SWITCH_INTERVAL,));
            }
        }
    }
}

/// The watch of one limited call. Dropped on every exit path — a panic unwinding included — it
/// marks the call done, so the watchdog never fires into whatever the thread runs next, and
/// clears an interrupt that fired but was not delivered yet.
struct Armed {
    state: Arc<AtomicU8>,
    thread: std::ffi::c_ulong,
}

thread_local! {
    /// The watches of the limited calls running on this thread, innermost last (a body that
    /// called Rust that called a limited op).
    static ENCLOSING: std::cell::RefCell<Vec<Arc<AtomicU8>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

impl Armed {
    fn new(state: Arc<AtomicU8>, thread: std::ffi::c_ulong) -> Self {
        // A call made by a thread-local destructor, after ENCLOSING is gone, is not known to
        // calls it encloses (it encloses none it could re-raise for): never a panic there.
        let _ = ENCLOSING.try_with(|s| s.borrow_mut().push(state.clone()));
        Armed { state, thread }
    }

    /// Marks the call done; whether the limit fired first.
    fn disarm(&self) -> bool {
        let _ = ENCLOSING.try_with(|s| {
            let mut s = s.borrow_mut();
            if let Some(i) = s.iter().rposition(|w| Arc::ptr_eq(w, &self.state)) {
                s.remove(i);
            }
        });
        let fired = self.state.swap(DONE, Ordering::AcqRel) == FIRED;
        if fired {
            // SAFETY: called with the GIL held (the call's own); a null exception clears one
            // still pending on this thread.
            unsafe { pyo3::ffi::PyThreadState_SetAsyncExc(self.thread as _, std::ptr::null_mut()) };
            // That also cleared the interrupt of an enclosing call whose limit fired meanwhile
            // (the watchdog has dropped its watch): raise it again, for that call to see.
            let enclosing_fired = ENCLOSING
                .try_with(|s| {
                    s.borrow()
                        .iter()
                        .any(|w| w.load(Ordering::Acquire) == FIRED)
                })
                .unwrap_or(false);
            if enclosing_fired {
                super::attach(|py| {
                    let exc = py.get_type::<OpTimeout>();
                    // SAFETY: the GIL is held; `exc` is a live exception type.
                    unsafe { pyo3::ffi::PyThreadState_SetAsyncExc(self.thread as _, exc.as_ptr()) };
                });
            }
        }
        fired
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        self.disarm();
    }
}

thread_local! {
    /// The earliest deadline of the limited calls running on this thread: Rust work a call does
    /// while holding the GIL (reading a body's outputs, a conversion a body asked for) checks it,
    /// since the watchdog's interrupt reaches Python bytecode only. No destructor: usable from
    /// any thread-local destructor.
    static DEADLINE: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// While alive, [`overdue`] on this thread tells whether the call's time limit has passed. A
/// call's limit covers all of it: the body, and the check of its outputs after it.
pub(crate) struct Deadline(Option<Option<Instant>>);

impl Deadline {
    /// The deadline of a call with `limit` starting now (none without a limit: then nothing is
    /// read or written, the common call pays nothing); an enclosing call's earlier deadline
    /// stays in force.
    pub(crate) fn enter(limit: Option<Duration>) -> Self {
        Deadline::until(limit.and_then(|l| Instant::now().checked_add(l)))
    }

    /// The deadline `at` (none: no limit) on this thread, as [`enter`](Self::enter) sets one.
    pub(crate) fn until(at: Option<Instant>) -> Self {
        let Some(at) = at else {
            return Deadline(None);
        };
        let outer = DEADLINE.get();
        DEADLINE.set(Some(outer.map_or(at, |o| o.min(at))));
        Deadline(Some(outer))
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        if let Some(outer) = self.0 {
            DEADLINE.set(outer);
        }
    }
}

/// Whether a limited call running on this thread is past its deadline.
pub(crate) fn overdue() -> bool {
    DEADLINE.get().is_some_and(|d| Instant::now() >= d)
}

/// A call another thread may cancel: an awaited call's, whose future was dropped
/// (`op::awaited`). Its body, while it runs, is interrupted as a time limit interrupts it (by the
/// watchdog, under the GIL); a body not yet started does not start.
#[derive(Clone, Default)]
pub(crate) struct Interrupt(Arc<Mutex<Interruptible>>);

#[derive(Default)]
struct Interruptible {
    cancelled: bool,
    /// The body running now: its thread and its watch's state.
    running: Option<(std::ffi::c_ulong, Arc<AtomicU8>)>,
}

thread_local! {
    /// The interrupt of the call this thread runs for an awaited call: taken by the first body
    /// run under it (a nested op's call inside that body is not the awaited call).
    static INTERRUPT: std::cell::RefCell<Option<Interrupt>> = const { std::cell::RefCell::new(None) };
    /// Whether `INTERRUPT` holds one: read first by every call (a plain flag, without the
    /// destructor bookkeeping of `INTERRUPT`'s `Arc`).
    static HAS_INTERRUPT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// This thread's interrupt, taken (see `INTERRUPT`).
fn take_interrupt() -> Option<Interrupt> {
    if !HAS_INTERRUPT.get() {
        return None;
    }
    HAS_INTERRUPT.set(false);
    INTERRUPT.try_with(|i| i.borrow_mut().take()).ok().flatten()
}

impl Interrupt {
    /// Runs `f` with this as the thread's interrupt: the body `f` runs (`run_limited`) can be
    /// cancelled.
    pub(crate) fn scope<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Reset;
        impl Drop for Reset {
            fn drop(&mut self) {
                take_interrupt();
            }
        }
        INTERRUPT.with(|i| *i.borrow_mut() = Some(self.clone()));
        HAS_INTERRUPT.set(true);
        let _reset = Reset;
        f()
    }

    /// Cancels the call: a body running now is interrupted, one not started never starts.
    pub(crate) fn cancel(&self) {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        s.cancelled = true;
        if let Some((thread, state)) = &s.running {
            let _ = watchdog().send(Watch {
                deadline: Instant::now(),
                thread: *thread,
                state: Arc::clone(state),
            });
        }
    }

    /// Whether the call was cancelled.
    pub(crate) fn cancelled(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).cancelled
    }

    /// A body starts on `thread` with its watch's `state`; false if the call was cancelled.
    fn begin(&self, thread: std::ffi::c_ulong, state: &Arc<AtomicU8>) -> bool {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        s.running = Some((thread, Arc::clone(state)));
        !s.cancelled
    }

    /// The body has ended (its watch disarmed).
    fn end(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).running = None;
    }
}

/// The error of a call cancelled before or while its body ran (seen by no one: the future that
/// would have had it was dropped).
fn cancelled(op: &str) -> Error {
    Error::op_failure(
        op,
        ErrorKind::Cancelled,
        "the call was cancelled (its future was dropped)",
    )
}

/// Runs `body` (which calls into Python) under an optional time limit, and interruptible when
/// the thread runs an awaited call (`Interrupt::scope`). A panic in Rust code the body reached
/// (a tensor method, a nested op) is caught here and becomes an error of kind
/// [`ErrorKind::Panic`]: pyo3 resumes such a panic when the body's exception is fetched.
#[inline]
pub(crate) fn run_limited<'py>(
    py: Python<'py>,
    op: &str,
    limit: Option<Duration>,
    body: impl FnOnce() -> PyResult<Bound<'py, PyAny>>,
) -> Result<Bound<'py, PyAny>> {
    // The usual call, with no limit and no interrupt: the body run inline.
    if limit.is_none() && !HAS_INTERRUPT.get() {
        return match caught(op, body) {
            Ok(Ok(returned)) => Ok(returned),
            Ok(Err(e)) => Err(python_error(py, op, e)),
            Err(e) => Err(e),
        };
    }
    run_limited_now(py, op, limit, body)
}

/// [`run_limited`] with a limit or an interrupt (out of line: the usual call inlines only the
/// check).
#[inline(never)]
fn run_limited_now<'py>(
    py: Python<'py>,
    op: &str,
    limit: Option<Duration>,
    body: impl FnOnce() -> PyResult<Bound<'py, PyAny>>,
) -> Result<Bound<'py, PyAny>> {
    // `Duration::MAX` and other limits past the end of time: no limit.
    let deadline = limit.and_then(|l| Instant::now().checked_add(l));
    let interrupt = take_interrupt();
    if deadline.is_none() && interrupt.is_none() {
        return caught(op, body).and_then(|r| r.map_err(|e| python_error(py, op, e)));
    }
    let state = Arc::new(AtomicU8::new(RUNNING));
    // SAFETY: only reads the calling thread's identifier.
    let thread = unsafe { pyo3::ffi::PyThread_get_thread_ident() };
    if let Some(i) = &interrupt {
        if !i.begin(thread, &state) {
            i.end();
            return Err(cancelled(op));
        }
    }
    if deadline.is_some() {
        switch_interval(py, true);
    }
    let armed = Armed::new(state.clone(), thread);
    if let Some(deadline) = deadline {
        let _ = watchdog().send(Watch {
            deadline,
            thread,
            state,
        });
    }
    let result = caught(op, body);
    // Still under the GIL: the watchdog either fired before this line or never will.
    let fired = armed.disarm();
    if let Some(i) = &interrupt {
        i.end();
    }
    if deadline.is_some() {
        switch_interval(py, false);
    }
    let result = result?;
    match result {
        Err(e) if fired && e.is_instance_of::<OpTimeout>(py) => {
            if interrupt.as_ref().is_some_and(Interrupt::cancelled) {
                return Err(cancelled(op));
            }
            let limit = limit.unwrap_or_default();
            // Keep the traceback: it says where the body was when it was interrupted.
            Err(python_error(py, op, e).with_kind(ErrorKind::Timeout, |_| {
                format!("the body ran past its time limit of {limit:?} and was interrupted")
            }))
        }
        other => other.map_err(|e| python_error(py, op, e)),
    }
}

/// `body()`, with a panic unwinding out of it turned into an error.
#[inline(always)]
fn caught<'py>(
    op: &str,
    body: impl FnOnce() -> PyResult<Bound<'py, PyAny>>,
) -> Result<PyResult<Bound<'py, PyAny>>> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(body))
        .map_err(|panic| panicked(op, panic))
}

#[cold]
fn panicked(op: &str, panic: Box<dyn std::any::Any + Send>) -> Error {
    Error::op_failure(
        op,
        ErrorKind::Panic,
        format!(
            "Rust code called by the body panicked: {}",
            panic_message(&*panic)
        ),
    )
}
