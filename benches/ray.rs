//! Calls through a pool of Ray actors (`cargo bench --bench ray`), beside Ray's own actor call
//! from Python and pyop's local workers, in one run on one cluster: a two-node cluster of this
//! machine started for the run (`scripts/ray_cluster.py`), or the one `PYOP_RAY_ADDRESS` names.
//! A bench of its own: the cluster's start (seconds) would dwarf the summary's cases.
//!
//! Cases (medians per call, `case=NAME median_us=X` as the summary prints them):
//! - `ray_ident_N`: an identity op on N f32 through a Ray pool of one actor;
//! - `ray_python_ident_N`: the same through Ray's own API from a Python driver
//!   (`ray.get(actor.ident.remote(x))` on a NumPy array), in a process of its own;
//! - `worker_ident_N`: the same op through a local worker process.
//!
//! `SIZES` and `REPS` as in the summary. Run as a test (`cargo test --benches`) it makes two
//! calls per case.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pyop::candle::{DType, Device, Tensor};
use pyop::{Arg, OutSpec, PyOp, RayPool, WorkerPool};

fn venv_python() -> std::path::PathBuf {
    std::env::var_os("VIRTUAL_ENV").map_or("python3".into(), |v| {
        std::path::Path::new(&v).join("bin/python")
    })
}

/// A two-node cluster of this machine, stopped when dropped.
struct LocalCluster(std::process::Child);

impl Drop for LocalCluster {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let _ = self.0.wait();
    }
}

fn local_cluster() -> (LocalCluster, String) {
    let mut child = Command::new(venv_python())
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/ray_cluster.py"
        ))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the venv's Python starts the cluster");
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let address = first
        .split("\"address\": \"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .unwrap_or_else(|| panic!("no cluster started: {first:?}"))
        .to_owned();
    (LocalCluster(child), address)
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
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

fn calls_for(size: usize, quick: bool) -> usize {
    match (quick, size) {
        (true, _) => 2,
        (_, 0..=1) => 300,
        (_, 2..=1048576) => 30,
        _ => 10,
    }
}

fn ident(pool: &WorkerPool) -> PyOp {
    PyOp::builder("ident")
        .code("def ident(x):\n    return x")
        .numpy()
        .pool(pool)
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap()
}

/// The median time per call of `op` on `size` f32 (after a warm-up call).
fn per_call(op: &PyOp, size: usize, calls: usize) -> Duration {
    let x = Tensor::ones(size, DType::F32, &Device::Cpu).unwrap();
    op.call(&[Arg::from(&x)]).unwrap();
    median(
        (0..calls)
            .map(|_| {
                let t = Instant::now();
                let y = op.call(&[Arg::from(&x)]).unwrap();
                let d = t.elapsed();
                assert_eq!(y[0].dims(), [size]);
                d
            })
            .collect(),
    )
}

/// Ray's own actor call from a Python driver on the same cluster: medians per size, in µs.
fn ray_python(address: &str, sizes: &[usize], quick: bool) -> Vec<(usize, f64)> {
    let calls: Vec<String> = sizes
        .iter()
        .map(|&s| calls_for(s, quick).to_string())
        .collect();
    let code = format!(
        "import time, numpy as np, ray, logging\n\
         ray.init(address='{address}', logging_level=logging.ERROR)\n\
         @ray.remote(num_cpus=1)\n\
         class A:\n    def ident(self, x):\n        return x\n\
         a = A.remote()\n\
         for n, calls in zip([{sizes}], [{calls}]):\n    \
             x = np.ones(n, np.float32)\n    \
             ray.get(a.ident.remote(x))\n    \
             ts = []\n    \
             for _ in range(calls):\n        \
                 t = time.perf_counter(); ray.get(a.ident.remote(x)); ts.append(time.perf_counter() - t)\n    \
             ts.sort(); print(n, ts[len(ts) // 2] * 1e6, flush=True)\n\
         ray.shutdown()\n",
        sizes = sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(","),
        calls = calls.join(","),
    );
    let out = Command::new(venv_python())
        .args(["-c", &code])
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    assert!(out.status.success(), "Ray's own call failed");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
        })
        .collect()
}

fn main() {
    let quick = !std::env::args().any(|a| a == "--bench");
    let reps: usize = std::env::var("REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let reps = if quick { 1 } else { reps.max(1) };
    let sizes = sizes();
    let (_cluster, address) = match std::env::var("PYOP_RAY_ADDRESS") {
        Ok(a) if !a.is_empty() => (None, a),
        _ => {
            let (c, a) = local_cluster();
            (Some(c), a)
        }
    };
    let pool = WorkerPool::ray(RayPool::new(1).address(address.clone()));
    let on_ray = ident(&pool);
    let local = WorkerPool::new(1);
    let in_worker = ident(&local);
    for &size in &sizes {
        let calls = calls_for(size, quick);
        let ray = median((0..reps).map(|_| per_call(&on_ray, size, calls)).collect());
        println!(
            "case=ray_ident_{size} median_us={:.3}",
            ray.as_secs_f64() * 1e6
        );
        let w = median(
            (0..reps)
                .map(|_| per_call(&in_worker, size, calls))
                .collect(),
        );
        println!(
            "case=worker_ident_{size} median_us={:.3}",
            w.as_secs_f64() * 1e6
        );
    }
    // Ray's own, after pyop's actor is gone (one CPU each on this machine's cluster).
    drop(on_ray);
    drop(pool);
    for (size, us) in ray_python(&address, &sizes, quick) {
        println!("case=ray_python_ident_{size} median_us={us:.3}");
    }
}
