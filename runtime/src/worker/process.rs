//! One worker process: started with the program's interpreter, fed over a socket pair, its
//! arenas, one call at a time, killed on a time limit, and always reaped.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::arena::Arena;
use super::exchange::RayActor;
use super::exchange::{Answered, Exchange, Failure, Launch, Load, StartError, Waits};
use super::exchange::{LOAD_TIMEOUT, THREAD_VARS};
use super::pace::{self, Pace, Spin};
use super::protocol::{self, ModuleKey, ProtocolError, Reply, Request};
use super::wire::{self, RecvError, Wait};

/// The worker's main loop, sent to it at start: what any process running bodies needs
/// (`host.py`, which a Ray actor runs too), what a Ray pool's relay does (`ray/relay.py`), then
/// the worker's own (`worker.py`).
const WORKER_PY: &str = concat!(
    include_str!("host.py"),
    include_str!("ray/relay.py"),
    include_str!("worker.py")
);

/// What `python -c` runs, for a program embedding Python `version`: first the program's
/// `sys.path` (its command line's arguments) replaces the worker's, before any import, so nothing
/// is imported from the current directory (which `-c` puts first) or from anywhere the program
/// would not import it; then the main loop's text is read from fd 3 and run under pyop's frame
/// name. A worker of another version keeps its own path (less the current directory) and says
/// so (`wrong_version`).
fn bootstrap(version: [u32; 2]) -> String {
    format!(
        "import sys\n\
         if sys.version_info[:2] == ({}, {}):\n    sys.path[:] = sys.argv[1:]\n\
         else:\n    sys.path[:] = [p for p in sys.path if p]\n\
         import socket\n\
         k = socket.socket(fileno=3)\n\
         n = int.from_bytes(k.recv(4, socket.MSG_WAITALL), 'little')\n\
         b = bytearray()\n\
         while len(b) < n:\n    c = k.recv(n - len(b))\n    if not c: raise SystemExit(0)\n    b += c\n\
         k.detach()\n\
         exec(compile(bytes(b), '<pyop>', 'exec'), {{'__name__': '__pyop_worker__'}})\n",
        version[0], version[1]
    )
}

/// The read end of the pipe every worker's guardian waits on (its fd 4); the program holds the
/// only write end, close-on-exec, while any worker pool exists, so the guardian reads end-of-file
/// exactly when the program has ended, however it ended, and kills its worker's process group.
/// Made by the first worker start, closed with the last pool ([`close_guardian_pipe`]).
fn guardian_pipe() -> std::io::Result<RawFd> {
    let mut pipe = GUARDIAN_PIPE.lock().unwrap_or_else(|e| e.into_inner());
    if pipe.is_none() {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: pipe2 writes two descriptors into the array it is given.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
            return Err(std::io::Error::other(
                "cannot make the workers' guardian pipe",
            ));
        }
        // SAFETY: both descriptors were just made and are owned by nothing else.
        *pipe = Some(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) });
    }
    Ok(pipe.as_ref().map_or(-1, |(read, _write)| read.as_raw_fd()))
}

static GUARDIAN_PIPE: std::sync::Mutex<Option<(OwnedFd, OwnedFd)>> = std::sync::Mutex::new(None);

/// Closes the guardian pipe: called when the last worker pool is gone (so no worker is running
/// or starting: a start holds its pool). A later start makes a new one.
pub(crate) fn close_guardian_pipe() {
    GUARDIAN_PIPE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
}

/// How long a worker may take to start (the interpreter and NumPy).
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// After this many calls in a row that use less than a quarter of an arena of at least 8 MiB,
/// the arena is replaced by one that fits: one large call does not pin its memory for the
/// worker's life.
const SHRINK_AFTER: u32 = 32;
const SHRINK_FROM: usize = 8 << 20;

/// Whose child a worker process is.
enum Proc {
    /// The program's own (started directly, or the zygote itself).
    Child(Child),
    /// The zygote's (`zygote.rs`), which reaps it when asked.
    Forked(Reaper),
}

/// How the zygote that forked a worker reaps it (`zygote.rs` gives these; this file does not
/// use that one).
#[derive(Clone, Copy)]
pub(crate) struct Reaper {
    /// Waits for the exited or killed worker `pid` forked by zygote `generation`: its raw wait
    /// status, if that zygote lives.
    pub reap: fn(u32, u64) -> Option<i32>,
    /// Whether zygote `generation` lives (so the worker's zombie, and its group's id, are still
    /// its).
    pub alive: fn(u64) -> bool,
    /// Which zygote forked the worker (a program starts a new one after its last pool ended).
    pub generation: u64,
}

pub(crate) struct Worker {
    pub id: u64,
    pub pid: u32,
    proc: Proc,
    /// Readable once the process has exited (Linux 5.3 and later; else `None`).
    pidfd: Option<OwnedFd>,
    sock: UnixStream,
    input: Option<Arena>,
    result: Option<Arena>,
    /// Calls in a row that used under a quarter of each arena.
    small_calls: [u32; 2],
    loaded: HashSet<ModuleKey>,
    /// Modules that failed to load here, with the reply that said so: a call does not run a
    /// failing module's top level again (the program runs it once, at `build()`).
    failed_loads: HashMap<ModuleKey, Reply>,
    /// Whether the process has been waited for (after which its id may name another process).
    reaped: bool,
    /// Whether the exchange under way is loading a body (for what a failure is called).
    loading: bool,
    /// The sequence number of the last request; every reply must echo it.
    seq: u64,
    /// Whether the socket has a write timeout set (from the last request's deadline).
    write_limited: bool,
    /// The pool's count of dropped ops this worker has unloaded up to.
    pub dropped_seen: u64,
    /// How long this worker's calls take, by function: when a caller checks for a reply.
    pace: Pace,
    /// For a Ray pool's relay: where its actor runs (`ray::start`).
    pub actor: Option<RayActor>,
    /// Its socket and pidfd registered with the reactor, once an awaited call used it.
    reactor: Option<super::awaiting::Reactor>,
}

/// Why an exchange ended without a reply.
enum Broken {
    Recv(RecvError),
    /// The worker sent something out of step or malformed: it is killed.
    Protocol(String),
    /// A relay's Ray actor is gone (Ray's error, as `Type: message`); the relay exits.
    Lost(String),
}

impl From<RecvError> for Broken {
    fn from(e: RecvError) -> Self {
        Broken::Recv(e)
    }
}

impl From<ProtocolError> for Broken {
    fn from(e: ProtocolError) -> Self {
        Broken::Protocol(e.to_string())
    }
}

fn io(e: std::io::Error) -> Broken {
    Broken::Recv(RecvError::Io(e))
}

fn unexpected(reply: &Reply, doing: &str) -> Broken {
    Broken::Protocol(unexpected_text(reply, doing))
}

impl Worker {
    /// Starts a Python process of its own on `theirs` (its end of `sock`), with `env` set, and
    /// waits until it is ready: a worker, or (`zygote`) the zygote.
    pub(crate) fn start_process(
        id: u64,
        launch: &Launch,
        sock: UnixStream,
        theirs: UnixStream,
        env: &[(&str, String)],
        zygote: bool,
    ) -> Result<Worker, StartError> {
        let failed = |what: &str, e: std::io::Error| {
            StartError::Failed(format!("{what} {}: {e}", launch.python.display()))
        };
        let guard = guardian_pipe().map_err(|e| failed("cannot start", e))?;
        let mut cmd = Command::new(&launch.python);
        cmd.arg("-c")
            .arg(bootstrap(launch.version))
            .args(&launch.sys_path)
            .stdin(Stdio::null())
            // Its own process group: Ctrl-C in a terminal is the program's to handle, and the
            // group is what is killed with it.
            .process_group(0);
        for (var, value) in env {
            cmd.env(var, value);
        }
        let fd = theirs.as_raw_fd();
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs in the forked child before exec and calls only
        // async-signal-safe functions (fcntl, dup2, close, prctl, getppid, _exit); it allocates
        // nothing.
        unsafe {
            cmd.pre_exec(move || {
                let err = || Err(std::io::Error::last_os_error());
                // Both copied above 4 first, so neither dup2 below overwrites the other's source;
                // dup2's copies are not close-on-exec.
                let s = libc::fcntl(fd, libc::F_DUPFD, 10);
                let g = libc::fcntl(guard, libc::F_DUPFD, 10);
                if s < 0 || g < 0 || libc::dup2(s, 3) < 0 || libc::dup2(g, 4) < 0 {
                    return err();
                }
                libc::close(s);
                libc::close(g);
                // Killed when the thread that started it ends: that is the spawner thread, which
                // lives as long as the program.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0 {
                    return err();
                }
                // The program may have died between fork and prctl.
                if libc::getppid() != parent {
                    libc::_exit(0);
                }
                Ok(())
            });
        }
        let child = spawn_from_spawner(cmd).map_err(|e| failed("cannot start", e))?;
        drop(theirs);
        let pid = child.id();
        let pidfd = pidfd_of(pid);
        let worker = Worker::new(id, pid, Proc::Child(child), pidfd, sock);
        worker.ready(launch, Some(zygote))
    }

    /// A worker the zygote forked (`pid`, its pidfd, the program's end of its socket) once it
    /// says it is ready.
    pub(crate) fn forked(
        id: u64,
        launch: &Launch,
        pid: u32,
        pidfd: OwnedFd,
        sock: UnixStream,
        reaper: Reaper,
    ) -> Result<Worker, StartError> {
        // It says `ready` as its first message: the zygote set it up.
        Worker::new(id, pid, Proc::Forked(reaper), Some(pidfd), sock).ready(launch, None)
    }

    fn new(id: u64, pid: u32, proc: Proc, pidfd: Option<OwnedFd>, sock: UnixStream) -> Worker {
        Worker {
            id,
            pid,
            proc,
            pidfd,
            sock,
            input: None,
            result: None,
            small_calls: [0; 2],
            loaded: HashSet::new(),
            failed_loads: HashMap::new(),
            reaped: false,
            loading: false,
            seq: 0,
            write_limited: false,
            pace: Pace::default(),
            dropped_seen: 0,
            actor: None,
            reactor: None,
        }
    }

    /// Sends the main loop and `init` (unless the zygote set the process up: `None`), then
    /// waits for `ready`.
    fn ready(mut self, launch: &Launch, init: Option<bool>) -> Result<Worker, StartError> {
        let deadline = Instant::now().checked_add(START_TIMEOUT);
        let sent = match init {
            Some(zygote) => {
                let init = protocol::frame(
                    0,
                    &Request::Init {
                        site_packages: launch.site_packages.as_deref(),
                        importer: launch.importer,
                        version: launch.version,
                        argv: &launch.argv,
                        zygote,
                    },
                );
                wire::send(&self.sock, WORKER_PY.as_bytes(), &[])
                    .and_then(|()| wire::send(&self.sock, &init, &[]))
            }
            None => Ok(()),
        };
        let reply = match sent {
            Ok(()) => self.reply(deadline),
            Err(_) => Err(Broken::Recv(RecvError::Closed)),
        };
        let mut worker = self;
        let id = worker.id;
        let python = launch.python.display();
        match reply {
            Ok((Reply::Ready { pid, .. }, _)) if pid != worker.pid => {
                worker.kill();
                Err(StartError::Failed(format!(
                    "{python} said it is pid {pid}, but it was started as {}",
                    worker.pid
                )))
            }
            Ok((Reply::Ready { pid, python, numpy }, _)) => {
                tracing::debug!(worker = id, pid, python, numpy, "pyop worker ready");
                Ok(worker)
            }
            Ok((Reply::WrongVersion { version }, _)) => Err(StartError::Failed(format!(
                "{python} is Python {version}, but the program embeds Python {}.{}: workers run \
                 the program's own interpreter (unset PYOP_WORKER_PYTHON, or point it at a \
                 python{0}.{1})",
                launch.version[0], launch.version[1]
            ))),
            Ok((Reply::NoNumpy { exc }, _)) => Err(StartError::NoNumpy(format!(
                "{}: {}",
                exc.type_name, exc.message
            ))),
            Ok((other, _)) => {
                worker.kill();
                Err(StartError::Failed(format!(
                    "{python} {}",
                    unexpected_text(&other, "its start")
                )))
            }
            Err(Broken::Protocol(what)) => {
                worker.kill();
                Err(StartError::Failed(format!("{python} {what}")))
            }
            Err(Broken::Lost(why)) => {
                worker.kill();
                Err(StartError::Failed(format!(
                    "{python} said `lost` ({why}) while starting"
                )))
            }
            Err(Broken::Recv(RecvError::TimedOut)) => {
                worker.kill();
                Err(StartError::Failed(format!(
                    "{python} did not start within {} s",
                    START_TIMEOUT.as_secs()
                )))
            }
            Err(Broken::Recv(RecvError::Closed | RecvError::Io(_))) => {
                let how = worker.reap();
                Err(StartError::Failed(format!(
                    "{python} {how} while starting (its own output, above, says why)"
                )))
            }
        }
    }

    /// Runs one call. On a time limit the worker is killed; on either failure it is gone,
    /// reaped, and the caller drops it.
    pub(crate) fn call(&mut self, ex: Exchange<'_>) -> Result<Answered, Failure> {
        let result = wire::block_now(self.exchange(ex, &mut wire::Blocking));
        self.failure(result)
    }

    /// [`call`](Self::call), waiting for the reply as a future: the socket and the pidfd are
    /// registered with `reactor`'s, and no thread waits. Dropped before it is ready, the call
    /// leaves the worker out of step: the caller kills it (`Lease::drop`).
    pub(crate) async fn call_async(&mut self, ex: Exchange<'_>) -> Result<Answered, Failure> {
        let result = match self.reactor() {
            Ok(mut reactor) => self.exchange(ex, &mut reactor).await,
            Err(e) => Err(io(e)),
        };
        self.failure(result)
    }

    /// The reactor registration of this worker's socket and pidfd, made on its first awaited
    /// call.
    fn reactor(&mut self) -> std::io::Result<super::awaiting::Reactor> {
        if self.reactor.is_none() {
            let sock = self.sock.as_fd().try_clone_to_owned()?;
            let pidfd = self
                .pidfd
                .as_ref()
                .map(|fd| fd.as_fd().try_clone_to_owned())
                .transpose()?;
            self.reactor = Some(super::awaiting::Reactor::register(sock, pidfd)?);
        }
        Ok(self.reactor.clone().expect("made above"))
    }

    /// The failure an exchange ended in, the worker killed and reaped.
    fn failure<T>(&mut self, result: Result<T, Broken>) -> Result<T, Failure> {
        let loading = std::mem::replace(&mut self.loading, false);
        let lost = |how: String| Failure::Lost { how, loading };
        match result {
            Ok(r) => Ok(r),
            Err(Broken::Recv(RecvError::TimedOut)) => {
                self.kill();
                Err(Failure::TimedOut { loading })
            }
            Err(Broken::Recv(RecvError::Closed)) => Err(lost(self.reap())),
            Err(Broken::Recv(RecvError::Io(e))) => {
                self.kill();
                Err(lost(format!("failed ({e}) and was killed")))
            }
            Err(Broken::Protocol(what)) => {
                self.kill();
                Err(lost(format!("{what}, and was killed")))
            }
            Err(Broken::Lost(why)) => {
                self.kill();
                Err(lost(format!("was lost ({why})")))
            }
        }
    }

    /// The worker as errors name it: `worker 3 (pid 1234)`, or for a Ray pool's relay its
    /// actor and itself, `Ray actor 3 (pid 5678 on 10.0.0.7; its relay here, pid 1234)`.
    pub(crate) fn named(&self) -> String {
        match &self.actor {
            None => format!("worker {} (pid {})", self.id, self.pid),
            Some(a) => format!(
                "Ray actor {} (pid {} on {}; its relay here, pid {})",
                a.id, a.pid, a.ip, self.pid
            ),
        }
    }

    /// What the pool starts in its place: `worker`, or `actor`.
    pub(crate) fn noun(&self) -> &'static str {
        if self.actor.is_some() {
            "actor"
        } else {
            "worker"
        }
    }

    /// Sends `frame` as the next request (`with_seq` gives it its number), by `deadline`: a
    /// worker that does not read its socket (its GIL held by a thread of the body's, say) cannot
    /// hold the caller past its time limit with a request larger than the socket's buffer.
    fn request(
        &mut self,
        frame: impl FnOnce(u64) -> Vec<u8>,
        deadline: Option<Instant>,
    ) -> Result<(), Broken> {
        self.seq += 1;
        let limit = deadline.map(|d| {
            d.saturating_duration_since(Instant::now())
                .max(Duration::from_micros(1))
        });
        if limit.is_some() || self.write_limited {
            self.sock.set_write_timeout(limit).map_err(io)?;
            self.write_limited = limit.is_some();
        }
        wire::send(&self.sock, &frame(self.seq), &[]).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                Broken::Recv(RecvError::TimedOut)
            }
            _ => io(e),
        })
    }

    /// Receives the reply to the last request, checking that it is that request's.
    fn reply(&mut self, deadline: Option<Instant>) -> Result<(Reply, Vec<u8>), Broken> {
        wire::block_now(self.reply_with(deadline, &mut wire::Blocking))
    }

    /// `reply`, waiting as `wait` does.
    async fn reply_with<W: Wait>(
        &mut self,
        deadline: Option<Instant>,
        wait: &mut W,
    ) -> Result<(Reply, Vec<u8>), Broken> {
        let (reply, payload, _) = self
            .reply_within(deadline, &mut Spin::now_for(pace::FIRST_SPIN), wait)
            .await?;
        Ok((reply, payload))
    }

    /// `reply`, checking for it without sleeping during `spin`; with how the worker waited for
    /// the request (the reply's `w`).
    async fn reply_within<W: Wait>(
        &mut self,
        deadline: Option<Instant>,
        spin: &mut Spin,
        wait: &mut W,
    ) -> Result<(Reply, Vec<u8>, Option<pace::Waited>), Broken> {
        let frame = wire::recv_with(&self.sock, deadline, self.alive(), spin, wait).await?;
        let protocol::Decoded {
            q,
            reply,
            payload,
            waited,
        } = protocol::decode(frame)?;
        if q != self.seq {
            return Err(Broken::Protocol(
                "sent a reply to another request than the one it was given".to_owned(),
            ));
        }
        Ok((reply, payload, waited))
    }

    /// Loads the module `load` names, unless it is loaded: with its own limit (a body's time
    /// limit is its calls'), once per worker whether it loads or fails (a failed load's reply is
    /// kept and given again). `Some` is that failed reply.
    async fn ensure_loaded<W: Wait>(
        &mut self,
        load: &Load,
        wait: &mut W,
    ) -> Result<Option<Reply>, Broken> {
        if let Some(reply) = self.failed_loads.get(&load.key) {
            return Ok(Some(reply.clone()));
        }
        if self.loaded.contains(&load.key) {
            return Ok(None);
        }
        self.loading = true;
        let deadline = Instant::now().checked_add(LOAD_TIMEOUT);
        self.request(|seq| protocol::with_seq(seq, &load.message), deadline)?;
        let (reply, _) = self.reply_with(deadline, wait).await?;
        self.loading = false;
        // An earlier generation of this op's module (hot reload) is gone there.
        self.loaded.retain(|k| k.base != load.key.base);
        match reply {
            Reply::Loaded {} => {
                self.loaded.insert(load.key.clone());
                Ok(None)
            }
            failed @ Reply::LoadFailed { .. } => {
                self.failed_loads.insert(load.key.clone(), failed.clone());
                Ok(Some(failed))
            }
            Reply::Lost { why } => Err(Broken::Lost(why)),
            other => Err(unexpected(&other, "a load")),
        }
    }

    async fn exchange<W: Wait>(
        &mut self,
        ex: Exchange<'_>,
        wait: &mut W,
    ) -> Result<Answered, Broken> {
        if let Some(reply) = self.ensure_loaded(&ex.load, wait).await? {
            return Ok(Answered {
                reply,
                payload: Vec::new(),
                input: None,
                result: None,
                copied_in: 0,
                copied_out: 0,
                waits: Waits::default(),
            });
        }
        let input = self.input_arena(ex.arena_len).map_err(io)?;
        let mut copied_in = 0u64;
        for (offset, bytes) in &ex.inputs {
            // SAFETY: the worker is between calls (it reads the arena only while running one,
            // and that call's reply came before this request).
            unsafe { input.write(*offset, bytes) };
            copied_in += bytes.len() as u64;
        }
        let input_len = input.len();
        // `Duration::MAX` (or any limit past what `Instant` holds): no limit.
        let deadline = ex.timeout.and_then(|t| Instant::now().checked_add(t));
        self.request(|seq| protocol::with_seq(seq, &ex.call), deadline)?;
        let function = pace::function_key(&ex.load.key.base, ex.function);
        let sent = Instant::now();
        let mut spin = self.pace.spin(function, sent);
        loop {
            let (reply, payload, worker_waited) =
                self.reply_within(deadline, &mut spin, wait).await?;
            let waited = std::mem::replace(&mut spin, Spin::now_for(pace::FIRST_SPIN));
            let waits = Waits {
                caller: waited.waited,
                worker: worker_waited,
            };
            let result_len = self.result.as_ref().map_or(0, Arena::len);
            let checked = reply.check([input_len, result_len], ex.outs.as_deref())?;
            let retained = match &reply {
                Reply::Need { need } => {
                    let need = usize::try_from(*need).map_err(|_| {
                        Broken::Protocol("sent a reply whose `need` does not fit".to_owned())
                    })?;
                    let arena = Arena::with_room_for(need).map_err(io)?;
                    self.send_arena(1, &arena).map_err(io)?;
                    self.result = Some(arena);
                    self.small_calls[1] = 0;
                    // The worker says it mapped it before it writes there: a `need` it did not
                    // send (a body forging one) cannot leave the two sides with other arenas.
                    match self.reply_with(deadline, wait).await?.0 {
                        Reply::Mapped {} => continue,
                        other => return Err(unexpected(&other, "a result arena")),
                    }
                }
                Reply::Array { retained, .. }
                | Reply::Pickled { retained, .. }
                | Reply::Wrote { retained, .. }
                | Reply::Raised { retained, .. } => *retained,
                Reply::Lost { why } => return Err(Broken::Lost(why.clone())),
                other => return Err(unexpected(other, "a call")),
            };
            // The body's time as the caller waits for it (a `need` in between included).
            self.pace.record(function, sent.elapsed(), &waited);
            let input = Arc::clone(self.input.as_ref().expect("made above").map());
            if retained {
                // The body kept a view of this arena: the next call gets a fresh one, and this
                // one lives on in the worker for as long as what it kept.
                self.input = None;
            }
            // The reply keeps the arenas this call's values are in; a result arena replaced for
            // being too large (below) is replaced after that, for the next call.
            let result = self.result.as_ref().map(|a| Arc::clone(a.map()));
            self.note_use(1, checked.copied_out as usize);
            return Ok(Answered {
                reply,
                payload,
                input: Some(input),
                result,
                copied_in,
                copied_out: checked.copied_out,
                waits,
            });
        }
    }

    /// The input arena with room for `needed` bytes, made (and sent) if there is
    /// none, it is too small, or it has been far too large for long.
    fn input_arena(&mut self, needed: usize) -> std::io::Result<&Arena> {
        self.note_use(0, needed);
        if self.input.as_ref().is_none_or(|a| a.len() < needed) {
            let arena = Arena::with_room_for(needed)?;
            self.send_arena(0, &arena)?;
            self.input = Some(arena);
            self.small_calls[0] = 0;
        }
        Ok(self.input.as_ref().expect("made above"))
    }

    /// Counts calls that used little of an arena; after `SHRINK_AFTER` of them in a row the
    /// arena is dropped (the next call that needs one makes one that fits). The worker keeps its
    /// old mapping only while a view it holds needs it.
    fn note_use(&mut self, which: usize, used: usize) {
        let arena = if which == 0 {
            &mut self.input
        } else {
            &mut self.result
        };
        let Some(a) = arena.as_ref() else { return };
        if a.len() >= SHRINK_FROM && used < a.len() / 4 {
            self.small_calls[which] += 1;
            if self.small_calls[which] >= SHRINK_AFTER {
                self.small_calls[which] = 0;
                if which == 1 {
                    // The worker must not write results into an arena this side dropped: it
                    // gets a small one now.
                    if let Ok(small) = Arena::with_room_for(used) {
                        if self.send_arena(1, &small).is_ok() {
                            self.result = Some(small);
                        }
                    }
                } else {
                    *arena = None;
                }
            }
        } else {
            self.small_calls[which] = 0;
        }
    }

    /// Unloads the modules of the bases in `dropped` that this worker has (never answered; a
    /// worker that cannot be told is lost at its next call).
    pub(crate) fn unload(&mut self, dropped: &HashSet<String>) {
        let mut bases: Vec<String> = self
            .loaded
            .iter()
            .chain(self.failed_loads.keys())
            .filter(|k| dropped.contains(&k.base))
            .map(|k| k.base.clone())
            .collect();
        bases.sort();
        bases.dedup();
        for base in bases {
            let msg = protocol::frame(self.seq, &Request::Unload { base: &base });
            if wire::send(&self.sock, &msg, &[]).is_err() {
                return;
            }
            self.loaded.retain(|k| k.base != base);
            self.failed_loads.retain(|k, _| k.base != base);
        }
    }

    /// Asks the module `load` names which of `fns` it lacks (a `ping`), loading it first (with
    /// the load's own limit), and waits up to `limit`: `Pong`, or the load's failure.
    pub(crate) fn ask(
        &mut self,
        load: &Load,
        fns: &[&str],
        limit: Duration,
    ) -> Result<Reply, Failure> {
        let run = |w: &mut Worker| -> Result<Reply, Broken> {
            if let Some(failed) = wire::block_now(w.ensure_loaded(load, &mut wire::Blocking))? {
                return Ok(failed);
            }
            let ping = Request::Ping {
                key: &load.key,
                fns,
            };
            let deadline = Instant::now().checked_add(limit);
            w.request(|seq| protocol::frame(seq, &ping), deadline)?;
            match w.reply(deadline)?.0 {
                pong @ Reply::Pong { .. } => Ok(pong),
                Reply::Lost { why } => Err(Broken::Lost(why)),
                other => Err(unexpected(&other, "a ping")),
            }
        };
        let result = run(self);
        self.failure(result)
    }

    /// Sends `request` with `fds` and returns its reply, whatever it is, within `limit`: the
    /// zygote's requests (`zygote.rs`), a relay's join (`ray`). On any failure the process is
    /// killed.
    pub(crate) fn ask_once(
        &mut self,
        request: &Request<'_>,
        fds: &[std::os::fd::BorrowedFd<'_>],
        limit: Duration,
    ) -> Result<Reply, Failure> {
        let run = |w: &mut Worker| -> Result<Reply, Broken> {
            let deadline = Instant::now().checked_add(limit);
            w.seq += 1;
            w.sock
                .set_write_timeout(Some(limit.max(Duration::from_millis(1))))
                .map_err(io)?;
            w.write_limited = true;
            wire::send(&w.sock, &protocol::frame(w.seq, request), fds).map_err(io)?;
            Ok(w.reply(deadline)?.0)
        };
        let result = run(self);
        self.failure(result)
    }

    /// Whether the process has exited (an idle worker the OOM killer took, say). It is left
    /// waitable (`WNOWAIT`, or the zygote waits only when asked), so its id still names it and
    /// its process group until it is reaped.
    pub(crate) fn exited(&mut self) -> bool {
        if self.reaped {
            return true;
        }
        if let Proc::Forked(_) = self.proc {
            return self
                .pidfd
                .as_ref()
                .is_none_or(|fd| readable_now(fd.as_fd()));
        }
        use rustix::process::{waitid, Pid, WaitId, WaitIdOptions};
        let Some(pid) = Pid::from_raw(self.pid as i32) else {
            return true;
        };
        let options = WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT;
        !matches!(waitid(WaitId::Pid(pid), options), Ok(None))
    }

    fn alive(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.pidfd.as_ref().map(|fd| fd.as_fd())
    }

    /// Sends an arena (never answered: it keeps the sequence number of the request it serves).
    fn send_arena(&self, which: u8, arena: &Arena) -> std::io::Result<()> {
        let msg = protocol::frame(
            self.seq,
            &Request::Arena {
                which,
                size: arena.len(),
            },
        );
        wire::send(&self.sock, &msg, &[arena.fd()])
    }

    /// Kills the worker's whole process group (the worker and what its bodies started) before
    /// reaping it, so the group's id cannot have been reused, and reaps it.
    pub(crate) fn kill(&mut self) {
        if self.reaped {
            return;
        }
        self.kill_group();
        match &self.proc {
            Proc::Child(_) => {
                self.kill_and_wait();
            }
            Proc::Forked(reaper) => {
                // The zygote reaps it, later: no time limit waits on the zygote.
                self.signal_forked();
                reap_later(*reaper, self.pid);
            }
        }
        self.reaped = true;
    }

    /// SIGKILL to a worker the zygote forked, through its pidfd (which names it, whoever
    /// reaped it).
    fn signal_forked(&self) {
        if let Some(fd) = &self.pidfd {
            let _ = rustix::process::pidfd_send_signal(fd.as_fd(), rustix::process::Signal::KILL);
        }
    }

    /// Kills the process itself and waits for it: the program's own child directly, one the
    /// zygote forked through its pidfd (which names it, whoever reaped it) and the zygote.
    /// Its exit status, when known.
    fn kill_and_wait(&mut self) -> Option<ExitStatus> {
        match &mut self.proc {
            Proc::Child(child) => {
                let _ = child.kill();
                child.wait().ok()
            }
            Proc::Forked(reaper) => {
                let reaper = *reaper;
                self.signal_forked();
                (reaper.reap)(self.pid, reaper.generation).map(ExitStatus::from_raw)
            }
        }
    }

    fn kill_group(&self) {
        // A forked worker's zombie is the zygote's to keep: if the zygote is gone, so is the
        // zombie, and its id may name another group by now (what the worker's bodies started
        // then ends with the program, by the worker's guardian).
        if let Proc::Forked(reaper) = &self.proc {
            if !(reaper.alive)(reaper.generation) {
                return;
            }
        }
        // SAFETY: killpg takes plain integers; the worker leads its own group (process_group(0)
        // at spawn, or setpgid by the zygote and itself) and is not reaped yet, so the id still
        // names that group.
        unsafe {
            libc::killpg(self.pid as libc::pid_t, libc::SIGKILL);
        }
    }

    /// Says how a worker that closed its end ended, after killing what is left of its group and
    /// reaping it.
    fn reap(&mut self) -> String {
        // The socket closes when the process exits; the exit follows within moments.
        let deadline = Instant::now() + Duration::from_millis(500);
        while !self.exited() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let exited = self.exited();
        if self.reaped {
            return "had exited".to_owned();
        }
        // What its bodies started, and the worker itself if it closed its socket but lives on;
        // then it is waited for, the group's id still its own until then.
        self.kill_group();
        let status = self.kill_and_wait();
        self.reaped = true;
        match status {
            Some(status) if exited => describe_exit(status),
            None if exited => "had exited (how is unknown: its zygote is gone)".to_owned(),
            _ => "closed its connection and was killed".to_owned(),
        }
    }
}

fn unexpected_text(reply: &Reply, doing: &str) -> String {
    format!("sent a `{}` reply to {doing}", reply.kind())
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Killed with the processes its bodies started, and reaped: no zombie, no orphan (also
        // for a worker that already exited: its group may outlive it). A worker holds nothing to
        // save (module state is the body's, as in the program, where nothing runs at exit
        // either).
        self.kill();
    }
}

/// The thread-count variables a worker starts with: the program's own value of each, or
/// `threads` where the program sets none.
pub(crate) fn thread_env(threads: usize) -> Vec<(&'static str, String)> {
    THREAD_VARS
        .iter()
        .filter_map(|&var| match std::env::var_os(var) {
            // (A value that is not UTF-8 is inherited as it is, where it can be.)
            Some(value) => value.into_string().ok().map(|v| (var, v)),
            None => Some((var, threads.to_string())),
        })
        .collect()
}

/// A pidfd of process `pid` (Linux 5.3 and later; else `None`).
pub(crate) fn pidfd_of(pid: u32) -> Option<OwnedFd> {
    rustix::process::Pid::from_raw(pid as i32)
        .and_then(|p| rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok())
}

/// Whether `fd` (a pidfd: readable once its process exited) is readable now.
pub(crate) fn readable_now(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
}

/// How a process ended, in words.
pub(crate) fn describe_exit(status: ExitStatus) -> String {
    if let Some(sig) = status.signal() {
        let name = match sig {
            libc::SIGSEGV => " (SIGSEGV)",
            libc::SIGKILL => " (SIGKILL)",
            libc::SIGABRT => " (SIGABRT)",
            libc::SIGBUS => " (SIGBUS)",
            libc::SIGFPE => " (SIGFPE)",
            libc::SIGILL => " (SIGILL)",
            libc::SIGTERM => " (SIGTERM)",
            _ => "",
        };
        format!("was killed by signal {sig}{name}")
    } else {
        format!("exited with status {}", status.code().unwrap_or(-1))
    }
}

/// Has `reap` wait for the killed worker `pid` on one long-lived thread (the zygote answers
/// reaps one at a time, and a caller whose time limit ended it must not wait for that).
fn reap_later(reaper: Reaper, pid: u32) {
    type Job = (Reaper, u32);
    static REAPER: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();
    let thread = REAPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        let spawned = std::thread::Builder::new()
            .name("pyop-worker-reaper".into())
            .spawn(move || {
                for (reaper, pid) in rx {
                    (reaper.reap)(pid, reaper.generation);
                }
            });
        if spawned.is_err() {
            tracing::debug!("no reaper thread: killed forked workers stay the zygote's zombies");
        }
        Mutex::new(tx)
    });
    let _ = thread
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send((reaper, pid));
}

/// Starts `cmd` from one long-lived thread: a worker's parent-death signal fires when the thread
/// that forked it ends, so that thread must be one that lives as long as the program.
fn spawn_from_spawner(cmd: Command) -> std::io::Result<Child> {
    type Job = Box<dyn FnOnce() + Send>;
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("pyop-worker-spawner".into())
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .expect("a thread for starting workers");
        Mutex::new(tx)
    });
    let (tx, rx) = mpsc::sync_channel(1);
    let mut cmd = cmd;
    let job: Job = Box::new(move || {
        let _ = tx.send(cmd.spawn());
    });
    spawner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send(job)
        .map_err(|_| std::io::Error::other("the worker spawner thread is gone"))?;
    rx.recv()
        .map_err(|_| std::io::Error::other("the worker spawner thread is gone"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each signal a worker commonly dies of is named (mutation testing: every arm deleted went
    /// unnoticed but SIGSEGV's, which `worker_limits_tests` provokes).
    #[test]
    fn exits_are_described_with_the_signal_named() {
        let killed = |sig: i32| describe_exit(ExitStatus::from_raw(sig));
        for (sig, name) in [
            (libc::SIGSEGV, "SIGSEGV"),
            (libc::SIGKILL, "SIGKILL"),
            (libc::SIGABRT, "SIGABRT"),
            (libc::SIGBUS, "SIGBUS"),
            (libc::SIGFPE, "SIGFPE"),
            (libc::SIGILL, "SIGILL"),
            (libc::SIGTERM, "SIGTERM"),
        ] {
            assert_eq!(killed(sig), format!("was killed by signal {sig} ({name})"));
        }
        assert_eq!(
            killed(libc::SIGUSR1),
            format!("was killed by signal {}", libc::SIGUSR1)
        );
        assert_eq!(
            describe_exit(ExitStatus::from_raw(3 << 8)),
            "exited with status 3"
        );
    }
}
