//! Pools of Ray actors (`WorkerPool::ray`): the worker contract on a real two-node cluster of
//! this machine (`scripts/ray_cluster.py`, started once by the parent test and shared by the
//! tests of `on_cluster`, each a subject), how a program that uses them ends, what they leave
//! unchanged in the program, starts from any thread, and their set-up errors. A test file of its
//! own: a cluster's start costs seconds, and `scripts/dev.sh test --quick` leaves these out.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pyop::candle::{DType, Tensor, Var};
use pyop::{py_op, Arg, ErrorKind, OutSpec, PyOp, WorkerPool};

mod common;
use common::workers::worker_op;
use common::{cpu, tables};

fn exists(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// A Ray cluster of this machine (`scripts/ray_cluster.py`: a head and a second node with the
/// resource `extra`), started by the parent test and used by its child processes through
/// `PYOP_RAY_ADDRESS` and `PYOP_RAY_CONTROL`; stopped when dropped (or when this process ends: the
/// helper stops it when its stdin closes).
struct RayCluster {
    helper: std::process::Child,
    /// The helper's output, kept open (a later line of its would meet a closed pipe).
    _lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
    address: String,
    /// The helper's control socket, for `remove` and `add` from another process.
    control: String,
    /// The session's folder, which every process of the cluster names.
    session: String,
}

impl RayCluster {
    fn start() -> RayCluster {
        let python = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
        let has_ray = Command::new(&python)
            .args(["-c", "import ray"])
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            has_ray,
            "Ray is not in .venv: `scripts/dev.sh test` installs it"
        );
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/ray_cluster.py");
        let mut helper = Command::new(python)
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(helper.stdout.take().unwrap()).lines();
        let first = lines.next().expect("the cluster's address").unwrap();
        RayCluster {
            helper,
            _lines: lines,
            address: json_field(&first, "address"),
            control: json_field(&first, "control"),
            session: json_field(&first, "session"),
        }
    }
}

impl Drop for RayCluster {
    fn drop(&mut self) {
        drop(self.helper.stdin.take());
        let _ = self.helper.wait();
    }
}

/// The string value of `key` in a one-line JSON object of the helper's.
fn json_field(line: &str, key: &str) -> String {
    let at = line.find(&format!("\"{key}\": \"")).unwrap() + key.len() + 5;
    line[at..].split('"').next().unwrap().to_owned()
}

/// The processes whose command line names `needle`.
fn processes_naming(needle: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle))
        })
        .collect()
}

/// Ray pools on a real two-node cluster keep the contract of local workers: the same output
/// and exception tables, exact results from 8 threads, time limits, an actor killed or a node
/// removed mid-call failing only that call, gradients, hot reload, validation, programs that
/// end cleanly. The cluster is started here and shared: the subjects of `on_cluster`, each a
/// test of its own, run in one child process, and those of `alone` (which need a
/// program that has not used Ray yet) each in a process of its own; once the cluster stops,
/// nothing of it is left behind.
#[test]
fn ray_pools_keep_the_contract_on_a_two_node_cluster() {
    let cluster = RayCluster::start();
    let run = |args: &[&str]| {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--test-threads=1"])
            .args(args)
            .env("PYOP_RAY_ADDRESS", &cluster.address)
            .env("PYOP_RAY_CONTROL", &cluster.control)
            .env("PYOP_RAY_POOLS", "ray_named")
            .env("PYOP_HOT_RELOAD", "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        println!("{text}");
        (out.status.success(), text)
    };
    let mut runs = vec![(run(&["on_cluster::"]), "on_cluster", SUBJECTS)];
    for alone in ALONE {
        let name = format!("alone::{alone}");
        runs.push((
            run(&["--exact", &name]),
            "alone",
            std::slice::from_ref(alone),
        ));
    }
    let session = cluster.session.clone();
    drop(cluster);
    for ((ok, text), module, subjects) in &runs {
        // (Ray's own log lines may come between a test's name and its `ok`.)
        assert!(ok, "{text}");
        for subject in subjects.iter() {
            assert!(
                text.contains(&format!("test {module}::{subject} ... ")),
                "{module}::{subject} did not run:\n{text}"
            );
        }
        let passed = format!("test result: ok. {} passed; 0 failed", subjects.len());
        assert!(text.contains(&passed), "not every subject passed:\n{text}");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !processes_naming(&session).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        processes_naming(&session),
        [] as [u32; 0],
        "Ray processes left behind"
    );
}

/// Every test of `on_cluster`, which the parent test runs in one process and expects to pass.
const SUBJECTS: &[&str] = &[
    "actors_spread_over_both_nodes_and_any_spelling_of_the_address_joins",
    "tables_threads_and_batches_are_exact",
    "awaited_calls_are_exact_and_a_dropped_one_kills_its_relay",
    "a_lost_actor_fails_its_call_only",
    "values_cross_as_in_the_program",
    "starts_never_wait_and_dropped_ops_unload",
    "declared_ops_validate_and_take_gradients_there",
    "hot_reload_reaches_every_actor",
    "programs_end_cleanly",
];

/// Every test of `alone`, each run in a process of its own, in this order.
const ALONE: &[&str] = &[
    "pools_change_nothing_else",
    "pools_start_from_any_thread",
    "a_removed_node_fails_its_call_and_a_new_one_serves",
];

#[py_op(code = "import os\ndef ray_named(x):\n    return x * 2", numpy, workers = 2, pool = "ray_named", tout = f32)]
fn ray_named(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = r#"
import numpy as np
def ray_cube(x):
    return x ** 3
def ray_cube_grad(inputs, outputs, grads):
    (x,), (g,) = inputs, grads
    return 3 * x ** 2 * g
"#, numpy, workers = 2, pool = "ray_named", grad = "ray_cube_grad", tout = f64)]
fn ray_cube(x: &Tensor) -> pyop::Result<Tensor>;

/// Run by `on_cluster::programs_end_cleanly` on the cluster: a declared op in a named Ray pool, called, then the
/// process ends at once (after an actor killed on a time limit, with `RAY_EXIT_KILL`).
#[test]
#[ignore = "a child process of on_cluster::programs_end_cleanly"]
fn ray_exit_child() {
    let x = Tensor::new(&[1f32, 2., 3.], &cpu()).unwrap();
    assert_eq!(
        ray_named(&x).unwrap().to_vec1::<f32>().unwrap(),
        [2., 4., 6.]
    );
    // And through Ray's object store (arguments and replies over 100 KiB go there).
    let big = Tensor::ones(1 << 18, DType::F32, &cpu()).unwrap();
    assert_eq!(ray_named(&big).unwrap().dims(), [1 << 18]);
    if std::env::var("RAY_EXIT_KILL").is_ok_and(|v| v == "1") {
        let slow = PyOp::builder("slow_exit")
            .code("import time\ndef slow_exit(x):\n    time.sleep(30)\n    return x")
            .numpy()
            .pool(&WorkerPool::find("ray_named").unwrap())
            .timeout(Duration::from_millis(300))
            .tout([OutSpec::new(DType::F32)])
            .build()
            .unwrap();
        let err = slow.call(&[Arg::from(&x)]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    }
    if let Some(ms) = std::env::var("RAY_EXIT_SLEEP")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        std::thread::sleep(Duration::from_millis(ms));
    }
}

/// How a program that uses Ray pools ends (`RAY_ENDING`: `return` from the test, `exit` (3)
/// from a spawned thread, `panic`, `sigterm`, `sigint`), run by
/// `on_cluster::programs_end_cleanly` on the cluster: 4 threads call an op of a 4-actor pool without end, a fifth thread's first call on
/// another pool is starting its actor (its relay importing Ray, joining, placing it, by
/// `RAY_ENDING_DELAY_MS`), and the program ends. A call that fails says so (`CALL FAILED`).
#[test]
#[ignore = "a child process of on_cluster::programs_end_cleanly"]
fn ray_ending_child() {
    let address = std::env::var("PYOP_RAY_ADDRESS").unwrap();
    let ending = std::env::var("RAY_ENDING").unwrap();
    let delay: u64 = std::env::var("RAY_ENDING_DELAY_MS")
        .unwrap()
        .parse()
        .unwrap();
    let spec = |n| {
        pyop::RayPool::new(n)
            .address(address.clone())
            .num_cpus(0.25)
    };
    let code = "def f(x, k):\n    return x * 2 + k";
    let op = ray_op(
        &WorkerPool::ray(spec(4)),
        "ending",
        code,
        &[OutSpec::new(DType::F32)],
    );
    op.start_workers().unwrap();
    let first = ray_op(
        &WorkerPool::ray(spec(1)),
        "first",
        code,
        &[OutSpec::new(DType::F32)],
    );
    let (op, first) = (Arc::new(op), Arc::new(first));
    let calls = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let call = |op: &PyOp, k: i64| {
        let x = Tensor::new(&[1f32, 2., 3.], &cpu()).unwrap();
        match op.call(&[Arg::from(&x), Arg::from(k)]) {
            Ok(y) => {
                let kf = k as f32;
                let got = y[0].to_vec1::<f32>().unwrap();
                if got != [2. + kf, 4. + kf, 6. + kf] {
                    eprintln!("CALL FAILED: {got:?} for k = {k}");
                }
            }
            Err(e) => eprintln!("CALL FAILED: {e}"),
        }
    };
    for t in 0..4 {
        let (op, calls) = (Arc::clone(&op), Arc::clone(&calls));
        std::thread::spawn(move || {
            for i in 0.. {
                call(&op, t * 1_000_000 + i);
                calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
    }
    while calls.load(std::sync::atomic::Ordering::Relaxed) < 20 {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::spawn(move || call(&first, 7));
    std::thread::sleep(Duration::from_millis(delay));
    println!("ending by {ending}");
    match ending.as_str() {
        "return" => {}
        "exit" => {
            let t = std::thread::spawn(|| std::process::exit(3));
            t.join().unwrap();
        }
        "panic" => panic!("the program panics"),
        "sigterm" | "sigint" => {
            let sig = if ending == "sigterm" {
                libc::SIGTERM
            } else {
                libc::SIGINT
            };
            // SAFETY: a plain signal to this process.
            unsafe { libc::kill(libc::getpid(), sig) };
            std::thread::sleep(Duration::from_secs(30));
            eprintln!("CALL FAILED: {ending} did not end the program");
        }
        other => panic!("no ending {other}"),
    }
}

/// Runs `ray_ending_child` `runs` times for each way of ending (`PYOP_RAY_ENDING_RUNS`, 2 by
/// default): every run ends as that way ends a program, no call fails, and once they have all
/// ended no actor of theirs is left on the cluster.
fn ray_programs_end_cleanly(runs: u64) {
    use std::os::unix::process::ExitStatusExt;
    let actors = || processes_naming("ray::PyopHost");
    let before = actors();
    for ending in ["return", "exit", "panic", "sigterm", "sigint"] {
        for run in 0..runs {
            // While the fifth thread's relay imports Ray, joins, and places its actor.
            let delay = [50, 2500, 1200, 600, 1800][run as usize % 5] + run / 5 * 97;
            let mut cmd = Command::new(std::env::current_exe().unwrap());
            cmd.args(["--ignored", "--exact", "ray_ending_child", "--nocapture"])
                .env("RAY_ENDING", ending)
                .env("RAY_ENDING_DELAY_MS", delay.to_string());
            // The program starts with SIGINT and SIGTERM as a program does, whatever this test
            // inherited (a shell's background job starts with SIGINT ignored, and an ignored
            // signal stays ignored across exec: `sigint` would not end it).
            // SAFETY: signal() is async-signal-safe; the closure allocates nothing.
            unsafe {
                use std::os::unix::process::CommandExt;
                cmd.pre_exec(|| {
                    libc::signal(libc::SIGINT, libc::SIG_DFL);
                    libc::signal(libc::SIGTERM, libc::SIG_DFL);
                    Ok(())
                });
            }
            let out = cmd.output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            let what = format!(
                "{ending} run {run} (after {delay} ms): {:?}\n{text}",
                out.status
            );
            assert!(text.contains(&format!("ending by {ending}\n")), "{what}");
            assert!(!text.contains("CALL FAILED"), "{what}");
            let st = out.status;
            let expected = match ending {
                "return" => st.success(),
                "exit" => st.code() == Some(3),
                "panic" => st.code() == Some(101),
                "sigterm" => st.signal() == Some(libc::SIGTERM),
                _ => st.signal() == Some(libc::SIGINT),
            };
            assert!(expected, "{what}");
        }
    }
    // Ray ends a driver's actors once it is gone (the relays end with their program).
    let deadline = Instant::now() + Duration::from_secs(30);
    let left = || -> Vec<u32> {
        actors()
            .into_iter()
            .filter(|p| !before.contains(p))
            .collect()
    };
    while !left().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(left(), [] as [u32; 0], "actors left behind");
    println!("ray endings: {runs} runs each of 5 ways, all clean");
}

/// What a body sees of its process that a Ray driver would change: `sys.modules`, `sys.path`,
/// `os.environ`, `PYTHONBREAKPOINT` and the Python signal handlers, as a checksum and in words.
const SEEN: &str = r#"
import os, signal, sys, zlib
import numpy as np
def seen(x):
    state = repr((sorted(sys.modules), sys.path, sorted(os.environ.items()),
                  [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]))
    return np.array([zlib.crc32(state.encode()), len(sys.modules),
                     "ray" in sys.modules, "PYTHONBREAKPOINT" in os.environ,
                     any("thirdparty_files" in p for p in sys.path)], np.int64)
f = seen
"#;

/// The dispositions of the signals a Ray driver changes, and the program's environment.
fn process_state() -> (Vec<usize>, Vec<(String, String)>) {
    let sigs = [
        libc::SIGTERM,
        libc::SIGINT,
        libc::SIGCHLD,
        libc::SIGPIPE,
        libc::SIGUSR1,
    ]
    .iter()
    .map(|&s| {
        // SAFETY: queries the disposition into a zeroed struct.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(s, std::ptr::null(), &mut old);
            old.sa_sigaction
        }
    })
    .collect();
    (sigs, std::env::vars().collect())
}

/// A Ray pool changes nothing else in the program: what in-program bodies and local workers
/// (started after) see, the signal dispositions and the environment are the same after Ray
/// calls as before.
fn ray_pools_change_nothing_else(address: &str) {
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let i64s = [OutSpec::new(DType::I64)];
    let in_program = PyOp::builder("seen")
        .code(SEEN)
        .numpy()
        .tout(i64s.clone())
        .build()
        .unwrap();
    let seen = |op: &PyOp| {
        op.call(&[Arg::from(&x)]).unwrap()[0]
            .to_vec1::<i64>()
            .unwrap()
    };
    let in_worker = || seen(&worker_op(&WorkerPool::new(1), "seen_w", SEEN, &i64s));
    let _ = (in_worker(), seen(&in_program));
    let before = (seen(&in_program), in_worker(), process_state());
    assert_eq!(
        before.0[2..],
        [0, 0, 0],
        "Ray's marks before any Ray call: {before:?}"
    );
    let pool = WorkerPool::ray(pyop::RayPool::new(1).address(address).num_cpus(0.5));
    let double = ray_op(
        &pool,
        "d",
        "def f(x):\n    return x * 2",
        &[OutSpec::new(DType::F32)],
    );
    assert_eq!(
        double.call(&[Arg::from(&x)]).unwrap()[0]
            .to_vec1::<f32>()
            .unwrap(),
        [2.]
    );
    let after = (seen(&in_program), in_worker(), process_state());
    assert_eq!(
        before, after,
        "what the program and its workers see changed"
    );
}

/// Joining the cluster, `start_workers()`, `validate()` and first calls work from any thread:
/// spawned, a rayon pool's and a tokio runtime's; first calls from 4 threads at once give 4
/// working actors.
fn ray_pools_start_from_any_thread(address: &str) {
    let x = Tensor::new(&[1f32, 2.], &cpu()).unwrap();
    let spec = |n| pyop::RayPool::new(n).address(address).num_cpus(0.25);
    let code = "def f(x):\n    return x + 1";
    let f32s = [OutSpec::new(DType::F32)];
    std::thread::spawn(|| {
        pyop::Validate::ops([pyop::op!(ray_named), pyop::op!(ray_cube)])
            .start_workers()
            .check()
            .unwrap();
    })
    .join()
    .unwrap();
    let rayon = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let pool = WorkerPool::ray(spec(1));
    let op = ray_op(&pool, "from_rayon", code, &f32s);
    rayon.install(|| op.start_workers().unwrap());
    assert_eq!(pool.stats().started, 1);
    let tokio = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let y = tokio.block_on(async {
        tokio::task::spawn_blocking(move || op.call(&[Arg::from(&x)]).unwrap())
            .await
            .unwrap()
    });
    assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2., 3.]);
    assert_eq!(pool.stats().started, 1);

    let pool = WorkerPool::ray(spec(4));
    let op = ray_op(&pool, "first_calls", code, &f32s);
    let barrier = std::sync::Barrier::new(4);
    std::thread::scope(|s| {
        for i in 0..4 {
            let (op, barrier) = (&op, &barrier);
            s.spawn(move || {
                let x = Tensor::new(&[i as f32], &cpu()).unwrap();
                barrier.wait();
                let y = op.call(&[Arg::from(&x)]).unwrap();
                assert_eq!(y[0].to_vec1::<f32>().unwrap(), [i as f32 + 1.]);
            });
        }
    });
    let stats = pool.stats();
    assert_eq!(
        (stats.started, stats.running, stats.calls),
        (4, 4, 4),
        "{stats:?}"
    );
    let pids: std::collections::HashSet<u32> = pool.ray_actors().iter().map(|a| a.pid).collect();
    assert_eq!(pids.len(), 4, "{:?}", pool.ray_actors());
}

fn ray_op(pool: &WorkerPool, name: &str, code: &str, tout: &[OutSpec]) -> PyOp {
    worker_op(pool, name, code, tout)
}

/// The subjects of `ray_pools_keep_the_contract_on_a_two_node_cluster`: each a test of its own,
/// run one after another in one child process on the cluster the parent started (a cluster
/// costs seconds to start; each test starts its own pools).
mod on_cluster {
    use super::*;

    /// The cluster's address, from the parent test.
    pub(super) fn address() -> String {
        std::env::var("PYOP_RAY_ADDRESS")
            .expect("run by ray_pools_keep_the_contract_on_a_two_node_cluster")
    }

    /// Tells the cluster's helper `command` (`remove`, `add`) through its control socket, and
    /// returns its answer.
    pub(super) fn tell(command: &str) -> String {
        use std::io::Write;
        let path = std::env::var("PYOP_RAY_CONTROL").unwrap();
        let mut sock = std::os::unix::net::UnixStream::connect(path).unwrap();
        writeln!(sock, "{command}").unwrap();
        let mut answer = String::new();
        BufReader::new(sock).read_line(&mut answer).unwrap();
        answer
    }

    fn spec(n: usize) -> pyop::RayPool {
        pyop::RayPool::new(n).address(address()).num_cpus(0.5)
    }

    pub(super) fn x() -> Tensor {
        Tensor::new(&[1f32, 2., 3.], &cpu()).unwrap()
    }

    /// A pool of `n` actors, started, and an op on it that doubles `x` and adds `k`.
    fn doubling(n: usize) -> (WorkerPool, PyOp) {
        let pool = WorkerPool::ray(spec(n));
        let double = ray_op(
            &pool,
            "double",
            "def f(x, k):\n    return x * 2 + k",
            &[OutSpec::new(DType::F32)],
        );
        double.start_workers().unwrap();
        (pool, double)
    }

    /// A pool of 2 actors is spread over both nodes; the loopback spelling of the address joins the
    /// same cluster, an address where nothing listens is said so at once; shutting a pool down ends
    /// its idle actors.
    #[test]
    #[ignore = "run on one cluster by ray_pools_keep_the_contract_on_a_two_node_cluster"]
    fn actors_spread_over_both_nodes_and_any_spelling_of_the_address_joins() {
        let x = x();
        // A pool of 2 actors, started side by side: one on each node (`SPREAD`).
        let (pool, _double) = doubling(2);
        let nodes: std::collections::HashSet<String> =
            pool.ray_actors().into_iter().map(|a| a.node).collect();
        assert_eq!(nodes.len(), 2, "{:?}", pool.ray_actors());
        assert_eq!((pool.stats().started, pool.stats().calls), (2, 0));

        // Another spelling of the cluster's address (the loopback address for the head's) joins
        // it too; each relay is a driver of its own, so pools may use different clusters, and one
        // where nothing listens is said so at once.
        let port = address().rsplit(':').next().unwrap().to_owned();
        let looped = WorkerPool::ray(
            pyop::RayPool::new(1)
                .address(format!("127.0.0.1:{port}"))
                .num_cpus(0.5),
        );
        let same = ray_op(
            &looped,
            "same",
            "def f(x): return x",
            &[OutSpec::new(DType::F32)],
        );
        assert_eq!(
            same.call(&[Arg::from(&x)]).unwrap()[0]
                .to_vec1::<f32>()
                .unwrap(),
            [1., 2., 3.]
        );
        drop((same, looped));
        let other = WorkerPool::ray(pyop::RayPool::new(1).address("127.0.0.1:1"));
        let err = ray_op(
            &other,
            "other",
            "def f(x): return x",
            &[OutSpec::new(DType::F32)],
        )
        .call(&[Arg::from(&x)])
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ClusterUnavailable, "{err}");
        assert!(
            err.to_string()
                .contains("cannot reach the Ray cluster at `127.0.0.1:1`"),
            "{err}"
        );

        // Shutting a pool down ends its idle actors (their processes go too).
        let pids: Vec<u32> = pool.ray_actors().iter().map(|a| a.pid).collect();
        assert!(!pids.is_empty());
        pool.shutdown();
        assert_eq!(pool.stats().running, 0, "{:?}", pool.stats());
        let deadline = Instant::now() + Duration::from_secs(10);
        while pids.iter().any(|&p| exists(p)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(pids.iter().all(|&p| !exists(p)), "{pids:?}");
        drop(pool);
    }

    /// The output and exception tables hold as in the program; 8 threads x 200 calls and a
    /// batching op's callers get exact results.
    #[test]
    #[ignore = "run on one cluster by ray_pools_keep_the_contract_on_a_two_node_cluster"]
    fn tables_threads_and_batches_are_exact() {
        let x = x();
        let (pool, double) = doubling(2);

        // The tables, as in the program.
        let make = |code: &str, tout: &[OutSpec]| ray_op(&pool, "rule", code, tout);
        tables::outputs_follow_one_rule_table(&make);
        tables::wrong_outputs_are_errors_naming_op_and_index(&make);
        tables::python_exceptions_keep_kind_message_and_traceback(&make);

        // 8 threads × 200 calls, every result exact.
        let before = pool.stats().calls;
        std::thread::scope(|s| {
            for t in 0..8i64 {
                let (double, x) = (&double, &x);
                s.spawn(move || {
                    for i in 0..200i64 {
                        let k = t * 1000 + i;
                        let y = double.call(&[Arg::from(x), Arg::from(k)]).unwrap();
                        let kf = k as f32;
                        assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2. + kf, 4. + kf, 6. + kf]);
                    }
                });
            }
        });
        assert_eq!(pool.stats().calls - before, 1600);
        assert_eq!(pool.stats().started, 2);
        assert!(pool.stats().bytes_in >= 1600 * 12, "{:?}", pool.stats());

        // A batching op on the Ray pool: concurrent calls are one request to an actor each batch,
        // every caller's rows exact.
        let batched = PyOp::builder("ray_batched")
            .code("def ray_batched(x, k):\n    return x * 2 + k")
            .numpy()
            .pool(&pool)
            .batch(
                pyop::Batch::new(8)
                    .wait(Duration::from_millis(20))
                    .inputs([0]),
            )
            .tout([OutSpec::new(DType::F32)])
            .build()
            .unwrap();
        let before = pool.stats().calls;
        std::thread::scope(|s| {
            for t in 0..6i64 {
                let batched = &batched;
                s.spawn(move || {
                    for i in 0..20i64 {
                        let rows = Tensor::new(&[[t as f32, i as f32]], &cpu()).unwrap();
                        let y = batched.call(&[Arg::from(&rows), Arg::from(1.0)]).unwrap();
                        let want = [[2. * t as f32 + 1., 2. * i as f32 + 1.]];
                        assert_eq!(y[0].to_vec2::<f32>().unwrap(), want);
                    }
                });
            }
        });
        let stats = batched.stats();
        assert_eq!(stats.batched_calls, 120, "{stats:?}");
        assert_eq!(
            pool.stats().calls - before,
            stats.batches,
            "one request a batch"
        );
        assert!(stats.max_batch > 1, "{stats:?}");
        drop(batched);
    }

    /// 200 awaited calls in flight are exact; one dropped mid-call kills its relay, and the next
    /// call works.
    #[test]
    #[ignore = "run on one cluster by ray_pools_keep_the_contract_on_a_two_node_cluster"]
    fn awaited_calls_are_exact_and_a_dropped_one_kills_its_relay() {
        let x = x();
        let (pool, double) = doubling(2);

        // Awaited: 200 calls in flight on a 2-thread runtime, every result exact; one dropped
        // mid-call kills its actor's relay (and the actor with it), and the next call works.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let calls: Vec<_> = (0..200i64)
            .map(|k| rt.spawn(double.call_async(&[Arg::from(&x), Arg::from(k)])))
            .collect();
        for (k, call) in calls.into_iter().enumerate() {
            let y = rt.block_on(call).unwrap().unwrap();
            let kf = k as f32;
            assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2. + kf, 4. + kf, 6. + kf]);
        }
        let sleepy = ray_op(
            &pool,
            "sleepy",
            "import time\ndef f(x, t):\n    time.sleep(t)\n    return x",
            &[OutSpec::new(DType::F32)],
        );
        let call = rt.spawn(sleepy.call_async(&[Arg::from(&x), Arg::from(30.0)]));
        let t = Instant::now();
        while pool.stats().busy == 0 {
            assert!(t.elapsed() < Duration::from_secs(30), "{:?}", pool.stats());
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(200));
        call.abort();
        assert!(rt.block_on(call).unwrap_err().is_cancelled());
        assert_eq!(pool.stats().cancelled, 1, "{:?}", pool.stats());
        let y = rt
            .block_on(sleepy.call_async(&[Arg::from(&x), Arg::from(0.0)]))
            .unwrap();
        assert_eq!(y[0].to_vec1::<f32>().unwrap(), [1., 2., 3.]);
        // (The pool's other actor took it: the pool starts one again when both are needed.)
        let stats = pool.stats();
        assert_eq!((stats.started, stats.running), (2, 1), "{stats:?}");
        drop((sleepy, rt));
    }

    /// A time limit kills the actor (its process gone), an actor killed from outside fails only
    /// the call it ran, and the next calls get new actors.
    #[test]
    #[ignore = "run on one cluster by ray_pools_keep_the_contract_on_a_two_node_cluster"]
    fn a_lost_actor_fails_its_call_only() {
        let x = x();
        let (pool, double) = doubling(2);

        // A time limit kills the actor; the next call gets a new one.
        let slow = PyOp::builder("slow")
            .code("import time\ndef slow(x, t):\n    time.sleep(t)\n    return x")
            .numpy()
            .pool(&pool)
            .timeout(Duration::from_millis(500))
            .tout([OutSpec::new(DType::F32)])
            .build()
            .unwrap();
        let t = Instant::now();
        let err = slow.call(&[Arg::from(&x), Arg::from(30.0)]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert!(err.to_string().contains("Ray actor"), "{err}");
        assert_eq!(pool.stats().timed_out, 1);
        // The actor was killed (its process is gone), not left sleeping, and the pool forgot it.
        let text = err.to_string();
        let pid: u32 = text
            .split("(pid ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while exists(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(!exists(pid), "the timed-out actor {pid} still runs");
        assert!(pool.ray_actors().iter().all(|a| a.pid != pid));
        assert_eq!(
            slow.call(&[Arg::from(&x), Arg::from(0.0)]).unwrap()[0]
                .to_vec1::<f32>()
                .unwrap(),
            [1., 2., 3.]
        );

        // An actor killed from outside during a call fails that call only.
        let pid_then_sleep = ray_op(
            &pool,
            "pid_then_sleep",
            "import os, time\ndef f(x, path):\n    open(path, 'w').write(str(os.getpid()))\n    time.sleep(30)\n    return x",
            &[OutSpec::new(DType::F32)],
        );
        let tmp = common::TempDir::new("ray-kill");
        let path = tmp.path().join("pid").display().to_string();
        let lost_before = pool.stats().lost;
        std::thread::scope(|s| {
            s.spawn(|| {
                let deadline = Instant::now() + Duration::from_secs(30);
                let pid = loop {
                    if let Some(p) = std::fs::read_to_string(&path)
                        .ok()
                        .and_then(|t| t.parse::<i32>().ok())
                    {
                        break p;
                    }
                    assert!(Instant::now() < deadline, "the body never started");
                    std::thread::sleep(Duration::from_millis(20));
                };
                // SAFETY: a plain signal to a process of the cluster.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            });
            let err = pid_then_sleep
                .call(&[Arg::from(&x), Arg::Str(&path)])
                .unwrap_err();
            assert_eq!(err.kind(), ErrorKind::WorkerLost, "{err}");
            let text = err.to_string();
            assert!(
                text.contains(") was lost (") && text.contains(") while running the body"),
                "{err}"
            );
            assert!(text.starts_with("op `pid_then_sleep`: Ray actor "), "{err}");
        });
        assert_eq!(pool.stats().lost, lost_before + 1);
        assert_eq!(
            double.call(&[Arg::from(&x), Arg::from(0i64)]).unwrap()[0]
                .to_vec1::<f32>()
                .unwrap(),
            [2., 4., 6.]
        );
    }

    /// Inputs arrive read-only (small ones inlined by Ray, large ones through its object store),
    /// lists as lists; a 0-d result keeps its shape; `out` is emulated.
    #[test]
    #[ignore = "run on one cluster by ray_pools_keep_the_contract_on_a_two_node_cluster"]
    fn values_cross_as_in_the_program() {
        let x = x();
        let pool = WorkerPool::ray(spec(1));

        // Inputs are read-only on the actors too, small (inlined by Ray) and large (its object store)
        // alike, and a list of tensors arrives as a list.
        let ro = ray_op(
            &pool,
            "read_only",
            "def f(x, ts):\n    assert x.flags.writeable is False\n    \
             assert isinstance(ts, list) and all(t.flags.writeable is False for t in ts)\n    \
             return x.sum() + sum(t.sum() for t in ts)",
            &[OutSpec::new(DType::F64)],
        );
        let big = Tensor::ones(1 << 18, DType::F64, &cpu()).unwrap();
        let small = Tensor::new(&[1f64, 2.], &cpu()).unwrap();
        let ts = [big.clone(), small.clone()];
        let total = ro.call(&[Arg::from(&small), Arg::from(&ts[..])]).unwrap()[0]
            .to_scalar::<f64>()
            .unwrap();
        assert_eq!(total, 6.0 + f64::from(1 << 18));

        // A 0-d result keeps its shape, as in the program.
        let zero_d = ray_op(
            &pool,
            "zero_d",
            "def f(x):\n    return np.array(3.5)",
            &[OutSpec::new(DType::F64)],
        );
        let y = zero_d.call(&[Arg::from(&x)]).unwrap();
        assert_eq!(y[0].dims(), [] as [usize; 0]);
        assert_eq!(y[0].to_scalar::<f64>().unwrap(), 3.5);

        // `out`, emulated: the actor gives the body arrays and sends back what it wrote.
        let out_op = PyOp::builder("with_out")
            .code("def with_out(x, out):\n    out[...] = x + 1")
            .numpy()
            .pool(&pool)
            .tout([OutSpec::like(DType::F32, 0)])
            .build()
            .unwrap();
        assert_eq!(
            out_op.call(&[Arg::from(&x)]).unwrap()[0]
                .to_vec1::<f32>()
                .unwrap(),
            [2., 3., 4.]
        );
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

    /// Starting actors waits for no call and no other start; a dropped op's module is unloaded
    /// from the actor that loaded it.
    #[test]
    #[ignore = "run on one cluster by ray_pools_keep_the_contract_on_a_two_node_cluster"]
    fn starts_never_wait_and_dropped_ops_unload() {
        let x = x();
        // Starting a pool's actors never waits for a call or for another start: two at once, while
        // a call holds an actor, return at once.
        let busy_pool = WorkerPool::ray(spec(2));
        let napper = ray_op(
            &busy_pool,
            "napper",
            "import time\ndef f(x):\n    time.sleep(15)\n    return x",
            &[OutSpec::new(DType::F32)],
        );
        std::thread::scope(|s| {
            let call = s.spawn(|| napper.call(&[Arg::from(&x)]).unwrap());
            // (The call's actor starts first: its relay imports Ray, joins, and places it.)
            while busy_pool.stats().busy == 0 || busy_pool.ray_actors().is_empty() {
                std::thread::sleep(Duration::from_millis(20));
            }
            let t = Instant::now();
            let starts: Vec<_> = (0..2)
                .map(|_| s.spawn(|| napper.start_workers().unwrap()))
                .collect();
            starts.into_iter().for_each(|h| h.join().unwrap());
            assert!(!call.is_finished(), "the starts waited for the call");
            assert!(t.elapsed() < Duration::from_secs(12), "{:?}", t.elapsed());
            assert_eq!(busy_pool.stats().started, 2);
        });
        drop((napper, busy_pool));

        // A dropped op's module is unloaded from the actor that loaded it.
        let solo = WorkerPool::ray(pyop::RayPool::new(1).address(address()).num_cpus(0.5));
        let count = ray_op(
            &solo,
            "count_modules",
            "import sys\ndef f(x):\n    \
             return np.array([len(sys._getframe(1).f_locals['self']._modules)], np.float32)",
            &[OutSpec::new(DType::F32)],
        );
        let modules = || {
            count.call(&[Arg::from(&x)]).unwrap()[0]
                .to_vec1::<f32>()
                .unwrap()
        };
        assert_eq!(modules(), [1.]);
        for i in 0..3 {
            let op = ray_op(
                &solo,
                &format!("dropped{i}"),
                "def f(x):\n    return x",
                &[OutSpec::new(DType::F32)],
            );
            op.call(&[Arg::from(&x)]).unwrap();
        }
        assert_eq!(modules(), [1.], "only the counting op's module is left");
        drop((count, solo));
    }

    /// A declared op in a named pool that `PYOP_RAY_POOLS` puts on the cluster is validated there,
    /// and its registered Python gradient runs there too.
    #[test]
    #[ignore = "run on one cluster by ray_pools_keep_the_contract_on_a_two_node_cluster"]
    fn declared_ops_validate_and_take_gradients_there() {
        let x = x();
        // A declared op in a named pool that PYOP_RAY_POOLS puts on the cluster, validated there,
        // and a registered Python gradient that runs there too.
        pyop::Validate::ops([pyop::op!(ray_named), pyop::op!(ray_cube)])
            .check()
            .unwrap();
        assert_eq!(
            ray_named(&x).unwrap().to_vec1::<f32>().unwrap(),
            [2., 4., 6.]
        );
        let named = WorkerPool::find("ray_named").unwrap();
        assert!(!named.ray_actors().is_empty());
        let v = Var::new(&[1f64, -2., 0.5], &cpu()).unwrap();
        let y = ray_cube(v.as_tensor()).unwrap();
        assert_eq!(y.to_vec1::<f64>().unwrap(), [1., -8., 0.125]);
        let grads = y.sum_all().unwrap().backward().unwrap();
        assert_eq!(
            grads.get(v.as_tensor()).unwrap().to_vec1::<f64>().unwrap(),
            [3., 12., 0.75]
        );
    }

    /// With `PYOP_HOT_RELOAD`, a changed body file reaches both actors of a pool.
    #[test]
    #[ignore = "run on one cluster by ray_pools_keep_the_contract_on_a_two_node_cluster"]
    fn hot_reload_reaches_every_actor() {
        let x = x();
        let pool = WorkerPool::ray(spec(2));

        // Hot reload reaches every actor.
        let dir = common::TempDir::new("ray-reload");
        let file = dir.path().join("rbody.py");
        std::fs::write(&file, "def rbody(x):\n    return x + 1\n").unwrap();
        let reloaded = PyOp::builder("rbody")
            .file(&file)
            .unwrap()
            .numpy()
            .pool(&pool)
            .tout([OutSpec::new(DType::F32)])
            .build()
            .unwrap();
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    assert_eq!(
                        reloaded.call(&[Arg::from(&x)]).unwrap()[0]
                            .to_vec1::<f32>()
                            .unwrap(),
                        [2., 3., 4.]
                    )
                });
            }
        });
        std::thread::sleep(Duration::from_millis(1100));
        std::fs::write(&file, "def rbody(x):\n    return x * 10\n").unwrap();
        for _ in 0..6 {
            assert_eq!(
                reloaded.call(&[Arg::from(&x)]).unwrap()[0]
                    .to_vec1::<f32>()
                    .unwrap(),
                [10., 20., 30.]
            );
        }
    }

    /// A program that used a Ray pool exits cleanly however it ends, whatever its threads are
    /// doing, also right after an actor was killed on a time limit.
    #[test]
    #[ignore = "run on one cluster by ray_pools_keep_the_contract_on_a_two_node_cluster"]
    fn programs_end_cleanly() {
        // A program that used a Ray pool exits cleanly however it ends, whatever its threads are
        // doing, also right after an actor was killed on a time limit.
        let runs = std::env::var("PYOP_RAY_ENDING_RUNS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2);
        ray_programs_end_cleanly(runs);
        for run in 0..2 {
            let out = Command::new(std::env::current_exe().unwrap())
                .args(["--ignored", "--exact", "ray_exit_child", "--nocapture"])
                .env("RAY_EXIT_KILL", if run % 2 == 1 { "1" } else { "" })
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            assert!(text.contains("running 1 test\n"), "{text}");
            assert!(out.status.success(), "run {run}: {:?}\n{text}", out.status);
        }
    }
}

/// The subjects that need a program that has not used Ray before (the parent test runs each in
/// a process of its own, on the shared cluster).
mod alone {
    use super::on_cluster::{address, tell, x};
    use super::*;

    /// See `ray_pools_change_nothing_else`: the state before is taken before any Ray call.
    #[test]
    #[ignore = "run alone on the cluster by ray_pools_keep_the_contract_on_a_two_node_cluster"]
    fn pools_change_nothing_else() {
        super::ray_pools_change_nothing_else(&address());
    }

    /// See `ray_pools_start_from_any_thread`: the declared ops' first start is from a spawned
    /// thread.
    #[test]
    #[ignore = "run alone on the cluster by ray_pools_keep_the_contract_on_a_two_node_cluster"]
    fn pools_start_from_any_thread() {
        super::ray_pools_start_from_any_thread(&address());
    }

    /// A node removed during a call fails that call as `WorkerLost`; with a node back, the next
    /// call succeeds. (Last, in a process of its own: the tests before it have the cluster as it
    /// started; a node added again was once declared dead under load while a later test used it.)
    #[test]
    #[ignore = "run alone on the cluster by ray_pools_keep_the_contract_on_a_two_node_cluster"]
    fn a_removed_node_fails_its_call_and_a_new_one_serves() {
        let x = x();
        // A node removed during a call: the call fails as `WorkerLost`; with a node back, the next
        // call succeeds. (No CPU: the named pool's actors, one CPU each, may hold both of the
        // node's.)
        let on_extra = WorkerPool::ray(
            pyop::RayPool::new(1)
                .address(address())
                .num_cpus(0.0)
                .resource("extra", 1.0),
        );
        let nap = ray_op(
            &on_extra,
            "nap",
            "import time\ndef f(x, t):\n    time.sleep(t)\n    return x",
            &[OutSpec::new(DType::F32)],
        );
        nap.call(&[Arg::from(&x), Arg::from(0.0)]).unwrap();
        let err = std::thread::scope(|s| {
            let call = s.spawn(|| nap.call(&[Arg::from(&x), Arg::from(30.0)]));
            std::thread::sleep(Duration::from_millis(500));
            assert!(tell("remove").contains("removed"));
            // The node comes back whatever happens to this test: later ones need both.
            struct Back;
            impl Drop for Back {
                fn drop(&mut self) {
                    if std::thread::panicking() {
                        tell("add");
                    }
                }
            }
            let _back = Back;
            call.join().unwrap().unwrap_err()
        });
        assert_eq!(err.kind(), ErrorKind::WorkerLost, "{err}");
        assert!(tell("add").contains("added"));
        assert_eq!(
            nap.call(&[Arg::from(&x), Arg::from(0.0)]).unwrap()[0]
                .to_vec1::<f32>()
                .unwrap(),
            [1., 2., 3.]
        );
        assert_eq!(on_extra.stats().lost, 1);
        drop(on_extra);
    }
}

/// A cluster that cannot be reached is a `ClusterUnavailable` error at the call, naming the
/// address and how to start one, without Ray's tens of seconds of retries.
#[test]
fn an_unreachable_ray_cluster_is_a_clear_error() {
    // A port nothing listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let pool = WorkerPool::ray(pyop::RayPool::new(1).address(format!("127.0.0.1:{port}")));
    let op = worker_op(
        &pool,
        "unreachable",
        "def f(x): return x",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let t = Instant::now();
    let err = op.call(&[Arg::from(&x)]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ClusterUnavailable, "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&format!(
            "cannot reach the Ray cluster at `127.0.0.1:{port}`"
        )),
        "{text}"
    );
    assert!(text.contains("ray start --head"), "{text}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(pool.stats().started, 0);
    // `local` would start a cluster in each relay, ending with it: refused, naming why.
    let pool = WorkerPool::ray(pyop::RayPool::new(1).address("local"));
    let op = worker_op(
        &pool,
        "local",
        "def f(x): return x",
        &[OutSpec::new(DType::F32)],
    );
    let err = op.call(&[Arg::from(&x)]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ClusterUnavailable, "{err}");
    assert!(
        err.to_string()
            .contains("the Ray address `local` would start a one-machine cluster in each"),
        "{err}"
    );
    assert_eq!(pool.stats().started, 0);
}

/// Ray missing from the program's environment is a `PackageUnavailable` error naming the pip
/// command that installs it, for every call (each tries again: a relay that finds no Ray costs a
/// fork and a failed import).
#[test]
fn a_ray_pool_without_ray_installed_names_the_fix() {
    let tmp = common::TempDir::new("no-ray");
    let fake = tmp.path().join("ray");
    std::fs::create_dir(&fake).unwrap();
    std::fs::write(
        fake.join("__init__.py"),
        "raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n",
    )
    .unwrap();
    let (ok, out) = common::child_test(
        module_path!(),
        "no_ray_child",
        &[("PYTHONPATH", Some(tmp.path().as_os_str()))],
    );
    assert!(ok, "{out}");
}

/// Run by `a_ray_pool_without_ray_installed_names_the_fix`, with a `ray` that cannot be imported
/// first on the path.
#[test]
#[ignore = "a child process of a_ray_pool_without_ray_installed_names_the_fix"]
fn no_ray_child() {
    let pool = WorkerPool::ray(pyop::RayPool::new(1));
    let op = worker_op(
        &pool,
        "no_ray",
        "def f(x): return x",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    for _ in 0..2 {
        let err = op.call(&[Arg::from(&x)]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::PackageUnavailable, "{err}");
        let text = err.to_string();
        assert!(
            text.contains("a Ray pool needs Ray in the program's Python environment"),
            "{text}"
        );
        assert!(
            text.contains("ModuleNotFoundError: No module named 'ray'"),
            "{text}"
        );
        assert!(text.contains("pip install ray"), "{text}");
    }
    assert_eq!(pool.stats().started, 0);
}
