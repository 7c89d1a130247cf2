//! Pools of Ray actors ([`RayPool`]): the program's interpreter is the Ray driver, each actor a
//! Python process on some node that loads an op's source from the program and runs one call at
//! a time. Inputs travel as NumPy arrays through Ray's object store; what comes back is read as
//! a worker process's reply is (`shared`), so the one output check runs on it in the program with
//! the same messages; exceptions come back as a worker's do. A call that passes its time limit
//! kills its actor; an actor or node lost during a call fails that call (`WorkerLost`); either
//! way the next call starts a new actor.
//!
//! No Rust client of Ray: Ray's API is Python's, and the program has an interpreter.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::shared::{array_value, pickled_value};
use crate::error::{Error, ErrorKind, Result};
use crate::python::describe;
use crate::worker::exchange::{Load, LOAD_TIMEOUT};
use crate::worker::protocol::ExcInfo;
use crate::worker::{Backend, RayActor, RayPool, WorkerPool};

/// The actor's code: what any process running bodies needs, then the actor class.
const ACTOR_PY: &str = concat!(
    include_str!("../../worker/host.py"),
    include_str!("actor.py")
);
/// How long a failed join of a cluster is not tried again.
const RETRY_AFTER: Duration = Duration::from_secs(30);
/// How long an actor may take to be placed, start and say where it runs.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The driver's functions (`driver.py`), once connected: its namespace, its versions and the
/// address it joined.
static DRIVER: PyOnceLock<(Py<PyDict>, Versions, Option<String>)> = PyOnceLock::new();

/// Python X.Y, NumPy and Ray versions: the driver's, which every actor's must equal.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Versions {
    python: String,
    numpy: String,
    ray: String,
}

/// What a call on an actor gave back.
pub(crate) enum RayReply<'py> {
    /// The body's result, read as a worker's reply is.
    Value(Bound<'py, PyAny>),
    /// The body wrote the `out` arrays it was given (one array, or a tuple of them).
    Wrote(Bound<'py, PyAny>),
    /// The body (or loading it) raised: the exception as a worker reports it, and the actor.
    Raised { exc: ExcInfo, actor: u64 },
}

/// One Ray pool's actors.
pub(crate) struct RayBackend {
    state: Mutex<State>,
    freed: Condvar,
}

struct State {
    idle: Vec<Actor>,
    live: usize,
    next_id: u64,
}

struct Actor {
    handle: Py<PyAny>,
    info: RayActor,
    /// The generation of each op's module it has loaded, by module base.
    loaded: HashMap<String, u64>,
    /// The pool's dropped-ops version it has unloaded up to.
    dropped_seen: u64,
}

impl Backend for RayBackend {
    fn shutdown(&self) -> Vec<u64> {
        let idle = {
            let mut st = self.lock();
            let idle = std::mem::take(&mut st.idle);
            st.live -= idle.len();
            idle
        };
        let ids = idle.iter().map(|a| a.info.id).collect();
        kill_all(idle);
        self.freed.notify_all();
        ids
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for RayBackend {
    fn drop(&mut self) {
        let idle = std::mem::take(&mut self.lock().idle);
        kill_all(idle);
    }
}

/// Kills actors (with the GIL, if the interpreter still runs).
fn kill_all(actors: Vec<Actor>) {
    // SAFETY: a plain query of the interpreter's state.
    if actors.is_empty() || unsafe { pyo3::ffi::Py_IsInitialized() } == 0 {
        return;
    }
    crate::python::attach(|py| {
        if let Some((driver, ..)) = DRIVER.get(py) {
            for a in actors {
                let _ = driver
                    .bind(py)
                    .get_item("kill")
                    .ok()
                    .flatten()
                    .map(|f| f.call1((a.handle.bind(py),)));
            }
        }
    });
    arm_exit();
}

impl RayBackend {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The backend of `pool` (a Ray pool), made on first use.
    fn of(pool: &WorkerPool) -> Arc<dyn Backend> {
        Arc::clone(pool.inner.backend.get_or_init(|| {
            Arc::new(RayBackend {
                state: Mutex::new(State {
                    idle: Vec::new(),
                    live: 0,
                    next_id: 1,
                }),
                freed: Condvar::new(),
            })
        }))
    }
}

/// The Ray backend `RayBackend::of` made.
fn ray_backend(backend: &Arc<dyn Backend>) -> &RayBackend {
    backend
        .as_any()
        .downcast_ref::<RayBackend>()
        .expect("a Ray pool's backend")
}

/// An actor taken for one call: back to the pool when dropped, unless the call lost it.
struct Lease<'a> {
    backend: &'a RayBackend,
    pool: &'a WorkerPool,
    actor: Option<Actor>,
    /// Whether a call runs on it (counted as busy until the lease ends), and the bytes the
    /// call sent and received.
    busy: bool,
    bytes: (u64, u64),
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        if self.busy {
            self.pool.count_busy(false, self.bytes);
        }
        let Some(a) = self.actor.take() else { return };
        if std::thread::panicking() {
            self.pool.count_end(a.info.id, Some(false));
            self.backend.lock().live -= 1;
            kill_all(vec![a]);
        } else {
            self.backend.lock().idle.push(a);
        }
        self.backend.freed.notify_one();
    }
}

impl Lease<'_> {
    /// Counts a call on this actor (busy until the lease ends).
    fn count_call(&mut self) {
        self.pool.count_busy(true, (0, 0));
        self.busy = true;
    }

    fn actor(&mut self) -> &mut Actor {
        self.actor.as_mut().expect("a leased actor")
    }

    /// The actor's id, pid and node address, for errors and traces.
    fn where_(&mut self) -> (u64, u32, String) {
        let a = self.actor();
        (a.info.id, a.info.pid, a.info.ip.clone())
    }

    /// The actor is gone (lost, or killed on a time limit): not returned, and a new one may
    /// start.
    fn discard(mut self, py: Python<'_>, kill: bool, timed_out: bool) {
        let a = self.actor.take().expect("a leased actor");
        if kill {
            let _ = driver_fn(py, "kill").and_then(|f| f.call1((a.handle.bind(py),)));
        }
        self.pool.count_end(a.info.id, Some(timed_out));
        self.backend.lock().live -= 1;
        self.backend.freed.notify_one();
        arm_exit();
    }
}

/// A function of the driver's namespace (connected).
fn driver_fn<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    let (driver, ..) = DRIVER
        .get(py)
        .expect("the driver connects before any actor exists");
    Ok(driver
        .bind(py)
        .get_item(name)?
        .expect("driver.py defines its functions"))
}

/// Connects the program's interpreter to `spec`'s cluster (once per process: a Ray driver joins
/// one cluster) and returns the driver's versions.
fn connect<'py>(py: Python<'py>, op: &str, spec: &RayPool) -> Result<&'static Versions> {
    // A join that failed (Ray retries for about 20 s first) is not tried again for a while: the
    // calls meanwhile fail at once, with its reason.
    static FAILED: Mutex<Option<(Instant, Option<String>, String)>> = Mutex::new(None);
    if DRIVER.get(py).is_none() {
        if let Some((at, address, why)) = &*FAILED.lock().unwrap_or_else(|e| e.into_inner()) {
            let ago = at.elapsed();
            if *address == spec.address && ago < RETRY_AFTER {
                return Err(unavailable(
                    op,
                    format!(
                        "{why} (an attempt {} s ago; the next one {} s after it)",
                        ago.as_secs(),
                        RETRY_AFTER.as_secs()
                    ),
                ));
            }
        }
    }
    let (_, versions, joined) = DRIVER.get_or_try_init(py, || {
        if let Some(address) = &spec.address {
            reachable(op, address)?;
        }
        let ns = PyDict::new(py);
        crate::python::errors::run_pyop_code(py, include_str!("driver.py"), &ns)
            .map_err(|e| crate::python::errors::python_error(py, op, e))?;
        let connect = ns.get_item("connect").ok().flatten().expect("defined");
        let versions = connect
            .call1((spec.address.as_deref(), spec.namespace.as_str(), ACTOR_PY))
            .map_err(|e| {
                let err = cannot_connect(py, op, spec, &e);
                *FAILED.lock().unwrap_or_else(|e| e.into_inner()) = Some((
                    Instant::now(),
                    spec.address.clone(),
                    err.message().into_owned(),
                ));
                err
            })?;
        let get = |k: &str| -> String {
            versions
                .get_item(k)
                .and_then(|v| v.extract())
                .unwrap_or_default()
        };
        let versions = Versions {
            python: get("python"),
            numpy: get("numpy"),
            ray: get("ray"),
        };
        arm_exit();
        Ok::<_, Error>((ns.unbind(), versions, spec.address.clone()))
    })?;
    // A Ray driver joins one cluster: a pool naming another is refused (another spelling of the
    // same one, `127.0.0.1:6379` for the head's own address, is the same).
    if let Some(address) = &spec.address {
        if joined.as_ref() != Some(address) {
            // Asked once per spelling (it may look up this node's address).
            static SAME: Mutex<Vec<(String, bool)>> = Mutex::new(Vec::new());
            let known = SAME
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .find(|(a, _)| a == address)
                .map(|&(_, same)| same);
            let same = known.unwrap_or_else(|| {
                let same: bool = driver_fn(py, "same_cluster")
                    .and_then(|f| f.call1((address.as_str(),)))
                    .and_then(|v| v.extract())
                    .unwrap_or(false);
                SAME.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((address.clone(), same));
                same
            });
            if !same {
                return Err(unavailable(
                    op,
                    format!(
                        "this program's Ray driver joined the cluster at {}; a pool cannot use \
                         another (`{address}`): a program's Ray pools share one cluster",
                        shown(joined)
                    ),
                ));
            }
        }
    }
    Ok(versions)
}

/// `arm_exit` after a call: Ray first uses some statics on a call's path (its object store, for
/// arguments and replies over 100 KiB). After each of a program's first 256 calls, then at most
/// every 10 s, so the list of exit functions stays short.
fn arm_exit_after_call() {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    static LAST: Mutex<Option<Instant>> = Mutex::new(None);
    if CALLS.fetch_add(1, Relaxed) < 256 {
        arm_exit();
        return;
    }
    let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
    if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
        *last = Some(Instant::now());
        arm_exit();
    }
}

/// Registers the disconnect at exit (again). `atexit` functions run in the reverse order of
/// their registration, and Ray's C++ code registers the destructors of its statics as it first
/// uses them (when an actor starts or dies): a disconnect registered before them would run after
/// they were destroyed (a crash or a hang at exit). So it is registered again after each such
/// event, and runs once.
fn arm_exit() {
    // SAFETY: registers a function of the right type.
    unsafe {
        libc::atexit(disconnect_at_exit);
    }
}

/// Disconnects the Ray driver when the program exits: the embedded interpreter runs none of
/// Python's `atexit` functions, and Ray's threads still running while the process's destructors
/// run crash it.
extern "C" fn disconnect_at_exit() {
    static DONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if DONE.swap(true, std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: a plain query of the interpreter's state.
        if unsafe { pyo3::ffi::Py_IsInitialized() } == 0 {
            return;
        }
        crate::python::attach(|py| {
            if DRIVER.get(py).is_some() {
                let _ = driver_fn(py, "shutdown").and_then(|f| f.call0());
            }
        });
    });
}

fn shown(address: &Option<String>) -> String {
    address
        .as_deref()
        .map_or_else(|| "Ray's default address".to_owned(), |a| format!("`{a}`"))
}

fn unavailable(op: &str, message: String) -> Error {
    Error::op_failure(op, ErrorKind::ClusterUnavailable, message)
}

/// A `host:port` address that refuses a connection is said so at once (Ray itself retries for
/// tens of seconds before it gives up).
fn reachable(op: &str, address: &str) -> Result<()> {
    use std::net::ToSocketAddrs;
    if address.contains("://") || address == "auto" || address == "local" {
        return Ok(());
    }
    let refused = |why: String| {
        unavailable(
            op,
            format!(
                "cannot reach the Ray cluster at `{address}` ({why}): start its head there with \
                 `ray start --head --port=<port>`, or point PYOP_RAY_ADDRESS (or \
                 RayPool::address) at a running one"
            ),
        )
    };
    let addrs: Vec<_> = address
        .to_socket_addrs()
        .map_err(|e| refused(e.to_string()))?
        .collect();
    let mut last = String::from("no address");
    for a in addrs {
        match std::net::TcpStream::connect_timeout(&a, Duration::from_secs(3)) {
            Ok(_) => return Ok(()),
            Err(e) => last = e.to_string(),
        }
    }
    Err(refused(last))
}

/// Why `ray.init` (or importing Ray) failed, and the fix.
fn cannot_connect(py: Python<'_>, op: &str, spec: &RayPool, e: &PyErr) -> Error {
    if e.is_instance_of::<pyo3::exceptions::PyModuleNotFoundError>(py)
        && e.value(py)
            .getattr("name")
            .and_then(|n| n.extract::<String>())
            .is_ok_and(|n| n == "ray" || n == "numpy")
    {
        let pip = crate::python::env::current(py).map_or_else(
            || "`pip install ray`".to_owned(),
            |env| env.pip_install("ray"),
        );
        return unavailable(
            op,
            format!(
                "a Ray pool needs Ray in the program's Python environment ({}); install it with \
                 {pip}, the same version as on the cluster's nodes",
                describe(py, e)
            ),
        );
    }
    unavailable(
        op,
        format!(
            "cannot join the Ray cluster at {} ({}); start one with `ray start --head`, or point \
             PYOP_RAY_ADDRESS (or RayPool::address) at a running one",
            shown(&spec.address),
            describe(py, e)
        ),
    )
}

/// Takes an idle actor of `pool`, starting one if fewer than its size run, else waits for one
/// (without the GIL).
fn checkout<'a>(
    py: Python<'_>,
    op: &str,
    pool: &'a WorkerPool,
    backend: &'a RayBackend,
    versions: &Versions,
) -> Result<Lease<'a>> {
    let id = py.detach(|| {
        let mut st = backend.lock();
        loop {
            if let Some(a) = st.idle.pop() {
                return Ok(a);
            }
            if st.live < pool.size() {
                st.live += 1;
                st.next_id += 1;
                return Err(st.next_id - 1);
            }
            st = backend.freed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    });
    let actor = match id {
        Ok(a) => a,
        Err(id) => match start(py, op, pool, id, versions) {
            Ok(a) => a,
            Err(e) => {
                backend.lock().live -= 1;
                backend.freed.notify_one();
                return Err(e);
            }
        },
    };
    Ok(Lease {
        backend,
        pool,
        actor: Some(actor),
        busy: false,
        bytes: (0, 0),
    })
}

/// The embedded-package importer's code actors run (the op layer sets it before any call).
static IMPORTER: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

/// Sets the importer's code (`body::package::IMPORTER`, a layer above this one).
pub(crate) fn set_importer(code: &'static str) {
    let _ = IMPORTER.set(code);
}

fn pool_importer() -> &'static str {
    IMPORTER
        .get()
        .copied()
        .unwrap_or("def _install_package(*a):\n    raise ImportError('no importer')\n")
}

/// Starts actor `id`, checking that its node runs the program's versions.
fn start(
    py: Python<'_>,
    op: &str,
    pool: &WorkerPool,
    id: u64,
    versions: &Versions,
) -> Result<Actor> {
    let importer = pool_importer();
    let spec = pool.ray_spec().expect("a Ray pool");
    let started = Instant::now();
    let options = PyDict::new(py);
    let py_err = |e: PyErr| crate::python::errors::python_error(py, op, e);
    options
        .set_item("num_cpus", spec.num_cpus)
        .map_err(py_err)?;
    if !spec.resources.is_empty() {
        let r = PyDict::new(py);
        for (k, v) in &spec.resources {
            r.set_item(k, v).map_err(py_err)?;
        }
        options.set_item("resources", r).map_err(py_err)?;
    }
    options
        .set_item("scheduling_strategy", "SPREAD")
        .map_err(py_err)?;
    let sys = py.import("sys").map_err(py_err)?;
    let argv = sys.getattr("argv").map_err(py_err)?;
    let started_actor = driver_fn(py, "start")
        .and_then(|f| f.call1((options, importer, argv, START_TIMEOUT.as_secs_f64())))
        .map_err(|e| {
            let timed_out = driver_fn(py, "failure")
                .and_then(|f| f.call1((e.value(py),)))
                .and_then(|k| k.extract::<Option<String>>())
                .ok()
                .flatten()
                .is_some_and(|k| k == "timeout");
            let why = if timed_out {
                format!(
                    "was not placed and started within {} s: the cluster may lack the CPUs or \
                     resources it asks for ({} CPU{}{}); `ray status` shows what the nodes have",
                    START_TIMEOUT.as_secs(),
                    spec.num_cpus,
                    if spec.num_cpus == 1.0 { "" } else { "s" },
                    spec.resources
                        .iter()
                        .map(|(k, v)| format!(", {v} {k}"))
                        .collect::<String>()
                )
            } else {
                "failed as it started: its node's Python environment may lack NumPy, or run \
                 another Python X.Y than the program (every node needs the program's Python, \
                 NumPy and Ray)"
                    .to_owned()
            };
            unavailable(
                op,
                format!("actor {id} of a Ray pool {why} ({})", describe(py, &e)),
            )
        })?;
    let (handle, place): (Bound<'_, PyAny>, Bound<'_, PyDict>) =
        started_actor.extract().map_err(py_err)?;
    let get = |k: &str| -> String {
        place
            .get_item(k)
            .ok()
            .flatten()
            .map(|v| v.str().map(|s| s.to_string()).unwrap_or_default())
            .unwrap_or_default()
    };
    let theirs = Versions {
        python: get("python"),
        numpy: get("numpy"),
        ray: get("ray"),
    };
    let info = RayActor {
        id,
        pid: get("pid").parse().unwrap_or(0),
        node: get("node"),
        ip: get("ip"),
    };
    if let Some(why) = mismatch(&info, &theirs, versions) {
        let _ = driver_fn(py, "kill").and_then(|f| f.call1((&handle,)));
        return Err(unavailable(op, why));
    }
    tracing::debug!(actor = id, pid = info.pid, node = %info.ip, "pyop Ray actor started");
    pool.count_start(started.elapsed(), info.clone());
    arm_exit();
    Ok(Actor {
        handle: handle.unbind(),
        info,
        loaded: HashMap::new(),
        dropped_seen: 0,
    })
}

/// Why the node `info` runs on cannot serve the program (`theirs` differ from `ours`), if so.
fn mismatch(info: &RayActor, theirs: &Versions, ours: &Versions) -> Option<String> {
    (theirs != ours).then(|| {
        format!(
            "the Ray node {} ({}) runs Python {}, NumPy {} and Ray {}, the program Python {}, \
             NumPy {} and Ray {}: every node needs the program's versions (install them in the \
             environment `ray start` runs from)",
            info.ip,
            info.node,
            theirs.python,
            theirs.numpy,
            theirs.ray,
            ours.python,
            ours.numpy,
            ours.ray
        )
    })
}

/// Runs `function` of the op's module (`load`, sent first if the actor lacks it) on `args` in
/// an actor of `pool`, with `outs` (dtype, shape) arrays for an `out` parameter, within
/// `timeout`; returns the reply, the actor's id and its node's address.
#[allow(clippy::too_many_arguments)]
pub(crate) fn call<'py>(
    py: Python<'py>,
    pool: &WorkerPool,
    op: &str,
    load: &Load,
    function: &str,
    args: Bound<'py, PyList>,
    outs: Option<Bound<'py, PyList>>,
    timeout: Option<Duration>,
    bytes_in: u64,
) -> Result<(RayReply<'py>, u64, String)> {
    let spec = pool.ray_spec().expect("a Ray pool");
    let versions = connect(py, op, spec)?;
    let backend_arc = RayBackend::of(pool);
    let backend = ray_backend(&backend_arc);
    let mut lease = checkout(py, op, pool, backend, versions)?;
    lease.count_call();
    let (id, pid, ip) = lease.where_();
    let _span = tracing::trace_span!("pyop.worker", op, worker = id, pid, node = %ip).entered();
    let py_err = |e: PyErr| crate::python::errors::python_error(py, op, e);
    unload_dropped(py, pool, lease.actor());
    let (mut lease, raised) = load_on(py, op, lease, load)?;
    if let Some(exc) = raised {
        return Ok((RayReply::Raised { exc, actor: id }, id, ip));
    }
    let key = (load.key.base.as_str(), load.key.generation);
    let handle = lease.actor().handle.clone_ref(py);
    let reply = driver_fn(py, "call").and_then(|f| {
        f.call1((
            handle,
            key,
            function,
            args,
            outs,
            timeout.map(|t| t.as_secs_f64()),
        ))
    });
    let reply = match reply {
        Ok(r) => r,
        Err(e) => return Err(failed(py, op, lease, &e, timeout, false)),
    };
    // A reply pyop's actor never sends ends the actor, as a worker out of step is ended.
    let out_of_step = |lease: Lease<'_>, what: String| {
        lease.discard(py, true, false);
        lost(op, id, pid, &ip, &what)
    };
    let Ok(reply) = reply.cast_into::<PyTuple>() else {
        return Err(out_of_step(
            lease,
            "answered with something else than a tuple".into(),
        ));
    };
    let Ok(kind) = reply.get_item(0).and_then(|k| k.extract::<String>()) else {
        return Err(out_of_step(lease, "answered without a kind".into()));
    };
    let item = |i: usize| reply.get_item(i).map_err(py_err);
    let (result, bytes_out) = match kind.as_str() {
        "array" => {
            let buffer = item(3)?;
            let n = buffer.len().unwrap_or(0) as u64;
            let dtype: String = item(1)?.extract().map_err(py_err)?;
            (
                RayReply::Value(array_value(py, &dtype, item(2)?, buffer).map_err(py_err)?),
                n,
            )
        }
        "pickled" => {
            let buffers = item(2)?;
            let n = buffers
                .try_iter()
                .map(|it| it.flatten().map(|b| b.len().unwrap_or(0) as u64).sum())
                .unwrap_or(0);
            (
                RayReply::Value(pickled_value(py, item(1)?, buffers).map_err(py_err)?),
                n,
            )
        }
        "wrote" => {
            let arrays = item(1)?;
            let n = arrays.len().unwrap_or(1);
            let bytes: u64 = arrays
                .try_iter()
                .map(|it| {
                    it.flatten()
                        .filter_map(|a| a.getattr("nbytes").and_then(|b| b.extract::<u64>()).ok())
                        .sum()
                })
                .unwrap_or(0);
            let value = if n == 1 {
                arrays.get_item(0).map_err(py_err)?
            } else {
                let items: Vec<Bound<'_, PyAny>> = arrays.extract().map_err(py_err)?;
                PyTuple::new(py, items).map_err(py_err)?.into_any()
            };
            (RayReply::Wrote(value), bytes)
        }
        "raised" => match exc_info(&item(1)?) {
            Ok(exc) => (RayReply::Raised { exc, actor: id }, 0),
            Err(m) => return Err(out_of_step(lease, m)),
        },
        other => {
            let other = other.to_owned();
            return Err(out_of_step(
                lease,
                format!("answered `{other}`, which a pyop actor never does"),
            ));
        }
    };
    lease.bytes = (bytes_in, bytes_out);
    arm_exit_after_call();
    Ok((result, id, ip))
}

/// Checks that an actor of `pool` starts and loads `load`, with `functions` (for `validate()`):
/// the functions missing, or the exception loading raised.
pub(crate) fn check(
    py: Python<'_>,
    pool: &WorkerPool,
    op: &str,
    load: &Load,
    functions: &[&str],
) -> Result<std::result::Result<Vec<String>, (ExcInfo, u64)>> {
    let spec = pool.ray_spec().expect("a Ray pool");
    let versions = connect(py, op, spec)?;
    let backend_arc = RayBackend::of(pool);
    let backend = ray_backend(&backend_arc);
    let mut lease = checkout(py, op, pool, backend, versions)?;
    lease.count_call();
    let id = lease.actor().info.id;
    let (mut lease, raised) = load_on(py, op, lease, load)?;
    if let Some(exc) = raised {
        return Ok(Err((exc, id)));
    }
    let handle = lease.actor().handle.clone_ref(py);
    let key = (load.key.base.as_str(), load.key.generation);
    match driver_fn(py, "ping")
        .and_then(|f| f.call1((&handle, key, functions.to_vec(), LOAD_TIMEOUT.as_secs_f64())))
    {
        Ok(missing) => Ok(Ok(missing
            .extract()
            .map_err(|e| crate::python::errors::python_error(py, op, e))?)),
        Err(e) => Err(failed(py, op, lease, &e, Some(LOAD_TIMEOUT), true)),
    }
}

/// Has the leased actor load `load` unless it has it; gives the lease back, with the exception
/// loading raised if it did. A wait that failed, or an answer pyop's actor never gives, ends the
/// lease (`failed`, `lost`).
fn load_on<'a>(
    py: Python<'_>,
    op: &str,
    mut lease: Lease<'a>,
    load: &Load,
) -> Result<(Lease<'a>, Option<ExcInfo>)> {
    let (base, generation) = (&load.key.base, load.key.generation);
    let actor = lease.actor();
    if actor.loaded.get(base) == Some(&generation) {
        return Ok((lease, None));
    }
    // The actor drops the op's other generations before it loads this one, loaded or not.
    actor.loaded.remove(base);
    let handle = actor.handle.clone_ref(py);
    let loaded = driver_fn(py, "load")
        .and_then(|f| f.call1((handle, &*load.message, LOAD_TIMEOUT.as_secs_f64())));
    match loaded {
        Ok(v) if v.is_none() => {
            lease.actor().loaded.insert(base.clone(), generation);
            Ok((lease, None))
        }
        Ok(v) => match exc_info(&v) {
            Ok(exc) => Ok((lease, Some(exc))),
            Err(m) => {
                let (id, pid, ip) = lease.where_();
                lease.discard(py, true, false);
                Err(lost(op, id, pid, &ip, &m))
            }
        },
        Err(e) => Err(failed(py, op, lease, &e, Some(LOAD_TIMEOUT), true)),
    }
}

/// Starts actors until `pool`'s size run (one after another: Ray places and starts each).
pub(crate) fn fill(py: Python<'_>, pool: &WorkerPool, op: &str) -> Result<()> {
    let spec = pool.ray_spec().expect("a Ray pool");
    let versions = connect(py, op, spec)?;
    let backend_arc = RayBackend::of(pool);
    let backend = ray_backend(&backend_arc);
    // The missing actors' places are taken at once (a call meanwhile waits or uses another), so
    // this never waits for a call, nor for another `fill`.
    let ids: Vec<u64> = {
        let mut st = backend.lock();
        let missing = pool.size().saturating_sub(st.live);
        (0..missing)
            .map(|_| {
                st.live += 1;
                st.next_id += 1;
                st.next_id - 1
            })
            .collect()
    };
    let mut first_error = None;
    for id in ids {
        match start(py, op, pool, id, versions) {
            Ok(a) => backend.lock().idle.push(a),
            Err(e) => {
                backend.lock().live -= 1;
                first_error.get_or_insert(e);
            }
        }
        backend.freed.notify_one();
    }
    first_error.map_or(Ok(()), Err)
}

/// Unloads from `actor` the modules of ops that are gone.
fn unload_dropped(py: Python<'_>, pool: &WorkerPool, actor: &mut Actor) {
    let (version, dropped) = pool.dropped();
    if version == actor.dropped_seen {
        return;
    }
    for base in dropped {
        if actor.loaded.remove(&base).is_some() {
            let _ = driver_fn(py, "unload").and_then(|f| f.call1((actor.handle.bind(py), base)));
        }
    }
    actor.dropped_seen = version;
}

/// An exception an actor reported (host.py's `_exception_info`, as JSON).
fn exc_info(v: &Bound<'_, PyAny>) -> std::result::Result<ExcInfo, String> {
    let text: String = v
        .extract()
        .map_err(|_| "reported an exception that is not JSON text".to_owned())?;
    serde_json::from_str(&text).map_err(|e| format!("reported an unreadable exception ({e})"))
}

/// The error of a wait for an actor that failed: its time limit passed (the actor is killed),
/// the actor or its node was lost, or anything else Ray raised.
fn failed(
    py: Python<'_>,
    op: &str,
    mut lease: Lease<'_>,
    e: &PyErr,
    timeout: Option<Duration>,
    loading: bool,
) -> Error {
    let (id, pid, ip) = lease.where_();
    let how: Option<String> = driver_fn(py, "failure")
        .and_then(|f| f.call1((e.value(py),)))
        .and_then(|k| k.extract())
        .unwrap_or(None);
    let doing = if loading {
        "loading the body"
    } else {
        "running the body"
    };
    match how.as_deref() {
        Some("timeout") => {
            lease.discard(py, true, true);
            Error::op_failure(
                op,
                ErrorKind::Timeout,
                format!(
                    "{} past its time limit of {:?} in Ray actor {id} (pid {pid} on {ip}), which \
                     was killed; the next call starts a new actor",
                    if loading {
                        "loading the body ran"
                    } else {
                        "the body ran"
                    },
                    timeout.unwrap_or_default()
                ),
            )
        }
        Some(_) => {
            // Lost already; killed too, in case only its node's link to the driver was.
            lease.discard(py, true, false);
            lost(
                op,
                id,
                pid,
                &ip,
                &format!("was lost while {doing} ({})", describe(py, e)),
            )
        }
        None => {
            // Not the actor's failure (an argument Ray could not serialise, say): the actor
            // goes back to the pool.
            drop(lease);
            crate::python::errors::python_error(py, op, e.clone_ref(py))
        }
    }
}

fn lost(op: &str, id: u64, pid: u32, ip: &str, what: &str) -> Error {
    Error::op_failure(
        op,
        ErrorKind::WorkerLost,
        format!(
            "Ray actor {id} (pid {pid} on {ip}) {what}; this call failed, and the next call \
             starts a new actor"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_with_other_versions_is_refused_naming_both() {
        let ours = Versions {
            python: "3.11".into(),
            numpy: "2.4.6".into(),
            ray: "2.60.0".into(),
        };
        let info = RayActor {
            id: 3,
            pid: 42,
            node: "abc".into(),
            ip: "10.0.0.7".into(),
        };
        assert_eq!(mismatch(&info, &ours.clone(), &ours), None);
        let theirs = Versions {
            numpy: "1.26.4".into(),
            ..ours.clone()
        };
        assert_eq!(
            mismatch(&info, &theirs, &ours).unwrap(),
            "the Ray node 10.0.0.7 (abc) runs Python 3.11, NumPy 1.26.4 and Ray 2.60.0, the \
             program Python 3.11, NumPy 2.4.6 and Ray 2.60.0: every node needs the program's \
             versions (install them in the environment `ray start` runs from)"
        );
        let theirs = Versions {
            python: "3.12".into(),
            ..ours.clone()
        };
        assert!(mismatch(&info, &theirs, &ours).is_some());
    }
}
