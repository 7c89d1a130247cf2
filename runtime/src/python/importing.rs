//! One thread at a time imports through pyop: a body's module loaded (its top-level imports),
//! NumPy imported for numpy mode. Two threads importing the same package for the first time at
//! once can break it for the rest of the process — NumPy's import, run twice at once, leaves
//! "partially initialized module" errors behind (numpy/numpy#21223), and a C extension that
//! failed to load cannot be loaded again. A program's first calls often come from many threads
//! at once (a server's first requests), so pyop takes its imports in turns. The lock is
//! re-entrant (a module whose top level calls another op loads that op's module too), and a
//! thread waiting for it waits without the GIL (the thread that holds it may need the GIL).
//! Imports inside a body's function, at call time, are the body's own and are not in turns. As
//! with Python's own import lock, a module whose top level waits for another thread that loads
//! an op's module deadlocks (`docs/src/limitations.md`).

use std::sync::{Condvar, Mutex};
use std::thread::ThreadId;

use pyo3::Python;

use super::timeout::Shield;

/// The thread importing now, and how many times it entered.
static OWNER: Mutex<Option<(ThreadId, usize)>> = Mutex::new(None);
static FREED: Condvar = Condvar::new();

/// While alive, this thread is the one importing through pyop, and no time limit interrupts it
/// (an import interrupted half-way leaves its module unimportable: "cannot load module more than
/// once").
pub(crate) struct Importing {
    _shield: Shield,
}

impl Importing {
    /// Waits (without the GIL) until no other thread imports through pyop, then imports.
    pub(crate) fn begin(py: Python<'_>) -> Importing {
        let me = std::thread::current().id();
        if !try_enter(me) {
            py.detach(|| {
                let mut owner = OWNER.lock().unwrap_or_else(|e| e.into_inner());
                while owner.is_some() {
                    owner = FREED.wait(owner).unwrap_or_else(|e| e.into_inner());
                }
                *owner = Some((me, 1));
            });
        }
        Importing {
            _shield: Shield::new(),
        }
    }
}

/// Enters if no thread imports or this one does already.
fn try_enter(me: ThreadId) -> bool {
    let mut owner = OWNER.lock().unwrap_or_else(|e| e.into_inner());
    match &mut *owner {
        None => {
            *owner = Some((me, 1));
            true
        }
        Some((t, n)) if *t == me => {
            *n += 1;
            true
        }
        Some(_) => false,
    }
}

impl Drop for Importing {
    fn drop(&mut self) {
        let mut owner = OWNER.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, n)) = &mut *owner {
            *n -= 1;
            if *n == 0 {
                *owner = None;
                FREED.notify_one();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn one_thread_imports_at_a_time_and_may_reenter() {
        pyo3::Python::initialize();
        let inside = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (inside, most) = (Arc::clone(&inside), Arc::clone(&most));
                std::thread::spawn(move || {
                    for _ in 0..20 {
                        Python::attach(|py| {
                            let _outer = Importing::begin(py);
                            // Re-entered by the same thread: no deadlock.
                            let _inner = Importing::begin(py);
                            let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                            most.fetch_max(now, Ordering::SeqCst);
                            // Gives the GIL away meanwhile, as an import does.
                            py.detach(|| std::thread::sleep(std::time::Duration::from_micros(200)));
                            inside.fetch_sub(1, Ordering::SeqCst);
                        });
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(most.load(Ordering::SeqCst), 1);
        assert!(OWNER.lock().unwrap().is_none());
    }
}
