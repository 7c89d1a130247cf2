//! `cargo bench --bench summary`: one line per case, `case=<name> median_us=<number>`, the median
//! of REPS (default 5) timed runs, with the same bodies and sizes as `../shared/bench/peers.py`
//! (SIZES=1,1048576,16777216 by default) so the two can be put side by side as ratios.
//! `candle_plus1_N` is candle's own `x + 1` called from Rust: what tensor mode's `x + 1` body
//! costs without pyop. `DEVICE=cuda` runs the op cases on the GPU (with `--features cuda`).

use std::future::Future;
use std::time::{Duration, Instant};

use pyop::candle::{DType, Device, Tensor, Var};
use pyop::interop::pyo3::prelude::*;
use pyop::{py_op, Arg, OutSpec, PyOp};

#[py_op(code = "def ident(x):\n    return x", name = "ident", numpy, tout = f32)]
fn numpy_ident(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "import numpy as np\ndef plus1(x, out=None):\n    return np.add(x, np.float32(1), out=out)", name = "plus1", numpy, tout = f32[x])]
fn numpy_plus1(x: &Tensor) -> pyop::Result<Tensor>;

/// The natural body: returns a fresh NumPy array, which becomes the tensor without a copy (pyop
/// adopts its buffer) or, where it cannot, is copied into candle memory.
#[py_op(code = "import numpy as np\ndef plus1(x):\n    return x + np.float32(1)", name = "plus1", numpy, tout = f32[x])]
fn numpy_plus1copy(x: &Tensor) -> pyop::Result<Tensor>;

/// The copy path proper: the body keeps a reference to the array it returns, so pyop cannot
/// adopt it and copies it (one `memcpy`).
#[py_op(code = "import numpy as np\nkept = None\ndef plus1(x):\n    global kept\n    kept = x + np.float32(1)\n    return kept", name = "plus1", numpy, tout = f32[x])]
fn numpy_plus1kept(x: &Tensor) -> pyop::Result<Tensor>;

/// The copy path's slower forms: a reversed (negative-stride) array, and an unaligned one.
#[py_op(code = "import numpy as np\ndef plus1(x):\n    return (x + np.float32(1))[::-1]", name = "plus1", numpy, tout = f32[x])]
fn numpy_plus1rev(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "import numpy as np\ndef plus1(x):\n    y = np.empty(x.nbytes + 1, np.uint8)[1:].view(np.float32)\n    return np.add(x, np.float32(1), out=y)", name = "plus1", numpy, tout = f32[x])]
fn numpy_plus1unaligned(x: &Tensor) -> pyop::Result<Tensor>;

/// `x + 1` in numpy mode with `dlpack`: the input taken through DLPack where it is (NumPy on the
/// CPU, CuPy, else torch, on CUDA) and the result read back by pyop's DLPack import (device to
/// device on CUDA).
#[py_op(code = "import numpy as np\ndef plus1(x):\n    if x.__dlpack_device__()[0] == 1:\n        return np.from_dlpack(x) + np.float32(1)\n    try:\n        import cupy\n        return cupy.from_dlpack(x) + cupy.float32(1)\n    except ImportError:\n        import torch\n        return torch.from_dlpack(x) + 1", name = "plus1", numpy, dlpack, tout = f32[x])]
fn dlpack_plus1(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def ident(x):\n    return x", name = "ident", numpy, workers = 1, tout = f32)]
fn worker_ident(x: &Tensor) -> pyop::Result<Tensor>;

/// A body that spends its time in NumPy's BLAS: its threads compete with the other worker's
/// unless the pool shares the cores among them (`OPENBLAS_NUM_THREADS=2` shows the cost).
#[py_op(code = "def matmul(x):\n    return x @ x", name = "matmul", numpy, workers = 2, tout = f64)]
fn matmul_workers(x: &Tensor) -> pyop::Result<Tensor>;

/// A Python-bound body of about 1 ms (a Python loop): what a tokeniser or a parser costs.
const PYLOOP: &str = "def pyloop(x, n):\n    s = 0\n    for i in range(n):\n        s += i % 7\n    return x + (s % 2)";

#[py_op(code = PYLOOP, name = "pyloop", numpy, tout = f32)]
fn pyloop_in_process(x: &Tensor, n: usize) -> pyop::Result<Tensor>;

#[py_op(code = PYLOOP, name = "pyloop", numpy, workers = 2, tout = f32)]
fn pyloop_workers(x: &Tensor, n: usize) -> pyop::Result<Tensor>;

/// The same loop timed by itself, inside the body (`time.perf_counter` around it): where a
/// Python loop runs faster or slower, apart from any call's cost.
const PYLOOP_TIMED: &str = "import time\nimport numpy as np\ndef pyloop(x, n):\n    t = time.perf_counter()\n    s = 0\n    for i in range(n):\n        s += i % 7\n    return np.float64(time.perf_counter() - t)";

#[py_op(code = PYLOOP_TIMED, name = "pyloop", numpy, tout = f64)]
fn pyloop_timed_in_process(x: &Tensor, n: usize) -> pyop::Result<Tensor>;

#[py_op(code = PYLOOP_TIMED, name = "pyloop", numpy, workers = 1, tout = f64)]
fn pyloop_timed_worker(x: &Tensor, n: usize) -> pyop::Result<Tensor>;

#[py_op(code = "def ident(x):\n    return x", name = "ident", tout = f32)]
fn tensor_ident(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def plus1(x):\n    return x + 1", name = "plus1", tout = f32)]
fn tensor_plus1(x: &Tensor) -> pyop::Result<Tensor>;

const SQUARE: &str = "def square(x):\n    return x * x\n\ndef square_grad(inputs, outputs, grads):\n    return grads[0] * 2 * inputs[0]\n";

#[py_op(code = "def square(x):\n    return x * x\n\ndef square_grad(inputs, outputs, grads):\n    return grads[0] * 2 * inputs[0]\n", numpy, tout = f32, grad = "square_grad")]
fn square(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "import numpy as np\ndef reduce(x):\n    return np.float32(x.sum())", numpy, tout = f32)]
fn reduce(x: &Tensor) -> pyop::Result<Tensor>;

fn device() -> Device {
    match std::env::var("DEVICE").as_deref() {
        Ok("cuda") => Device::new_cuda(0).expect("DEVICE=cuda needs a GPU and --features cuda"),
        _ => Device::Cpu,
    }
}

fn reps() -> usize {
    std::env::var("REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5)
}

fn sizes() -> Vec<usize> {
    std::env::var("SIZES")
        .ok()
        .map(|v| {
            v.split(',')
                .map(|s| s.trim().parse().expect("SIZES"))
                .collect()
        })
        .unwrap_or_else(|| vec![1, 1 << 20, 1 << 24])
}

fn calls_for(size: usize) -> usize {
    // `CALLS` sets the count of every case (scripts/callgrind.sh counts instructions per call
    // from two runs that differ only in it).
    if let Some(n) = std::env::var("CALLS").ok().and_then(|v| v.parse().ok()) {
        return n;
    }
    if size <= 1 {
        2000
    } else if size <= 1 << 20 {
        50
    } else {
        10
    }
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

/// Set while a warm-up round runs: its results are not printed.
static WARMING_UP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn warming_up() -> bool {
    WARMING_UP.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether `case` runs: all do unless `CASES` (comma-separated parts of names, or whole names
/// ending in `$`) picks some.
fn wanted(case: &str) -> bool {
    std::env::var("CASES").map_or(true, |cases| {
        cases
            .split(',')
            .map(str::trim)
            .any(|part| match part.strip_suffix('$') {
                Some(whole) => case == whole,
                None => case.contains(part),
            })
    })
}

/// Runs case `case` (if [`wanted`]) and prints its median time per call.
fn report(case: &str, f: impl FnOnce() -> Duration) {
    if !wanted(case) {
        return;
    }
    let per_call = f();
    if warming_up() {
        return;
    }
    println!("case={case} median_us={:.3}", per_call.as_secs_f64() * 1e6);
}

/// Minor page faults of this process so far (`getrusage`): a fresh output buffer costs one per
/// 4 KiB page it touches, which is most of what separates a copy from `memcpy` speed.
fn minor_faults() -> i64 {
    // SAFETY: getrusage fills the zeroed struct it is given.
    unsafe {
        let mut r: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut r);
        r.ru_minflt
    }
}

/// [`report`], with the page faults per call taken while `f` ran (`n` calls per timed run).
fn report_faults(case: &str, n: usize, f: impl FnOnce() -> Duration) {
    if !wanted(case) {
        return;
    }
    let before = minor_faults();
    let per_call = f();
    let faults = (minor_faults() - before) as f64 / ((reps() + 1) * n) as f64;
    if warming_up() {
        return;
    }
    println!(
        "case={case} median_us={:.3} faults_per_call={faults:.1}",
        per_call.as_secs_f64() * 1e6
    );
}

/// `memcpy_N`: N f32 copied from a Rust buffer into a fresh output buffer of the kind pyop's
/// outputs get (the same allocation), chained like the op cases: the floor of any copy path.
fn memcpy(n: usize, x: &Tensor) -> Duration {
    let src: Vec<f32> = x.to_vec1().unwrap();
    chained(n, x, |_| Ok(pyop::__private::output_copied_from(&src)))
}

/// Median per-call time of `n` chained calls `a = f(a)`, over REPS runs after one untimed run.
fn chained(n: usize, x: &Tensor, f: impl Fn(&Tensor) -> pyop::Result<Tensor>) -> Duration {
    // One untimed run first, as `python_loop` does: the allocator reaches the state it keeps.
    let mut a = x.clone();
    for _ in 0..n.max(3) {
        a = f(&a).unwrap();
    }
    drop(a);
    median(
        (0..reps())
            .map(|_| {
                let t = Instant::now();
                let mut a = x.clone();
                for _ in 0..n {
                    a = f(&a).unwrap();
                }
                t.elapsed() / n as u32
            })
            .collect(),
    )
}

/// Median seconds per iteration of `body` run `n` times in a Python loop after `setup`, over
/// REPS runs, timed in Python in this process, in a fresh context: with NumPy's own data
/// allocator, not the one pyop installs in threads that ran numpy-mode bodies.
fn python_loop(setup: &str, body: &str, n: usize) -> Duration {
    Python::attach(|py| {
        let code = format!(
            "import numpy as np, time, contextvars\n{setup}\n\
             def run():\n    a = start\n    t = time.perf_counter()\n    for _ in range({n}):\n        {body}\n    return (time.perf_counter() - t) / {n}\n\
             def median():\n    run()\n    times = sorted(run() for _ in range({reps}))\n    return times[len(times) // 2]\n\
             result = contextvars.Context().run(median)\n",
            reps = reps()
        );
        let globals = pyo3::types::PyDict::new(py);
        py.run(&std::ffi::CString::new(code).unwrap(), Some(&globals), None)
            .unwrap();
        let result = globals.get_item("result").unwrap().unwrap();
        Duration::from_secs_f64(result.extract().unwrap())
    })
}

/// The plain Python `x + 1` body on a NumPy array, chained in a Python loop, in this process.
fn python_plus1(size: usize, n: usize) -> Duration {
    let setup = format!(
        "def plus1(x):\n    return x + np.float32(1)\nstart = np.zeros({size}, np.float32)"
    );
    python_loop(&setup, "a = plus1(a)", n)
}

/// The registered gradient function called directly from Python.
fn pygrad_body(n: usize) -> Duration {
    let setup = format!(
        "{SQUARE}\nx = np.array(1.5, np.float32); y = square(x); g = np.array(1.0, np.float32)\nstart = None"
    );
    python_loop(&setup, "square_grad((x,), (y,), (g,))", n)
}

fn backward_pygrad(n: usize) -> Duration {
    let x = Var::new(1.5f32, &Device::Cpu).unwrap();
    let step = || {
        let y = square(x.as_tensor()).unwrap();
        let g = y.backward().unwrap();
        assert_eq!(g.get(&x).unwrap().to_scalar::<f32>().unwrap(), 3.0);
    };
    for _ in 0..10 {
        step();
    }
    median(
        (0..reps())
            .map(|_| {
                let t = Instant::now();
                for _ in 0..n {
                    step();
                }
                t.elapsed() / n as u32
            })
            .collect(),
    )
}

/// How late a 10 ms time limit interrupts a pure-Python busy loop: the median of (call time −
/// 10 ms), with `busy` other threads running Python bodies meanwhile (they compete for the GIL,
/// which the watchdog needs to raise the interrupt).
fn timeout_latency(busy: usize, calls: usize) -> Duration {
    let limit = Duration::from_millis(10);
    let spin = PyOp::builder("spin")
        .code("def spin(x):\n    while True:\n        pass")
        .tout([OutSpec::new(DType::F32)])
        .timeout(limit)
        .build()
        .unwrap();
    let work = PyOp::builder("work")
        .code("def work(x):\n    s = 0\n    for i in range(20000):\n        s += i\n    return x")
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap();
    let x = Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..busy {
            s.spawn(|| {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    work.call(&[Arg::from(&x)]).unwrap();
                }
            });
        }
        let late = (0..calls)
            .map(|_| {
                let t = Instant::now();
                assert!(spin.call(&[Arg::from(&x)]).is_err());
                t.elapsed().saturating_sub(limit)
            })
            .collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        median(late)
    })
}

/// Time per call, as seen by total throughput, with `threads` Rust threads each making `calls`
/// calls of `call` (once untimed, then REPS timed runs).
fn threaded(threads: usize, calls: usize, call: impl Fn() + Sync) -> Duration {
    threaded_once(threads, 1, &call);
    median(
        (0..reps())
            .map(|_| threaded_once(threads, calls, &call))
            .collect(),
    )
}

/// One timed run of [`threaded`].
fn threaded_once(threads: usize, calls: usize, call: &(impl Fn() + Sync)) -> Duration {
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| (0..calls).for_each(|_| call()));
        }
    });
    t.elapsed() / (threads * calls.max(1)) as u32
}

/// `threaded` over `reduce`, a body that releases the GIL for its work.
fn threads_call(threads: usize, calls: usize) -> Duration {
    let x = Tensor::ones(4 << 20, DType::F32, &Device::Cpu).unwrap();
    threaded(threads, calls, || {
        reduce(&x).unwrap();
    })
}

/// Threads kept for a group's short runs, as a service keeps its pool's: each run hands every
/// one `calls` calls of a job and waits for them all. (Threads spawned for each short run cost
/// their start, and pyop its per-thread state, on every run: in the program that lands on the
/// CPU the GIL leaves idle, in a worker case on the CPUs the workers need.)
struct Crew {
    jobs: Vec<std::sync::mpsc::Sender<(usize, Job)>>,
    done: std::sync::mpsc::Receiver<()>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

type Job = std::sync::Arc<dyn Fn() + Send + Sync>;

impl Crew {
    fn new(n: usize) -> Crew {
        let (done_tx, done) = std::sync::mpsc::channel();
        let (jobs, threads) = (0..n)
            .map(|_| {
                let (tx, rx) = std::sync::mpsc::channel::<(usize, Job)>();
                let done = done_tx.clone();
                let thread = std::thread::spawn(move || {
                    while let Ok((calls, job)) = rx.recv() {
                        (0..calls).for_each(|_| job());
                        done.send(()).unwrap();
                    }
                });
                (tx, thread)
            })
            .unzip();
        Crew {
            jobs,
            done,
            threads,
        }
    }

    /// One timed run: `calls` calls of `job` on every thread; the time per call.
    fn run(&self, calls: usize, job: &Job) -> Duration {
        let t = Instant::now();
        for tx in &self.jobs {
            tx.send((calls, job.clone())).unwrap();
        }
        for _ in &self.jobs {
            self.done.recv().unwrap();
        }
        t.elapsed() / (self.jobs.len() * calls.max(1)) as u32
    }
}

impl Drop for Crew {
    fn drop(&mut self) {
        self.jobs.clear();
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
    }
}

/// One timed run of the ~1 ms Python loop `f` on `crew`'s threads (`pyloop_group` times them in
/// turns).
fn pyloop_threads(
    crew: &Crew,
    calls: usize,
    iters: usize,
    f: fn(&Tensor, usize) -> pyop::Result<Tensor>,
) -> Duration {
    let x = Tensor::zeros(16, DType::F32, &Device::Cpu).unwrap();
    let job: Job = std::sync::Arc::new(move || {
        f(&x, iters).unwrap();
    });
    crew.run(calls, &job)
}

/// Loop iterations that make `pyloop` take about 1 ms here, in the program (measured each run).
fn pyloop_iters() -> usize {
    // `PYLOOP_ITERS` fixes it (to compare runs).
    if let Some(n) = std::env::var("PYLOOP_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return n;
    }
    let x = Tensor::zeros(16, DType::F32, &Device::Cpu).unwrap();
    let n = 20_000;
    pyloop_in_process(&x, n).unwrap();
    let t = Instant::now();
    for _ in 0..5 {
        pyloop_in_process(&x, n).unwrap();
    }
    let per = t.elapsed() / 5;
    ((n as f64) * 1e-3 / per.as_secs_f64()).round().max(1.0) as usize
}

/// The loop of `PYLOOP_TIMED` in `procs` plain `python -c` processes at once (the venv's
/// interpreter), with NumPy imported as in a worker: the median of `calls` timed loops of `iters`
/// iterations in each, averaged over the processes. Two at once on two CPUs give the most two
/// workers can do here: each runs the loop a little slower than one alone (the CPUs share the
/// host's caches and memory).
fn python_process_loop(iters: usize, calls: usize, procs: usize) -> Duration {
    let python = venv_python();
    let code = format!(
        "import time, numpy\n\
         def pyloop(n):\n    t = time.perf_counter()\n    s = 0\n    for i in range(n):\n        s += i % 7\n    return time.perf_counter() - t\n\
         [pyloop({iters}) for _ in range(5)]\n\
         ts = sorted(pyloop({iters}) for _ in range({calls}))\n\
         print(ts[len(ts) // 2])"
    );
    let children: Vec<_> = (0..procs)
        .map(|_| {
            std::process::Command::new(&python)
                .args(["-c", &code])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let total: f64 = children
        .into_iter()
        .map(|child| {
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout)
                .unwrap()
                .trim()
                .parse::<f64>()
                .unwrap()
        })
        .sum();
    Duration::from_secs_f64(total / procs as f64)
}

/// `pingpong_python_pyloop`: what one thread calling the ~1 ms loop in another process costs on
/// this machine without pyop: a plain `python -c` forks a child that runs the loop for each 8
/// bytes it reads from a socket pair and answers 8 bytes (both sides blocking), and times, in
/// turns (`runs` short runs of `calls` each), the loop called in the child and run in itself.
/// Returns the medians per call: (in the child, round trip included; in the parent). Their
/// ratio is the floor of "1 thread: workers ÷ program" here (two processes' caches and the
/// machine's wake-ups, with nothing of pyop's). `placement`: where the scheduler puts the two
/// (`free`), or both pinned to one CPU (`same`: no CPU is woken, each hands the other the one it
/// runs on), or to two (`split`: every message wakes the other's CPU from idle); `None` for
/// `split` with one CPU allowed.
fn python_pair_loop(
    iters: usize,
    calls: usize,
    runs: usize,
    placement: &str,
) -> Option<(Duration, Duration)> {
    let code = format!(
        "import os, socket, sys, time\n\
         def pyloop(n):\n    s = 0\n    for i in range(n):\n        s += i % 7\n    return s\n\
         cpus = sorted(os.sched_getaffinity(0))\n\
         pin = {{'free': None, 'same': (cpus[0], cpus[0]), 'split': (cpus[0], cpus[-1])}}['{placement}']\n\
         if pin and pin[0] == pin[1] and '{placement}' == 'split':\n    print('nan nan'); sys.exit()\n\
         if pin:\n    os.sched_setaffinity(0, {{pin[0]}})\n\
         a, b = socket.socketpair()\n\
         if os.fork() == 0:\n    a.close()\n    if pin:\n        os.sched_setaffinity(0, {{pin[1]}})\n    while b.recv(8):\n        pyloop({iters})\n        b.sendall(bytes(8))\n    os._exit(0)\n\
         b.close()\n\
         def child():\n    t = time.perf_counter()\n    for _ in range({calls}):\n        a.sendall(bytes(8)); a.recv(8)\n    return (time.perf_counter() - t) / {calls}\n\
         def parent():\n    t = time.perf_counter()\n    for _ in range({calls}):\n        pyloop({iters})\n    return (time.perf_counter() - t) / {calls}\n\
         child(); parent()\n\
         runs = [(child(), parent()) for _ in range({runs})]\n\
         med = lambda xs: sorted(xs)[len(xs) // 2]\n\
         print(med([c for c, _ in runs]), med([p for _, p in runs]))\n\
         a.close()"
    );
    let out = std::process::Command::new(venv_python())
        .args(["-c", &code])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let t: Vec<f64> = text
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect();
    (t[0].is_finite() && t[1].is_finite())
        .then(|| (Duration::from_secs_f64(t[0]), Duration::from_secs_f64(t[1])))
}

/// The venv's interpreter, as `scripts/dev.sh` sets it up (its NumPy), else `python3`.
fn venv_python() -> std::path::PathBuf {
    std::env::var_os("VIRTUAL_ENV").map_or("python3".into(), |v| {
        std::path::Path::new(&v).join("bin/python")
    })
}

/// `python_numpy_start`: a plain `python -c "import numpy"` of that interpreter, start to exit,
/// median of REPS: what a worker start is measured against.
fn python_numpy_start() -> Duration {
    let python = venv_python();
    let once = || {
        let t = Instant::now();
        let status = std::process::Command::new(&python)
            .args(["-c", "import numpy"])
            .status()
            .unwrap();
        assert!(status.success());
        t.elapsed()
    };
    once();
    median((0..reps()).map(|_| once()).collect())
}

/// The environment variable that makes this binary the echoing peer of `ipc_pingpong_blocking`.
const ECHO_PEER: &str = "PYOP_BENCH_ECHO_PEER";

/// The peer of `ipc_pingpong_blocking`: reads 4 bytes from fd 3 and writes them back, blocking,
/// until the socket closes. Runs before anything else in `main`.
fn echo_peer() -> ! {
    use std::io::{Read, Write};
    use std::os::fd::FromRawFd;
    // SAFETY: the parent put the socket on fd 3 for this process, and nothing else owns it.
    let mut sock = unsafe { std::os::unix::net::UnixStream::from_raw_fd(3) };
    let mut buf = [0u8; 4];
    while sock.read_exact(&mut buf).is_ok() {
        if sock.write_all(&buf).is_err() {
            break;
        }
    }
    std::process::exit(0)
}

/// `ipc_pingpong_blocking`: the round trip of 4 bytes between this process and another over a
/// socket pair, both sides blocking in `read` (no spinning): the floor a worker's round trip is
/// measured against.
struct PingPong {
    ours: std::os::unix::net::UnixStream,
    child: std::process::Child,
}

impl PingPong {
    fn start() -> PingPong {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = theirs.as_raw_fd();
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.env(ECHO_PEER, "1");
        // SAFETY: dup2 is async-signal-safe; the closure allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(fd, 3) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        drop(theirs);
        let mut p = PingPong { ours, child };
        p.timed(1000);
        p
    }

    /// The time per round trip of `n` round trips.
    fn timed(&mut self, n: usize) -> Duration {
        use std::io::{Read, Write};
        let mut buf = [0u8; 4];
        let t = Instant::now();
        for _ in 0..n {
            self.ours.write_all(&[1, 2, 3, 4]).unwrap();
            self.ours.read_exact(&mut buf).unwrap();
        }
        t.elapsed() / n as u32
    }
}

impl Drop for PingPong {
    fn drop(&mut self) {
        let _ = self.ours.shutdown(std::net::Shutdown::Both);
        let _ = self.child.wait();
    }
}

/// How many short runs [`interleaved`] times per case: REPS × 10.
fn short_runs() -> usize {
    reps() * 10
}

/// A case timed by [`interleaved`]: the median of its runs, and the spread of the middle 80 % of
/// them (10th to 90th percentile, as a share of the median).
#[derive(Clone, Copy, Default)]
struct Timed {
    median: Duration,
    spread: f64,
}

impl Timed {
    fn us(self) -> f64 {
        self.median.as_secs_f64() * 1e6
    }
}

/// Runs each case's short timed run in turn, [`short_runs`] rounds (after one untimed round), and
/// returns each case's median and spread: cases compared as ratios are timed under the same
/// conditions, whatever the machine does meanwhile. A shared virtual machine's speed moves over
/// seconds (the same 20,000-iteration Python loop took 0.84 ms and 1.61 ms a few seconds apart
/// here), so cases timed one after the other, a second each, gave ratios that moved as much.
fn interleaved(cases: &mut [&mut dyn FnMut() -> Duration]) -> Vec<Timed> {
    for case in cases.iter_mut() {
        case();
    }
    let mut times = vec![Vec::new(); cases.len()];
    for _ in 0..short_runs() {
        for (case, t) in cases.iter_mut().zip(&mut times) {
            t.push(case());
        }
    }
    times
        .into_iter()
        .map(|mut t| {
            t.sort();
            let at = |q: f64| t[((t.len() - 1) as f64 * q).round() as usize];
            let median = at(0.5);
            Timed {
                median,
                spread: (at(0.9) - at(0.1)).as_secs_f64() / median.as_secs_f64().max(1e-12),
            }
        })
        .collect()
}

/// [`interleaved`] over boxed runs (dropped when timed: they may hold what the cases' ops
/// need released).
fn interleaved_runs(mut runs: Vec<Box<dyn FnMut() -> Duration + '_>>) -> Vec<Timed> {
    let mut refs: Vec<&mut dyn FnMut() -> Duration> = runs
        .iter_mut()
        .map(|r| &mut **r as &mut dyn FnMut() -> Duration)
        .collect();
    interleaved(&mut refs)
}

/// How a worker op's calls were waited for on both sides, per call, over the runs it was given
/// (the pool's `WaitStats`), as `key=value` fields for its case's line: the share of calls each
/// side caught checking, missed after checking, or slept through without checking, the µs each
/// spent checking per call, and how often a caller found the CPUs crowded (spinning went off).
#[derive(Default)]
struct WaitsSeen {
    calls: u64,
    /// Caught, missed, slept: the callers', then the workers'.
    counts: [u64; 6],
    checking: [Duration; 2],
    crowded: u64,
}

impl WaitsSeen {
    /// Runs `f`, adding what `op`'s pool counted meanwhile.
    fn during<R>(&mut self, op: &'static pyop::StaticOp, f: impl FnOnce() -> R) -> R {
        let pool = op.get().unwrap().pool().expect("a worker op").clone();
        let counts = |s: &pyop::PoolStats| {
            let w = s.waits;
            (
                s.calls,
                [
                    w.caller_caught,
                    w.caller_missed,
                    w.caller_slept,
                    w.worker_caught,
                    w.worker_missed,
                    w.worker_slept,
                ],
                [w.caller_checking, w.worker_checking],
                pyop::__private::crowded_count(),
            )
        };
        let before = counts(&pool.stats());
        let r = f();
        let after = counts(&pool.stats());
        self.calls += after.0 - before.0;
        for i in 0..6 {
            self.counts[i] += after.1[i] - before.1[i];
        }
        for i in 0..2 {
            self.checking[i] += after.2[i] - before.2[i];
        }
        self.crowded += after.3 - before.3;
        r
    }

    fn fields(&self) -> String {
        let n = self.calls.max(1) as f64;
        let c = self.counts.map(|k| k as f64 / n);
        let us = self.checking.map(|d| d.as_secs_f64() * 1e6 / n);
        format!(
            "caller_caught={:.2} caller_missed={:.2} caller_slept={:.2} caller_check_us={:.1} \
             worker_caught={:.2} worker_missed={:.2} worker_slept={:.2} worker_check_us={:.1} \
             crowded={}",
            c[0], c[1], c[2], us[0], c[3], c[4], c[5], us[1], self.crowded
        )
    }
}

/// The machine while a group of cases ran: its load average and the share of CPU time the host
/// gave to others (steal, from `/proc/stat`).
struct MachineSeen {
    stat: Option<(u64, u64)>,
}

impl MachineSeen {
    /// (all CPU time, stolen time) so far, in ticks.
    fn read() -> Option<(u64, u64)> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let cpu: Vec<u64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect();
        Some((cpu.iter().sum(), *cpu.get(7)?))
    }

    fn start() -> MachineSeen {
        MachineSeen { stat: Self::read() }
    }

    fn fields(&self) -> String {
        let load = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|l| l.split_whitespace().next().map(str::to_owned))
            .unwrap_or_else(|| "?".into());
        let steal = match (self.stat, Self::read()) {
            (Some((t0, s0)), Some((t1, s1))) if t1 > t0 => {
                format!("{:.1}", (s1 - s0) as f64 * 100.0 / (t1 - t0) as f64)
            }
            _ => "?".into(),
        };
        format!("load1={load} steal_pct={steal}")
    }
}

struct Busy(Vec<std::process::Child>);

impl Busy {
    fn start(n: usize) -> Busy {
        Busy(
            (0..n)
                .map(|_| {
                    std::process::Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .spawn()
                        .unwrap()
                })
                .collect(),
        )
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// How long a worker takes to start (its interpreter and NumPy, until ready), the median of
/// REPS fresh pools.
fn worker_start() -> Duration {
    let x = Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap();
    median(
        (0..reps())
            .map(|_| {
                let pool = pyop::WorkerPool::new(1);
                let op = PyOp::builder("start")
                    .code("def start(x):\n    return x")
                    .numpy()
                    .pool(&pool)
                    .tout([OutSpec::new(DType::F32)])
                    .build()
                    .unwrap();
                op.call(&[Arg::from(&x)]).unwrap();
                pool.stats().start_time
            })
            .collect(),
    )
}

/// The floor of any embedding: the GIL taken, a Python identity function called (vectorcall) and
/// the GIL released, with bare pyo3 on this thread: one call per run of the closure this returns.
/// The thread must keep its Python thread state between calls (the main thread does, and so does
/// any thread pyop has called Python from).
fn floor_attach_call() -> impl FnMut() {
    let (ident, arg) = Python::attach(|py| {
        let module =
            PyModule::from_code(py, c"def ident(x):\n    return x", c"floor.py", c"floor").unwrap();
        let ident: Py<PyAny> = module.getattr("ident").unwrap().unbind();
        let arg: Py<PyAny> = 1.5f32.into_pyobject(py).unwrap().into_any().unbind();
        (ident, arg)
    });
    move || {
        Python::attach(|py| {
            ident.bind(py).call1((arg.bind(py),)).unwrap();
        })
    }
}

/// The scalar call and the floor of any embedding on this thread, measured in turns: each of
/// REPS runs times `n` calls of every case once, so a machine whose speed drifts between runs (a
/// shared VM) moves all of them alike and their ratios hold. Median per-call times of the
/// [`wanted`] ones among `floor_attach_call_1`, `tensor_ident_1` and `numpy_ident_1`, each name
/// with `suffix`.
fn scalar_group(n: usize, suffix: &str) -> Vec<(String, Duration)> {
    // A thread pyop has called Python from keeps its thread state, as `main` does.
    tensor_ident(&Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap()).unwrap();
    let x = Tensor::zeros(1, DType::F32, &device()).unwrap();
    let floor = floor_attach_call();
    type Case<'a> = (String, Box<dyn FnMut() + 'a>);
    let chain = |op: fn(&Tensor) -> pyop::Result<Tensor>| {
        let mut a = x.clone();
        move || a = op(&a).unwrap()
    };
    let mut cases: Vec<Case<'_>> = vec![
        (format!("floor_attach_call_1{suffix}"), Box::new(floor)),
        (
            format!("tensor_ident_1{suffix}"),
            Box::new(chain(tensor_ident)),
        ),
        (
            format!("numpy_ident_1{suffix}"),
            Box::new(chain(numpy_ident)),
        ),
    ];
    cases.retain(|(name, _)| wanted(name));
    for (_, call) in &mut cases {
        (0..n.max(3)).for_each(|_| call());
    }
    let mut times = vec![Vec::new(); cases.len()];
    for _ in 0..reps() {
        for ((_, call), times) in cases.iter_mut().zip(&mut times) {
            let t = Instant::now();
            (0..n).for_each(|_| call());
            times.push(t.elapsed() / n as u32);
        }
    }
    cases
        .into_iter()
        .zip(times)
        .map(|((name, _), times)| (name, median(times)))
        .collect()
}

/// Awaited calls on tokio's multi-thread runtime (2 worker threads), each from a spawned task
/// awaiting `n` chained calls, measured in turns (as [`scalar_group`]): `async_ident_1` (the
/// scalar tensor-mode op's `_async` sibling), `spawn_blocking_ident_1` (its sync function through
/// `spawn_blocking`, what a tokio program does without `_async`), `async_worker_ident_1` (the
/// worker op's sibling), `sync_worker_ident_1` (the worker op called in the task itself, a
/// runtime thread blocked for the round trip) and `spawn_blocking_worker_ident_1` (it through
/// `spawn_blocking`). Median per-call times of the [`wanted`] ones.
fn awaited_group(n: usize) -> Vec<(String, Duration)> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let x = Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap();
    type Call = fn(Tensor) -> std::pin::Pin<Box<dyn Future<Output = Tensor> + Send>>;
    let mut cases: Vec<(&str, Call)> = vec![
        ("async_ident_1", |a| {
            Box::pin(async move { tensor_ident_async(&a).await.unwrap() })
        }),
        ("spawn_blocking_ident_1", |a| {
            Box::pin(async move {
                tokio::task::spawn_blocking(move || tensor_ident(&a).unwrap())
                    .await
                    .unwrap()
            })
        }),
        ("async_worker_ident_1", |a| {
            Box::pin(async move { worker_ident_async(&a).await.unwrap() })
        }),
        ("sync_worker_ident_1", |a| {
            Box::pin(async move { worker_ident(&a).unwrap() })
        }),
        ("spawn_blocking_worker_ident_1", |a| {
            Box::pin(async move {
                tokio::task::spawn_blocking(move || worker_ident(&a).unwrap())
                    .await
                    .unwrap()
            })
        }),
    ];
    cases.retain(|(name, _)| wanted(name));
    // One run: a spawned task awaiting `n` chained calls.
    let timed = |call: Call, n: usize| -> Duration {
        let x = x.clone();
        rt.block_on(rt.spawn(async move {
            let mut a = x;
            let started = Instant::now();
            for _ in 0..n {
                a = call(a).await;
            }
            started.elapsed()
        }))
        .unwrap()
    };
    for &(_, call) in &cases {
        timed(call, n.max(3));
    }
    let mut times = vec![Vec::new(); cases.len()];
    for _ in 0..reps() {
        for (&(_, call), times) in cases.iter().zip(&mut times) {
            times.push(timed(call, n) / n as u32);
        }
    }
    cases
        .into_iter()
        .zip(times)
        .map(|((name, _), times)| (name.to_owned(), median(times)))
        .collect()
}

/// `contended_ident_8threads`: 8 threads call the scalar tensor-mode op at once (after a
/// barrier), `calls` calls each; every call timed alone. Prints the median, p99 and p999 of the
/// calls and the calls per second in all: how the GIL is handed over under contention.
/// `contended_gapped_4threads`: 4 threads, each doing `gap` of Rust work (a spin) after each
/// call, as a server's threads do between calls: how the turns treat threads that do not call in
/// a loop (the GIL is free most of the time).
fn contended(threads: usize, calls: usize, gap: Duration) -> (Duration, Duration, Duration, f64) {
    let barrier = std::sync::Barrier::new(threads);
    let started = Instant::now();
    let mut all: Vec<Duration> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let barrier = &barrier;
                s.spawn(move || {
                    let x = Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap();
                    tensor_ident(&x).unwrap();
                    barrier.wait();
                    (0..calls)
                        .map(|_| {
                            let t = Instant::now();
                            std::hint::black_box(tensor_ident(&x).unwrap());
                            let took = t.elapsed();
                            while t.elapsed() < took + gap {
                                std::hint::spin_loop();
                            }
                            took
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let per_second = all.len() as f64 / started.elapsed().as_secs_f64();
    all.sort();
    let at = |q: f64| all[((all.len() - 1) as f64 * q) as usize];
    (at(0.5), at(0.99), at(0.999), per_second)
}

/// The threads besides `main` that programs call ops from.
#[derive(Clone, Copy)]
enum Place {
    /// A `std::thread::spawn`ed thread.
    Spawned,
    /// A thread of a rayon pool.
    Rayon,
    /// A thread of tokio's blocking pool (`spawn_blocking`).
    Tokio,
}

impl Place {
    const ALL: [Place; 3] = [Place::Spawned, Place::Rayon, Place::Tokio];

    fn name(self) -> &'static str {
        match self {
            Place::Spawned => "spawned",
            Place::Rayon => "rayon",
            Place::Tokio => "tokio",
        }
    }

    /// Runs `f` on a thread of this kind and returns what it returns.
    fn run<R: Send + 'static>(self, f: impl FnOnce() -> R + Send + 'static) -> R {
        static RAYON: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();
        static TOKIO: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
        match self {
            Place::Spawned => std::thread::spawn(f).join().unwrap(),
            Place::Rayon => RAYON
                .get_or_init(|| {
                    rayon::ThreadPoolBuilder::new()
                        .num_threads(2)
                        .build()
                        .unwrap()
                })
                .install(f),
            Place::Tokio => {
                let rt = TOKIO.get_or_init(|| {
                    tokio::runtime::Builder::new_current_thread()
                        .build()
                        .unwrap()
                });
                rt.block_on(rt.spawn_blocking(f)).unwrap()
            }
        }
    }
}

/// `worker_ident_1` (`n` chained scalar calls through a worker) and `ipc_pingpong_blocking`
/// (`trips` round trips), timed in turns, each line with how the worker's calls were waited for
/// and the machine's load and steal meanwhile.
fn round_trip_group(n: usize, trips: usize) {
    let (ident, pingpong) = ("worker_ident_1", "ipc_pingpong_blocking");
    if !wanted(ident) && !wanted(pingpong) {
        return;
    }
    let machine = MachineSeen::start();
    let mut waits = WaitsSeen::default();
    let x = Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap();
    let mut peer = wanted(pingpong).then(PingPong::start);
    let mut worker = || {
        waits.during(pyop::op!(worker_ident), || {
            let t = Instant::now();
            let mut a = x.clone();
            for _ in 0..n {
                a = worker_ident(&a).unwrap();
            }
            t.elapsed() / n as u32
        })
    };
    let mut floor = || peer.as_mut().map_or(Duration::ZERO, |p| p.timed(trips));
    let times = match (wanted(ident), wanted(pingpong)) {
        (true, true) => interleaved(&mut [&mut worker, &mut floor]),
        (true, false) => interleaved(&mut [&mut worker]),
        _ => vec![Timed::default(), interleaved(&mut [&mut floor])[0]],
    };
    if warming_up() {
        return;
    }
    let machine = machine.fields();
    let spread = |t: Timed| format!("spread_pct={:.0}", t.spread * 100.0);
    if wanted(ident) {
        let (waits, t) = (waits.fields(), times[0]);
        println!(
            "case={ident} median_us={:.3} {} {waits} {machine}",
            t.us(),
            spread(t)
        );
    }
    if wanted(pingpong) {
        let t = times[1];
        println!(
            "case={pingpong} median_us={:.3} {} {machine}",
            t.us(),
            spread(t)
        );
    }
}

/// The body of the batching cases: one row (or a batch of rows) times a fixed 256×256 weight,
/// NumPy's matrix product (the vectorisable body a service batches).
const MATMUL_ROWS: &str = "
import numpy as np
W = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
def mm(x):
    return x @ W
";

/// A body whose cost is mostly per call: a small network (256 → 1024 → 16) whose 1 MiB of
/// weights a call reads once however many rows it has (the `batching` example's).
const MLP_ROWS: &str = "
import numpy as np
W1 = np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)
W2 = np.random.default_rng(1).standard_normal((1024, 256)).astype(np.float32)
def mm(x):
    return np.maximum(x @ W1, 0) @ W2
";

/// `mm` as an op (`body`: [`MATMUL_ROWS`] or [`MLP_ROWS`]): unbatched, or batching with `batch`.
fn matmul_rows(body: &str, batch: Option<pyop::Batch>) -> PyOp {
    let b = PyOp::builder("mm")
        .code(body)
        .numpy()
        .tout([OutSpec::shaped(DType::F32, vec![None, Some(256)])]);
    match batch {
        Some(batch) => b.batch(batch),
        None => b,
    }
    .build()
    .unwrap()
}

/// Dynamic micro-batching: 8 threads each calling the (1, 256) × (256, 256) product one row a
/// call, unbatched and batched (`max = 64, wait_us = 200`), and 1 thread alone, unbatched and
/// batching with `wait_us = 0`; the same 8-thread pair over a small network (`_mlp`); timed in
/// turns, by throughput (wall time over all calls). A batched case's line gives its mean batch
/// size.
fn batch_group(calls: usize) {
    let batch = pyop::Batch::new(64).wait(Duration::from_micros(200));
    let plain = matmul_rows(MATMUL_ROWS, None);
    let batched = matmul_rows(MATMUL_ROWS, Some(batch.clone()));
    let eager = matmul_rows(MATMUL_ROWS, Some(pyop::Batch::new(64)));
    let mlp = matmul_rows(MLP_ROWS, None);
    let mlp_batched = matmul_rows(MLP_ROWS, Some(batch));
    let cases: Vec<(&str, usize, &PyOp)> = vec![
        ("unbatched_8threads_1row", 8, &plain),
        ("batched_8threads_1row", 8, &batched),
        ("unbatched_1thread_1row", 1, &plain),
        ("batched_wait0_1thread_1row", 1, &eager),
        ("batched_wait0_8threads_1row", 8, &eager),
        ("unbatched_8threads_1row_mlp", 8, &mlp),
        ("batched_8threads_1row_mlp", 8, &mlp_batched),
    ];
    let cases: Vec<_> = cases.into_iter().filter(|c| wanted(c.0)).collect();
    if cases.is_empty() {
        return;
    }
    let x = Tensor::randn(0f32, 1., (1, 256), &Device::Cpu).unwrap();
    let machine = MachineSeen::start();
    let runs: Vec<Box<dyn FnMut() -> Duration + '_>> = cases
        .iter()
        .map(|&(_, threads, op)| {
            let x = &x;
            Box::new(move || {
                threaded_once(threads, calls, &|| {
                    std::hint::black_box(op.call(&[Arg::from(x)]).unwrap());
                })
            }) as Box<dyn FnMut() -> Duration>
        })
        .collect();
    let times = interleaved_runs(runs);
    if warming_up() {
        return;
    }
    let machine = machine.fields();
    for ((case, _, op), t) in cases.iter().zip(times) {
        let stats = op.stats();
        let batches = if op.batching().is_some() {
            format!("mean_batch={:.1} ", stats.mean_batch())
        } else {
            String::new()
        };
        println!(
            "case={case} median_us={:.3} spread_pct={:.0} {batches}{machine}",
            t.us(),
            t.spread * 100.0
        );
    }
}

/// The ~1 ms Python loop (`iters` iterations) from 1 and 2 threads, `calls` calls per thread
/// per run, in the program and through 2 workers, timed in turns; `busy`: from 2 threads only,
/// while 2 CPU-bound processes run beside it. Each line has the iterations, how the workers'
/// calls were waited for, and the machine's load and steal meanwhile.
fn pyloop_group(
    iters: &std::cell::LazyCell<usize, impl FnOnce() -> usize>,
    calls: usize,
    busy: bool,
) {
    type Pyloop = fn(&Tensor, usize) -> pyop::Result<Tensor>;
    /// What a case's run times: calls from threads, by throughput; or the loop alone, timed
    /// inside the body, 1 thread (the mean of the run's calls).
    #[derive(Clone, Copy)]
    enum Run {
        Threads(usize, Pyloop),
        Inner(Pyloop),
    }
    let suffix = if busy { "_busy" } else { "" };
    let threads: &[usize] = if busy { &[2] } else { &[1, 2] };
    let mut cases: Vec<(String, Run, Option<&'static pyop::StaticOp>)> = Vec::new();
    for &t in threads {
        let name = if t == 1 { "1thread" } else { "2threads" };
        cases.push((
            format!("pyloop_inprocess_{name}{suffix}"),
            Run::Threads(t, pyloop_in_process),
            None,
        ));
        cases.push((
            format!("pyloop_workers2_{name}{suffix}"),
            Run::Threads(t, pyloop_workers),
            Some(pyop::op!(pyloop_workers)),
        ));
    }
    if !busy {
        // The loop alone, timed inside the body, in the program and in a worker: whether a body
        // runs slower in a worker, or the difference is the round trip.
        cases.push((
            "pyloop_inner_inprocess".into(),
            Run::Inner(pyloop_timed_in_process),
            None,
        ));
        cases.push((
            "pyloop_inner_worker".into(),
            Run::Inner(pyloop_timed_worker),
            Some(pyop::op!(pyloop_timed_worker)),
        ));
    }
    cases.retain(|c| wanted(&c.0));
    if cases.is_empty() {
        return;
    }
    let iters = **iters;
    // The same threads for every case of the group (1 and 2).
    let crews = &[Crew::new(1), Crew::new(2)];
    let _busy = busy.then(|| Busy::start(2));
    let machine = MachineSeen::start();
    let mut waits: Vec<WaitsSeen> = cases.iter().map(|_| WaitsSeen::default()).collect();
    let runs: Vec<Box<dyn FnMut() -> Duration + '_>> = cases
        .iter()
        .zip(&mut waits)
        .map(|(&(_, run, op), seen)| {
            let once = move || match run {
                Run::Threads(t, f) => pyloop_threads(&crews[t - 1], calls, iters, f),
                Run::Inner(f) => {
                    let x = Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap();
                    let total: f64 = (0..calls)
                        .map(|_| f(&x, iters).unwrap().to_scalar::<f64>().unwrap())
                        .sum();
                    Duration::from_secs_f64(total / calls as f64)
                }
            };
            Box::new(move || match op {
                Some(op) => seen.during(op, once),
                None => once(),
            }) as Box<dyn FnMut() -> Duration>
        })
        .collect();
    let times = interleaved_runs(runs);
    if warming_up() {
        return;
    }
    let machine = machine.fields();
    for ((case, seen), t) in cases.iter().zip(&waits).zip(times) {
        let waits = if case.2.is_some() {
            format!("{} ", seen.fields())
        } else {
            String::new()
        };
        println!(
            "case={} median_us={:.3} spread_pct={:.0} iters={iters} {waits}{machine}",
            case.0,
            t.us(),
            t.spread * 100.0
        );
    }
}

fn main() {
    if std::env::var_os(ECHO_PEER).is_some() {
        echo_peer();
    }
    pyop::validate().expect("the benchmarked ops are declared right");
    // `cargo bench` passes `--bench`; `cargo test --benches` runs this with no such flag: keep
    // that run short.
    let quick = !std::env::args().any(|a| a == "--bench");
    let sizes = if quick { vec![1, 1024] } else { sizes() };
    // Each size runs ROUNDS times (2 by default) and only the last round is printed: the first
    // pays the growth of the C heap to the size a long-running program keeps (page faults that
    // land on whichever case runs first), which is not what any case costs.
    let rounds = if quick {
        1
    } else {
        std::env::var("ROUNDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2usize)
            .max(1)
    };
    for &size in &sizes {
        for round in 0..rounds {
            WARMING_UP.store(round + 1 < rounds, std::sync::atomic::Ordering::Relaxed);
            let n = if quick { 5 } else { calls_for(size) };
            let x = Tensor::zeros(size, DType::F32, &device()).unwrap();
            // At one element, the scalar group below measures these beside the floor.
            if size != 1 {
                report(&format!("numpy_ident_{size}"), || {
                    chained(n, &x, numpy_ident)
                });
            }
            report_faults(&format!("numpy_plus1_{size}"), n, || {
                chained(n, &x, numpy_plus1)
            });
            report_faults(&format!("numpy_plus1copy_{size}"), n, || {
                chained(n, &x, numpy_plus1copy)
            });
            report_faults(&format!("numpy_plus1kept_{size}"), n, || {
                chained(n, &x, numpy_plus1kept)
            });
            report_faults(&format!("numpy_plus1rev_{size}"), n, || {
                chained(n, &x, numpy_plus1rev)
            });
            report_faults(&format!("numpy_plus1unaligned_{size}"), n, || {
                chained(n, &x, numpy_plus1unaligned)
            });
            // Where the device's array library cannot be imported, say so instead of a number.
            match dlpack_plus1(&x) {
                Ok(_) => report_faults(&format!("dlpack_plus1_{size}"), n, || {
                    chained(n, &x, dlpack_plus1)
                }),
                Err(e) => println!("case=dlpack_plus1_{size} skipped=\"{e}\""),
            }
            if size != 1 {
                report(&format!("tensor_ident_{size}"), || {
                    chained(n, &x, tensor_ident)
                });
            }
            report(&format!("tensor_plus1_{size}"), || {
                chained(n, &x, tensor_plus1)
            });
            report_faults(&format!("python_plus1_{size}"), n, || python_plus1(size, n));
            if x.device().is_cpu() {
                report_faults(&format!("memcpy_{size}"), n, || memcpy(n, &x));
                // A worker round trip: the input written into shared memory, returned as is
                // (named in place, not copied back), copied once into the output. At one element,
                // the round-trip group below measures it beside its floor.
                if size != 1 {
                    report_faults(&format!("worker_ident_{size}"), n, || {
                        chained(n, &x, worker_ident)
                    });
                }
            }
            // The op tensor mode's `x + 1` runs: a broadcast add of a 0-d tensor.
            report(&format!("candle_plus1_{size}"), || {
                chained(n, &x, |a| {
                    Ok(a.broadcast_add(&Tensor::new(1f32, a.device())?)?)
                })
            });
        }
    }
    // The scalar call and the floor of any embedding, measured in turns on each kind of thread
    // programs call from (the main thread's without a suffix).
    let n = if quick { 5 } else { calls_for(1) };
    let scalar = |suffix: &'static str| move || scalar_group(n, suffix);
    let mut results = scalar("")();
    for place in Place::ALL {
        let suffix: &'static str = match place {
            Place::Spawned => "_spawned",
            Place::Rayon => "_rayon",
            Place::Tokio => "_tokio",
        };
        results.extend(place.run(scalar(suffix)));
    }
    if !warming_up() {
        for (case, per_call) in results {
            println!("case={case} median_us={:.3}", per_call.as_secs_f64() * 1e6);
        }
    }
    // A worker's scalar round trip and its floor, a blocking ping-pong of two processes, timed
    // in turns, with how both sides waited.
    // Short runs (`interleaved`): 200 calls and 500 round trips each.
    round_trip_group((n / 10).max(1), if quick { 10 } else { 500 });
    // A worker round trip from those threads too (where a program's pool of threads calls a
    // worker op).
    if device().is_cpu() {
        for place in Place::ALL {
            report(&format!("worker_ident_1_{}", place.name()), || {
                let x = Tensor::zeros(1, DType::F32, &device()).unwrap();
                place.run(move || chained(n, &x, worker_ident))
            });
        }
    }
    // The same while another thread of the program runs Python there (an in-process op's loop
    // of ~8 ms, back to back): the program's GIL is busy all the time, as in a service whose
    // other handlers run their bodies in the program.
    if device().is_cpu() && wanted("worker_ident_1_python_busy") {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let busy = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let x = Tensor::zeros(16, DType::F32, &Device::Cpu).unwrap();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    pyloop_in_process(&x, 100_000).unwrap();
                }
            })
        };
        report("worker_ident_1_python_busy", || {
            let x = Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap();
            chained((n / 10).max(1), &x, worker_ident)
        });
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        busy.join().unwrap();
    }
    if device().is_cpu() {
        for (case, per_call) in awaited_group(n) {
            if !warming_up() {
                println!("case={case} median_us={:.3}", per_call.as_secs_f64() * 1e6);
            }
        }
    }
    for (case, threads, calls, gap) in [
        ("contended_ident_8threads", 8, 5000, Duration::ZERO),
        (
            "contended_gapped_4threads",
            4,
            2000,
            Duration::from_micros(20),
        ),
    ] {
        if !wanted(case) {
            continue;
        }
        let (p50, p99, p999, per_second) = contended(threads, if quick { 5 } else { calls }, gap);
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        println!(
            "case={case} median_us={:.3} p99_us={:.3} p999_us={:.3} calls_per_s={per_second:.0}",
            us(p50),
            us(p99),
            us(p999)
        );
    }
    let n = if quick { 5 } else { 2000 };
    report("backward_pygrad", || backward_pygrad(n));
    report("pygrad_body", || pygrad_body(n));
    let calls = if quick { 2 } else { 100 };
    report("threads1_call", || threads_call(1, calls));
    report("threads2_call", || threads_call(2, calls));
    // Python-bound bodies (~1 ms of Python loop) from 2 threads: in the program they take turns
    // on the GIL; in 2 workers they run side by side.
    // Both found only when a case needs them (the calibration is timed: under callgrind it
    // would differ between runs).
    let iters = std::cell::LazyCell::new(|| if quick { 100 } else { pyloop_iters() });
    let calls = if quick { 2 } else { 100 };
    // The plain-interpreter cases need NumPy there (the venv's, as scripts/dev.sh sets it up).
    let numpy_here = std::cell::LazyCell::new(|| {
        std::process::Command::new(venv_python())
            .args(["-c", "import numpy"])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    if wanted("python_numpy_start") && *numpy_here {
        report("python_numpy_start", python_numpy_start);
    }
    report("worker_start", worker_start);
    // The loop in a plain `python -c` of the same interpreter (medians of per-call loop times);
    // in the program and in a worker it is timed with the pyloop group below.
    if wanted("pyloop_inner_python") && *numpy_here {
        report("pyloop_inner_python", || {
            python_process_loop(*iters, calls.max(reps()), 1)
        });
        report("pyloop_inner_python_pair", || {
            python_process_loop(*iters, calls.max(reps()), 2)
        });
    }
    // Where the scheduler puts them, then pinned to one CPU and to two: what placement alone
    // does to the floor of the 1-thread ratio here.
    for (case, placement) in [
        ("pingpong_python_pyloop", "free"),
        ("pingpong_python_pyloop_samecpu", "same"),
        ("pingpong_python_pyloop_twocpus", "split"),
    ] {
        if !wanted(case) {
            continue;
        }
        let pair = python_pair_loop(*iters, (calls / 10).max(1), reps() * 10, placement);
        if let (Some((child, parent)), false) = (pair, warming_up()) {
            println!(
                "case={case} median_us={:.3} inparent_us={:.3}",
                child.as_secs_f64() * 1e6,
                parent.as_secs_f64() * 1e6
            );
        }
    }
    // The loop from 1 and 2 threads, in the program and in 2 workers, timed in turns; then the
    // 2-thread pair while 2 CPU-bound processes run beside it: the machine oversubscribed.
    // Short runs (`interleaved`): 10 calls per thread each.
    pyloop_group(&iters, (calls / 10).max(1), false);
    pyloop_group(&iters, (calls / 10).max(1), true);
    batch_group(if quick { 2 } else { 100 });
    let x = Tensor::randn(0f64, 1., (256, 256), &Device::Cpu).unwrap();
    report("matmul256_workers2_2threads", || {
        threaded(2, calls, || {
            matmul_workers(&x).unwrap();
        })
    });
    let calls = if quick { 2 } else { 50 };
    report("timeout_late_idle", || timeout_latency(0, calls));
    report("timeout_late_busy4", || timeout_latency(4, calls));
}
