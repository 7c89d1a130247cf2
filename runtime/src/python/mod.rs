//! The interpreter: what pyop needs of CPython itself, knowing errors but not tensors.
//!
//! Starting and checking the environment (`env`), Python exceptions into [`Error`]s and back
//! (`errors`, `exceptions`), NumPy's presence (`numpy`) and the time-limit watchdog (`timeout`).
//! The one door op code takes into Python, `bridge::with_gil`, sits a layer above, because it
//! also installs the `pyop` module.
//!
//! [`Error`]: crate::Error

pub(crate) mod env;
pub(crate) mod errors;
pub(crate) mod exceptions;
pub(crate) mod importing;
pub(crate) mod numpy;
pub(crate) mod numpy_alloc;
pub(crate) mod thread_state;
pub(crate) mod timeout;
pub(crate) mod turns;

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use pyo3::prelude::*;

thread_local! {
    /// How many times this thread took the GIL through [`attach`].
    static TAKEN: Cell<u64> = const { Cell::new(0) };
}

/// Runs `f` with the GIL: every place pyop enters Python goes through here
/// (`runtime/tests/layers.rs` checks), so how often a thread took the GIL is known
/// ([`acquisitions`]; re-entering while it is held takes nothing), and every thread keeps its
/// Python thread state between calls (`thread_state`), so a call from any thread costs what it
/// costs on the main thread.
pub(crate) fn attach<R>(f: impl for<'py> FnOnce(Python<'py>) -> R) -> R {
    attach_as(false, f)
}

/// [`attach`] for an op's call: a thread that does not hold the GIL waits for its turn first
/// (`turns`), so that threads calling short ops at once take the GIL in long turns.
pub(crate) fn attach_in_turn<R>(f: impl for<'py> FnOnce(Python<'py>) -> R) -> R {
    attach_as(true, f)
}

#[inline(always)]
fn attach_as<R>(in_turn: bool, f: impl for<'py> FnOnce(Python<'py>) -> R) -> R {
    let outer = !thread_state::holds_gil();
    let _turn = (outer && in_turn).then(turns::take);
    let _inside = outer.then(|| {
        let _ = TAKEN.try_with(|t| t.set(t.get() + 1));
        thread_state::keep();
        INSIDE.fetch_add(1, Ordering::AcqRel);
        Inside
    });
    Python::attach(f)
}

/// Threads inside [`attach`] now (holding the GIL or waiting for it), and [`Alone`] claims.
static INSIDE: AtomicUsize = AtomicUsize::new(0);

/// Counted in [`INSIDE`] while alive.
struct Inside;

impl Drop for Inside {
    fn drop(&mut self) {
        INSIDE.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A claim that no other thread is inside pyop's door into Python (see [`alone`]); others that
/// come while it lives wait for the GIL as usual.
pub(crate) struct Alone(#[allow(dead_code)] Inside);

/// Claims, if no thread is inside [`attach`], that none is: the GIL is then free but for a
/// thread pyop did not put there (a Python thread running Python of its own, which gives it up
/// within the interpreter's switch interval). An awaited call takes the GIL on a runtime's
/// thread only under this claim, for work of its own that is short (a worker's reply read back).
pub(crate) fn alone() -> Option<Alone> {
    INSIDE
        .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
        .ok()
        .map(|_| Alone(Inside))
}

/// How many times this thread has taken the GIL through [`attach`] so far.
pub(crate) fn acquisitions() -> u64 {
    TAKEN.try_with(Cell::get).unwrap_or(0)
}

/// Runs `f`, which must not need Python, with the GIL released if this thread holds it.
///
/// Used around anything that can block on another thread (candle's storage locks): a thread that
/// blocks while holding the GIL can deadlock with a Python body that is waiting for the GIL.
#[inline]
pub(crate) fn without_gil<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if thread_state::holds_gil() {
        detached(f)
    } else {
        f()
    }
}

/// [`without_gil`] on a thread that holds the GIL (out of line: the usual caller does not).
#[inline(never)]
fn detached<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    attach(|py| py.detach(f))
}

/// Copies of at least this many bytes run without the GIL, so that other threads' Python goes on
/// meanwhile; below it, releasing and taking the GIL back costs more than it frees.
const COPY_WITHOUT_GIL_AT: usize = 1 << 20;

/// Runs `copy`, a copy of `bytes` bytes that needs no Python, on a thread that may hold the GIL
/// (a caller inside `Python::attach`, a body): without it when it is held and the copy is large.
pub(crate) fn copy_without_gil<R: Send>(bytes: usize, copy: impl FnOnce() -> R + Send) -> R {
    if bytes >= COPY_WITHOUT_GIL_AT {
        without_gil(copy)
    } else {
        copy()
    }
}

/// `TypeName: message` of a Python error, for messages that need no traceback.
pub(crate) fn describe(py: Python<'_>, err: &PyErr) -> String {
    let (ty, msg) = exception_parts(py, err);
    format!("{ty}: {msg}")
}

/// The exception's type name and `str()` of it.
pub(crate) fn exception_parts(py: Python<'_>, err: &PyErr) -> (String, String) {
    let ty = err
        .get_type(py)
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "Exception".to_owned());
    // An exception whose `__str__` raises (or returns no str) is described by its `repr`.
    let value = err.value(py);
    let msg = value
        .str()
        .or_else(|_| value.repr())
        .map(|s| s.to_string())
        .unwrap_or_default();
    (ty, msg)
}
