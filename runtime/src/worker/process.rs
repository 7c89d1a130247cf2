//! One worker: its process (`proc`) and the conversation with it over a socket pair: started and
//! told its main loop, its arenas, one call at a time, its modules loaded and unloaded, and what
//! a failed exchange becomes (the process killed on a time limit, and always reaped).

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::arena::Arena;
use super::exchange::RayActor;
use super::exchange::LOAD_TIMEOUT;
use super::exchange::{Answered, Exchange, Failure, Launch, Load, StartError, Waits};
use super::pace::{self, Pace, Spin};
use super::proc::{Process, Reaper};
use super::protocol::{self, ModuleKey, ProtocolError, Reply, Request};
use super::wire::{self, RecvError, Wait};

/// The worker's main loop, sent to it at start: what any process running bodies needs
/// (`host.py`, which a Ray actor runs too), what a Ray pool's relay does (`ray/relay.py`), then
/// the worker's own (`worker.py`).
const WORKER_PY: &str = concat!(
    super::python::host_py!(),
    include_str!("ray/python/relay.py"),
    include_str!("python/worker.py")
);

/// How long a worker may take to start (the interpreter and NumPy).
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// After this many calls in a row that use less than a quarter of an arena of at least 8 MiB,
/// the arena is replaced by one that fits: one large call does not pin its memory for the
/// worker's life.
const SHRINK_AFTER: u32 = 32;
const SHRINK_FROM: usize = 8 << 20;

pub(crate) struct Worker {
    pub id: u64,
    pub pid: u32,
    /// The operating system's process: killed, reaped, watched for its exit.
    process: Process,
    sock: UnixStream,
    input: Option<Arena>,
    result: Option<Arena>,
    /// Calls in a row that used under a quarter of each arena.
    small_calls: [u32; 2],
    loaded: HashSet<ModuleKey>,
    /// Modules that failed to load here, with the reply that said so: a call does not run a
    /// failing module's top level again (the program runs it once, at `build()`).
    failed_loads: HashMap<ModuleKey, Reply>,
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
        let process = Process::spawn(launch, theirs, env).map_err(|e| failed("cannot start", e))?;
        let pid = process.pid;
        let worker = Worker::new(id, pid, process, sock);
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
        Worker::new(id, pid, Process::forked(pid, pidfd, reaper), sock).ready(launch, None)
    }

    fn new(id: u64, pid: u32, process: Process, sock: UnixStream) -> Worker {
        Worker {
            id,
            pid,
            process,
            sock,
            input: None,
            result: None,
            small_calls: [0; 2],
            loaded: HashSet::new(),
            failed_loads: HashMap::new(),
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
                let how = worker.process.reap();
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
                .process
                .pidfd()
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
                self.process.kill();
                Err(Failure::TimedOut { loading })
            }
            Err(Broken::Recv(RecvError::Closed)) => Err(lost(self.process.reap())),
            Err(Broken::Recv(RecvError::Io(e))) => {
                self.process.kill();
                Err(lost(format!("failed ({e}) and was killed")))
            }
            Err(Broken::Protocol(what)) => {
                self.process.kill();
                Err(lost(format!("{what}, and was killed")))
            }
            Err(Broken::Lost(why)) => {
                self.process.kill();
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
        let frame = wire::recv_with(&self.sock, deadline, self.process.pidfd(), spin, wait).await?;
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

    /// Whether the process has exited (see [`Process::exited`]).
    pub(crate) fn exited(&mut self) -> bool {
        self.process.exited()
    }

    /// Kills the worker's whole process group and reaps it (see [`Process::kill`]).
    pub(crate) fn kill(&mut self) {
        self.process.kill();
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
}

fn unexpected_text(reply: &Reply, doing: &str) -> String {
    format!("sent a `{}` reply to {doing}", reply.kind())
}
