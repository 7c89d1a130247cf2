//! One worker process: started with the program's interpreter, fed over a socket pair, its
//! arenas, one call at a time, killed on a time limit, and always reaped.

use std::collections::HashSet;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use memmap2::MmapRaw;

use super::arena::Arena;
use super::wire::{self, RecvError};
use super::Launch;

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

/// Why a worker could not start.
#[derive(Debug)]
pub(crate) enum StartError {
    /// NumPy cannot be imported there: the exception, as `Type: message`.
    NoNumpy(String),
    /// Anything else, said in full.
    Failed(String),
}

/// Why a call got no reply.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Past the deadline; the worker was killed.
    TimedOut,
    /// The worker died: how (`exited with status 3`, `was killed by signal 11 (SIGSEGV)`).
    Lost(String),
}

/// A worker's reply: its header, its pickle, and the arenas its buffers are in (kept mapped for
/// as long as the reply, or a view of it, lives).
pub(crate) struct Reply {
    pub header: serde_json::Value,
    pub payload: Vec<u8>,
    pub input: Arc<MmapRaw>,
    pub result: Option<Arc<MmapRaw>>,
}

/// One request: the call's JSON, the inputs to write first, and the input arena's size needed.
pub(crate) struct Request<'a> {
    pub call: Vec<u8>,
    pub inputs: Vec<(usize, &'a [u8])>,
    pub arena_len: usize,
    /// The module's key and the message that loads it, sent if this worker has not loaded it.
    pub load: Option<(String, Vec<u8>)>,
    pub deadline: Option<Instant>,
}

pub(crate) struct Worker {
    pub id: u64,
    pub pid: u32,
    child: Child,
    sock: UnixStream,
    input: Option<Arena>,
    result: Option<Arena>,
    loaded: HashSet<String>,
}

impl Worker {
    /// Starts worker `id` and waits until it is ready (its interpreter and NumPy imported).
    pub(crate) fn start(id: u64, launch: &Launch) -> Result<Worker, StartError> {
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
        let mut worker = Worker {
            id,
            pid: child.id(),
            child,
            sock,
            input: None,
            result: None,
            loaded: HashSet::new(),
        };
        let init = serde_json::json!({
            "sys_path": launch.sys_path,
            "importer": launch.importer,
            "version": launch.version,
        });
        let deadline = Some(Instant::now() + START_TIMEOUT);
        let sent = wire::send(&worker.sock, WORKER_PY.as_bytes(), &[])
            .and_then(|()| wire::send(&worker.sock, init.to_string().as_bytes(), &[]));
        let reply = match sent {
            Ok(()) => wire::recv(&worker.sock, deadline),
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
        match self.exchange(req) {
            Ok(reply) => Ok(reply),
            Err(RecvError::TimedOut) => {
                self.kill();
                Err(Failure::TimedOut)
            }
            Err(RecvError::Closed) => Err(Failure::Lost(self.reap())),
            Err(RecvError::Io(e)) => Err(Failure::Lost(format!("{} ({e})", self.reap()))),
        }
    }

    fn exchange(&mut self, req: Request<'_>) -> Result<Reply, RecvError> {
        let io = RecvError::Io;
        if self.input.as_ref().is_none_or(|a| a.len() < req.arena_len) {
            let arena = Arena::with_room_for(req.arena_len).map_err(io)?;
            self.send_arena(0, &arena).map_err(io)?;
            self.input = Some(arena);
        }
        let input = self.input.as_ref().expect("made above");
        for (offset, bytes) in &req.inputs {
            // SAFETY: the worker is between calls (it reads the arena only while running one,
            // and that call's reply came before this request).
            unsafe { input.write(*offset, bytes) };
        }
        if let Some((key, load)) = &req.load {
            if !self.loaded.contains(key) {
                wire::send(&self.sock, load, &[]).map_err(io)?;
                self.loaded.insert(key.clone());
            }
        }
        wire::send(&self.sock, &req.call, &[]).map_err(io)?;
        loop {
            let frame = wire::recv(&self.sock, req.deadline)?;
            let (header, payload) = wire::split_reply(frame).map_err(io)?;
            if header["s"] == "need" {
                let need = header["need"].as_u64().unwrap_or(0) as usize;
                let arena = Arena::with_room_for(need).map_err(io)?;
                self.send_arena(1, &arena).map_err(io)?;
                self.result = Some(arena);
                continue;
            }
            let input = Arc::clone(self.input.as_ref().expect("made above").map());
            if header["retained"] == true {
                // The body kept a view of this arena: the next call gets a fresh one, and this
                // one lives on in the worker for as long as what it kept.
                self.input = None;
            }
            return Ok(Reply {
                header,
                payload,
                input,
                result: self.result.as_ref().map(|a| Arc::clone(a.map())),
            });
        }
    }

    /// Sends a plain request and waits for its reply header (a `ping`).
    pub(crate) fn ask(
        &mut self,
        load: Option<(String, Vec<u8>)>,
        request: &[u8],
        deadline: Option<Instant>,
    ) -> Result<serde_json::Value, Failure> {
        let run = |w: &mut Worker| -> Result<serde_json::Value, RecvError> {
            if let Some((key, load)) = &load {
                if !w.loaded.contains(key) {
                    wire::send(&w.sock, load, &[]).map_err(RecvError::Io)?;
                    w.loaded.insert(key.clone());
                }
            }
            wire::send(&w.sock, request, &[]).map_err(RecvError::Io)?;
            let frame = wire::recv(&w.sock, deadline)?;
            Ok(wire::split_reply(frame).map_err(RecvError::Io)?.0)
        };
        match run(self) {
            Ok(h) => Ok(h),
            Err(RecvError::TimedOut) => {
                self.kill();
                Err(Failure::TimedOut)
            }
            Err(_) => Err(Failure::Lost(self.reap())),
        }
    }

    fn send_arena(&self, which: u8, arena: &Arena) -> std::io::Result<()> {
        let msg = serde_json::json!({"op": "arena", "which": which, "size": arena.len()});
        wire::send(&self.sock, msg.to_string().as_bytes(), &[arena.fd()])
    }

    /// Kills the process and reaps it.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for a process that is ending (its socket closed) and says how it ended.
    fn reap(&mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return describe_exit(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(2))
                }
                _ => {
                    self.kill();
                    return "closed its connection".to_owned();
                }
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // A worker reads end-of-file when its socket closes and exits; one that does not (a body
        // still running) is killed. Either way it is reaped: no zombie is left.
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        if !matches!(self.child.try_wait(), Ok(Some(_))) {
            self.reap();
        }
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
