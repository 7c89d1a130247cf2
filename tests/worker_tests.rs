//! Numpy-mode ops in worker processes: the same tables as in the program, crashes, hangs and
//! kills that fail only their call, nothing left behind, gradients, `out`, many threads.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use pyop::candle::{DType, Device, Tensor, Var};
use pyop::{py_op, Arg, CallOptions, ErrorKind, OutSpec, PyOp, WorkerPool};

mod common;
use common::{cpu, tables, within};

/// The tests of this file run one at a time: some count the program's shared-memory mappings and
/// descriptors, which another test's pool would change.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// One pool of two workers for the table tests: every op gets its own module in it.
fn table_pool() -> &'static WorkerPool {
    static POOL: OnceLock<WorkerPool> = OnceLock::new();
    POOL.get_or_init(|| WorkerPool::new(2))
}

fn worker_op(pool: &WorkerPool, name: &str, code: &str, tout: &[OutSpec]) -> PyOp {
    PyOp::builder(name)
        .code(format!("import numpy as np\n{code}"))
        .function("f")
        .numpy()
        .pool(pool)
        .tout(tout.iter().cloned())
        .build()
        .unwrap()
}

/// The op `worker_op` builds, run in the program instead: the same body to compare against.
fn program_op(name: &str, code: &str, tout: &[OutSpec]) -> PyOp {
    PyOp::builder(name)
        .code(format!("import numpy as np\n{code}"))
        .function("f")
        .numpy()
        .tout(tout.iter().cloned())
        .build()
        .unwrap()
}

fn in_workers(code: &str, tout: &[OutSpec]) -> PyOp {
    worker_op(table_pool(), "rule", code, tout)
}

// --- the same tables as in the program ---

#[test]
fn outputs_follow_one_rule_table_in_workers() {
    let _s = serial();
    tables::outputs_follow_one_rule_table(&in_workers);
}

#[test]
fn wrong_outputs_are_errors_naming_op_and_index_in_workers() {
    let _s = serial();
    tables::wrong_outputs_are_errors_naming_op_and_index(&in_workers);
    // A value of a class the body defines arrives as a stand-in of the same name, refused as the
    // program would refuse the object itself.
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let err = in_workers(
        "class Box:\n    pass\ndef f(x): return Box()",
        &[OutSpec::new(DType::F32)],
    )
    .call(&[Arg::from(&x)])
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutputMismatch);
    assert!(
        err.to_string().contains("got a value of type `Box`"),
        "{err}"
    );
    let err = in_workers("def f(x): return lambda: 1", &[OutSpec::new(DType::F32)])
        .call(&[Arg::from(&x)])
        .unwrap_err();
    assert!(
        err.to_string().contains("got a value of type `function`"),
        "{err}"
    );
}

/// A body returning objects of generated classes (a new class name each call) is refused each
/// call as the program would refuse it, and does not grow the program: the stand-in classes made
/// for those names are bounded (third audit, finding 10: one class kept per name for ever).
#[test]
fn stand_ins_of_generated_classes_are_not_kept_without_bound() {
    let _s = serial();
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let op = in_workers(
        "import itertools, os\n_n = itertools.count()\n\
         def f(x): return type('StandinGen%d_%d' % (os.getpid(), next(_n)), (), {})()",
        &[OutSpec::new(DType::F32)],
    );
    for _ in 0..1000 {
        let err = op.call(&[Arg::from(&x)]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutputMismatch, "{err}");
        assert!(
            err.to_string().contains("got a value of type `StandinGen"),
            "{err}"
        );
    }
    // The program's classes of those names still alive after a collection.
    let live = program_op(
        "live",
        "import gc\ndef f(x):\n    gc.collect()\n    \
         return np.array([sum(1 for o in gc.get_objects() if isinstance(o, type) \
         and o.__qualname__.startswith('StandinGen'))], dtype=np.int64)",
        &[OutSpec::new(DType::I64)],
    )
    .call(&[Arg::from(&x)])
    .unwrap()[0]
        .to_vec1::<i64>()
        .unwrap()[0];
    assert!((1..=256).contains(&live), "{live} stand-in classes alive");
}
/// An ml_dtypes array from a worker (a worker op is in numpy mode, whose outputs are NumPy's
/// dtypes) is refused by name, as ml_dtypes' type, not read as plain bytes of a void dtype; the
/// program imports nothing for it.
#[test]
fn ml_dtypes_arrays_from_a_worker_are_refused_by_name() {
    let _s = serial();
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    for (made, name) in [
        (
            "np.array([1.5, 2.25], dtype=ml_dtypes.bfloat16)",
            "bfloat16",
        ),
        (
            "np.array([1.5, 2.25], dtype=ml_dtypes.bfloat16)[::-1]",
            "bfloat16",
        ),
        ("ml_dtypes.float8_e4m3fn(1.5)", "float8_e4m3fn"),
    ] {
        let err = in_workers(
            &format!("import ml_dtypes\ndef f(x): return {made}"),
            &[OutSpec::new(DType::F32)],
        )
        .call(&[Arg::from(&x)])
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutputMismatch, "{err}");
        assert!(
            err.to_string().contains(&format!(
                "a pyop worker sent values of ml_dtypes' {name}, which a worker op cannot return"
            )),
            "{err}"
        );
    }
}

#[test]
fn python_exceptions_keep_kind_message_and_traceback_in_workers() {
    let _s = serial();
    tables::python_exceptions_keep_kind_message_and_traceback(&in_workers);
    // A class of the body's own keeps its name and the kind of its builtin base.
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let err = in_workers(
        "class Bad(ValueError):\n    pass\ndef f(x):\n    raise Bad('no')",
        &[OutSpec::new(DType::F32)],
    )
    .call(&[Arg::from(&x)])
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert!(err.to_string().contains("Bad: no"), "{err}");
    // A missing package names the environment and the fix, as in the program.
    let err = in_workers(
        "def f(x):\n    import no_such_package_xyz\n    return x",
        &[OutSpec::new(DType::F32)],
    )
    .call(&[Arg::from(&x)])
    .unwrap_err();
    assert!(err.to_string().contains("ModuleNotFoundError"), "{err}");
    assert!(
        err.to_string().contains("pip install no_such_package_xyz"),
        "{err}"
    );
}

#[test]
fn every_argument_kind_reaches_the_worker() {
    let _s = serial();
    let op = worker_op(
        table_pool(),
        "kinds",
        "def f(x, ts, a, b, c, s, fs, n, none, big, nan):\n    \
         assert x.flags.writeable is False\n    \
         assert isinstance(ts, list) and len(ts) == 2\n    \
         assert (a, b, c, s) == (2.5, -3, True, 'hé') and type(a) is float and type(b) is int\n    \
         assert fs == [0.5, 1.0] and type(fs[1]) is float and n == [1, 2]\n    \
         assert none is None and big == 2**64 - 1 and nan != nan\n    \
         return x.sum() + ts[0].sum() + ts[1].sum()",
        &[OutSpec::new(DType::F64)],
    );
    let x = Tensor::new(&[[1f64, 2.], [3., 4.]], &cpu()).unwrap();
    // A non-contiguous view and an empty tensor arrive with correct values.
    let t = x.t().unwrap();
    let empty = Tensor::zeros(0, DType::F64, &cpu()).unwrap();
    let ts = [t.clone(), empty];
    let y = op
        .call(&[
            Arg::from(&x),
            Arg::from(&ts[..]),
            Arg::from(2.5),
            Arg::from(-3i64),
            Arg::Bool(true),
            Arg::Str("hé"),
            Arg::F64s(&[0.5, 1.0]),
            Arg::I64s(&[1, 2]),
            Arg::None,
            Arg::from(u64::MAX),
            Arg::from(f64::NAN),
        ])
        .unwrap();
    assert_eq!(y[0].to_scalar::<f64>().unwrap(), 20.0);
}

#[test]
fn an_input_returned_as_is_comes_back_exactly() {
    let _s = serial();
    let op = worker_op(
        table_pool(),
        "ident",
        "def f(x): return x",
        &[OutSpec::new(DType::F32)],
    );
    for n in [1usize, 1000, 1 << 20] {
        let x = Tensor::arange(0u32, n as u32, &cpu())
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let y = op.call(&[Arg::from(&x)]).unwrap();
        assert_eq!(y[0].to_vec1::<f32>().unwrap(), x.to_vec1::<f32>().unwrap());
    }
}

/// The program's mappings of worker arenas: (inode, size in bytes) of each.
fn arena_maps() -> Vec<(u64, usize)> {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("pyop-worker-arena"))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (a, b) = f[0].split_once('-').unwrap();
            let size =
                usize::from_str_radix(b, 16).unwrap() - usize::from_str_radix(a, 16).unwrap();
            (f[4].parse().unwrap(), size)
        })
        .collect()
}

/// A worker returns an input where it lies: the reply names the place in the input arena, and
/// nothing is copied into a result arena (so the input arena is not held as retained either, and
/// is reused by the next call).
#[test]
fn a_returned_input_is_named_where_it_lies_not_copied() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let op = |name: &str, code: &str| {
        PyOp::builder(name)
            .code(code)
            .function("f")
            .numpy()
            .pool(&pool)
            .tout([OutSpec::new(DType::F32)])
            .build()
            .unwrap()
    };
    let fresh = op(
        "fresh",
        "import numpy as np\ndef f(x):\n    return np.zeros(1, np.float32)",
    );
    let ident = op("ident_in_place", "def f(x):\n    return x");
    let x = Tensor::ones(4 << 20, DType::F32, &cpu()).unwrap(); // 16 MiB
    fresh.call(&[Arg::from(&x)]).unwrap();
    let big = |maps: &[(u64, usize)]| {
        maps.iter()
            .filter(|a| a.1 >= 16 << 20)
            .map(|a| a.0)
            .collect::<Vec<_>>()
    };
    let input = big(&arena_maps());
    assert_eq!(
        input.len(),
        1,
        "one 16 MiB arena, the input's: {:?}",
        arena_maps()
    );
    for _ in 0..2 {
        let before = pool.stats();
        let y = ident.call(&[Arg::from(&x)]).unwrap();
        assert_eq!(y[0].dims(), x.dims());
        // The copies, counted: the input in, nothing out.
        let after = pool.stats();
        assert_eq!(after.bytes_in - before.bytes_in, 16 << 20);
        assert_eq!(after.bytes_out, before.bytes_out, "nothing copied out");
        assert_eq!(
            big(&arena_maps()),
            input,
            "the input arena kept and no 16 MiB result arena made: {:?}",
            arena_maps()
        );
    }
}

// --- out, gradients, module state, kept views ---

#[test]
fn out_buffers_in_workers() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let op = PyOp::builder("plus_out")
        .code("import numpy as np\ndef plus_out(x, out):\n    np.add(x, 1, out=out)")
        .numpy()
        .pool(&pool)
        .tout([OutSpec::like(DType::F32, 0)])
        .build()
        .unwrap();
    let x = Tensor::new(&[1f32, 2., 3.], &cpu()).unwrap();
    let y = op.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2., 3., 4.]);
    // Returning something else than None or `out` is the same error as in the program.
    let bad = PyOp::builder("bad_out")
        .code("def bad_out(x, out):\n    return 5")
        .numpy()
        .pool(&pool)
        .tout([OutSpec::like(DType::F32, 0)])
        .build()
        .unwrap();
    let err = bad.call(&[Arg::from(&x)]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutputMismatch);
    assert!(
        err.to_string()
            .contains("returns None (or `out`), got a value of type `int`"),
        "{err}"
    );
}

#[py_op(code = r#"
import numpy as np

def cube(x):
    return x ** 3

def cube_grad(inputs, outputs, grads):
    import os
    (x,), (g,) = inputs, grads
    # The gradient runs in a worker too: record where.
    cube_grad.pid = os.getpid()
    return 3 * x ** 2 * g
"#, numpy, workers = 1, grad = "cube_grad", tout = f64)]
fn cube(x: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn python_gradients_run_in_workers() {
    let _s = serial();
    let x = Var::new(&[1f64, -2., 0.5], &cpu()).unwrap();
    let y = cube(x.as_tensor()).unwrap();
    assert_eq!(y.to_vec1::<f64>().unwrap(), [1., -8., 0.125]);
    let grads = y.sum_all().unwrap().backward().unwrap();
    let g = grads.get(x.as_tensor()).unwrap();
    assert_eq!(g.to_vec1::<f64>().unwrap(), [3., 12., 0.75]);
    // A forward and a gradient call, both in the worker.
    let op = pyop::op!(cube).get().unwrap();
    assert_eq!(op.stats().calls, 2);
    assert!(op.stats().worker_time > Duration::ZERO);
}

#[test]
fn module_state_is_per_worker_and_kept_views_stay_valid() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let op = worker_op(
        &pool,
        "keeper",
        "kept = []\ndef f(x):\n    kept.append(x)\n    return np.array([len(kept), kept[0].sum()], np.float64)",
        &[OutSpec::new(DType::F64)],
    );
    let a = Tensor::new(&[1f64, 2.], &cpu()).unwrap();
    let b = Tensor::new(&[10f64, 20.], &cpu()).unwrap();
    assert_eq!(
        op.call(&[Arg::from(&a)]).unwrap()[0]
            .to_vec1::<f64>()
            .unwrap(),
        [1., 3.]
    );
    // The first call's input, kept by the body, still reads the first call's values.
    assert_eq!(
        op.call(&[Arg::from(&b)]).unwrap()[0]
            .to_vec1::<f64>()
            .unwrap(),
        [2., 3.]
    );
    assert_eq!(
        op.call(&[Arg::from(&b)]).unwrap()[0]
            .to_vec1::<f64>()
            .unwrap(),
        [3., 3.]
    );
}

// --- crashes, hangs, kills: only the call fails, nothing is left ---

/// The fields of `/proc/<pid>/stat` after the command name (state, parent, group, …); `None`
/// once the process is reaped.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit(')').next().unwrap_or("");
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

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

/// The program's shared-memory arena mappings: each one's address range.
fn arena_mappings() -> Vec<(usize, usize)> {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("pyop-worker-arena"))
        .map(|l| {
            let (start, end) = l.split(' ').next().unwrap().split_once('-').unwrap();
            let hex = |h| usize::from_str_radix(h, 16).unwrap();
            (hex(start), hex(end))
        })
        .collect()
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

#[test]
fn eight_threads_through_two_workers_get_exact_results() {
    let _s = serial();
    let pool = WorkerPool::new(2);
    let op = worker_op(
        &pool,
        "affine",
        "def f(x, k):\n    return x * k + np.arange(x.size, dtype=x.dtype)",
        &[OutSpec::new(DType::F64)],
    );
    within(600, "8 threads x 1000 calls", move || {
        std::thread::scope(|s| {
            for t in 0..8u32 {
                let op = &op;
                s.spawn(move || {
                    for i in 0..1000u32 {
                        let v = f64::from(t * 1000 + i);
                        let x = Tensor::new(&[v, v + 0.5, -v], &Device::Cpu).unwrap();
                        let k = f64::from(i % 7);
                        let y = op.call(&[Arg::from(&x), Arg::from(k)]).unwrap();
                        assert_eq!(
                            y[0].to_vec1::<f64>().unwrap(),
                            [v * k, (v + 0.5) * k + 1., -v * k + 2.],
                            "thread {t} call {i}"
                        );
                    }
                });
            }
        });
        let stats = pool.stats();
        assert_eq!(stats.calls, 8000);
        assert!(stats.started <= 2 && stats.lost == 0, "{stats:?}");
        assert_eq!(op.stats().calls, 8000);
    });
}

// --- the CPUs a worker's BLAS threads get ---

/// Run by `workers_share_the_cpus_among_their_blas_threads`: one call in a pool of
/// `PYOP_TEST_POOL` workers; prints each of `WorkerPool::THREAD_VARS` as the worker's environment
/// has it (-1 when unset), then the number of threads the worker runs.
#[test]
#[ignore = "a child process of workers_share_the_cpus_among_their_blas_threads, with the \
            environment that test gives it"]
fn blas_threads_child() {
    let size = std::env::var("PYOP_TEST_POOL").unwrap().parse().unwrap();
    let op = worker_op(
        &WorkerPool::new(size),
        "threads",
        &format!(
            "import os\ndef f(x):\n    vals = [int(os.environ.get(v, -1)) for v in {:?}]\n    \
             return np.array(vals + [len(os.listdir('/proc/self/task'))], dtype=np.int64)",
            WorkerPool::THREAD_VARS
        ),
        &[OutSpec::new(DType::I64)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let got = op.call(&[Arg::from(&x)]).unwrap()[0]
        .to_vec1::<i64>()
        .unwrap();
    let got: Vec<String> = got.iter().map(|v| v.to_string()).collect();
    println!("THREADS {}", got.join(" "));
}

/// `blas_threads_child`'s line, run in a pool of `size` with none of `WorkerPool::THREAD_VARS`
/// set but `env`: each variable's value in the worker, and the threads the worker runs.
fn blas_threads(size: usize, env: &[(&str, &str)]) -> (Vec<i64>, i64) {
    let size = size.to_string();
    let mut vars: Vec<(&str, Option<&std::ffi::OsStr>)> = WorkerPool::THREAD_VARS
        .iter()
        .map(|&var| (var, None))
        .collect();
    vars.push(("PYOP_TEST_POOL", Some(size.as_ref())));
    vars.extend(env.iter().map(|&(k, v)| (k, Some(v.as_ref()))));
    let (passed, text) = common::child_test(module_path!(), "blas_threads_child", &vars);
    assert!(passed, "{text}");
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("THREADS "))
        .unwrap_or_else(|| panic!("no THREADS line:\n{text}"));
    let mut values: Vec<i64> = line.split(' ').map(|v| v.parse().unwrap()).collect();
    let threads = values.pop().unwrap();
    (values, threads)
}

/// A worker's BLAS and OpenMP pools get the program's CPUs shared among the pool's workers, at
/// least one thread each (as joblib's process pools do), so NumPy's OpenBLAS does not start a
/// thread per core in every worker; a setting in the program's own environment is kept.
#[test]
fn workers_share_the_cpus_among_their_blas_threads() {
    let _s = serial();
    let vars = WorkerPool::THREAD_VARS;
    // What NumPy's OpenBLAS reads (its pthreads and OpenMP builds).
    assert!(vars.contains(&"OMP_NUM_THREADS") && vars.contains(&"OPENBLAS_NUM_THREADS"));
    let every = |n: i64| vec![n; vars.len()];
    let cpus = std::thread::available_parallelism().unwrap().get();
    let want = (cpus / 2).max(1) as i64;
    let (values, threads) = blas_threads(2, &[]);
    assert_eq!(
        values,
        every(want),
        "{vars:?} in a pool of 2 on {cpus} CPUs"
    );
    assert!(
        (1..=want).contains(&threads),
        "the worker's main thread and at most {want} - 1 of OpenBLAS: {threads}"
    );
    // More workers than CPUs: one thread each, and OpenBLAS starts none of its own.
    assert_eq!(blas_threads(2 * cpus, &[]), (every(1), 1));
    let (values, threads) = blas_threads(2 * cpus, &[("OPENBLAS_NUM_THREADS", "2")]);
    let kept: Vec<i64> = vars
        .iter()
        .map(|&v| if v == "OPENBLAS_NUM_THREADS" { 2 } else { 1 })
        .collect();
    assert_eq!(values, kept, "the program's own setting is kept");
    assert!((1..=2).contains(&threads), "{threads}");
}

// --- the zygote workers fork from ---

/// The body of the zygote tests: the worker's pid, parent, process group, threads after a
/// matrix product (OpenBLAS's pool then runs), and whether `worker.py` takes itself for the
/// zygote (which never checks for its next request before sleeping).
const FAMILY: &str = "import os, sys\ndef f(x):\n    a = np.ones((256, 256))\n    a @ a\n    \
    return np.array([os.getpid(), os.getppid(), os.getpgid(0), \
    len(os.listdir('/proc/self/task')), sys._getframe(1).f_globals['_is_zygote']], \
    dtype=np.int64)";

fn family(pool: &WorkerPool) -> [i64; 5] {
    let op = worker_op(pool, "family", FAMILY, &[OutSpec::new(DType::I64)]);
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let v = op.call(&[Arg::from(&x)]).unwrap()[0]
        .to_vec1::<i64>()
        .unwrap();
    [v[0], v[1], v[2], v[3], v[4]]
}

fn task_count(pid: i64) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .count()
}

/// Workers of every pool fork from one zygote, a process of its own with a single thread (its
/// BLAS pool never started); each worker leads its own process group and, after the fork, runs
/// as many BLAS threads as its share of the CPUs says (set in it, not inherited from the
/// zygote's one).
#[test]
fn workers_fork_from_one_single_threaded_zygote() {
    let _s = serial();
    let (a, b) = (WorkerPool::new(1), WorkerPool::new(1));
    let (fa, fb) = (family(&a), family(&b));
    assert_ne!(fa[0], fb[0], "two workers");
    assert_eq!(fa[1], fb[1], "one zygote forked both");
    assert_ne!(
        fa[1],
        i64::from(std::process::id()),
        "not this process's children"
    );
    assert_eq!(task_count(fa[1]), 1, "the zygote has one thread");
    assert_eq!((fa[2], fb[2]), (fa[0], fb[0]), "each leads its own group");
    // A forked worker serves as a worker: it checks for its next request after a reply (it
    // slept after every reply while it took itself for the zygote: 54 µs a scalar call, not 23).
    assert_eq!((fa[4], fb[4]), (0, 0), "a worker, not the zygote");
    let cpus = std::thread::available_parallelism().unwrap().get();
    if cpus > 1 {
        assert_eq!(
            fa[3], cpus as i64,
            "a pool of 1: the main thread and cpus - 1 of OpenBLAS's"
        );
    }
    // A worker the pool replaces comes from the same zygote.
    a.shutdown();
    assert_eq!(family(&a)[1], fa[1]);
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

/// Run by `without_the_zygote_workers_are_the_programs_children` with `PYOP_ZYGOTE=0`.
#[test]
#[ignore = "a child process of without_the_zygote_workers_are_the_programs_children"]
fn no_zygote_child() {
    let pool = WorkerPool::new(1);
    let f = family(&pool);
    assert_eq!(f[1], i64::from(std::process::id()));
    assert_eq!(f[2], f[0]);
    // An idle worker of the program's own is seen to live (`waitid` without reaping it), and
    // serves the next call (mutation testing of `process.rs`: `exited` true for a live child
    // went unnoticed: every call started a new worker).
    assert_eq!(family(&pool)[0], f[0], "the same worker");
    assert_eq!(pool.stats().started, 1);
    println!("child: ok");
}

/// `PYOP_ZYGOTE=0` starts every worker as a process of its own, the program's child.
#[test]
fn without_the_zygote_workers_are_the_programs_children() {
    let (passed, text) = common::child_test(
        module_path!(),
        "no_zygote_child",
        &[("PYOP_ZYGOTE", Some("0".as_ref()))],
    );
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

/// Run by `forked_workers_get_the_programs_directory_and_environment_now`.
#[test]
#[ignore = "a child process of forked_workers_get_the_programs_directory_and_environment_now"]
fn late_env_child() {
    family(&WorkerPool::new(1));
    let dir = std::env::temp_dir().canonicalize().unwrap();
    std::env::set_current_dir(&dir).unwrap();
    // SAFETY: this child process runs this one test, and no other thread reads or writes the
    // environment while it is set (the pool's threads wait on their sockets).
    unsafe { std::env::set_var("PYOP_TEST_LATE", "late") };
    let op = worker_op(
        &WorkerPool::new(1),
        "late",
        &format!(
            "import os\ndef f(x):\n    return np.array([os.getcwd() == {:?}, \
             os.environ.get('PYOP_TEST_LATE') == 'late', os.getppid() != {}], dtype=np.int64)",
            dir.to_str().unwrap(),
            std::process::id()
        ),
        &[OutSpec::new(DType::I64)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let got = op.call(&[Arg::from(&x)]).unwrap()[0]
        .to_vec1::<i64>()
        .unwrap();
    assert_eq!(got, [1, 1, 1], "[cwd, environment, forked from the zygote]");
    println!("child: ok");
}

/// A worker forked after the program changed its directory and environment has the new ones,
/// as a worker the program starts itself would.
#[test]
fn forked_workers_get_the_programs_directory_and_environment_now() {
    let (passed, text) = common::child_test(module_path!(), "late_env_child", &[]);
    assert!(passed && text.contains("child: ok"), "{text}");
}

/// Run by `a_forked_worker_that_cannot_set_itself_up_ends_forking`: the program's environment
/// holds an entry that glibc's `putenv` takes and Python cannot (a name with `=` in it), so every
/// worker the zygote forks fails while it copies the program's environment, and exits.
#[test]
#[ignore = "a child process of a_forked_worker_that_cannot_set_itself_up_ends_forking"]
fn unsettable_env_child() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tracing_subscriber::layer::SubscriberExt;
    /// Counts pyop's debug event for a forked worker that did not start.
    struct FailedForks(Arc<AtomicUsize>);
    struct Message(String);
    impl tracing::field::Visit for Message {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.0 = format!("{value:?}");
            }
        }
    }
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for FailedForks {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            let mut m = Message(String::new());
            event.record(&mut m);
            if m.0 == "pyop worker forked by the zygote did not start" {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
    let failed = Arc::new(AtomicUsize::new(0));
    tracing::subscriber::set_global_default(
        tracing_subscriber::registry().with(FailedForks(failed.clone())),
    )
    .unwrap();
    // SAFETY: this child process runs this one test, and no other thread reads or writes the
    // environment yet; glibc keeps the pointer, which is static.
    let put = unsafe { libc::putenv(c"=PYOP_TEST=1".as_ptr().cast_mut()) };
    assert_eq!(put, 0);
    let pool = WorkerPool::new(3);
    let op = worker_op(
        &pool,
        "unforked",
        "def f(x):
    return x + 1",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    assert_eq!(
        op.call(&[Arg::from(&x)]).unwrap()[0]
            .to_vec1::<f32>()
            .unwrap(),
        [2.]
    );
    op.start_workers().unwrap();
    // Every worker started as the program's own child, and the zygote was asked to fork once:
    // after a forked worker failed, it forks no more.
    let pids = pool.idle_pids();
    assert_eq!(pids.len(), 3);
    for pid in pids {
        let parent: u32 = stat_fields(pid).unwrap()[1].parse().unwrap();
        assert_eq!(
            parent,
            std::process::id(),
            "worker {pid} is the program's child"
        );
    }
    assert_eq!(failed.load(Ordering::SeqCst), 1, "forks that failed");
    println!("child: ok");
}

/// A worker the zygote forked that cannot set itself up (here, the program's environment has an
/// entry Python refuses) fails no call: it starts directly instead, and so do all later workers
/// (mutation testing of `worker/zygote.rs`: `stop_spawning` emptied, and its flag ignored, went
/// unnoticed).
#[test]
fn a_forked_worker_that_cannot_set_itself_up_ends_forking() {
    let (passed, text) = common::child_test(module_path!(), "unsettable_env_child", &[]);
    assert!(passed && text.contains("child: ok"), "{text}");
}

/// A worker keeps each op's module between calls, also while it runs other ops' bodies: loading
/// op B, or unloading it once B is dropped, does not unload op A, whose module state goes on
/// (mutation testing of `process.rs`: `ensure_loaded` and `unload` forgetting every other op's
/// module went unnoticed).
#[test]
fn a_workers_modules_stay_loaded_while_it_runs_other_ops() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let counter = |name: &str| {
        worker_op(
            &pool,
            name,
            "n = [0]\ndef f(x):\n    n[0] += 1\n    return np.int64(n[0])",
            &[OutSpec::new(DType::I64)],
        )
    };
    let (a, b) = (counter("count_a"), counter("count_b"));
    // A body whose module fails to load in a worker (the program's build loads it too, and
    // passes), once per worker: the failure is kept and given again.
    let tmp = common::TempDir::new("failed-loads");
    let loads = tmp.path().join("loads");
    let broken = worker_op(
        &pool,
        "broken_load",
        &format!(
            "import os\nif os.getpid() != {}:\n    open({:?}, 'a').write('x')\n    \
             raise ValueError('broken')\ndef f(x):\n    return x",
            std::process::id(),
            loads.to_str().unwrap()
        ),
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    assert!(broken.call(&[Arg::from(&x)]).is_err());
    let next = |op: &PyOp| {
        op.call(&[Arg::from(&x)]).unwrap()[0]
            .to_scalar::<i64>()
            .unwrap()
    };
    let got = [next(&a), next(&a), next(&b), next(&a), next(&b)];
    assert_eq!(got, [1, 2, 1, 3, 2], "each op's count, in one worker");
    // Op B dropped: the worker unloads its module before its next call, and only that module.
    drop(b);
    assert_eq!(next(&a), 4, "op A's module after op B's was unloaded");
    let err = broken.call(&[Arg::from(&x)]).unwrap_err();
    assert!(err.to_string().contains("in a worker: broken"), "{err}");
    assert_eq!(
        std::fs::read_to_string(&loads).unwrap(),
        "x",
        "the failed load ran once"
    );
    assert_eq!(pool.stats().started, 1);
}

/// Bytes of the program's shared-memory arenas that are mapped now.
fn arena_bytes() -> usize {
    arena_mappings()
        .iter()
        .map(|(start, end)| end - start)
        .sum()
}

/// One large call does not pin its memory for the worker's life: after 32 calls in a row that
/// use under a quarter of an arena of 8 MiB or more, the program drops the input arena and gives
/// the worker a small result arena (mutation testing of `process.rs`: `note_use` emptied, or
/// counting the other arena, went unnoticed).
#[test]
fn arenas_shrink_after_a_large_call() {
    let _s = serial();
    let before = arena_bytes();
    let pool = WorkerPool::new(1);
    let op = worker_op(
        &pool,
        "shrink",
        "def f(x):\n    return x + 1",
        &[OutSpec::new(DType::F32)],
    );
    let big = Tensor::zeros(4 << 20, DType::F32, &cpu()).unwrap(); // 16 MiB
    op.call(&[Arg::from(&big)]).unwrap();
    let large = arena_bytes() - before;
    assert!(
        large >= 32 << 20,
        "an input and a result arena of 16 MiB: {large}"
    );
    let small = Tensor::new(&[1f32; 16], &cpu()).unwrap();
    for _ in 0..31 {
        op.call(&[Arg::from(&small)]).unwrap();
    }
    assert_eq!(arena_bytes() - before, large, "kept for 31 small calls");
    // Calls that use more than a quarter of them do not count (and reset the count).
    let half = Tensor::zeros(2 << 20, DType::F32, &cpu()).unwrap(); // 8 MiB
    for _ in 0..33 {
        op.call(&[Arg::from(&half)]).unwrap();
    }
    assert_eq!(
        arena_bytes() - before,
        large,
        "kept for 33 calls of half their size"
    );
    for _ in 0..31 {
        op.call(&[Arg::from(&small)]).unwrap();
    }
    assert_eq!(
        arena_bytes() - before,
        large,
        "kept for 31 small calls again"
    );
    for _ in 0..2 {
        op.call(&[Arg::from(&small)]).unwrap();
    }
    // Two arenas of the smallest size (1 MiB) serve the small calls now.
    let after = arena_bytes() - before;
    assert_eq!(after, 2 << 20, "after 33 small calls");
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

// --- a pool shared by declared ops ---

#[py_op(code = "import os\ndef pid_a(x):\n    return np.int64(os.getpid())\nimport numpy as np", numpy, workers = 1, pool = "shared", tout = i64)]
fn pid_a(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "import os\ndef pid_b(x):\n    return np.int64(os.getpid())\nimport numpy as np", numpy, workers = 1, pool = "shared", tout = i64)]
fn pid_b(x: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn declared_ops_share_a_named_pool() {
    let _s = serial();
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let a = pid_a(&x).unwrap().to_scalar::<i64>().unwrap();
    let b = pid_b(&x).unwrap().to_scalar::<i64>().unwrap();
    // One worker ran both ops (each with its own module).
    assert_eq!(a, b);
    let pool = WorkerPool::find("shared").expect("made by the first op");
    assert_eq!(
        (pool.size(), pool.stats().started, pool.stats().calls),
        (1, 1, 2)
    );
    assert_eq!(pool.idle_pids(), [a as u32]);
}

// --- set-up: validate(), a worker that cannot start ---

#[py_op(code = "import numpy as np\ndef halve(x):\n    return x / 2", numpy, workers = 2, tout = f32)]
fn halve(x: &Tensor) -> pyop::Result<Tensor>;

/// A worker op whose module does not import NumPy: it loads in a program without NumPy, and
/// only its worker finds NumPy missing.
#[py_op(code = "def plain_w(x):\n    return x", numpy, workers = 1, tout = f32)]
fn plain_w(x: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn validate_starts_workers_only_when_asked() {
    let _s = serial();
    pyop::validate().unwrap();
    // validate() checked the body in the program and started no worker.
    let op = pyop::op!(halve).get().unwrap();
    let pool = op.pool().expect("declared with workers = 2");
    assert_eq!(pool.size(), 2);
    assert_eq!(pool.stats().started, 0, "{:?}", pool.stats());
    // Asked to, it has a worker load the body (the typed handle names the op).
    let report = pyop::Validate::ops([pyop::op!(halve)])
        .start_workers()
        .check()
        .unwrap();
    assert_eq!(report.checked, 1);
    assert!(
        pool.stats().started >= 1 && pool.stats().calls >= 1,
        "{:?}",
        pool.stats()
    );
    let x = Tensor::new(&[3f32], &cpu()).unwrap();
    assert_eq!(halve(&x).unwrap().to_vec1::<f32>().unwrap(), [1.5]);
}

/// `start_workers` starts the workers a pool is missing, now, and the counts say who is busy
/// (mutation testing of `worker/mod.rs`: `fill` emptied, its missing count miscomputed, and
/// `busy` as running + idle all went unnoticed).
#[test]
fn start_workers_starts_the_missing_ones_now() {
    let _s = serial();
    let pool = WorkerPool::new(3);
    let op = worker_op(
        &pool,
        "fill",
        "def f(x):\n    return x",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    op.call(&[Arg::from(&x)]).unwrap();
    let s = pool.stats();
    assert_eq!((s.started, s.running, s.busy), (1, 1, 0), "{s:?}");
    // Two are missing: two more start, before any call needs them.
    op.start_workers().unwrap();
    let s = pool.stats();
    assert_eq!((s.started, s.running, s.busy), (3, 3, 0), "{s:?}");
    assert_eq!(pool.idle_pids().len(), 3);
    // None is missing: none starts.
    op.start_workers().unwrap();
    assert_eq!(pool.stats().started, 3);
    // Its Debug is its counters.
    let shown = format!("{pool:?}");
    assert!(
        shown.starts_with(
            "WorkerPool { stats: PoolStats { size: 3, running: 3, busy: 0, started: 3"
        ),
        "{shown}"
    );
}

#[test]
fn ops_that_cannot_run_in_workers_are_refused() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let err = PyOp::builder("t")
        .code("def t(x): return x")
        .pool(&pool)
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert!(
        err.to_string()
            .contains("worker processes run numpy-mode ops only"),
        "{err}"
    );
    use pyop::interop::pyo3::prelude::*;
    let f = Python::attach(|py| py.eval(c"lambda x: x", None, None).unwrap().unbind());
    let err = PyOp::builder("c")
        .callable(f)
        .numpy()
        .workers(1)
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap_err();
    assert!(
        err.to_string().contains("cannot run in a worker process"),
        "{err}"
    );
}

/// Run by `a_worker_that_cannot_start_is_a_clear_error` in a process of its own, with
/// `PYOP_WORKER_PYTHON` set (workers find their interpreter once per process).
#[test]
#[ignore = "a child process of a_worker_that_cannot_start_is_a_clear_error"]
fn worker_start_child() {
    let pool = WorkerPool::new(1);
    // No NumPy import in the program: it may have none either (PYOP_PYTHON_ENV=none).
    let op = PyOp::builder("nostart")
        .code("def nostart(x):\n    return x")
        .numpy()
        .pool(&pool)
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap();
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let err = op.call(&[Arg::from(&x)]).unwrap_err();
    println!("kind: {:?}", err.kind());
    println!("error: {err}");
    // validate() says the same of the declared worker ops (their workers cannot start either).
    if std::env::var_os("PYOP_PYTHON_ENV").is_none() {
        let err = pyop::Validate::all().start_workers().check().unwrap_err();
        println!("validate: {err}");
    } else {
        // No NumPy in the program or its workers: one problem, whichever way an op meets it.
        let report = pyop::Validate::ops([pyop::op!(plain_w), pyop::op!(halve)])
            .start_workers()
            .report()
            .unwrap();
        for p in &report.problems {
            println!("problem: {}", p.to_string().replace('\n', " "));
        }
        println!("validate: {} problem(s)", report.problems.len());
    }
    // The next call meets the same error (nothing is left half-started).
    assert_eq!(op.call(&[Arg::from(&x)]).unwrap_err().kind(), err.kind());
    assert_eq!(pool.stats().running, 0);
}

fn start_child(env: &[(&str, &str)]) -> String {
    let env: Vec<_> = env.iter().map(|(k, v)| (*k, Some(v.as_ref()))).collect();
    let (passed, text) = common::child_test(module_path!(), "worker_start_child", &env);
    assert!(passed, "{text}");
    text
}

#[test]
fn a_worker_that_cannot_start_is_a_clear_error() {
    let _s = serial();
    let text = start_child(&[("PYOP_WORKER_PYTHON", "/nonexistent/python3")]);
    assert!(text.contains("kind: PythonUnavailable"), "{text}");
    assert!(
        text.contains("cannot start a worker: cannot start /nonexistent/python3"),
        "{text}"
    );
    let validate = text
        .lines()
        .skip_while(|l| !l.starts_with("validate:"))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(validate.contains("worker_tests::halve"), "{text}");
    assert!(
        validate.contains("cannot start a worker: cannot start /nonexistent/python3"),
        "{text}"
    );
    let running = pyop::python_env().unwrap().running;
    // Another Python version than the program's.
    let other = ["3.10", "3.11", "3.12", "3.13"]
        .into_iter()
        .filter(|v| !running.version.starts_with(&format!("{v}.")))
        .find_map(|v| which(&format!("python{v}")));
    match other {
        Some(other) => {
            let text = start_child(&[("PYOP_WORKER_PYTHON", other.as_str())]);
            assert!(text.contains("kind: PythonUnavailable"), "{text}");
            assert!(text.contains("but the program embeds Python"), "{text}");
        }
        // A machine with one Python (the README's fresh machine) has no other version to start.
        None => eprintln!("skipped the other-version case: no Python of another version here"),
    }
    // An interpreter that runs as a child of the process started (a wrapper script without
    // `exec`): the program would signal, wait for and watch the wrapper, not the worker, so the
    // worker is refused at its start (mutation testing of `process.rs`: the pid check dropped
    // went unnoticed).
    let python = running.executable.clone().expect("the program's python");
    let tmp = common::TempDir::new("wrapped-python");
    let wrapper = tmp.path().join("python-wrapper");
    std::fs::write(
        &wrapper,
        format!("#!/bin/sh\n'{}' \"$@\"\n", python.display()),
    )
    .unwrap();
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let text = start_child(&[("PYOP_WORKER_PYTHON", wrapper.to_str().unwrap())]);
    assert!(text.contains("kind: PythonUnavailable"), "{text}");
    assert!(
        text.contains(&format!(
            "cannot start a worker: {} said it is pid ",
            wrapper.display()
        )) && text.contains(", but it was started as "),
        "{text}"
    );
    // The program's own interpreter without its environment: no NumPy there. The error names
    // the environment and the command that fixes it.
    let text = start_child(&[("PYOP_PYTHON_ENV", "none")]);
    assert!(text.contains("kind: PackageUnavailable"), "{text}");
    assert!(
        text.contains("a worker cannot import NumPy (ModuleNotFoundError"),
        "{text}"
    );
    assert!(text.contains("PYOP_PYTHON_ENV=none"), "{text}");
    assert!(text.contains("-m pip install numpy"), "{text}");
    assert!(text.contains("validate: 1 problem(s)"), "{text}");
    assert!(
        text.contains("affects 2 ops:       worker_tests::plain_w")
            && text.contains("worker_tests::halve"),
        "{text}"
    );
}

/// `name` on PATH or among pyenv's versions.
fn which(name: &str) -> Option<String> {
    let root = std::env::var("PYENV_ROOT")
        .unwrap_or_else(|_| format!("{}/.pyenv", std::env::var("HOME").unwrap_or_default()));
    let pyenv = std::fs::read_dir(format!("{root}/versions"))
        .into_iter()
        .flatten()
        .filter_map(|e| Some(e.ok()?.path().join("bin").join(name)));
    // pyenv's shims on PATH only say which version has the command: skip them.
    let path = std::env::var("PATH").unwrap_or_default();
    let on_path = path
        .split(':')
        .filter(|d| !d.contains("shims"))
        .map(|d| std::path::Path::new(d).join(name))
        .collect::<Vec<_>>();
    pyenv
        .chain(on_path)
        .find(|p| p.exists())
        .map(|p| p.display().to_string())
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

// --- the outside review's findings, each a case ---

/// A file in a fresh temp folder, for a body to leave a process id in.
fn pid_file(tmp: &common::TempDir, name: &str) -> String {
    tmp.path().join(name).display().to_string()
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
fn a_result_cannot_make_the_program_run_code() {
    let _s = serial();
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let one = [OutSpec::new(DType::F32)];
    // Objects whose pickling would call `eval` in the program: a class claiming to be NumPy's
    // (sent as a stand-in, refused), and a NumPy scalar subclass with its own __reduce__ (sent
    // as its bytes: its reduce never runs).
    let evil = "def __reduce__(self):\n        return (eval, (\"__import__('os')._exit(42)\",))";
    let err = in_workers(
        &format!("class Evil:\n    __module__ = 'numpy'\n    {evil}\ndef f(x): return Evil()"),
        &one,
    )
    .call(&[Arg::from(&x)])
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutputMismatch, "{err}");
    let y = in_workers(
        &format!(
            "class Evil(np.float32):\n    __module__ = 'numpy'\n    {evil}\ndef f(x): return Evil(1.5)"
        ),
        &one,
    )
    .call(&[Arg::from(&x)])
    .unwrap();
    assert_eq!(y[0].to_scalar::<f32>().unwrap(), 1.5);
    // Still here (the program did not exit with 42).
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
fn exceptions_and_results_read_as_in_the_program() {
    let _s = serial();
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let one = [OutSpec::new(DType::F32)];
    let err = in_workers("def f(x): raise KeyError('a')", &one)
        .call(&[Arg::from(&x)])
        .unwrap_err();
    assert!(err.to_string().contains("KeyError: 'a'"), "{err}");
    assert!(!err.to_string().contains("\"'a'\""), "{err}");
    // A message JSON cannot carry as it is (a lone surrogate), an ImportError named by an
    // object: the exception's own kind, not a lost worker.
    let err = in_workers(
        "def f(x): raise ValueError(b'caf\\xe9'.decode('utf-8', 'surrogateescape'))",
        &one,
    )
    .call(&[Arg::from(&x)])
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let err = in_workers("def f(x): raise ImportError('nope', name=object())", &one)
        .call(&[Arg::from(&x)])
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unknown, "{err}");
    assert!(err.to_string().contains("ImportError: nope"), "{err}");
    // Subclasses of tuple and int are read as the program reads them.
    let two = [OutSpec::new(DType::F32), OutSpec::new(DType::I64)];
    let y = in_workers(
        "import collections, enum\nP = collections.namedtuple('P', 'a b')\nclass K(enum.IntEnum):\n    THREE = 3\ndef f(x): return P(x, K.THREE)",
        &two,
    )
    .call(&[Arg::from(&x)])
    .unwrap();
    assert_eq!(y[1].to_scalar::<i64>().unwrap(), 3);
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

/// Run by `import_hooks_of_the_environment_work_in_workers` with `PYOP_PYTHON_ENV` set to an
/// environment whose `.pth` file installs an import hook (as editable installs do).
#[test]
#[ignore = "a child process of import_hooks_of_the_environment_work_in_workers"]
fn import_hook_child() {
    let pool = WorkerPool::new(1);
    let op = worker_op(
        &pool,
        "hooked",
        "def f(x):\n    import magic_mod\n    return x * magic_mod.VALUE",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[2f32], &cpu()).unwrap();
    println!(
        "worker: {:?}",
        op.call(&[Arg::from(&x)])
            .map(|y| y[0].to_vec1::<f32>().unwrap())
    );
}

#[test]
fn import_hooks_of_the_environment_work_in_workers() {
    let _s = serial();
    let env = pyop::python_env().unwrap();
    let python = env
        .running
        .executable
        .clone()
        .expect("the interpreter's python");
    let numpy_dir = env.site_packages.clone().expect("this project's venv");
    let tmp = common::TempDir::new("worker-pth");
    let venv = tmp.path().join("venv");
    let made = Command::new(&python)
        .args(["-m", "venv", "--without-pip"])
        .arg(&venv)
        .status()
        .unwrap();
    assert!(made.success());
    let major_minor: String = env
        .running
        .version
        .split('.')
        .take(2)
        .collect::<Vec<_>>()
        .join(".");
    let site = venv.join(format!("lib/python{major_minor}/site-packages"));
    // A path line (NumPy, from this project's venv) and an import line that installs a finder
    // serving `magic_mod`, which no folder on sys.path holds.
    std::fs::write(
        site.join("hook.pth"),
        format!("{}\nimport _pyop_test_hook\n", numpy_dir.display()),
    )
    .unwrap();
    std::fs::write(
        site.join("_pyop_test_hook.py"),
        "import sys, importlib.abc, importlib.util\n\
         class _F(importlib.abc.MetaPathFinder, importlib.abc.Loader):\n    \
         def find_spec(self, name, path=None, target=None):\n        \
         return importlib.util.spec_from_loader(name, self) if name == 'magic_mod' else None\n    \
         def create_module(self, spec):\n        return None\n    \
         def exec_module(self, module):\n        module.VALUE = 7\n\
         sys.meta_path.append(_F())\n",
    )
    .unwrap();
    let (_, text) = common::child_test(
        module_path!(),
        "import_hook_child",
        &[("PYOP_PYTHON_ENV", Some(venv.as_os_str()))],
    );
    assert!(text.contains("worker: Ok([14.0])"), "{text}");
}

// --- the second review's findings ---

#[test]
fn arenas_given_back_after_a_large_call_do_not_change_results() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let x = Tensor::new(&[1f32, 2., 3., 4.], &cpu()).unwrap();
    // Plain arrays, a pickled tuple, and `out` buffers the body keeps a view of.
    let plain = worker_op(
        &pool,
        "sized",
        "def f(x, n):\n    return np.arange(n, dtype=np.float32) + x[0]",
        &[OutSpec::new(DType::F32)],
    );
    let pickled = worker_op(
        &pool,
        "sized_tuple",
        "def f(x, n):\n    return (np.arange(n, dtype=np.float32)[::-1] + x[0],)",
        &[OutSpec::new(DType::F32)],
    );
    // 16 MiB once, then small calls past the point where the arenas are given back.
    let big = plain
        .call(&[Arg::from(&x), Arg::from(4usize << 20)])
        .unwrap();
    assert_eq!(big[0].dims(), [4 << 20]);
    let big_input = Tensor::ones(4 << 20, DType::F32, &cpu()).unwrap();
    pickled
        .call(&[Arg::from(&big_input), Arg::from(4usize)])
        .unwrap();
    for i in 0..80 {
        let y = plain.call(&[Arg::from(&x), Arg::from(4usize)]).unwrap();
        assert_eq!(
            y[0].to_vec1::<f32>().unwrap(),
            [1., 2., 3., 4.],
            "plain call {i}"
        );
        let y = pickled.call(&[Arg::from(&x), Arg::from(4usize)]).unwrap();
        assert_eq!(
            y[0].to_vec1::<f32>().unwrap(),
            [4., 3., 2., 1.],
            "pickled call {i}"
        );
    }
}

#[test]
fn numpy_values_travel_as_bytes_never_as_pickled_numpy_state() {
    let _s = serial();
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    // A NumPy scalar subclass claiming to be NumPy's with its own reduce: sent as its bytes.
    let y = in_workers(
        "class Evil(np.float64):\n    __module__ = 'numpy'\n    def __reduce_ex__(self, protocol):\n        return (np.dtype, ('O',))\ndef f(x): return Evil(2.5)",
        &[OutSpec::new(DType::F64)],
    )
    .call(&[Arg::from(&x)])
    .unwrap();
    assert_eq!(y[0].to_scalar::<f64>().unwrap(), 2.5);
    // ndarray subclasses read as arrays, as in the program; a masked array is refused with the
    // program's message.
    let y = in_workers(
        "class A(np.ndarray):\n    pass\ndef f(x): return (x + 1).view(A)",
        &[OutSpec::new(DType::F32)],
    )
    .call(&[Arg::from(&x)])
    .unwrap();
    assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2.]);
    let err = in_workers(
        "def f(x): return np.ma.masked_array(x, mask=[True])",
        &[OutSpec::new(DType::F32)],
    )
    .call(&[Arg::from(&x)])
    .unwrap_err();
    assert!(
        err.to_string().contains("a masked array is not a tensor"),
        "{err}"
    );
}

#[test]
fn empty_results_need_no_shared_memory() {
    let _s = serial();
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    for code in [
        "def f(x): return np.zeros((0, 3), np.float32)",
        "def f(x): return (np.zeros((0, 3), np.float32),)",
    ] {
        // A fresh pool: no result arena exists yet.
        let pool = WorkerPool::new(1);
        let y = worker_op(&pool, "empty", code, &[OutSpec::new(DType::F32)])
            .call(&[Arg::from(&x)])
            .unwrap_or_else(|e| panic!("{code}: {e}"));
        assert_eq!(y[0].dims(), [0, 3], "{code}");
    }
}

#[test]
fn a_worker_that_cannot_map_memory_is_replaced() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    // The body keeps its input (so the next call gets a fresh input arena) and caps the
    // worker's address space just above what it uses: the next arena cannot be mapped.
    let op = worker_op(
        &pool,
        "capped",
        "import resource\nkept = []\ndef f(x, cap):\n    if cap:\n        kept.append(x)\n        used = int(open('/proc/self/statm').read().split()[0]) * 4096\n        resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 16), resource.RLIM_INFINITY))\n    return x + 1",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    // Both arenas exist after the first call; the second caps and keeps its input.
    op.call(&[Arg::from(&x), Arg::Bool(false)]).unwrap();
    op.call(&[Arg::from(&x), Arg::Bool(true)]).unwrap();
    let err = op.call(&[Arg::from(&x), Arg::Bool(false)]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::WorkerLost, "{err}");
    let y = op.call(&[Arg::from(&x), Arg::Bool(false)]).unwrap();
    assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2.]);
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

#[test]
fn a_module_that_fails_to_load_runs_its_top_level_once_per_worker() {
    let _s = serial();
    let tmp = common::TempDir::new("worker-load-once");
    let marks = pid_file(&tmp, "marks");
    let pool = WorkerPool::new(1);
    // Loads in the program at build() (where it works: the file does not say fail yet), then
    // fails in the worker.
    std::fs::write(&marks, "").unwrap();
    let op = worker_op(
        &pool,
        "fails_later",
        &format!(
            "import os\nmarks = {marks:?}\nwith open(marks, 'a') as m:\n    m.write('x')\nif os.getpid() != {parent}:\n    raise RuntimeError('not here')\ndef f(x): return x",
            parent = std::process::id()
        ),
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    for _ in 0..3 {
        let err = op.call(&[Arg::from(&x)]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Source, "{err}");
        assert!(err.to_string().contains("cannot load the code"), "{err}");
        assert!(err.to_string().contains("not here"), "{err}");
    }
    // Once in the program, once in the worker.
    assert_eq!(std::fs::read_to_string(&marks).unwrap(), "xx");
}

// --- the second audit's worker findings (../shared/reviews/adversarial-findings-2.md), each a case ---

/// The Python exception's type name an error carries.
fn exception(e: &pyop::Error) -> Option<&str> {
    e.exception()
}

/// The bytes an op's calls copied into and out of workers (`OpStats`).
fn copies(op: &PyOp) -> (u64, u64) {
    let s = op.stats();
    (s.worker_bytes_in, s.worker_bytes_out)
}

#[test]
fn copies_in_and_out_are_counted_and_returned_inputs_are_not_copied() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let x = Tensor::arange(0f32, 1024., &cpu()).unwrap();
    let op = |name: &str, code: &str, tout: OutSpec| worker_op(&pool, name, code, &[tout]);
    let f32_ = OutSpec::new(DType::F32);
    let ident = op("ident_counted", "def f(x):\n    return x", f32_.clone());
    let view = op("view_counted", "def f(x):\n    return x[1:]", f32_.clone());
    let plus = op("plus_counted", "def f(x):\n    return x + 1", f32_.clone());
    let out = op(
        "out_counted",
        "def f(x, out=None):\n    np.add(x, 1, out=out)",
        OutSpec::like(DType::F32, 0),
    );
    ident.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(
        copies(&ident),
        (4096, 0),
        "a returned input is read where it lies"
    );
    let y = view.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(y[0].to_vec1::<f32>().unwrap()[0], 1.);
    assert_eq!(copies(&view), (4096, 0), "so is a view of one");
    plus.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(copies(&plus), (4096, 4096), "a fresh result is copied once");
    out.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(
        copies(&out),
        (4096, 0),
        "an `out` buffer is read where it lies"
    );
    let p = pool.stats();
    assert_eq!(
        (p.bytes_in, p.bytes_out),
        (4 * 4096, 4096),
        "the pool counts them all"
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

/// Run by `workers_import_nothing_from_the_current_directory`, in a folder of shadowing modules.
#[test]
#[ignore = "a child process of workers_import_nothing_from_the_current_directory"]
fn cwd_child() {
    let code = "import sys, zlib\ndef f(x):\n    return np.array([zlib.crc32(repr((sys.path, sys.argv)).encode())], np.int64)";
    let pool = WorkerPool::new(1);
    let in_worker = worker_op(&pool, "path_w", code, &[OutSpec::new(DType::I64)]);
    let in_program = program_op("path_p", code, &[OutSpec::new(DType::I64)]);
    let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
    let w = in_worker.call(&[Arg::from(&x)]).unwrap()[0]
        .to_vec1::<i64>()
        .unwrap();
    let p = in_program.call(&[Arg::from(&x)]).unwrap()[0]
        .to_vec1::<i64>()
        .unwrap();
    println!("PATHS {} {}", w[0], p[0]);
}

/// Finding 2: a `socket.py`, `json.py`, … in the program's current directory runs nowhere: a
/// worker's `sys.path` is the program's from its first import on.
#[test]
fn workers_import_nothing_from_the_current_directory() {
    let tmp = common::TempDir::new("pyop-cwd");
    let marker = tmp.path().join("marker");
    for name in [
        "socket",
        "json",
        "pickle",
        "signal",
        "select",
        "traceback",
        "linecache",
        "mmap",
        "types",
        "io",
    ] {
        std::fs::write(
            tmp.path().join(format!("{name}.py")),
            format!(
                "open({:?}, 'a').write('{name}.py ran\\n')\nraise ImportError('shadowed')\n",
                marker.display().to_string()
            ),
        )
        .unwrap();
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "cwd_child", "--nocapture"])
        .current_dir(tmp.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !marker.exists(),
        "{}",
        std::fs::read_to_string(&marker).unwrap_or_default()
    );
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("PATHS "))
        .expect("PATHS");
    let (w, p) = line.split_once(' ').unwrap();
    assert_eq!(w, p, "a worker's sys.path and sys.argv are the program's");
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

/// Finding 4: an input crosses as the storage it views. A broadcast of 2^40 elements is one
/// element in the arena (it aborted the process), and narrowed, transposed and broadcast inputs
/// have the same strides and values in a worker as in the program.
#[test]
fn inputs_cross_as_the_storage_they_view() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let huge = Tensor::new(&[1f32], &cpu())
        .unwrap()
        .broadcast_as((1usize << 40,))
        .unwrap();
    let head = worker_op(
        &pool,
        "head",
        "def f(x):\n    return np.array(x[:4])",
        &[OutSpec::new(DType::F32)],
    );
    let y = head.call(&[Arg::from(&huge)]).unwrap();
    assert_eq!(y[0].to_vec1::<f32>().unwrap(), [1.; 4]);
    assert_eq!(pool.stats().bytes_in, 4, "one element in the arena");
    let code = "def f(x):\n    return np.array(x.strides + x.shape + (float(x.sum()), x.flags.writeable), np.float64)";
    let worker = worker_op(&pool, "strides", code, &[OutSpec::new(DType::F64)]);
    let program = program_op("strides_p", code, &[OutSpec::new(DType::F64)]);
    let m = Tensor::arange(0f32, 12., &cpu())
        .unwrap()
        .reshape((3, 4))
        .unwrap();
    let cases = [
        m.clone(),
        m.t().unwrap(),
        m.narrow(1, 1, 2).unwrap(),
        m.narrow(0, 1, 2).unwrap().t().unwrap(),
        m.narrow(1, 2, 1).unwrap().broadcast_as((3, 5)).unwrap(),
        Tensor::new(&[7f32], &cpu())
            .unwrap()
            .broadcast_as((2, 3))
            .unwrap(),
        m.narrow(0, 0, 0).unwrap(),
    ];
    for (i, t) in cases.iter().enumerate() {
        let w = worker.call(&[Arg::from(t)]).unwrap()[0]
            .to_vec1::<f64>()
            .unwrap();
        let p = program.call(&[Arg::from(t)]).unwrap()[0]
            .to_vec1::<f64>()
            .unwrap();
        assert_eq!(w, p, "case {i}: {:?} {:?}", t.dims(), t.stride());
    }
}

/// Finding 6: a value is read through its base type's own slots in a worker as in the program,
/// whatever a subclass overrides.
#[test]
fn subclasses_read_as_in_the_program() {
    let _s = serial();
    let code = "\
class I(int):\n    def __int__(self): return 42\n    def __index__(self): return 42\n\
class F(float):\n    def __float__(self): return 42.0\n\
class T(tuple):\n    def __iter__(self): return iter((42.0, 42.0))\n    def __getitem__(self, i): return 42.0\n\
class L(list):\n    def __iter__(self): return iter([42.0, 42.0, 42.0])\n    def __getitem__(self, i): return 42.0\n\
class A(np.ndarray):\n    def view(self, *a, **k): return np.full(3, 42.0).view(*a, **k)\n    def __array__(self, *a, **k): return np.full(3, 42.0)\n\
class S(np.float64):\n    def tobytes(self, *a): return np.float64(42.0).tobytes()\n    @property\n    def dtype(self): return np.dtype('<f4')\n\
class D(dict):\n    def items(self): return [('k', 42.0)]\n    def __iter__(self): return iter(['k'])\n\
def f(x, kind):\n    \
if kind == 'int': return I(7)\n    \
if kind == 'float': return F(7.0)\n    \
if kind == 'tuple': return T((7.0, 8.0))\n    \
if kind == 'list': return L([7.0, 8.0])\n    \
if kind == 'array': return np.array([7.0, 8.0, 9.0]).view(A)\n    \
if kind == 'scalar': return S(7.0)\n    \
if kind == 'dict': return D(k=7.0)\n";
    let pool = WorkerPool::new(1);
    let tout = [OutSpec::new(DType::F64)];
    let worker = worker_op(&pool, "subclass", code, &tout);
    let program = program_op("subclass_p", code, &tout);
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let show = |r: pyop::Result<Vec<Tensor>>| match r {
        Ok(t) => format!(
            "{:?}",
            t[0].flatten_all().unwrap().to_vec1::<f64>().unwrap()
        ),
        Err(e) => format!(
            "{:?}: {}",
            e.kind(),
            e.to_string().replace("subclass_p", "subclass")
        ),
    };
    for kind in ["int", "float", "tuple", "list", "array", "scalar", "dict"] {
        let args = [Arg::from(&x), Arg::Str(kind)];
        let p = show(program.call(&args));
        assert_eq!(show(worker.call(&args)), p, "{kind}");
        assert!(
            !p.contains("42"),
            "{kind}: the program read an override: {p}"
        );
    }
}

/// Finding 7: inputs are read-only in a worker as in the program, through every route to their
/// memory, and a thread a body leaves writing to what it kept cannot reach later calls' inputs.
#[test]
fn inputs_are_read_only_and_kept_memory_cannot_reach_later_calls() {
    let _s = serial();
    let code = "\
import threading, time\n\
def f(x, how):\n    \
if how == 'setflags':\n        x.setflags(write=True); x[0] = 42\n    \
elif how == 'base':\n        x.base[...] = 42\n    \
elif how == 'mmap':\n        x.base.base[0:4] = b'\\xff' * 4\n    \
return x.copy()\n";
    let pool = WorkerPool::new(1);
    let tout = [OutSpec::new(DType::F32)];
    let worker = worker_op(&pool, "readonly", code, &tout);
    let program = program_op("readonly_p", code, &tout);
    let x = Tensor::new(&[1f32, 2.], &cpu()).unwrap();
    for how in ["setflags", "base"] {
        let args = [Arg::from(&x), Arg::Str(how)];
        let p = program.call(&args).unwrap_err();
        let w = worker.call(&args).unwrap_err();
        assert_eq!(
            (w.kind(), exception(&w)),
            (p.kind(), exception(&p)),
            "{how}: {w}"
        );
    }
    // The mapping under a worker's input views is read-only too.
    let w = worker.call(&[Arg::from(&x), Arg::Str("mmap")]).unwrap_err();
    assert_eq!(exception(&w), Some("TypeError"), "{w}");
    // Threads left writing through what a body kept: its input's mapping, and its `out`
    // buffer's writable array and mapping.
    let scribble = worker_op(
        &pool,
        "scribble",
        "import os, threading, time, weakref\n\
         def loop(m):\n    \
         while True:\n        \
         try:\n            m[0:16] = b'\\xff' * 16\n        \
         except Exception:\n            return\n        \
         time.sleep(0.0002)\n\
         def weak(w):\n    \
         end = time.time() + 1\n    \
         while time.time() < end:\n        \
         m = w()\n        \
         if m is None: return\n        \
         m[0:16] = b'\\xff' * 16\n        \
         del m\n        \
         time.sleep(0.0002)\n\
         def f(x, how, out=None):\n    \
         if how == 'input': threading.Thread(target=loop, args=(x.base.base,), daemon=True).start()\n    \
         if how == 'out': threading.Thread(target=loop, args=(out.base,), daemon=True).start()\n    \
         if how == 'outmap': threading.Thread(target=loop, args=(out.base.base,), daemon=True).start()\n    \
         if how == 'weak': threading.Thread(target=weak, args=(weakref.ref(out.base.base.obj),), daemon=True).start()\n    \
         if how == 'fork' and os.fork() == 0:\n        \
         end = time.time() + 1\n        \
         while time.time() < end: out[...] = 99\n        \
         os._exit(0)\n    \
         np.add(x, 0, out=out)",
        &[OutSpec::like(DType::F32, 0)],
    );
    let x = Tensor::new(&[1f32, 2., 3., 4.], &cpu()).unwrap();
    for how in ["input", "out", "outmap", "weak", "fork"] {
        let y = scribble.call(&[Arg::from(&x), Arg::Str(how)]).unwrap();
        if how == "fork" {
            // A forked child's writes are its own (a thread's race the body's own output).
            assert_eq!(y[0].to_vec1::<f32>().unwrap(), [1., 2., 3., 4.], "{how}");
        }
        for i in 0..30 {
            let y = scribble.call(&[Arg::from(&x), Arg::Str("")]).unwrap();
            assert_eq!(
                y[0].to_vec1::<f32>().unwrap(),
                [1., 2., 3., 4.],
                "{how}, call {i}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// The worker's sequence number and socket, for a body that forges a reply.
const FORGE: &str = "import gc, json, socket, sys\n\
def forge(m):\n    \
seq = sys._getframe(2).f_globals['_seq']\n    \
s = next(o for o in gc.get_objects() if isinstance(o, socket.socket) and o.fileno() >= 0)\n    \
h = json.dumps({'q': seq, 'm': m}).encode()\n    \
body = len(h).to_bytes(4, 'little') + h\n    \
s.sendall(len(body).to_bytes(4, 'little') + body)\n";

/// Finding 8: a forged reply with the right sequence number and sizes past any arena (or
/// `usize`) is a protocol error naming its field: `WorkerLost` for that call, no panic, and the
/// next call gets a worker in step.
#[test]
fn forged_sizes_are_protocol_errors_naming_the_field() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let op = worker_op(
        &pool,
        "forged",
        &format!(
            "{FORGE}def f(x, what):\n    \
             if what == 'need': forge({{'s': 'need', 'need': 2**64 - 1}})\n    \
             if what == 'bufs': forge({{'s': 'pickled', 'bufs': [[1, 0, 2**63], [1, 0, 2**63]], 'retained': False}})\n    \
             if what == 'shape': forge({{'s': 'array', 'place': [0, 0, 4], 'dtype': '<f4', 'shape': [2**62, 4], 'retained': False}})\n    \
             if what == 'need1': forge({{'s': 'need', 'need': 1}})\n    \
             if what == 'start': forge({{'s': 'raised', 'exc': {{'type': 'E', 'module': 'm', 'bases': [], 'message': '', 'traceback': '', 'phase': 'start', 'syntax': None, 'name': None}}, 'retained': False}})\n    \
             if what == 'field': forge({{'s': 'array', 'place': [0, 0, 4], 'dtype': '<f4', 'shape': [1], 'retained': False, 'x': 1}})\n    \
             return x + 1"
        ),
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    for (what, says) in [
        ("need", "`need` asks for 18446744073709551615 bytes"),
        ("bufs", "`bufs` names bytes"),
        ("shape", "`shape` [4611686018427387904, 4] overflows"),
        ("field", "`header` is not a reply (unknown field `x`"),
        ("need1", "reply to a result arena"),
        ("start", "`exc` says the worker failed to start"),
    ] {
        let err = op.call(&[Arg::from(&x), Arg::Str(what)]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::WorkerLost, "{what}: {err}");
        assert!(err.to_string().contains(says), "{what}: {err}");
        let y = op.call(&[Arg::from(&x), Arg::Str("")]).unwrap();
        assert_eq!(
            y[0].to_vec1::<f32>().unwrap(),
            [2.],
            "{what}: the next call"
        );
    }
}

/// Finding 9: a refused result's stand-in allocates nothing of its logical size in the program:
/// a broadcast object array of 2^40 elements is refused for being an object array.
#[test]
fn stand_ins_for_refused_results_allocate_nothing_of_their_size() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let op = worker_op(
        &pool,
        "objects",
        "def f(x, n, structured):\n    \
         one = np.zeros(1, dtype=[('a', 'f4')]) if structured else np.array([None], dtype=object)\n    \
         return np.broadcast_to(one, (n,))",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    for (structured, says) in [
        (false, "object arrays are not tensors"),
        (true, "structured arrays are not tensors"),
    ] {
        let err = op
            .call(&[Arg::from(&x), Arg::I64(1 << 40), Arg::Bool(structured)])
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutputMismatch, "{err}");
        assert!(err.to_string().contains(says), "{err}");
    }
}

/// Finding 10: module keys do not collide by prefix: ops `a` and `a#1.0` share a pool and keep
/// their own modules.
#[test]
fn module_keys_cannot_collide() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let op = |name: &str, k: f32| {
        worker_op(
            &pool,
            name,
            &format!("def f(x):\n    return x + {k}"),
            &[OutSpec::new(DType::F32)],
        )
    };
    let (a, b) = (op("a", 1.0), op("a#1.0", 2.0));
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    for (op, want) in [(&b, 3.), (&a, 2.), (&b, 3.), (&a, 2.)] {
        assert_eq!(
            op.call(&[Arg::from(&x)]).unwrap()[0]
                .to_vec1::<f32>()
                .unwrap(),
            [want]
        );
    }
    assert_eq!(pool.stats().started, 1);
}

/// Finding 11: the `pyop` stub raises `AttributeError` where Python expects one, so `inspect`
/// and `hasattr` work in a worker as in the program; using it still says why it cannot be used.
#[test]
fn the_pyop_stub_raises_attribute_error() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let op = worker_op(
        &pool,
        "stub",
        "import inspect, pyop\n\
         def f(x, what):\n    \
         if what == 'stack': return np.array([len(inspect.stack()) > 0], np.float32)\n    \
         if what == 'hasattr': return np.array([hasattr(pyop, 'rust')], np.float32)\n    \
         if what == 'getattr': return np.array([getattr(pyop, '__file__', None) is None], np.float32)\n    \
         if what == 'use': return pyop.Tensor\n    \
         if what == 'import':\n        from pyop import Tensor\n",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let call = |what| op.call(&[Arg::from(&x), Arg::Str(what)]);
    assert_eq!(call("stack").unwrap()[0].to_vec1::<f32>().unwrap(), [1.]);
    assert_eq!(call("hasattr").unwrap()[0].to_vec1::<f32>().unwrap(), [0.]);
    assert_eq!(call("getattr").unwrap()[0].to_vec1::<f32>().unwrap(), [1.]);
    let e = call("use").unwrap_err();
    assert_eq!(exception(&e), Some("AttributeError"), "{e}");
    assert!(e.to_string().contains("lives in the program"), "{e}");
    let e = call("import").unwrap_err();
    assert_eq!(exception(&e), Some("ImportError"), "{e}");
    assert!(e.to_string().contains("lives in the program"), "{e}");
}

/// Every reply kind a call can get, through the real worker, decoded by the program's strict
/// protocol types: loaded, array, pickled, wrote, raised, need (a result larger than the result
/// arena), load_failed (a module that fails only in workers). `ready` is every start's, `pong`
/// `validate_starts_a_worker_for_declared_worker_ops`'s, `wrong_version` and `no_numpy`
/// `a_worker_that_cannot_start_is_a_clear_error`'s.
#[test]
fn every_message_kind_round_trips_through_a_real_worker() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let op = worker_op(
        &pool,
        "kinds",
        "def f(x, kind):\n    \
         if kind == 'array': return x * 2\n    \
         if kind == 'pickled': return (x * 2)[::-1]\n    \
         if kind == 'raised': raise KeyError('k')\n    \
         if kind == 'need': return np.tile(x * 2, 1 << 19)\n",
        &[OutSpec::new(DType::F32)],
    );
    let wrote = worker_op(
        &pool,
        "kinds_out",
        "def f(x, out=None):\n    np.multiply(x, 2, out=out)\n    return out",
        &[OutSpec::like(DType::F32, 0)],
    );
    let x = Tensor::new(&[1f32, 2.], &cpu()).unwrap();
    let y = wrote.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2., 4.]);
    let y = op.call(&[Arg::from(&x), Arg::Str("need")]).unwrap();
    assert_eq!(
        y[0].dims(),
        [1 << 20],
        "a result of 4 MiB, past the 1 MiB result arena"
    );
    let y = op.call(&[Arg::from(&x), Arg::Str("array")]).unwrap();
    assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2., 4.]);
    let y = op.call(&[Arg::from(&x), Arg::Str("pickled")]).unwrap();
    assert_eq!(y[0].to_vec1::<f32>().unwrap(), [4., 2.]);
    let e = op.call(&[Arg::from(&x), Arg::Str("raised")]).unwrap_err();
    assert_eq!(exception(&e), Some("KeyError"), "{e}");
    let failing = PyOp::builder("fails_in_workers")
        .code("import sys\nif '_pyop_worker' in sys.modules:\n    raise RuntimeError('only in a worker')\ndef f(x):\n    return x")
        .function("f")
        .numpy()
        .pool(&pool)
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap();
    let e = failing.call(&[Arg::from(&x)]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Source, "{e}");
    assert!(e.to_string().contains("only in a worker"), "{e}");
    let stats = pool.stats();
    assert_eq!((stats.started, stats.lost), (1, 0), "{stats:?}");
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

/// A dropped op's module is unloaded from the workers of a shared pool, as the program frees it
/// (60 ops built and dropped on one pool kept 60 modules and 644 MB in its worker).
#[test]
fn a_dropped_ops_module_is_unloaded_from_its_workers() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let count = worker_op(
        &pool,
        "count_modules",
        "import sys\ndef f(x):\n    return np.array([len(sys._getframe(1).f_globals['_modules'])], np.float32)",
        &[OutSpec::new(DType::F32)],
    );
    for i in 0..5 {
        let op = worker_op(
            &pool,
            &format!("dyn{i}"),
            "G = np.ones(10 << 20, np.uint8)\ndef f(x):\n    return x + 1",
            &[OutSpec::new(DType::F32)],
        );
        op.call(&[Arg::from(&x)]).unwrap();
        drop(op);
    }
    let n = count.call(&[Arg::from(&x)]).unwrap()[0]
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(n, [1.], "only the counting op's module is left");
}

/// The same op in the program and in a worker (numpy mode, `tout = like(x)`).
fn both_ways(pool: &WorkerPool, name: &str, code: &str) -> (PyOp, PyOp) {
    let tout = [OutSpec::same_as(0)];
    let program = program_op(&format!("{name}_p"), code, &tout);
    (worker_op(pool, name, code, &tout), program)
}

/// Every dtype NumPy holds crosses with its own dtype and values, as in the program.
#[test]
fn every_dtype_crosses_as_in_the_program() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let (worker, program) = both_ways(&pool, "dtypes", "def f(x):\n    return x * 2");
    let base = Tensor::arange(0u32, 6, &cpu()).unwrap();
    for dtype in [
        DType::U8,
        DType::U32,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::F32,
        DType::F64,
    ] {
        let x = base
            .to_dtype(dtype)
            .unwrap()
            .reshape((2, 3))
            .unwrap()
            .t()
            .unwrap();
        let w = &worker.call(&[Arg::from(&x)]).unwrap()[0];
        let p = &program.call(&[Arg::from(&x)]).unwrap()[0];
        assert_eq!(w.dtype(), dtype);
        let values = |t: &Tensor| {
            t.to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()
        };
        assert_eq!(values(w), values(p), "{dtype:?}");
        assert_eq!(values(w), [0., 6., 2., 8., 4., 10.], "{dtype:?}");
    }
}

/// `out` buffers lie apart from the inputs in shared memory: a body that fills its `out` before
/// reading its input reads the input.
#[test]
fn out_buffers_never_overlap_inputs() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let (worker, _) = both_ways(
        &pool,
        "apart",
        "def f(x, y, out=None):\n    out[...] = -1\n    np.add(x, y, out=out)",
    );
    let x = Tensor::new(&[1f32, 2., 3.], &cpu()).unwrap();
    let y = Tensor::new(&[10f32, 20., 30.], &cpu()).unwrap();
    let z = worker.call(&[Arg::from(&x), Arg::from(&y)]).unwrap();
    assert_eq!(z[0].to_vec1::<f32>().unwrap(), [11., 22., 33.]);
}

/// `out` buffers larger than the machine's memory are refused before any arena is made, as in
/// the program (a 4 TiB buffer would otherwise be a sparse memfd the body then fills).
#[test]
fn out_buffers_larger_than_memory_are_refused() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let (worker, program) = both_ways(
        &pool,
        "huge_out",
        "def f(x, out=None):\n    np.add(x, 1, out=out)",
    );
    let x = Tensor::new(&[1f32], &cpu())
        .unwrap()
        .broadcast_as((1usize << 40,))
        .unwrap();
    let w = worker.call(&[Arg::from(&x)]).unwrap_err();
    let p = program.call(&[Arg::from(&x)]).unwrap_err();
    assert_eq!(w.kind(), ErrorKind::ResourceExhausted, "{w}");
    assert_eq!(p.kind(), ErrorKind::ResourceExhausted, "{p}");
    assert_eq!(
        pool.stats().bytes_in,
        0,
        "refused before anything was written"
    );
}
