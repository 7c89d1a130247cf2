//! One Python thread state per OS thread, kept from the thread's first call into Python until the
//! thread ends.
//!
//! `Python::attach` is `PyGILState_Ensure`/`Release`. On a thread CPython has no thread state
//! for, every `Ensure` creates one and the matching `Release` deletes it again: a thread state,
//! its first frame's 16 KiB data-stack chunk (an `mmap` and a `munmap`) and its `threading.local`
//! data, made and thrown away on every call, 7–10 µs each. The program's main thread never pays
//! this, because the interpreter's start leaves it a thread state. Here every other thread gets
//! the same: on its first call, an outer `PyGILState_Ensure` creates the thread state and
//! `PyEval_SaveThread` lets the GIL go at once, so every later `Ensure` finds the thread state,
//! only takes the GIL, and its `Release` only lets it go (the thread state's counter never falls
//! back to zero). When the thread ends, its thread-local destructor takes the GIL and makes the
//! matching `Release`, which clears and deletes the thread state.
//!
//! Why this is sound (CPython's `Python/pystate.c`, pyo3 0.30's `internal/state.rs`):
//! - Only a thread state pyop made is kept: a thread that already has one (the main thread, a
//!   `threading.Thread`, a caller's own `Python::attach` around a `detach`) is left as it is,
//!   because its owner deletes it and a kept pointer would dangle.
//! - The pointer lives in a `thread_local!`, so no other thread ever uses it; the GIL is taken
//!   and released around each call exactly as before (`PyEval_SaveThread` right after the
//!   creation), so it is held only while Python runs.
//! - The destructor does nothing once the interpreter is finalizing or finalized (taking the GIL
//!   then hangs or exits the thread, and finalization has freed the thread states), nothing on
//!   the process's main thread, whose thread-local destructors run inside `exit()`: waiting there
//!   for the GIL another thread holds would stall the program's end for nothing, and nothing on a
//!   thread that holds the GIL as its thread-locals are destroyed (`exit()` called from Python on
//!   that thread): taking the GIL would wait for itself.
//! - The destructor clears the thread's Python objects with the thread state's counter above
//!   zero, so Python code their `__del__` runs may take and let go the GIL (through pyop or
//!   pyo3) without the thread state being deleted under it, then deletes the cleared state.
//! - pyo3's own attach counter is untouched: between calls this thread is detached, as pyo3
//!   expects of a thread whose count is zero.

use std::cell::Cell;
use std::ptr;

use pyo3::ffi;

/// This thread's Python thread state as pyop knows it: the one pyop made and keeps (`owned`), or
/// the main thread's own, which lives as long as the interpreter; null until the first call, and
/// always null on a thread whose thread state someone else made and may delete (a
/// `threading.Thread`, a caller's own `Python::attach`).
struct Kept {
    tstate: Cell<*mut ffi::PyThreadState>,
    owned: Cell<bool>,
}

impl Drop for Kept {
    fn drop(&mut self) {
        let tstate = self.tstate.replace(ptr::null_mut());
        if tstate.is_null() || !self.owned.get() || is_main_thread() || !interpreter_running() {
            return;
        }
        // SAFETY: the interpreter is running; this reads the thread state that holds the GIL
        // (`PyGILState_Check` would not do: it answers 1 for good once a subinterpreter exists).
        if unsafe { ffi::compat::PyThreadState_GetUnchecked() } == tstate {
            // This thread holds the GIL while its thread-locals are destroyed: `exit()` called
            // from Python (a body, or Rust inside `Python::attach`). Taking the GIL would wait
            // for this very thread; the process is ending, and the thread state ends with it.
            return;
        }
        // SAFETY: `tstate` is the thread state this thread's outer `PyGILState_Ensure` made and
        // `PyEval_SaveThread` detached; the interpreter is running, so it was not freed.
        // Restoring it takes the GIL. The thread's Python objects (its `threading.local` data)
        // are cleared with the gilstate counter at one, the outer `Ensure`'s, as CPython's own
        // threads clear theirs: a `__del__` run by the clearing may take and let go the GIL
        // through `PyGILState_Ensure`/`Release` (an exposed Rust function, an op), which takes
        // the counter to two and back, never to zero (where `Release` would delete the thread
        // state under the running `__del__`). Then the cleared state is deleted and the GIL let
        // go (`PyThreadState_DeleteCurrent` also unbinds it from this thread's gilstate slot),
        // without clearing it a second time as a last `Release` would.
        unsafe {
            ffi::PyEval_RestoreThread(tstate);
            ffi::PyThreadState_Clear(tstate);
            ffi::PyThreadState_DeleteCurrent();
        }
    }
}

thread_local! {
    static KEPT: Kept = const {
        Kept {
            tstate: Cell::new(ptr::null_mut()),
            owned: Cell::new(false),
        }
    };
}

/// Whether this thread holds the GIL, asked cheaply once its thread state is known: one read of
/// the current thread state, compared with this thread's (on 3.11 the current one is the GIL
/// holder's, on 3.12 and later this thread's own while it is attached: equal to this thread's
/// either way exactly when this thread holds the GIL). Before that, or on a thread whose state
/// pyop does not know, the same compare with the state CPython keeps for this thread, as
/// `PyGILState_Check` makes it (which answers yes on every thread once a subinterpreter has
/// existed: a runtime thread that never ran Python would then take the GIL to let go of it).
pub(crate) fn holds_gil() -> bool {
    let known = KEPT.try_with(|k| k.tstate.get()).unwrap_or(ptr::null_mut());
    if !known.is_null() {
        // SAFETY: the interpreter was running when `known` was recorded, and is not finalized
        // while pyop's calls run; this only reads the current thread state's address.
        return unsafe { ffi::compat::PyThreadState_GetUnchecked() } == known;
    }
    // SAFETY: Py_IsInitialized first, so that nothing is asked before the interpreter exists;
    // PyGILState_GetThisThreadState reads this thread's entry, and the current thread state's
    // address is only compared.
    unsafe {
        if ffi::Py_IsInitialized() == 0 {
            return false;
        }
        let mine = ffi::PyGILState_GetThisThreadState();
        !mine.is_null() && ffi::compat::PyThreadState_GetUnchecked() == mine
    }
}

/// Makes sure this thread, which does not hold the GIL, has a Python thread state that outlives
/// the next `Python::attach`: starts the interpreter if needed, then, if CPython has no thread
/// state for this thread, makes one and keeps it until the thread ends.
pub(crate) fn keep() {
    // A thread whose thread-local storage is being torn down (Python run by a destructor) keeps
    // nothing: `Python::attach` makes and deletes a thread state for that call, as before.
    let Ok(known) = KEPT.try_with(|k| !k.tstate.get().is_null()) else {
        return;
    };
    if known {
        return;
    }
    // SAFETY: Py_IsInitialized may be called at any time.
    if unsafe { ffi::Py_IsInitialized() } == 0 {
        pyo3::Python::initialize();
    }
    if !interpreter_running() {
        return;
    }
    // SAFETY: the interpreter is initialized; this reads the calling thread's gilstate slot.
    let existing = unsafe { ffi::PyGILState_GetThisThreadState() };
    if !existing.is_null() {
        // The main thread's state, made by the interpreter's start, lives as long as the
        // interpreter: known from now on. Any other thread's belongs to whoever made it.
        if is_main_thread() {
            let _ = KEPT.try_with(|k| k.tstate.set(existing));
        }
        return;
    }
    // SAFETY: the interpreter is running and this thread has no thread state and does not hold
    // the GIL: `Ensure` makes a thread state and takes the GIL, `SaveThread` lets the GIL go and
    // returns that thread state, still bound to this thread.
    let tstate = unsafe {
        ffi::PyGILState_Ensure();
        ffi::PyEval_SaveThread()
    };
    let _ = KEPT.try_with(|k| {
        k.tstate.set(tstate);
        k.owned.set(true);
    });
}

/// Whether the interpreter is initialized and not finalizing.
fn interpreter_running() -> bool {
    #[cfg(not(Py_3_13))]
    unsafe extern "C" {
        fn _Py_IsFinalizing() -> std::ffi::c_int;
    }
    // SAFETY: both only read the runtime's state and may be called at any time.
    unsafe {
        ffi::Py_IsInitialized() != 0 && {
            #[cfg(Py_3_13)]
            let finalizing = ffi::Py_IsFinalizing();
            #[cfg(not(Py_3_13))]
            let finalizing = _Py_IsFinalizing();
            finalizing == 0
        }
    }
}

/// Whether this is the process's main thread (whose thread-local destructors run inside `exit`).
fn is_main_thread() -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: both only return the caller's ids.
        unsafe { libc::gettid() == libc::getpid() }
    }
    #[cfg(target_os = "macos")]
    {
        // SAFETY: only reads the caller's identity.
        unsafe { libc::pthread_main_np() != 0 }
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        false
    }
}
