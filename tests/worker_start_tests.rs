//! Starting worker processes: the zygote workers fork from, the directory, environment,
//! `sys.argv`, `sys.path` and BLAS threads a worker gets, `validate()` and `start_workers`,
//! workers that cannot start, import hooks, named pools shared by declared ops.
//!
//! A test whose doc begins "Finding N" is a case of the second audit's finding N
//! (`../shared/reviews/adversarial-findings-2.md`).

use std::process::Command;

use pyop::candle::{DType, Device, Tensor};
use pyop::{py_op, Arg, ErrorKind, OutSpec, PyOp, WorkerPool};

mod common;
use common::cpu;
use common::workers::{family, program_op, serial, stat_fields, worker_op};

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
    assert!(validate.contains("worker_start_tests::halve"), "{text}");
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
        text.contains("affects 2 ops:       worker_start_tests::plain_w")
            && text.contains("worker_start_tests::halve"),
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
