//! Workers that fail or are ended: crashes, hangs and kills that fail only their call, time
//! limits, workers lost, out of step or replaced, processes a body starts, panics, and how a
//! program ends with its workers (killed, exiting abruptly, its last pool dropped).
//!
//! A test whose doc begins "Finding N" is a case of the second audit's finding N
//! (`../shared/reviews/adversarial-findings-2.md`).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pyop::candle::{DType, Device, Tensor};
use pyop::{Arg, CallOptions, ErrorKind, OutSpec, PyOp, WorkerPool};

mod common;
use common::cpu;
use common::workers::{arena_mappings, family, pid_file, serial, stat_fields, worker_op};

// --- crashes, hangs, kills: only the call fails, nothing is left ---

fn alive(pid: u32) -> bool {
    // A reaped process has no /proc entry; a zombie's state is Z.
    stat_fields(pid).is_some_and(|f| f.first().is_some_and(|state| state != "Z"))
}

/// Waits (up to 5 s) until the kernel reports the worker `pid` as exited to whoever waits for
/// it (this process, or the zygote that forked it), without reaping it (the pool does): its
/// pidfd turns readable. Its `/proc` state says `Z` as soon as its main thread has exited, while
/// its other threads (NumPy's BLAS pool) may still be exiting; the pool, like any parent, sees
/// the death only once they all have.
fn wait_until_exited(pid: u32) {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor (or -1).
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) } as i32;
    assert!(
        fd >= 0,
        "pidfd_open({pid}): {}",
        std::io::Error::last_os_error()
    );
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd; the descriptor is ours and closed below.
    let ready = unsafe { libc::poll(&mut pfd, 1, 5000) };
    // SAFETY: closing the descriptor opened above.
    unsafe { libc::close(fd) };
    assert_eq!(ready, 1, "worker {pid} did not exit");
}

fn exists(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether `pid` leaves the process table within 5 s: a killed worker the zygote forked is
/// reaped by it moments later, off the caller's thread (`exists` at once for the program's own
/// children).
fn reaped_soon(pid: u32) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while exists(pid) {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// The program's shared-memory arenas: mappings and open descriptors.
fn arenas_here() -> usize {
    let mapped = arena_mappings().len();
    let fds = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|p| p.to_string_lossy().contains("pyop-worker-arena"))
        .count();
    mapped + fds
}

fn dev_shm() -> usize {
    std::fs::read_dir("/dev/shm")
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn crashes_exits_and_hangs_fail_only_their_call() {
    let _s = serial();
    let shm_before = dev_shm();
    let arenas_before = arenas_here();
    let pool = WorkerPool::new(1);
    let op = worker_op(
        &pool,
        "fragile",
        "import ctypes, os, time\n\
         def f(x, how):\n    \
         if how == 'segfault':\n        ctypes.string_at(0)\n    \
         if how == 'exit':\n        os._exit(3)\n    \
         if how == 'sleep':\n        time.sleep(30)\n    \
         if how == 'numpy':\n        np.linalg.svd(np.ones((3000, 3000)))\n    \
         if how == 'spin':\n        while True: pass\n    \
         return x + 1",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let call = |how: &str, limit: Option<u64>| {
        let mut options = CallOptions::new();
        if let Some(ms) = limit {
            options = options.timeout(Duration::from_millis(ms));
        }
        op.call_with(&[Arg::from(&x), Arg::Str(how)], &options)
    };
    let mut pids = Vec::new();
    for (i, (how, limit, kind, says)) in [
        (
            "segfault",
            None,
            ErrorKind::WorkerLost,
            "was killed by signal 11 (SIGSEGV)",
        ),
        ("exit", None, ErrorKind::WorkerLost, "exited with status 3"),
        (
            "sleep",
            Some(300),
            ErrorKind::Timeout,
            "ran past its time limit of 300ms",
        ),
        ("numpy", Some(300), ErrorKind::Timeout, "was killed"),
        ("spin", Some(300), ErrorKind::Timeout, "was killed"),
    ]
    .into_iter()
    .enumerate()
    {
        // The worker that will run this call.
        assert_eq!(call("ok", None).unwrap()[0].to_vec1::<f32>().unwrap(), [2.]);
        pids.extend(pool.idle_pids());
        let started = Instant::now();
        let err = call(how, limit).unwrap_err();
        assert_eq!(err.kind(), kind, "{how}: {err}");
        assert_eq!(err.op(), Some("fragile"));
        assert!(err.to_string().contains(says), "{how}: {err}");
        // Workers are numbered from 1 in the order they start: each failure names a new one
        // (mutation testing of `worker/mod.rs`, `reserve`: the ids went unchecked).
        assert!(
            err.to_string().contains(&format!("worker {} (pid ", i + 1)),
            "{how}: {err}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{how} took {:?}",
            started.elapsed()
        );
        // The next call succeeds, in a new worker.
        assert_eq!(call("ok", None).unwrap()[0].to_vec1::<f32>().unwrap(), [2.]);
    }
    let stats = pool.stats();
    assert_eq!((stats.lost, stats.timed_out), (2, 3), "{stats:?}");
    assert_eq!(stats.started, 6, "{stats:?}");
    pids.extend(pool.idle_pids());
    // Dead workers were reaped (no zombies), and ending the pool ends the last one.
    drop(op);
    drop(pool);
    for pid in &pids {
        assert!(
            reaped_soon(*pid),
            "worker {pid} is still in the process table"
        );
    }
    assert_eq!(
        arenas_here(),
        arenas_before,
        "shared memory left mapped or open"
    );
    assert_eq!(dev_shm(), shm_before, "something was left in /dev/shm");
}

#[test]
fn dropping_the_pool_ends_its_workers_and_frees_shared_memory() {
    let _s = serial();
    let arenas_before = arenas_here();
    let pool = WorkerPool::new(2);
    let op = worker_op(
        &pool,
        "two",
        "def f(x): return x * 2",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32, 2.], &cpu()).unwrap();
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                for _ in 0..20 {
                    op.call(&[Arg::from(&x)]).unwrap();
                }
            });
        }
    });
    let pids = pool.idle_pids();
    assert!(!pids.is_empty());
    assert!(pids.iter().all(|p| alive(*p)));
    assert!(arenas_here() > arenas_before);
    drop(op);
    // The op held the pool too: the workers end with the last holder.
    assert!(pids.iter().all(|p| alive(*p)));
    drop(pool);
    assert!(pids.iter().all(|p| reaped_soon(*p)), "{pids:?}");
    assert_eq!(arenas_here(), arenas_before);
}

/// The program's descriptors (what each names) and child processes now.
fn descriptors_and_children() -> (Vec<String>, Vec<String>) {
    let mut fds: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let to = std::fs::read_link(e.path()).ok()?;
            let name = e.file_name().to_string_lossy().into_owned();
            // A pidfd says which process it names.
            let pid = std::fs::read_to_string(format!("/proc/self/fdinfo/{name}"))
                .unwrap_or_default()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("Pid:")
                        .map(|p| format!(" (pid {})", p.trim()))
                })
                .unwrap_or_default();
            Some(format!("{name} -> {}{pid}", to.display()))
        })
        .collect();
    fds.sort();
    let mut children: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flat_map(|t| {
            let path = t.unwrap().path().join("children");
            let text = std::fs::read_to_string(path).unwrap_or_default();
            text.split_whitespace()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    children.sort();
    (fds, children)
}

/// Run by `nothing_stays_after_the_last_pool_is_dropped`, in a process of its own (the other
/// tests' pools would keep the zygote).
#[test]
#[ignore = "a child process of nothing_stays_after_the_last_pool_is_dropped"]
fn last_pool_child() {
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    // The interpreter and the watchdog first: they stay with the program.
    let local = common::numpy_op(
        "local",
        "def f(x):\n    return x",
        &[OutSpec::new(DType::F32)],
    )
    .unwrap();
    local
        .call_with(
            &[Arg::from(&x)],
            &CallOptions::new().timeout(Duration::from_secs(5)),
        )
        .unwrap();
    let before = descriptors_and_children();
    for round in 0..3 {
        let (a, b) = (WorkerPool::new(2), WorkerPool::new(1));
        let zygote = family(&a)[1];
        assert_eq!(family(&b)[1], zygote, "one zygote for both pools");
        assert_ne!(zygote, i64::from(std::process::id()), "forked by a zygote");
        // Storms of time-limit kills in both pools, the last right before the last pool goes
        // (its workers' reaps still queued when the next round starts a new zygote: a reap for
        // a worker of the old one must not reach the new one).
        let slow = "import time\ndef f(x):\n    time.sleep(10)\n    return x";
        let storm = |op: &PyOp| {
            for _ in 0..3 {
                let err = op
                    .call_with(
                        &[Arg::from(&x)],
                        &CallOptions::new().timeout(Duration::from_millis(50)),
                    )
                    .unwrap_err();
                assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
            }
        };
        let slow_a = worker_op(&a, "slow_a", slow, &[OutSpec::new(DType::F32)]);
        storm(&slow_a);
        family(&a);
        drop(slow_a);
        drop(a);
        // One pool left: the zygote stays for it.
        assert!(
            descriptors_and_children().1.contains(&zygote.to_string()),
            "round {round}: the zygote ended with a pool still alive"
        );
        family(&b);
        let slow_b = worker_op(&b, "slow_b", slow, &[OutSpec::new(DType::F32)]);
        storm(&slow_b);
        drop(slow_b);
        drop(b);
        assert_eq!(
            descriptors_and_children(),
            before,
            "round {round}: descriptors and child processes after the last pool was dropped"
        );
        // The zygote's process is gone (killed and reaped), not a zombie.
        assert!(!std::path::Path::new(&format!("/proc/{zygote}")).exists());
    }
    println!("child: ok");
}

/// When the last worker pool is dropped, its workers and the zygote end: the program has the
/// descriptors and child processes it had before it made a pool (also after time-limit kills),
/// and a pool made later starts a zygote again.
#[test]
fn nothing_stays_after_the_last_pool_is_dropped() {
    let (passed, text) = common::child_test(module_path!(), "last_pool_child", &[]);
    assert!(passed && text.contains("child: ok"), "{text}");
}

/// A body that closes every descriptor of its worker (its connection among them) and lives on.
const HANGS_UP: &str =
    "import os, time\ndef f(x):\n    os.closerange(3, 65536)\n    time.sleep(30)";

/// Run by `a_dead_zygote_fails_no_call`: the zygote is killed from outside while a worker it
/// forked runs a call.
#[test]
#[ignore = "a child process of a_dead_zygote_fails_no_call"]
fn dead_zygote_child() {
    let (a, b, c) = (WorkerPool::new(1), WorkerPool::new(1), WorkerPool::new(1));
    let zygote = family(&a)[1];
    assert_eq!(family(&c)[1], zygote);
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    // Worker A's body leaves a process running in A's group.
    let sleeper = worker_op(
        &a,
        "sleeper",
        "import subprocess\nkept = []\ndef f(x):\n    \
         kept.append(subprocess.Popen(['sleep', '1000']))\n    return np.int64(kept[-1].pid)",
        &[OutSpec::new(DType::I64)],
    );
    let sleep_pid = sleeper.call(&[Arg::from(&x)]).unwrap()[0]
        .to_scalar::<i64>()
        .unwrap() as u32;
    let slow = worker_op(
        &b,
        "slow",
        "import time\ndef f(x):\n    time.sleep(1.0)\n    return x + 1",
        &[OutSpec::new(DType::F32)],
    );
    let during = std::thread::scope(|s| {
        let call = s.spawn(|| slow.call(&[Arg::from(&x)]));
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: kill takes plain integers; `zygote` is this test's zygote, alive until now.
        let killed = unsafe { libc::kill(zygote as libc::pid_t, libc::SIGKILL) };
        assert_eq!(killed, 0);
        call.join().unwrap()
    });
    // The call in flight in a worker the zygote forked is not failed by the zygote's end.
    assert_eq!(during.unwrap()[0].to_vec1::<f32>().unwrap(), [2.]);
    // Later workers start as the program's own children.
    assert_eq!(
        family(&WorkerPool::new(1))[1],
        i64::from(std::process::id())
    );
    // A worker of the dead zygote past its time limit is killed through its pidfd (not through
    // its group, whose id may name another group by now), and one that exits is said to have
    // exited, how being unknown (mutation testing of `process.rs`: `signal_forked` emptied, and
    // `reap`'s guard for it, went unnoticed).
    let b_pid = b.idle_pids()[0];
    let spin = worker_op(
        &b,
        "spin",
        "def f(x):\n    while True:\n        pass",
        &[OutSpec::new(DType::F32)],
    );
    let err = spin
        .call_with(
            &[Arg::from(&x)],
            &CallOptions::new().timeout(Duration::from_millis(300)),
        )
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(gone_soon(b_pid), "the timed-out worker {b_pid} lives on");
    let exits = worker_op(
        &a,
        "exits",
        "import os\ndef f(x):\n    os._exit(3)",
        &[OutSpec::new(DType::F32)],
    );
    let err = exits.call(&[Arg::from(&x)]).unwrap_err();
    assert!(
        err.to_string()
            .contains("had exited (how is unknown: its zygote is gone)"),
        "{err}"
    );
    // One that closes its connection and lives on is killed, and said to be.
    let hangs_up = worker_op(&c, "hangs_up", HANGS_UP, &[OutSpec::new(DType::F32)]);
    let err = hangs_up.call(&[Arg::from(&x)]).unwrap_err();
    assert!(
        err.to_string()
            .contains("closed its connection and was killed"),
        "{err}"
    );
    // Ending worker A ends what its body started, with no zygote to keep its group's id.
    a.shutdown();
    assert!(
        gone_soon(sleep_pid),
        "the body's process {sleep_pid} outlived its worker"
    );
    println!("child: ok");
}

/// The zygote is one process: killed from outside, it fails no call in the workers it forked
/// (they do not die with it), later workers start directly, and a worker's group still ends
/// with it.
#[test]
fn a_dead_zygote_fails_no_call() {
    let (passed, text) = common::child_test(module_path!(), "dead_zygote_child", &[]);
    assert!(passed && text.contains("child: ok"), "{text}");
}

/// A worker that closes its connection but lives on (a body that closed every descriptor) fails
/// its call, is killed, and is said to be so, not to have crashed (mutation testing of
/// `process.rs`: `reap`'s `exited` guards forced went unnoticed).
#[test]
fn a_worker_that_closes_its_connection_is_killed_and_said_to_be() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let op = worker_op(&pool, "hangs_up", HANGS_UP, &[OutSpec::new(DType::F32)]);
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let started = Instant::now();
    let err = op.call(&[Arg::from(&x)]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::WorkerLost, "{err}");
    assert!(
        err.to_string()
            .contains("closed its connection and was killed"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// A failure of the worker's own machinery (here, a body that breaks it: the check that runs
/// after every call replaced by one that raises) is said to the program, which fails that call
/// and does not reuse the worker (mutation testing of `op/worker_call/mod.rs`: the worker kept
/// went unnoticed).
#[test]
fn a_worker_whose_own_machinery_fails_is_not_reused() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let op = worker_op(
        &pool,
        "saboteur",
        "import os, sys\ndef f(x, how):\n    if how == 'break':\n        \
         def boom(self):\n            raise RuntimeError('the machinery broke')\n        \
         sys._getframe(1).f_globals['_Views'].retained = boom\n    \
         return np.array([os.getpid()], np.int64)",
        &[OutSpec::new(DType::I64)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let pid = |how: &str| {
        op.call(&[Arg::from(&x), Arg::Str(how)])
            .map(|o| o[0].to_vec1::<i64>().unwrap()[0])
    };
    let first = pid("ok").unwrap();
    let err = pid("break").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::WorkerLost, "{err}");
    assert!(
        err.to_string().contains(
            "worker 1 failed in its own code (RuntimeError: the machinery broke) and exited; \
             the next call starts a new worker"
        ),
        "{err}"
    );
    let s = pool.stats();
    assert_eq!((s.running, s.lost), (0, 1), "{s:?}");
    assert_ne!(pid("ok").unwrap(), first, "a new worker");
    assert_eq!(pool.stats().started, 2);
}

/// Run by `a_killed_program_leaves_no_workers`: starts two workers, prints their pids, waits to
/// be killed.
#[test]
#[ignore = "a child process of a_killed_program_leaves_no_workers"]
fn killed_program_child() {
    let pool = WorkerPool::new(2);
    let op = worker_op(
        &pool,
        "held",
        "import time\ndef f(x):\n    time.sleep(0.2)\n    return x",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| op.call(&[Arg::from(&x)]).unwrap());
        }
    });
    // One worker busy when the program dies, one idle.
    let idle = pool.idle_pids();
    let busy = std::thread::spawn({
        let op = op.clone();
        move || {
            let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
            let _ = op.call(&[Arg::from(&x)]);
        }
    });
    println!(
        "PIDS {}",
        idle.iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    );
    if std::env::var_os("PYOP_TEST_EXIT").is_some() {
        // The pool is still held (by the op in this frame, and the busy thread): a program that
        // ends abruptly (a panic with `panic = "abort"`, `process::exit`) runs no destructor for
        // it, and its workers end anyway.
        std::thread::sleep(Duration::from_millis(50));
        std::process::exit(101);
    }
    std::thread::sleep(Duration::from_secs(60));
    drop(busy);
}

#[test]
fn a_killed_program_leaves_no_workers() {
    let _s = serial();
    program_ends_with_its_workers(false);
}

#[test]
fn a_program_that_exits_abruptly_leaves_no_workers() {
    let _s = serial();
    program_ends_with_its_workers(true);
}

/// Starts `killed_program_child`, then kills it (SIGKILL) or lets it exit abruptly while a body
/// runs, and checks that its workers are gone.
fn program_ends_with_its_workers(exit_itself: bool) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--ignored",
        "--exact",
        "killed_program_child",
        "--nocapture",
    ])
    .stdout(Stdio::piped());
    if exit_itself {
        cmd.env("PYOP_TEST_EXIT", "1");
    }
    let mut child = cmd.spawn().unwrap();
    let mut pids: Vec<u32> = Vec::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("PIDS ") {
            pids = rest.split(' ').map(|p| p.parse().unwrap()).collect();
            break;
        }
    }
    assert_eq!(pids.len(), 2, "{pids:?}");
    if !exit_itself {
        assert!(pids.iter().all(|p| alive(*p)));
        child.kill().unwrap(); // SIGKILL: no destructor runs
    }
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|p| alive(*p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        pids.iter().all(|p| !alive(*p)),
        "workers outlived their program: {pids:?}"
    );
}

fn read_pid(path: &str) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            if let Ok(pid) = text.trim().parse() {
                return pid;
            }
        }
        assert!(Instant::now() < deadline, "no pid in {path}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn gone_soon(pid: u32) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    !alive(pid)
}

#[test]
fn time_limits_count_from_the_call_not_the_start_or_the_queue() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    // A module that takes 300 ms to import, under a 100 ms limit: the import is not the call's.
    let slow_import = PyOp::builder("slow_import")
        .code("import time\ntime.sleep(0.3)\ndef slow_import(x):\n    return x")
        .numpy()
        .pool(&pool)
        .timeout(Duration::from_millis(100))
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap();
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    slow_import.call(&[Arg::from(&x)]).unwrap();
    // Two calls of 200 ms through one worker under a 300 ms limit: the second waits its turn,
    // which is not its body's time.
    let nap = worker_op(
        &pool,
        "nap",
        "import time\ndef f(x):\n    time.sleep(0.2)\n    return x",
        &[OutSpec::new(DType::F32)],
    );
    let options = CallOptions::new().timeout(Duration::from_millis(300));
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| nap.call_with(&[Arg::from(&x)], &options).unwrap());
        }
    });
    assert_eq!(pool.stats().timed_out, 0, "{:?}", pool.stats());
    assert_eq!(pool.stats().started, 1);
}

#[test]
fn processes_a_body_starts_end_with_its_worker() {
    let _s = serial();
    let tmp = common::TempDir::new("worker-children");
    let pool = WorkerPool::new(1);
    let op = worker_op(
        &pool,
        "spawns",
        "import os, subprocess, time\n\
         def f(x, how, path):\n    \
         if how == 'fork':\n        \
         pid = os.fork()\n        \
         if pid == 0:\n            time.sleep(30)\n            os._exit(0)\n        \
         open(path, 'w').write(str(pid))\n        \
         os._exit(3)\n    \
         p = subprocess.Popen(['sleep', '30'])\n    \
         open(path, 'w').write(str(p.pid))\n    \
         time.sleep(30)",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    // A body that forks and dies: the death is seen at once, though the child lives on with the
    // worker's descriptors, and the child is killed with the worker's process group.
    let path = pid_file(&tmp, "fork");
    let started = Instant::now();
    let err = op
        .call(&[Arg::from(&x), Arg::Str("fork"), Arg::Str(&path)])
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::WorkerLost, "{err}");
    assert!(err.to_string().contains("exited with status 3"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(
        gone_soon(read_pid(&path)),
        "the forked child outlived its worker"
    );
    // A body past its limit that started a subprocess: both are killed.
    let path = pid_file(&tmp, "popen");
    let err = op
        .call_with(
            &[Arg::from(&x), Arg::Str("popen"), Arg::Str(&path)],
            &CallOptions::new().timeout(Duration::from_millis(500)),
        )
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(
        gone_soon(read_pid(&path)),
        "the body's subprocess outlived its worker"
    );
}

#[test]
fn a_worker_out_of_step_is_replaced() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    // The body finds the worker's socket and sends a well-formed reply of its own.
    let op = worker_op(
        &pool,
        "forger",
        "import gc, json, socket\n\
         def f(x, forge):\n    \
         if forge:\n        \
         s = next(o for o in gc.get_objects() if isinstance(o, socket.socket) and o.fileno() >= 0)\n        \
         h = json.dumps({'q': 0, 'm': {'s': 'array', 'place': [0, 0, 4], 'dtype': '<f4', 'shape': [1], 'retained': False}}).encode()\n        \
         body = len(h).to_bytes(4, 'little') + h\n        \
         s.sendall(len(body).to_bytes(4, 'little') + body)\n    \
         return x + 1",
        &[OutSpec::new(DType::F32)],
    );
    let err = op.call(&[Arg::from(&x), Arg::Bool(true)]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::WorkerLost, "{err}");
    assert!(err.to_string().contains("another request"), "{err}");
    for _ in 0..3 {
        let y = op.call(&[Arg::from(&x), Arg::Bool(false)]).unwrap();
        assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2.]);
    }
    // The body writes half a frame and stalls: the limit still holds.
    let stall = worker_op(
        &pool,
        "stall",
        "import gc, socket, time\n\
         def f(x):\n    \
         s = next(o for o in gc.get_objects() if isinstance(o, socket.socket) and o.fileno() >= 0)\n    \
         s.sendall((100).to_bytes(4, 'little') + b'{')\n    \
         time.sleep(30)",
        &[OutSpec::new(DType::F32)],
    );
    let started = Instant::now();
    let err = stall
        .call_with(
            &[Arg::from(&x)],
            &CallOptions::new().timeout(Duration::from_millis(300)),
        )
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn an_idle_worker_killed_from_outside_costs_no_call() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let op = worker_op(
        &pool,
        "idle",
        "def f(x): return x * 3",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    op.call(&[Arg::from(&x)]).unwrap();
    let pid = pool.idle_pids()[0];
    // SAFETY: signalling a process this test started (through the pool).
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    wait_until_exited(pid);
    let y = op.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(y[0].to_vec1::<f32>().unwrap(), [3.]);
    let stats = pool.stats();
    assert_eq!((stats.lost, stats.started), (1, 2), "{stats:?}");
}

#[test]
fn processes_of_a_worker_that_died_idle_end_too() {
    let _s = serial();
    let tmp = common::TempDir::new("worker-idle-child");
    let path = pid_file(&tmp, "sleep");
    let pool = WorkerPool::new(1);
    let op = worker_op(
        &pool,
        "leaves",
        "import subprocess\ndef f(x, path):\n    p = subprocess.Popen(['sleep', '30'])\n    open(path, 'w').write(str(p.pid))\n    return x",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    op.call(&[Arg::from(&x), Arg::Str(&path)]).unwrap();
    let sleeper = read_pid(&path);
    let worker = pool.idle_pids()[0];
    // SAFETY: signalling a process this test started (through the pool).
    unsafe { libc::kill(worker as libc::pid_t, libc::SIGKILL) };
    wait_until_exited(worker);
    // The next call finds the worker dead and replaces it; its subprocess goes with it.
    let other = pid_file(&tmp, "sleep2");
    op.call(&[Arg::from(&x), Arg::Str(&other)]).unwrap();
    assert!(
        gone_soon(sleeper),
        "the dead worker's subprocess outlived it"
    );
    let sleeper2 = read_pid(&other);
    drop(op);
    drop(pool);
    assert!(
        gone_soon(sleeper2),
        "the pool's last worker's subprocess outlived it"
    );
}

/// Finding 1: any `Duration` is a time limit, `Duration::MAX` none, as in the program; no panic
/// escapes and the worker stays in step.
#[test]
fn a_time_limit_of_duration_max_is_no_limit() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let op = PyOp::builder("tmax")
        .code("def f(x):\n    return x + 1")
        .function("f")
        .numpy()
        .pool(&pool)
        .timeout(Duration::MAX)
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap();
    for t in [
        Duration::MAX,
        Duration::from_secs(u64::MAX),
        Duration::from_secs(5),
    ] {
        let y = op
            .call_with(&[Arg::from(&x)], &CallOptions::new().timeout(t))
            .unwrap();
        assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2.]);
    }
    assert_eq!(
        op.call(&[Arg::from(&x)]).unwrap()[0]
            .to_vec1::<f32>()
            .unwrap(),
        [2.]
    );
    assert_eq!((pool.stats().started, pool.stats().lost), (1, 0));
}

/// Finding 1, second half: a lease dropped while unwinding (here, a tracing layer of the
/// program's that panics on entering the worker span) discards its worker instead of putting it
/// back, possibly out of step, for the next caller.
#[test]
fn a_worker_leased_by_a_call_that_panics_is_not_reused() {
    use tracing_subscriber::layer::SubscriberExt;
    struct PanicOnWorkerSpan;
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for PanicOnWorkerSpan {
        fn on_new_span(
            &self,
            attrs: &tracing::span::Attributes<'_>,
            _: &tracing::span::Id,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            if attrs.metadata().name() == "pyop.worker" {
                panic!("a tracing layer panicked");
            }
        }
    }
    let _s = serial();
    let pool = WorkerPool::new(1);
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let op = worker_op(
        &pool,
        "unwound",
        "import os\ndef f(x):\n    return np.array([os.getpid()], np.float32)",
        &[OutSpec::new(DType::F32)],
    );
    let first = op.call(&[Arg::from(&x)]).unwrap()[0]
        .to_vec1::<f32>()
        .unwrap()[0];
    let subscriber = tracing_subscriber::registry().with(PanicOnWorkerSpan);
    let panicked = tracing::subscriber::with_default(subscriber, || {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op.call(&[Arg::from(&x)])))
    });
    assert!(panicked.is_err());
    let stats = pool.stats();
    assert_eq!((stats.running, stats.lost), (0, 1), "{stats:?}");
    let next = op.call(&[Arg::from(&x)]).unwrap()[0]
        .to_vec1::<f32>()
        .unwrap()[0];
    assert_ne!(first, next, "a new worker serves the next call");
}

/// Run by `processes_a_body_started_end_with_the_program`: starts a `sleep` from a worker body,
/// prints its pid, then ends as PYOP_TEST_END says.
#[test]
#[ignore = "a child process of processes_a_body_started_end_with_the_program"]
fn body_process_child() {
    let pool = WorkerPool::new(2);
    let op = worker_op(
        &pool,
        "spawn_sleep",
        "import subprocess, time\n_keep = []\ndef f(x, wait):\n    \
         p = subprocess.Popen(['sleep', '300'])\n    _keep.append(p)\n    \
         print('SLEEP', p.pid, flush=True)\n    time.sleep(wait)\n    \
         return np.array([p.pid], np.int64)",
        &[OutSpec::new(DType::I64)],
    );
    let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
    let end = std::env::var("PYOP_TEST_END").unwrap();
    if end == "inflight" {
        let op = op.clone();
        std::thread::spawn(move || {
            let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
            let _ = op.call(&[Arg::from(&x), Arg::F64(60.0)]);
        });
        std::thread::sleep(Duration::from_millis(1500));
        std::process::exit(0);
    }
    op.call(&[Arg::from(&x), Arg::F64(0.0)]).unwrap();
    match end.as_str() {
        "exit" => std::process::exit(0),
        "panic" => panic!("the program panics"),
        _ => {} // returns: the pool lives in `op`, dropped on return; a static's is not
    }
    std::mem::forget(op);
    std::mem::forget(pool);
}

/// Finding 3: processes a body started end with the program at every normal end (return from
/// main with the pool still alive, `process::exit`, a panic, a call in flight), not only when
/// the pool is dropped.
#[test]
fn processes_a_body_started_end_with_the_program() {
    for end in ["return", "exit", "panic", "inflight"] {
        // Read up to the pid only: the `sleep` holds the child's stdout open as long as it lives.
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "body_process_child", "--nocapture"])
            .env("PYOP_TEST_END", end)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid: u32 = BufReader::new(child.stdout.take().unwrap())
            .lines()
            .map_while(Result::ok)
            .find_map(|l| l.strip_prefix("SLEEP ").map(|p| p.trim().parse().unwrap()))
            .unwrap_or_else(|| panic!("{end}: no SLEEP line"));
        child.wait().unwrap();
        let gone = gone_soon(pid);
        if !gone {
            // SAFETY: kill takes plain integers; the leftover is this test's own `sleep`.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        assert!(
            gone,
            "{end}: the body's `sleep` (pid {pid}) outlived the program"
        );
    }
}

/// A time limit holds while the request is sent: a worker whose GIL a thread of the body's holds
/// (so it reads nothing) cannot keep a call with a request larger than the socket's buffer past
/// its limit (it took 9.9 s for a limit of 300 ms).
#[test]
fn a_time_limit_holds_while_the_request_is_sent() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let op = worker_op(
        &pool,
        "hog",
        "import re, threading, time\n\
         def hog():\n    time.sleep(0.2)\n    re.match(r'(a+)+$', 'a' * 28 + 'b')\n\
         def f(x, hog_next, big):\n    \
         if hog_next: threading.Thread(target=hog, daemon=True).start()\n    \
         return x + 1",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let big = vec![0.5f64; 200_000];
    op.call(&[Arg::from(&x), Arg::Bool(true), Arg::F64s(&[])])
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let err = op
        .call_with(
            &[Arg::from(&x), Arg::Bool(false), Arg::F64s(&big)],
            &CallOptions::new().timeout(Duration::from_millis(300)),
        )
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    let y = op
        .call(&[Arg::from(&x), Arg::Bool(false), Arg::F64s(&[])])
        .unwrap();
    assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2.]);
}
