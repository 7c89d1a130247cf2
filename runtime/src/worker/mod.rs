//! Worker processes for numpy-mode ops: a [`WorkerPool`] of Python processes that run bodies
//! outside the program's interpreter, so that Python-bound bodies run in parallel, a body that
//! crashes or hangs in C code fails only its own call, and a time limit always holds (the worker
//! is killed).
//!
//! Plain Rust: the pool (here), a worker's OS process (`proc`: started, killed, reaped) and the
//! conversation with it (`process`), the one protocol (`protocol`), what a
//! call and a start say in Rust (`exchange`), shared memory (`arena`) and the frames on the socket
//! (`wire`); the Python a worker runs is in `python/` (its text exported by `python`). Turning
//! replies into tensors and errors is the bridge's (`bridge::shared`), and the call itself the
//! op's (`op::worker`). How a caller waits for a reply is `pace`'s.

#[cfg(target_os = "linux")]
pub(crate) mod arena;
#[cfg(target_os = "linux")]
pub(crate) mod awaiting;
pub(crate) mod exchange;
#[cfg(target_os = "linux")]
pub(crate) mod pace;
#[cfg(target_os = "linux")]
pub(crate) mod proc;
#[cfg(target_os = "linux")]
pub(crate) mod process;
#[cfg(not(target_os = "linux"))]
#[path = "unsupported.rs"]
pub(crate) mod process;
pub(crate) mod protocol;
pub(crate) mod python;
pub(crate) mod ray;
#[cfg(target_os = "linux")]
pub(crate) mod wire;
#[cfg(target_os = "linux")]
pub(crate) mod zygote;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use event_listener::IntoNotification;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use exchange::{Launch, StartError};
use process::Worker;
pub use ray::{RayActor, RayPool};

/// A pool of Python worker processes that numpy-mode ops run their bodies in.
///
/// Give one op its own pool with [`OpBuilder::workers`](crate::OpBuilder::workers) (or
/// `#[py_op(numpy, workers = N)]`), or share one pool between ops with
/// [`OpBuilder::pool`](crate::OpBuilder::pool). Workers start on first use, up to `size`, and
/// are replaced when one dies or is killed on a time limit; each runs one call at a time. Module
/// state (globals, caches) is per worker. Cloning is cheap and shares the pool; when the last
/// clone (and every op using it) is dropped, the workers end, and with the program's last pool
/// the zygote they are forked from: nothing of pyop's stays running. They also end with the
/// program, however it ends.
///
/// ```
/// use pyop::candle::{DType, Device, Tensor};
/// use pyop::{Arg, OutSpec, PyOp, WorkerPool};
///
/// let pool = WorkerPool::new(2);
/// let op = PyOp::builder("tokens")
///     .code("import numpy as np\ndef tokens(x):\n    return np.array([len(str(v)) for v in x.tolist()], dtype=np.int64)")
///     .numpy()
///     .pool(&pool)
///     .tout([OutSpec::new(DType::I64)])
///     .build()?;
/// let x = Tensor::new(&[1.5f64, 10., 100.25], &Device::Cpu)?;
/// assert_eq!(op.call(&[Arg::from(&x)])?[0].to_vec1::<i64>()?, [3, 4, 6]);
/// assert_eq!(pool.stats().started, 1);
/// # Ok::<(), pyop::Error>(())
/// ```
#[derive(Clone)]
pub struct WorkerPool {
    pub(crate) inner: Arc<PoolInner>,
}

pub(crate) struct PoolInner {
    size: usize,
    state: Mutex<PoolState>,
    freed: Condvar,
    /// Wakes awaited calls waiting for a worker, as `freed` wakes threads.
    freed_async: event_listener::Event,
    started: AtomicU64,
    start_ns: AtomicU64,
    lost: AtomicU64,
    timed_out: AtomicU64,
    cancelled: AtomicU64,
    calls: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    /// [`WaitStats`]'s counters: the callers' (caught, missed, slept, µs checking), then the
    /// workers'.
    waits: [[AtomicU64; 4]; 2],
    /// The module bases of ops that are gone: each worker unloads those it has, before its next
    /// call (`Lease::worker`). `dropped_version` counts changes, so a call checks it for free.
    dropped: Mutex<std::collections::HashSet<String>>,
    dropped_version: AtomicU64,
    /// Where its workers run bodies: here, or (each worker the relay of one actor) on a Ray
    /// cluster.
    kind: Kind,
    /// A Ray pool's actors now (each relay's, from its start until it ends).
    actors: Mutex<Vec<RayActor>>,
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        // The idle workers first (those forked by the zygote are reaped through it), then the
        // zygote itself when this was the last pool: nothing of pyop's keeps running.
        drop(std::mem::take(
            &mut self.state.get_mut().unwrap_or_else(|e| e.into_inner()).idle,
        ));
        zygote::pool_dropped();
    }
}

/// Where a pool's workers run bodies.
enum Kind {
    /// In themselves: processes of this machine.
    Local,
    /// In a Ray actor each, whose relay the worker is (`ray`).
    Ray(RayPool),
}

struct PoolState {
    idle: Vec<Worker>,
    /// Workers started and not lost: idle ones and those out on a call.
    live: usize,
    next_id: u64,
}

/// What a [`WorkerPool`] has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// The most workers the pool runs at once.
    pub size: usize,
    /// Workers running now (idle or busy).
    pub running: usize,
    /// Workers running a call now.
    pub busy: usize,
    /// Workers started so far, replacements included.
    pub started: u64,
    /// Time spent starting them, in all (the interpreter and NumPy, until each was ready).
    pub start_time: Duration,
    /// Workers that died during a call (a crash, `os._exit`, a kill from outside), or while idle
    /// (found dead when a call took them, and replaced at no call's cost).
    pub lost: u64,
    /// Workers killed because a call ran past its time limit.
    pub timed_out: u64,
    /// Workers killed because an awaited call was cancelled (its future dropped) while the
    /// worker ran it.
    pub cancelled: u64,
    /// Calls (bodies, gradients and checks) run in the pool's workers.
    pub calls: u64,
    /// Bytes the program copied into its workers' shared memory for their calls (inputs; `out`
    /// buffers are not copied in).
    pub bytes_in: u64,
    /// Bytes the workers copied into shared memory for the program to read: results not already
    /// there. A returned input, a view of one, or an `out` buffer is named where it lies and adds
    /// nothing; what the output check then copies into candle memory is not counted.
    pub bytes_out: u64,
    /// How the program and the workers waited for each other's messages.
    pub waits: WaitStats,
}

/// How a pool's calls were waited for, on both sides: the program's thread waiting for the reply
/// (the caller) and the worker waiting for its next request. Either side either caught the
/// message checking for it without sleeping (spinning, from shortly before it was due: no
/// wake-up to pay), checked for a while and then slept until it came (it came later than
/// expected), or slept without checking (spinning was off: a spinner found the CPUs crowded; or,
/// for a caller, the reply came before it was due). Each call counts once on each side; calls
/// through a relay that does not say count on the caller's side only. What explains a pool's
/// round-trip times (`cargo bench --bench summary` prints them per call beside its worker cases).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WaitStats {
    /// Replies a caller caught checking for them.
    pub caller_caught: u64,
    /// Replies a caller checked for, then slept until they came.
    pub caller_missed: u64,
    /// Replies that woke a caller that had not checked for them.
    pub caller_slept: u64,
    /// Time callers spent checking, in all.
    pub caller_checking: Duration,
    /// Requests a worker caught checking for them.
    pub worker_caught: u64,
    /// Requests a worker checked for, then slept until they came.
    pub worker_missed: u64,
    /// Requests that woke a worker that had not checked for them.
    pub worker_slept: u64,
    /// Time workers spent checking, in all.
    pub worker_checking: Duration,
}

impl std::fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerPool")
            .field("stats", &self.stats())
            .finish()
    }
}

impl WorkerPool {
    /// The environment variables that size the thread pools of BLAS, OpenMP and their kin
    /// (NumPy's OpenBLAS, MKL, BLIS, Accelerate, numexpr, numba). Each worker gets every one of
    /// them that the program's own environment does not set, as joblib's process pools do: the
    /// CPUs the program may use divided by the pool's size, at least 1. Without them, each
    /// worker's OpenBLAS would start a thread per core, and N workers would run N per core.
    pub const THREAD_VARS: [&'static str; 7] = exchange::THREAD_VARS;

    /// A pool of at most `size` workers (at least one), none started yet.
    pub fn new(size: usize) -> WorkerPool {
        WorkerPool::with(size, None)
    }

    /// A pool whose workers are actors on a Ray cluster (see [`RayPool`]): used as any other
    /// pool (`OpBuilder::pool`, or a named pool `PYOP_RAY_POOLS` points at a cluster), with the
    /// same results, errors and counters as a pool of this machine's processes: each of its
    /// workers is a process of pyop's on this machine that relays the worker protocol to its
    /// actor.
    pub fn ray(spec: RayPool) -> WorkerPool {
        WorkerPool::with(spec.actors, Some(spec))
    }

    /// Where the actors of a Ray pool run now (empty for other pools).
    pub fn ray_actors(&self) -> Vec<RayActor> {
        self.inner
            .actors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn with(size: usize, ray: Option<RayPool>) -> WorkerPool {
        zygote::pool_made();
        WorkerPool {
            inner: Arc::new(PoolInner {
                size: size.max(1),
                state: Mutex::new(PoolState {
                    idle: Vec::new(),
                    live: 0,
                    next_id: 1,
                }),
                freed: Condvar::new(),
                freed_async: event_listener::Event::new(),
                started: AtomicU64::new(0),
                start_ns: AtomicU64::new(0),
                lost: AtomicU64::new(0),
                timed_out: AtomicU64::new(0),
                cancelled: AtomicU64::new(0),
                calls: AtomicU64::new(0),
                bytes_in: AtomicU64::new(0),
                bytes_out: AtomicU64::new(0),
                waits: Default::default(),
                dropped: Mutex::new(std::collections::HashSet::new()),
                dropped_version: AtomicU64::new(0),
                kind: ray.map_or(Kind::Local, Kind::Ray),
                actors: Mutex::new(Vec::new()),
            }),
        }
    }

    /// The process-wide pool called `name`, made with `size` workers the first time it is asked
    /// for: `#[py_op(numpy, workers = 4, pool = "text")]` declarations share it. A later caller's
    /// `size` does not change it (`validate()` reports declarations that disagree). When
    /// `PYOP_RAY_POOLS` names it (or is `*`), its workers are `size` actors on the Ray cluster
    /// at `PYOP_RAY_ADDRESS` (see [`RayPool`]): the same binary runs on one machine or a cluster.
    pub fn named(name: &str, size: usize) -> WorkerPool {
        let mut pools = NAMED.lock().unwrap_or_else(|e| e.into_inner());
        pools
            .get_or_insert_with(std::collections::HashMap::new)
            .entry(name.to_owned())
            .or_insert_with(|| match RayPool::from_env(name, size) {
                Some(spec) => WorkerPool::ray(spec),
                None => WorkerPool::new(size),
            })
            .clone()
    }

    /// The process-wide pool called `name`, if something made it.
    pub fn find(name: &str) -> Option<WorkerPool> {
        let pools = NAMED.lock().unwrap_or_else(|e| e.into_inner());
        pools.as_ref().and_then(|p| p.get(name)).cloned()
    }

    /// The most workers the pool runs at once.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// What the pool has done so far.
    pub fn stats(&self) -> PoolStats {
        let p = &*self.inner;
        let (running, busy) = {
            let st = p.lock();
            (st.live, st.live - st.idle.len())
        };
        PoolStats {
            size: p.size,
            running,
            busy,
            started: p.started.load(Relaxed),
            start_time: Duration::from_nanos(p.start_ns.load(Relaxed)),
            lost: p.lost.load(Relaxed),
            timed_out: p.timed_out.load(Relaxed),
            cancelled: p.cancelled.load(Relaxed),
            calls: p.calls.load(Relaxed),
            bytes_in: p.bytes_in.load(Relaxed),
            bytes_out: p.bytes_out.load(Relaxed),
            waits: {
                let [c, w] = &p.waits;
                let n = |a: &AtomicU64| a.load(Relaxed);
                WaitStats {
                    caller_caught: n(&c[0]),
                    caller_missed: n(&c[1]),
                    caller_slept: n(&c[2]),
                    caller_checking: Duration::from_micros(n(&c[3])),
                    worker_caught: n(&w[0]),
                    worker_missed: n(&w[1]),
                    worker_slept: n(&w[2]),
                    worker_checking: Duration::from_micros(n(&w[3])),
                }
            },
        }
    }

    /// The process ids of the idle workers (for tests and diagnostics).
    #[doc(hidden)]
    pub fn idle_pids(&self) -> Vec<u32> {
        self.inner.lock().idle.iter().map(|w| w.pid).collect()
    }

    /// Ends the idle workers now (busy ones end when their call returns and the pool is gone);
    /// the pool starts new ones when it is used again.
    pub fn shutdown(&self) {
        let idle = {
            let mut st = self.inner.lock();
            let idle = std::mem::take(&mut st.idle);
            st.live -= idle.len();
            idle
        };
        for w in idle {
            self.inner.retire(w);
        }
        self.inner.notify_freed(usize::MAX);
    }
}

/// The named pools: they live as long as the program (their workers end with it).
static NAMED: Mutex<Option<std::collections::HashMap<String, WorkerPool>>> = Mutex::new(None);

impl PoolInner {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A worker taken from its pool for one call; back to the pool when dropped, unless the call
/// lost it.
pub(crate) struct Lease {
    pool: Arc<PoolInner>,
    worker: Option<Worker>,
    /// Set while an awaited call's exchange is under way: a lease dropped then was cancelled
    /// mid-call, and its worker, out of step, is killed.
    in_call: bool,
}

/// What a call gets from its pool at once: an idle worker, or the id reserved for one it
/// starts.
// Made once per call and moved at once into a `Lease`: a box would only add an allocation.
#[allow(clippy::large_enum_variant)]
enum Taken {
    Idle(Worker),
    Start(u64),
}

impl PoolInner {
    /// An idle worker, or a place to start one if fewer than `size` run; `None` when every
    /// worker is busy.
    fn take(&self) -> Option<Taken> {
        let mut dead = Vec::new();
        let taken = {
            let mut st = self.lock();
            loop {
                match st.idle.pop() {
                    Some(mut w) => {
                        if !w.exited() {
                            break Some(Taken::Idle(w));
                        }
                        // Died while idle (the OOM killer, a kill from outside): not this call's
                        // to fail. It is reaped, and another one is taken or started. The kernel
                        // reports the death once all its threads have exited; a call that takes
                        // it in the milliseconds before fails as a death during the call.
                        st.live -= 1;
                        self.lost.fetch_add(1, Relaxed);
                        dead.push(w);
                    }
                    None if st.live < self.size => break Some(Taken::Start(st.reserve())),
                    None => break None,
                }
            }
        };
        for w in dead {
            self.retire(w);
        }
        taken
    }

    /// Whether every worker is busy (a call must wait for one).
    fn all_busy(&self, st: &PoolState) -> bool {
        st.idle.is_empty() && st.live >= self.size
    }

    /// A worker was freed (or its place): wakes `n` waiting threads and as many waiting tasks.
    fn notify_freed(&self, n: usize) {
        if n == 1 {
            self.freed.notify_one();
        } else {
            self.freed.notify_all();
        }
        // `additional`: tasks notified before and not yet run do not count against `n`.
        self.freed_async.notify(n.additional());
    }

    fn lease(self: &Arc<Self>, w: Worker) -> Lease {
        Lease {
            pool: Arc::clone(self),
            worker: Some(w),
            in_call: false,
        }
    }
}

impl WorkerPool {
    /// Takes an idle worker, starting one if fewer than `size` run, else waits for one. Runs
    /// without the GIL (the caller releases it).
    pub(crate) fn checkout(&self, launch: &Launch) -> Result<Lease, StartError> {
        let p = &self.inner;
        loop {
            match p.take() {
                Some(Taken::Idle(w)) => return Ok(p.lease(w)),
                Some(Taken::Start(id)) => return Ok(p.lease(p.start(id, launch)?)),
                None => {}
            }
            let st = p.lock();
            drop(
                p.freed
                    .wait_while(st, |st| p.all_busy(st))
                    .unwrap_or_else(|e| e.into_inner()),
            );
        }
    }

    /// [`checkout`](Self::checkout) for an awaited call: waiting for a worker as a task, and a
    /// worker started on a thread of its own (it takes tens of milliseconds), put in the pool
    /// if the call that started it was dropped meanwhile.
    #[cfg(target_os = "linux")]
    pub(crate) async fn checkout_async(
        &self,
        launch: &'static Launch,
    ) -> Result<Lease, StartError> {
        let p = &self.inner;
        loop {
            match p.take() {
                Some(Taken::Idle(w)) => return Ok(p.lease(w)),
                Some(Taken::Start(id)) => {
                    let pool = Arc::clone(p);
                    let orphans = Arc::clone(p);
                    let started = crate::threads::on_own_thread(
                        "pyop-worker-start",
                        // A start that panics gives its place back, as one that fails does.
                        move || {
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                pool.start(id, launch)
                            }))
                            .unwrap_or_else(|panic| {
                                pool.lock().live -= 1;
                                pool.notify_freed(1);
                                Err(StartError::Failed(format!(
                                    "starting a worker panicked: {}",
                                    crate::error::panic_message(&*panic)
                                )))
                            })
                        },
                        // Started for a call that was dropped meanwhile: the next call's.
                        move |w: Result<Worker, StartError>| {
                            if let Ok(w) = w {
                                orphans.lock().idle.push(w);
                                orphans.notify_freed(1);
                            }
                        },
                    );
                    match started.await {
                        Ok(Ok(w)) => return Ok(p.lease(w)),
                        Ok(Err(e)) => return Err(e),
                        // The start never ran (the closure above does not panic).
                        Err(panic) => {
                            p.lock().live -= 1;
                            p.notify_freed(1);
                            return Err(StartError::Failed(crate::error::panic_message(&*panic)));
                        }
                    }
                }
                None => {}
            }
            let freed = p.freed_async.listen();
            if !p.all_busy(&p.lock()) {
                continue;
            }
            freed.await;
        }
    }
}

impl PoolState {
    /// Counts one more worker as running and gives it its id, before it starts.
    fn reserve(&mut self) -> u64 {
        self.live += 1;
        self.next_id += 1;
        self.next_id - 1
    }
}

impl PoolInner {
    /// Starts the worker `id` was reserved for, counting its start; if it cannot start, its
    /// place is given back.
    fn start(&self, id: u64, launch: &Launch) -> Result<Worker, StartError> {
        let started = Instant::now();
        let worker = match &self.kind {
            Kind::Local => Worker::start(id, launch, self.threads_per_worker()),
            Kind::Ray(spec) => ray::start(id, launch, spec),
        };
        match worker {
            Ok(w) => {
                self.started.fetch_add(1, Relaxed);
                self.start_ns
                    .fetch_add(started.elapsed().as_nanos() as u64, Relaxed);
                if let Some(actor) = &w.actor {
                    self.actors
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(actor.clone());
                }
                tracing::debug!(worker = id, pid = w.pid, "pyop worker started");
                Ok(w)
            }
            Err(e) => {
                self.lock().live -= 1;
                self.notify_freed(1);
                Err(e)
            }
        }
    }
}

impl PoolInner {
    /// Ends a worker that leaves the pool (lost, killed, idle at `shutdown`), and forgets its
    /// actor if it had one.
    fn retire(&self, w: Worker) {
        if let Some(actor) = &w.actor {
            self.actors
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|a| a.id != actor.id);
        }
        drop(w);
    }

    /// The threads each worker's BLAS and OpenMP pools get: the CPUs this program may use (its
    /// affinity and cgroup quota), shared among the pool's workers, at least one. Without it, a
    /// pool of N workers on C cores would run N × C BLAS threads, and each worker would start C
    /// of them.
    fn threads_per_worker(&self) -> usize {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cpus / self.size).max(1)
    }
}

impl WorkerPool {
    /// Starts workers until `size` run, side by side (so the start cost is paid once, not once
    /// per worker), and puts them in the pool.
    pub(crate) fn fill(&self, launch: &Launch) -> Result<(), StartError> {
        let p = &self.inner;
        let ids: Vec<u64> = {
            let mut st = p.lock();
            let missing = p.size - st.live;
            (0..missing).map(|_| st.reserve()).collect()
        };
        let results: Vec<Result<Worker, StartError>> = std::thread::scope(|s| {
            let handles: Vec<_> = ids
                .iter()
                .map(|&id| s.spawn(move || p.start(id, launch)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a worker start does not panic"))
                .collect()
        });
        let mut first_error = None;
        let mut st = p.lock();
        for r in results {
            match r {
                Ok(w) => st.idle.push(w),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        drop(st);
        p.notify_freed(usize::MAX);
        first_error.map_or(Ok(()), Err)
    }
}

impl WorkerPool {
    /// The op whose modules are under `base` is gone: its workers unload them (before their next
    /// call), as the program frees a dropped op's module.
    pub(crate) fn forget(&self, base: &str) {
        let p = &self.inner;
        p.dropped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(base.to_owned());
        p.dropped_version.fetch_add(1, Relaxed);
    }
}

impl Lease {
    /// The leased worker, once it has unloaded the modules of ops that are gone.
    pub(crate) fn worker(&mut self) -> &mut Worker {
        let w = self.worker.as_mut().expect("a leased worker");
        let version = self.pool.dropped_version.load(Relaxed);
        if w.dropped_seen != version {
            let dropped = self.pool.dropped.lock().unwrap_or_else(|e| e.into_inner());
            w.unload(&dropped);
            w.dropped_seen = version;
        }
        w
    }

    /// The leased worker as it is (for its name).
    pub(crate) fn peek(&self) -> &Worker {
        self.worker.as_ref().expect("a leased worker")
    }

    /// Counts one call run in this worker.
    pub(crate) fn count_call(&self) {
        self.pool.calls.fetch_add(1, Relaxed);
    }

    /// Counts the bytes one call copied into and out of this worker's shared memory, and how its
    /// two sides waited.
    pub(crate) fn count_answer(&self, answered: &exchange::Answered) {
        self.pool.bytes_in.fetch_add(answered.copied_in, Relaxed);
        self.pool.bytes_out.fetch_add(answered.copied_out, Relaxed);
        let waits = answered.waits;
        for (side, waited) in self.pool.waits.iter().zip([waits.caller, waits.worker]) {
            let Some((kind, checked)) = waited.map(protocol::Waited::slot) else {
                continue;
            };
            side[kind].fetch_add(1, Relaxed);
            if !checked.is_zero() {
                let us = u64::try_from(checked.as_micros()).unwrap_or(u64::MAX);
                side[3].fetch_add(us, Relaxed);
            }
        }
    }

    /// The call killed or lost the worker: it is not returned, and a new one may start.
    pub(crate) fn discard(mut self, timed_out: bool) {
        let counter = if timed_out {
            &self.pool.timed_out
        } else {
            &self.pool.lost
        };
        counter.fetch_add(1, Relaxed);
        if let Some(w) = self.worker.take() {
            self.pool.retire(w);
        }
        self.pool.lock().live -= 1;
        self.pool.notify_freed(1);
    }

    /// Runs one call in the leased worker as a future ([`Worker::call_async`]); dropped before
    /// it is ready, the lease kills the worker (counted `cancelled`).
    #[cfg(target_os = "linux")]
    pub(crate) async fn call_async(
        &mut self,
        ex: exchange::Exchange<'_>,
    ) -> Result<exchange::Answered, exchange::Failure> {
        self.in_call = true;
        let answered = self.worker().call_async(ex).await;
        self.in_call = false;
        answered
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some(w) = self.worker.take() else { return };
        if self.in_call {
            // An awaited call dropped while its worker ran it: the worker is out of step (a
            // request without its reply read), and is killed as on a time limit.
            self.pool.cancelled.fetch_add(1, Relaxed);
            self.pool.retire(w);
            self.pool.lock().live -= 1;
        } else if std::thread::panicking() {
            // Dropped while unwinding: the call may have stopped anywhere between its request and
            // its reply, so the worker may be out of step. It is ended, not reused.
            self.pool.lost.fetch_add(1, Relaxed);
            self.pool.retire(w);
            self.pool.lock().live -= 1;
        } else {
            self.pool.lock().idle.push(w);
        }
        self.pool.notify_freed(1);
    }
}
