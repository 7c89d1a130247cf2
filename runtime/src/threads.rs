//! pyop's own threads for awaited calls: they wait for the GIL and run the Python part of a call
//! (a body in the program, the read-back of a worker's reply), so that no thread of the caller's
//! runtime ever waits for the GIL. Two lanes: bodies, on a few threads started as calls need
//! them (the GIL runs one at a time; more let a body that releases it overlap another), and
//! short work of pyop's own on a thread of its own, never queued behind a body. Each thread runs
//! one job at a time from its lane's queue, in order.
//!
//! A result reaches its future through a [`Slot`]. A quick call's result comes sooner than a
//! wake-up of the awaiting task's thread (tens of microseconds on a virtual machine), so a
//! future whose call is under way checks for it for [`SPIN`] before it sleeps, and a thread
//! that ran a call checks for the next for as long before it sleeps; neither does while the
//! machine's CPUs are all busy (`pace::spinning_allowed`).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::python::timeout::Interrupt;

/// How long a future whose call is under way, and a thread between calls, check before they
/// sleep.
const SPIN: Duration = Duration::from_micros(50);

#[cfg(target_os = "linux")]
use crate::worker::pace::spinning_allowed;

/// Elsewhere nothing spins.
#[cfg(not(target_os = "linux"))]
fn spinning_allowed() -> bool {
    false
}

/// A value handed from the thread that makes it to the future that awaits it.
struct Slot<R> {
    state: Mutex<SlotState<R>>,
}

struct SlotState<R> {
    value: Option<std::thread::Result<R>>,
    waker: Option<Waker>,
    /// Whether a thread has begun making it (else it waits in the queue).
    started: bool,
    /// Set when the future was dropped: the value goes to `orphan` instead (or is dropped).
    abandoned: bool,
    orphan: Option<Orphan<R>>,
}

/// What becomes of a value whose future was dropped.
type Orphan<R> = Box<dyn FnOnce(R) + Send>;

impl<R> Slot<R> {
    fn new(orphan: Option<Orphan<R>>) -> Arc<Slot<R>> {
        Arc::new(Slot {
            state: Mutex::new(SlotState {
                value: None,
                waker: None,
                started: false,
                abandoned: false,
                orphan,
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState<R>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` and hands over what it returned (or its panic), waking the future.
    fn make(&self, f: impl FnOnce() -> R) {
        self.lock().started = true;
        let value = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        let mut s = self.lock();
        if s.abandoned {
            let orphan = s.orphan.take();
            drop(s);
            if let (Some(orphan), Ok(value)) = (orphan, value) {
                orphan(value);
            }
            return;
        }
        s.value = Some(value);
        let waker = s.waker.take();
        drop(s);
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// The future was dropped: a value made already, or made later, goes to the orphan handler.
    fn abandon(&self) {
        let mut s = self.lock();
        s.abandoned = true;
        let made = match s.value.take() {
            Some(Ok(value)) => s.orphan.take().map(|orphan| (orphan, value)),
            _ => None,
        };
        drop(s);
        if let Some((orphan, value)) = made {
            orphan(value);
        }
    }
}

/// The future of a value made on another thread: its output is what the function returned, or
/// its panic. Dropped before that, it cancels the call (`Interrupt`).
pub(crate) struct Landing<R> {
    slot: Arc<Slot<R>>,
    interrupt: Interrupt,
    since: Instant,
    /// Whether calls were queued ahead of this one when it was sent (then it is not checked for
    /// before it starts).
    queued_behind: bool,
    done: bool,
}

impl<R> Future for Landing<R> {
    type Output = std::thread::Result<R>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut s = self.slot.lock();
        if let Some(value) = s.value.take() {
            drop(s);
            self.done = true;
            return Poll::Ready(value);
        }
        let under_way = s.started || !self.queued_behind;
        if under_way && self.since.elapsed() < SPIN && spinning_allowed() {
            // Polled again at once (the executor runs its other tasks in between).
            drop(s);
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        match &mut s.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            w => *w = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl<R> Drop for Landing<R> {
    fn drop(&mut self) {
        if !self.done {
            self.interrupt.cancel();
            self.slot.abandon();
        }
    }
}

/// Which of pyop's threads run a job: bodies (which may run long, and may wait for a worker), or
/// short work of pyop's own (a worker's reply read back, an op built), which a thread of its own
/// serves, so that it never waits behind a body, nor a body for a worker whose reply waits
/// behind bodies.
#[derive(Clone, Copy)]
pub(crate) enum Lane {
    Bodies,
    Short,
}

/// Runs `f` on one of pyop's threads (interruptible by `interrupt` there, see `Interrupt::scope`)
/// and returns the future of its result.
pub(crate) fn run<R: Send + 'static>(
    lane: Lane,
    interrupt: Interrupt,
    f: impl FnOnce() -> R + Send + 'static,
) -> Landing<R> {
    let job_interrupt = interrupt.clone();
    submit(lane, interrupt, move |slot| {
        if job_interrupt.cancelled() {
            // Dropped while it waited: nobody wants it.
            return;
        }
        slot.make(|| job_interrupt.scope(f));
    })
}

/// As [`run`], but `f` runs to its end whether or not the future is dropped (a batch's leader,
/// whose batch other calls wait for): dropping the future only leaves its result unread.
pub(crate) fn run_to_end<R: Send + 'static>(
    lane: Lane,
    f: impl FnOnce() -> R + Send + 'static,
) -> Landing<R> {
    submit(lane, Interrupt::default(), move |slot| slot.make(f))
}

/// Queues `job`, which fills the slot of the returned future, on `lane`.
fn submit<R: Send + 'static>(
    lane: Lane,
    interrupt: Interrupt,
    job: impl FnOnce(&Slot<R>) + Send + 'static,
) -> Landing<R> {
    let slot = Slot::new(None);
    let queued_behind = threads(lane).submit({
        let slot = Arc::clone(&slot);
        Box::new(move || job(&slot))
    });
    Landing {
        slot,
        interrupt,
        since: Instant::now(),
        queued_behind,
        done: false,
    }
}

/// Runs `f`, which blocks for long and needs no GIL (starting a worker process), on a thread of
/// its own, and returns the future of its result. Dropping the future does not stop `f`: what
/// it returns then goes to `orphan`.
pub(crate) fn on_own_thread<R: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> R + Send + 'static,
    orphan: impl FnOnce(R) + Send + 'static,
) -> Landing<R> {
    let slot = Slot::new(Some(Box::new(orphan)));
    let maker = Arc::clone(&slot);
    let job = Arc::new(Mutex::new(Some(f)));
    let theirs = Arc::clone(&job);
    let spawned = std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            if let Some(f) = theirs.lock().unwrap_or_else(|e| e.into_inner()).take() {
                maker.make(f);
            }
        });
    if spawned.is_err() {
        // No thread to be had (the system's limit): run here, blocking, rather than never.
        if let Some(f) = job.lock().unwrap_or_else(|e| e.into_inner()).take() {
            slot.make(f);
        }
    }
    Landing {
        slot,
        interrupt: Interrupt::default(),
        since: Instant::now(),
        queued_behind: true,
        done: false,
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// The threads, and the calls waiting for one.
struct Threads {
    queue: Mutex<Queue>,
    work: Condvar,
    /// The queue's length, read without the lock by a thread checking for its next call.
    queued: AtomicUsize,
    most: usize,
    name: &'static str,
}

struct Queue {
    jobs: VecDeque<Job>,
    /// Threads started, and those of them between calls.
    started: usize,
    idle: usize,
}

fn threads(lane: Lane) -> &'static Threads {
    static BODIES: OnceLock<Threads> = OnceLock::new();
    static SHORT: OnceLock<Threads> = OnceLock::new();
    let (lock, most, name) = match lane {
        Lane::Bodies => (&BODIES, most_threads as fn() -> usize, "pyop-async"),
        Lane::Short => (&SHORT, (|| 1) as fn() -> usize, "pyop-async-short"),
    };
    lock.get_or_init(|| Threads {
        queue: Mutex::new(Queue {
            jobs: VecDeque::new(),
            started: 0,
            idle: 0,
        }),
        work: Condvar::new(),
        queued: AtomicUsize::new(0),
        most: most(),
        name,
    })
}

/// How many threads awaited calls run on: `PYOP_ASYNC_THREADS`, else the CPUs the program may
/// use, at least 2.
fn most_threads() -> usize {
    std::env::var("PYOP_ASYNC_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .max(2)
        })
}

impl Threads {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `job`, starting a thread if more jobs wait than threads are free and fewer than
    /// the most run; whether other calls were queued ahead of it.
    fn submit(&'static self, job: Job) -> bool {
        let mut q = self.lock();
        let ahead = !q.jobs.is_empty();
        q.jobs.push_back(job);
        self.queued.store(q.jobs.len(), Ordering::Release);
        if q.jobs.len() > q.idle && q.started < self.most {
            q.started += 1;
            let n = q.started;
            q.idle += 1;
            drop(q);
            let spawned = std::thread::Builder::new()
                .name(format!("{}-{n}", self.name))
                .spawn(move || self.serve());
            if spawned.is_err() {
                let mut q = self.lock();
                q.started -= 1;
                q.idle -= 1;
                if q.started == 0 {
                    // No thread to be had (the system's limit) and none running: the jobs run
                    // here, blocking, rather than never.
                    let jobs = std::mem::take(&mut q.jobs);
                    self.queued.store(0, Ordering::Release);
                    drop(q);
                    jobs.into_iter().for_each(|job| job());
                }
            }
            return ahead;
        }
        drop(q);
        self.work.notify_one();
        ahead
    }

    /// A thread's life: the next call, run, and so on (counted idle in between).
    fn serve(&self) {
        loop {
            let job = {
                let spun = Instant::now();
                while self.queued.load(Ordering::Acquire) == 0
                    && spun.elapsed() < SPIN
                    && spinning_allowed()
                {
                    std::hint::spin_loop();
                }
                let mut q = self.lock();
                loop {
                    if let Some(job) = q.jobs.pop_front() {
                        self.queued.store(q.jobs.len(), Ordering::Release);
                        q.idle -= 1;
                        break job;
                    }
                    q = self.work.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            job();
            self.lock().idle += 1;
        }
    }
}
