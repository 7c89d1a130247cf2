//! Time limits for bodies: a watchdog thread raises `pyop.OpTimeout` in a body that runs past its
//! limit, as an asynchronous exception delivered at the body's next bytecode.
//!
//! Firing and finishing are decided under the GIL, so an exception is never left pending on a
//! thread whose body has already returned.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use super::errors::python_error;
use super::exceptions::OpTimeout;
use crate::error::{ErrorKind, Result};

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
        for w in pending.iter().filter(|w| w.deadline <= now) {
            Python::attach(|py| {
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

/// Runs `body` (which calls into Python) under an optional time limit.
pub(crate) fn run_limited<'py>(
    py: Python<'py>,
    op: &str,
    limit: Option<Duration>,
    body: impl FnOnce() -> PyResult<Bound<'py, PyAny>>,
) -> Result<Bound<'py, PyAny>> {
    let Some(limit) = limit else {
        return body().map_err(|e| python_error(py, op, e));
    };
    let state = Arc::new(AtomicU8::new(RUNNING));
    // SAFETY: only reads the calling thread's identifier.
    let thread = unsafe { pyo3::ffi::PyThread_get_thread_ident() };
    let _ = watchdog().send(Watch {
        deadline: Instant::now() + limit,
        thread,
        state: state.clone(),
    });
    let result = body();
    // Still under the GIL: the watchdog either fired before this line or never will.
    if state.swap(DONE, Ordering::AcqRel) == FIRED {
        // SAFETY: the GIL is held; a null exception clears one still pending on this thread.
        unsafe { pyo3::ffi::PyThreadState_SetAsyncExc(thread as _, std::ptr::null_mut()) };
        if let Err(e) = result {
            if !e.is_instance_of::<OpTimeout>(py) {
                return Err(python_error(py, op, e));
            }
            // Keep the traceback: it says where the body was when it was interrupted.
            return Err(python_error(py, op, e).with_kind(ErrorKind::Timeout, |_| {
                format!("the body ran past its time limit of {limit:?} and was interrupted")
            }));
        }
        return result.map_err(|e| python_error(py, op, e));
    }
    result.map_err(|e| python_error(py, op, e))
}
