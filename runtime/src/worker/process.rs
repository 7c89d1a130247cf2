//! One worker process: started with the program's interpreter, fed over a socket pair, its
//! arenas, one call at a time, killed on a time limit, and always reaped.

use std::collections::HashSet;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::arena::Arena;
use super::wire::{self, RecvError};
use super::{Failure, Launch, Reply, Request, StartError, WorkerPool};

/// The worker's main loop, sent to it at start.
const WORKER_PY: &str = include_str!("worker.py");

/// What `python -c` runs: read the main loop's text from fd 3, run it under pyop's frame name.
const BOOTSTRAP: &str = "import socket\n\
k = socket.socket(fileno=3)\n\
n = int.from_bytes(k.recv(4, socket.MSG_WAITALL), 'little')\n\
b = bytearray()\n\
while len(b) < n:\n    c = k.recv(n - len(b))\n    if not c: raise SystemExit(0)\n    b += c\n\
k.detach()\n\
exec(compile(bytes(b), '<pyop>', 'exec'), {'__name__': '__pyop_worker__'})\n";

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
    child: Child,
    /// Readable once the process has exited (Linux 5.3 and later; else `None`).
    pidfd: Option<OwnedFd>,
    sock: UnixStream,
    input: Option<Arena>,
    result: Option<Arena>,
    /// Calls in a row that used under a quarter of each arena.
    small_calls: [u32; 2],
    loaded: HashSet<String>,
    /// Modules that failed to load here, with the reply that said so: a call does not run a
    /// failing module's top level again (the program runs it once, at `build()`).
    failed_loads: std::collections::HashMap<String, (serde_json::Value, Vec<u8>)>,
    /// Whether the process has been waited for (after which its id may name another process).
    reaped: bool,
    /// Whether the exchange under way is loading a body (for what a failure is called).
    loading: bool,
    /// The sequence number of the last request; every reply must echo it.
    seq: u64,
}

/// Why an exchange ended without a reply.
enum Broken {
    Recv(RecvError),
    /// The worker sent something out of step: it is killed.
    Protocol(String),
}

impl From<RecvError> for Broken {
    fn from(e: RecvError) -> Self {
        Broken::Recv(e)
    }
}

impl Worker {
    /// Starts worker `id` and waits until it is ready (its interpreter and NumPy imported).
    /// `threads` sizes its BLAS and OpenMP thread pools where the program's environment does not
    /// ([`WorkerPool::THREAD_VARS`]).
    pub(crate) fn start(id: u64, launch: &Launch, threads: usize) -> Result<Worker, StartError> {
        let failed = |what: &str, e: std::io::Error| {
            StartError::Failed(format!("{what} {}: {e}", launch.python.display()))
        };
        let (sock, theirs) =
            UnixStream::pair().map_err(|e| failed("cannot make a socket for", e))?;
        let mut cmd = Command::new(&launch.python);
        cmd.arg("-c")
            .arg(BOOTSTRAP)
            .stdin(Stdio::null())
            // Its own process group: Ctrl-C in a terminal is the program's to handle.
            .process_group(0);
        let threads = threads.to_string();
        for var in WorkerPool::THREAD_VARS {
            if std::env::var_os(var).is_none() {
                cmd.env(var, &threads);
            }
        }
        let fd = theirs.as_raw_fd();
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs in the forked child before exec and calls only
        // async-signal-safe functions (dup2, fcntl, prctl, getppid, _exit); it allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if fd == 3 {
                    // dup2 onto itself would keep close-on-exec.
                    if libc::fcntl(3, libc::F_SETFD, 0) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                } else if libc::dup2(fd, 3) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // Killed when the thread that started it ends: that is the spawner thread, which
                // lives as long as the program.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0 {
                    return Err(std::io::Error::last_os_error());
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
        let pidfd = rustix::process::Pid::from_raw(pid as i32).and_then(|p| {
            rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
        });
        let mut worker = Worker {
            id,
            pid,
            child,
            pidfd,
            sock,
            input: None,
            result: None,
            small_calls: [0; 2],
            loaded: HashSet::new(),
            failed_loads: std::collections::HashMap::new(),
            reaped: false,
            loading: false,
            seq: 0,
        };
        let init = serde_json::json!({
            "sys_path": launch.sys_path,
            "site_packages": launch.site_packages,
            "importer": launch.importer,
            "version": launch.version,
        });
        let deadline = Some(Instant::now() + START_TIMEOUT);
        let sent = wire::send(&worker.sock, WORKER_PY.as_bytes(), &[])
            .and_then(|()| wire::send(&worker.sock, init.to_string().as_bytes(), &[]));
        let reply = match sent {
            Ok(()) => wire::recv(&worker.sock, deadline, worker.alive()),
            Err(_) => Err(RecvError::Closed),
        };
        let header = match reply.map(wire::split_reply) {
            Ok(Ok((header, _))) => header,
            Ok(Err(e)) => return Err(StartError::Failed(e.to_string())),
            Err(RecvError::TimedOut) => {
                worker.kill();
                return Err(StartError::Failed(format!(
                    "{} did not start within {} s",
                    launch.python.display(),
                    START_TIMEOUT.as_secs()
                )));
            }
            Err(RecvError::Closed) | Err(RecvError::Io(_)) => {
                let how = worker.reap();
                return Err(StartError::Failed(format!(
                    "{} {how} while starting (its own output, above, says why)",
                    launch.python.display()
                )));
            }
        };
        if let Some(theirs) = header["version"].as_str() {
            let ours = format!("{}.{}", launch.version[0], launch.version[1]);
            return Err(StartError::Failed(format!(
                "{} is Python {theirs}, but the program embeds Python {ours}: workers run the \
                 program's own interpreter (unset PYOP_WORKER_PYTHON, or point it at a \
                 python{ours})",
                launch.python.display()
            )));
        }
        if header["s"] == "err" {
            let exc = &header["exc"];
            return Err(StartError::NoNumpy(format!(
                "{}: {}",
                exc["type"].as_str().unwrap_or("ImportError"),
                exc["message"].as_str().unwrap_or_default()
            )));
        }
        Ok(worker)
    }

    /// Runs one request. On a time limit the worker is killed; on either failure it is gone,
    /// reaped, and the caller drops it.
    pub(crate) fn call(&mut self, req: Request<'_>) -> Result<Reply, Failure> {
        let result = self.exchange(req);
        self.failure(result)
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
        }
    }

    /// A frame with this worker's next sequence number added.
    fn next_frame(&mut self, mut msg: serde_json::Value) -> Vec<u8> {
        self.seq += 1;
        msg["q"] = self.seq.into();
        msg.to_string().into_bytes()
    }

    /// Receives the reply to the last request, checking that it is that request's.
    fn reply(&mut self, deadline: Option<Instant>) -> Result<(serde_json::Value, Vec<u8>), Broken> {
        let frame = wire::recv(&self.sock, deadline, self.alive())?;
        let (header, payload) = wire::split_reply(frame)
            .map_err(|_| Broken::Protocol("sent a malformed reply".to_owned()))?;
        if header["q"].as_u64() != Some(self.seq) {
            return Err(Broken::Protocol(
                "sent a reply to another request than the one it was given".to_owned(),
            ));
        }
        Ok((header, payload))
    }

    /// Loads the body whose load request is `load` under `key`, unless it is loaded: with its own
    /// limit (a body's time limit is its calls'), once per worker whether it loads or fails (a
    /// failed load's reply is kept and given again). `Some` is that failed reply.
    fn ensure_loaded(
        &mut self,
        key: &str,
        load: &str,
    ) -> Result<Option<(serde_json::Value, Vec<u8>)>, Broken> {
        if let Some(reply) = self.failed_loads.get(key) {
            return Ok(Some(reply.clone()));
        }
        if self.loaded.contains(key) {
            return Ok(None);
        }
        self.loading = true;
        self.seq += 1;
        let frame = format!("{{\"q\":{},{}", self.seq, &load[1..]);
        wire::send(&self.sock, frame.as_bytes(), &[])
            .map_err(|e| Broken::Recv(RecvError::Io(e)))?;
        let (header, payload) = self.reply(Some(Instant::now() + super::LOAD_TIMEOUT))?;
        self.loading = false;
        // An earlier generation of this op's module (hot reload) is gone there.
        let base = key.rsplit_once('.').map_or(key, |(b, _)| b);
        self.loaded
            .retain(|k| k.rsplit_once('.').is_none_or(|(b, _)| b != base));
        if header["s"] == "ok" {
            self.loaded.insert(key.to_owned());
            Ok(None)
        } else {
            self.failed_loads
                .insert(key.to_owned(), (header.clone(), payload.clone()));
            Ok(Some((header, payload)))
        }
    }

    fn exchange(&mut self, req: Request<'_>) -> Result<Reply, Broken> {
        let io = |e| Broken::Recv(RecvError::Io(e));
        if let Some((key, load)) = &req.load {
            let failed = self.ensure_loaded(key, load)?;
            if let Some((header, payload)) = failed {
                return Ok(Reply {
                    header,
                    payload,
                    input: None,
                    result: None,
                });
            }
        }
        let input = self.input_arena(req.arena_len).map_err(io)?;
        for (offset, bytes) in &req.inputs {
            // SAFETY: the worker is between calls (it reads the arena only while running one,
            // and that call's reply came before this request).
            unsafe { input.write(*offset, bytes) };
        }
        let frame = self.next_frame(req.call);
        wire::send(&self.sock, &frame, &[]).map_err(io)?;
        let deadline = req.timeout.map(|t| Instant::now() + t);
        loop {
            let (header, payload) = self.reply(deadline)?;
            if header["s"] == "need" {
                let need = header["need"].as_u64().unwrap_or(0) as usize;
                let arena = Arena::with_room_for(need).map_err(io)?;
                self.send_arena(1, &arena).map_err(io)?;
                self.result = Some(arena);
                self.small_calls[1] = 0;
                continue;
            }
            let input = Arc::clone(self.input.as_ref().expect("made above").map());
            if header["retained"] == true {
                // The body kept a view of this arena: the next call gets a fresh one, and this
                // one lives on in the worker for as long as what it kept.
                self.input = None;
            }
            // The reply keeps the arenas this call's values are in; a result arena replaced for
            // being too large (below) is replaced after that, for the next call.
            let result = self.result.as_ref().map(|a| Arc::clone(a.map()));
            let used = result_bytes(&header);
            self.note_use(1, used);
            return Ok(Reply {
                header,
                payload,
                input: Some(input),
                result,
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

    /// Sends a plain request and waits up to `limit` for its reply header (a `ping`), loading
    /// the body first (with the load's own limit).
    pub(crate) fn ask(
        &mut self,
        load: Option<(String, Arc<str>)>,
        request: serde_json::Value,
        limit: Duration,
    ) -> Result<serde_json::Value, Failure> {
        let run = |w: &mut Worker| -> Result<serde_json::Value, Broken> {
            let io = |e| Broken::Recv(RecvError::Io(e));
            if let Some((key, load)) = &load {
                if let Some((header, _)) = w.ensure_loaded(key, load)? {
                    return Ok(header);
                }
            }
            let frame = w.next_frame(request);
            wire::send(&w.sock, &frame, &[]).map_err(io)?;
            Ok(w.reply(Some(Instant::now() + limit))?.0)
        };
        let result = run(self);
        self.failure(result)
    }

    /// Whether the process has exited (an idle worker the OOM killer took, say). It is left
    /// waitable (`WNOWAIT`), so its id still names it and its process group until it is reaped.
    pub(crate) fn exited(&mut self) -> bool {
        if self.reaped {
            return true;
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

    fn send_arena(&self, which: u8, arena: &Arena) -> std::io::Result<()> {
        let msg = serde_json::json!({"op": "arena", "which": which, "size": arena.len()});
        wire::send(&self.sock, msg.to_string().as_bytes(), &[arena.fd()])
    }

    /// Kills the worker's whole process group (the worker and what its bodies started) before
    /// reaping it, so the group's id cannot have been reused, and reaps it.
    pub(crate) fn kill(&mut self) {
        if self.reaped {
            return;
        }
        self.kill_group();
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.reaped = true;
    }

    fn kill_group(&self) {
        // SAFETY: killpg takes plain integers; the worker leads its own group (process_group(0)
        // at spawn) and is not reaped yet, so the id still names that group.
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
        let _ = self.child.kill();
        let status = self.child.wait();
        self.reaped = true;
        match status {
            Ok(status) if exited => describe_exit(status),
            _ => "closed its connection and was killed".to_owned(),
        }
    }
}

/// Bytes of the result arena a reply's values use.
fn result_bytes(header: &serde_json::Value) -> usize {
    let in_result = |b: &serde_json::Value| {
        if b[0] == 1 {
            b[2].as_u64().unwrap_or(0) as usize
        } else {
            0
        }
    };
    let listed = |k: &str| -> usize {
        header[k]
            .as_array()
            .into_iter()
            .flatten()
            .map(in_result)
            .sum()
    };
    listed("bufs") + listed("outs") + in_result(&header["arr"])
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
