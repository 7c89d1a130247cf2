//! The zygote: one Python process per program that has started the interpreter, set up the
//! program's `sys.path`, `sys.argv` and environment, and imported NumPy, and that forks each
//! worker from there, so a worker is ready in the time a `fork` takes instead of a whole
//! interpreter start.
//!
//! Forking is sound only for a single-threaded process: the zygote is started with every
//! [`THREAD_VARS`] at 1, so NumPy's BLAS (and OpenMP) start no thread pool in it, runs no body,
//! and checks before every fork that it has one thread (`/proc/self/task`), refusing otherwise.
//! Each forked worker sets its own thread counts (the variables as a worker started directly
//! gets them, and OpenBLAS's or MKL's count through their `set_num_threads`), leads its own
//! process group, starts its own guardian, and dies with the zygote (a parent-death signal),
//! which dies with the program. The zygote keeps each worker's zombie (its pid, and so its
//! process group's id) until the program asks for its exit status (`reap`), exactly as the
//! program keeps the workers it starts itself.
//!
//! Anything wrong with the zygote (it cannot start, it dies, it refuses) makes workers start as
//! before, each a process of its own: the zygote only ever saves time. A zygote that said its
//! interpreter is another Python version or lacks NumPy is that start's error, as it would be a
//! worker's.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::Duration;

use super::exchange::{Launch, StartError, THREAD_VARS};
use super::proc::{self, Reaper};
use super::process::Worker;
use super::protocol::{Reply, Request};

impl Worker {
    /// Starts worker `id` and waits until it is ready (its interpreter and NumPy imported):
    /// forked from the zygote when there is one, else as a process of its own. `threads` sizes
    /// its BLAS and OpenMP thread pools where the program's environment does not
    /// ([`THREAD_VARS`]).
    pub(crate) fn start(id: u64, launch: &Launch, threads: usize) -> Result<Worker, StartError> {
        let env = proc::thread_env(threads);
        let pair = || {
            UnixStream::pair().map_err(|e| {
                StartError::Failed(format!(
                    "cannot make a socket for {}: {e}",
                    launch.python.display()
                ))
            })
        };
        let (sock, theirs) = pair()?;
        match spawn(launch, &theirs, &env) {
            Spawn::Forked {
                pid,
                pidfd,
                generation,
            } => {
                drop(theirs);
                let reaper = Reaper {
                    reap,
                    alive,
                    generation,
                };
                match Worker::forked(id, launch, pid, pidfd, sock, reaper) {
                    Ok(worker) => return Ok(worker),
                    // A forked worker that could not set itself up (its own output says why):
                    // the zygote forks no more, and this worker starts directly.
                    Err(e) => {
                        tracing::debug!(?e, "pyop worker forked by the zygote did not start");
                        stop_spawning();
                    }
                }
            }
            Spawn::Refused(e) => return Err(e),
            Spawn::Direct => {}
        }
        // A fresh socket: the zygote may have handed a child the other one before it failed.
        let (sock, theirs) = pair()?;
        Worker::start_process(id, launch, sock, theirs, &env, false)
    }
}

/// How long the zygote may take to fork a worker or to say how one ended (a fork takes
/// milliseconds; a zygote this late is stuck, and is killed).
const ZYGOTE_LIMIT: Duration = Duration::from_secs(5);

/// What a worker start gets from the zygote.
enum Spawn {
    /// A worker forked: its process id and pidfd.
    Forked {
        pid: u32,
        pidfd: OwnedFd,
        /// The zygote's generation.
        generation: u64,
    },
    /// The zygote's start said why no worker can start (another Python version, no NumPy).
    Refused(StartError),
    /// No zygote: start the worker directly.
    Direct,
}

enum State {
    /// Not started yet.
    None,
    /// Running, for workers of this launch; `spawning` until it refused a fork once (it then
    /// stays, to reap the workers it forked, which die with it).
    Running {
        zygote: Box<Worker>,
        launch: Key,
        spawning: bool,
        /// Which zygote of the program's this is: a reap for a worker of an earlier one (ended
        /// with the last pool) is not this one's to answer.
        generation: u64,
    },
    /// It failed or died: workers start directly from now on.
    Broken,
}

/// What must be equal for a worker to be forked from the zygote: where its interpreter and
/// imports come from.
#[derive(PartialEq)]
struct Key {
    python: std::path::PathBuf,
    sys_path: Vec<String>,
    site_packages: Option<std::path::PathBuf>,
    argv: Vec<String>,
    version: [u32; 2],
}

impl Key {
    fn of(launch: &Launch) -> Key {
        Key {
            python: launch.python.clone(),
            sys_path: launch.sys_path.clone(),
            site_packages: launch.site_packages.clone(),
            argv: launch.argv.clone(),
            version: launch.version,
        }
    }
}

static ZYGOTE: Mutex<State> = Mutex::new(State::None);

/// The running zygote's pidfd, apart from `ZYGOTE` (whose lock a request holds): whether it
/// lives is known without waiting for one.
static ZYGOTE_PIDFD: Mutex<Option<(u64, std::sync::Arc<OwnedFd>)>> = Mutex::new(None);

/// The generation of the last zygote started.
static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many worker pools exist. The zygote ends with the last one, under this lock, so that a
/// pool made meanwhile starts a new zygote rather than forking from one that is ending (lock
/// order: `POOLS`, then `ZYGOTE`).
static POOLS: Mutex<usize> = Mutex::new(0);

/// A worker pool was made.
pub(crate) fn pool_made() {
    *POOLS.lock().unwrap_or_else(|p| p.into_inner()) += 1;
}

/// A worker pool was dropped (its workers are gone): the last one ends the zygote (its socket and
/// pidfd) and closes the workers' guardian pipe, so a program that has dropped its pools keeps no
/// process or descriptor of pyop's.
/// A pool made later starts a zygote again.
pub(crate) fn pool_dropped() {
    let mut pools = POOLS.lock().unwrap_or_else(|p| p.into_inner());
    *pools = pools.saturating_sub(1);
    if *pools > 0 {
        return;
    }
    let ended = {
        let mut state = lock();
        if !matches!(*state, State::Running { .. }) {
            // None started, or it broke: a broken one stays so (workers start directly).
            drop(state);
            proc::close_guardian_pipe();
            return;
        }
        std::mem::replace(&mut *state, State::None)
    };
    ZYGOTE_PIDFD
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    // Killed and reaped (it is the program's own child) outside the zygote's lock, before the
    // guardian pipe closes (its guardian would kill it too, under a reap in flight); both under
    // `POOLS`, so no pool made meanwhile starts a worker whose guardian waits on the pipe that
    // is closing.
    drop(ended);
    proc::close_guardian_pipe();
    drop(pools);
}

/// The zygote failed or died: workers start directly from now on. Its pidfd goes with it.
fn break_zygote(state: &mut State) {
    *state = State::Broken;
    ZYGOTE_PIDFD
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
}

fn lock() -> std::sync::MutexGuard<'static, State> {
    ZYGOTE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether zygotes are off (`PYOP_ZYGOTE=0`): every worker starts as a process of its own.
fn disabled() -> bool {
    std::env::var_os("PYOP_ZYGOTE").is_some_and(|v| v == "0")
}

/// Forks a worker for `launch` on `theirs` (its end of the worker's socket), with `env` set,
/// starting the zygote first if there is none.
fn spawn(launch: &Launch, theirs: &UnixStream, env: &[(&str, String)]) -> Spawn {
    if disabled() {
        return Spawn::Direct;
    }
    let mut state = lock();
    if matches!(*state, State::None) {
        match start(launch) {
            Ok(zygote) => {
                let generation = GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                *ZYGOTE_PIDFD.lock().unwrap_or_else(|p| p.into_inner()) =
                    proc::pidfd_of(zygote.pid).map(|fd| (generation, std::sync::Arc::new(fd)));
                *state = State::Running {
                    zygote: Box::new(zygote),
                    launch: Key::of(launch),
                    spawning: true,
                    generation,
                }
            }
            Err(refused @ StartError::NoNumpy(_)) => return Spawn::Refused(refused),
            Err(StartError::Failed(why) | StartError::NoRay(why) | StartError::Cluster(why)) => {
                // (Another Python version is said as a failure with its own words.)
                if why.contains("but the program embeds Python") {
                    return Spawn::Refused(StartError::Failed(why));
                }
                tracing::debug!(why, "pyop zygote did not start: workers start directly");
                break_zygote(&mut state);
                return Spawn::Direct;
            }
        }
    }
    let State::Running {
        zygote,
        launch: key,
        spawning,
        generation,
    } = &mut *state
    else {
        return Spawn::Direct;
    };
    let generation = *generation;
    if !*spawning || *key != Key::of(launch) {
        return Spawn::Direct;
    }
    // The program's environment and directory now (as a worker started directly would get
    // them), the thread counts as a worker's; what is not UTF-8 cannot be sent.
    let Some(cwd) = std::env::current_dir()
        .ok()
        .and_then(|d| d.into_os_string().into_string().ok())
    else {
        return Spawn::Direct;
    };
    let env: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .filter(|(k, _)| !THREAD_VARS.contains(&k.as_str()))
        .chain(env.iter().map(|(k, v)| ((*k).to_owned(), v.clone())))
        .collect();
    let request = Request::Spawn {
        env: &env,
        cwd: &cwd,
    };
    let broken = match zygote.ask_once(&request, &[theirs.as_fd()], ZYGOTE_LIMIT) {
        Ok(Reply::Spawned { pid }) => match proc::pidfd_of(pid) {
            Some(pidfd) => {
                return Spawn::Forked {
                    pid,
                    pidfd,
                    generation,
                }
            }
            // (pidfds worked for the zygote itself.) Not used: killed (its pid is still the
            // zygote's to reap, so it names that process) and reaped.
            None => {
                // SAFETY: kill takes plain integers; the zygote has not reaped `pid`.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                let _ = zygote.ask_once(&Request::Reap { pid }, &[], ZYGOTE_LIMIT);
                "no pidfd".to_owned()
            }
        },
        Ok(Reply::SpawnFailed { why }) => {
            tracing::debug!(why, "pyop zygote refused a fork: workers start directly");
            *spawning = false;
            return Spawn::Direct;
        }
        Ok(other) => format!("sent a `{}` reply to a spawn", other.kind()),
        // It was killed (a zygote that does not answer within 30 s is hung), and the workers it
        // forked with it.
        Err(f) => format!("{f:?}"),
    };
    tracing::debug!(why = broken, "pyop zygote failed: workers start directly");
    break_zygote(&mut state);
    Spawn::Direct
}

/// Stops forking workers (the zygote stays, to reap the ones it forked).
fn stop_spawning() {
    if let State::Running { spawning, .. } = &mut *lock() {
        *spawning = false;
    }
}

/// Starts the zygote: a worker process in all but its `init`, every thread count at 1. Only
/// where pidfds work (Linux 5.3 and later, not blocked by a seccomp profile): a forked worker's
/// end is seen, and it is signalled, through one.
fn start(launch: &Launch) -> Result<Worker, StartError> {
    if proc::pidfd_of(std::process::id()).is_none() {
        return Err(StartError::Failed("no pidfds here".to_owned()));
    }
    let (sock, theirs) = UnixStream::pair()
        .map_err(|e| StartError::Failed(format!("cannot make a socket for the zygote: {e}")))?;
    let env: Vec<(&str, String)> = THREAD_VARS.iter().map(|&v| (v, "1".to_owned())).collect();
    Worker::start_process(0, launch, sock, theirs, &env, true)
}

/// Waits for the child `pid` of zygote `generation` (exited, or killed by the caller) and
/// returns its raw wait status; `None` if that zygote is gone (its children died with it and
/// were reaped by others), also when another zygote runs now: a reap queued for a worker of a
/// zygote that ended with the last pool is never sent to the next one (which would not know
/// the pid, or would wait for a worker of its own that got the same pid).
fn reap(pid: u32, generation: u64) -> Option<i32> {
    let mut state = lock();
    let State::Running {
        zygote,
        generation: running,
        ..
    } = &mut *state
    else {
        return None;
    };
    if *running != generation {
        return None;
    }
    match zygote.ask_once(&Request::Reap { pid }, &[], ZYGOTE_LIMIT) {
        Ok(Reply::Reaped { status }) => Some(status),
        _ => {
            break_zygote(&mut state);
            None
        }
    }
}

/// Whether zygote `generation` is running (so the zombies of the workers it forked are still
/// its own). Never waits for a zygote request.
fn alive(generation: u64) -> bool {
    let fd = ZYGOTE_PIDFD
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    fd.is_some_and(|(g, fd)| g == generation && !proc::readable_now(fd.as_fd()))
}
