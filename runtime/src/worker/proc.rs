//! A worker's operating-system process: started with the program's interpreter (its socket as
//! fd 3, the guardian pipe as fd 4, a process group of its own, a parent-death signal from a
//! long-lived spawner thread) or forked by the zygote; killed with its whole group; always
//! reaped; how it ended, in words.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::exchange::{Launch, THREAD_VARS};

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

/// A worker's operating-system process: its id, how it is reaped, its pidfd, and whether it was.
pub(crate) struct Process {
    pub pid: u32,
    proc: Proc,
    /// Readable once the process has exited (Linux 5.3 and later; else `None`).
    pidfd: Option<OwnedFd>,
    /// Whether the process has been waited for (after which its id may name another process).
    reaped: bool,
}

impl Drop for Process {
    fn drop(&mut self) {
        // Killed with the processes its bodies started, and reaped: no zombie, no orphan (also
        // for a worker that already exited: its group may outlive it). A worker holds nothing to
        // save (module state is the body's, as in the program, where nothing runs at exit
        // either). (A `Worker` drops its process before its socket: its first field after ids.)
        self.kill();
    }
}

impl Process {
    /// Starts the program's interpreter on `theirs` (fd 3), the guardian pipe's read end as fd
    /// 4, in a process group of its own, with `env` set, from the spawner thread.
    pub(crate) fn spawn(
        launch: &Launch,
        theirs: UnixStream,
        env: &[(&str, String)],
    ) -> std::io::Result<Process> {
        let guard = guardian_pipe()?;
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
        let child = spawn_from_spawner(cmd)?;
        drop(theirs);
        let pid = child.id();
        let pidfd = pidfd_of(pid);
        Ok(Process {
            pid,
            proc: Proc::Child(child),
            pidfd,
            reaped: false,
        })
    }

    /// A process the zygote forked, which it reaps when asked.
    pub(crate) fn forked(pid: u32, pidfd: OwnedFd, reaper: Reaper) -> Process {
        Process {
            pid,
            proc: Proc::Forked(reaper),
            pidfd: Some(pidfd),
            reaped: false,
        }
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

    /// The pidfd, readable once the process has exited (Linux 5.3 and later; else `None`).
    pub(crate) fn pidfd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.pidfd.as_ref().map(|fd| fd.as_fd())
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

    /// Says how a worker that closed its end ended (the caller saw its socket close), after killing what is left of its group and
    /// reaping it.
    pub(crate) fn reap(&mut self) -> String {
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
