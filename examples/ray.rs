//! The Python-bound tokeniser of `examples/workers.rs` on a Ray cluster: a pool whose workers are
//! Ray actors, called from several threads, with the throughput, each actor's node and the
//! pool's counters. With `PYOP_RAY_ADDRESS` set it joins that cluster; without, it starts a
//! two-node cluster of this machine for itself (`scripts/ray_cluster.py`, Ray from `.venv`) and
//! stops it at the end. On one machine's cores Ray cannot beat the program; a cluster's nodes add
//! cores (see the guide's "Ray clusters").
//!
//! ```text
//! $ cargo run --release --example ray
//! a 2-node Ray cluster of this machine at 192.0.2.2:46111 (started for this example)
//! 4 threads x 25 calls, 256 rows each
//! in-process       659 calls/s
//! Ray, 4 actors    475 calls/s  (0.72x)
//! actor 1 on node 01d069b13c (192.0.2.2), pid 19372
//! actor 2 on node 1b8dce0cc2 (192.0.2.2), pid 19431
//! actor 3 on node 01d069b13c (192.0.2.2), pid 19371
//! actor 4 on node 1b8dce0cc2 (192.0.2.2), pid 19457
//! pool: size 4, started 4 (start time 938 ms in all), calls 101, lost 0, timed out 0
//! ```

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pyop::candle::{Device, Tensor};
use pyop::{Arg, OutSpec, PyOp, RayPool, WorkerPool};

/// Lower-cases each row of ASCII bytes, splits it into words and maps each word to an id in
/// 0..4096 by a hash computed in Python.
const TOKENIZE: &str = r#"
import numpy as np

def tokenize(rows, width):
    out = np.zeros((rows.shape[0], width), dtype=np.int64)
    for r in range(rows.shape[0]):
        words = rows[r].tobytes().decode("ascii").lower().split()
        for i, word in enumerate(words[:width]):
            h = 5381
            for ch in word:
                h = (h * 33 + ord(ch)) & 0xFFFFFFFF
            out[r, i] = h % 4096
    return out
"#;

const ROWS: usize = 256;
const WIDTH: i64 = 16;
const LINE: usize = 96;

/// `ROWS` lines of text, one per row of a u8 tensor.
fn text() -> pyop::Result<Tensor> {
    let words = [
        "The", "quick", "Brown", "fox", "jumps", "over", "the", "lazy", "DOG",
    ];
    let mut bytes = Vec::with_capacity(ROWS * LINE);
    for r in 0..ROWS {
        let mut line = Vec::new();
        for i in 0..12 {
            line.extend_from_slice(words[(r + i * 7) % words.len()].as_bytes());
            line.push(b' ');
        }
        line.resize(LINE, b' ');
        bytes.extend_from_slice(&line);
    }
    Ok(Tensor::from_vec(bytes, (ROWS, LINE), &Device::Cpu)?)
}

/// The tokeniser as an op, in `pool` or (without one) in the program.
fn tokenizer(pool: Option<&WorkerPool>) -> pyop::Result<PyOp> {
    let b = PyOp::builder("tokenize").code(TOKENIZE).numpy();
    let b = match pool {
        Some(p) => b.pool(p),
        None => b,
    };
    b.tout([OutSpec::new(pyop::candle::DType::I64)]).build()
}

/// Calls per second with `threads` threads making `calls` calls each, every result checked.
fn throughput(op: &PyOp, threads: usize, calls: usize) -> pyop::Result<f64> {
    let rows = text()?;
    let args = [Arg::from(&rows), Arg::from(WIDTH)];
    let want = op.call(&args)?[0].to_vec2::<i64>()?;
    let started = Instant::now();
    std::thread::scope(|s| -> pyop::Result<()> {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> pyop::Result<()> {
                    for _ in 0..calls {
                        let ids = op.call(&args)?;
                        assert_eq!(ids[0].to_vec2::<i64>()?, want, "the same ids every call");
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().expect("thread")?;
        }
        Ok(())
    })?;
    Ok((threads * calls) as f64 / started.elapsed().as_secs_f64())
}

/// A two-node cluster of this machine, stopped when dropped.
struct LocalCluster(std::process::Child);

impl Drop for LocalCluster {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let _ = self.0.wait();
    }
}

/// Starts `scripts/ray_cluster.py` with the venv's Python; returns it and the head's address.
fn local_cluster() -> std::io::Result<(LocalCluster, String)> {
    let python = std::env::var_os("VIRTUAL_ENV").map_or("python3".into(), |v| {
        std::path::Path::new(&v).join("bin/python")
    });
    let has_ray = Command::new(&python)
        .args(["-c", "import ray"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_ray {
        let python = python.display();
        eprintln!(
            "Ray is not installed in {python}: install it with\n    {python} -m pip install \
             'ray>=2.40,<3'\n(`scripts/dev.sh test` installs it too), or set PYOP_RAY_ADDRESS to \
             a running cluster whose Ray version the program's environment has"
        );
        std::process::exit(2);
    }
    let mut child = Command::new(python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/ray_cluster.py"
        ))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut first = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut first)?;
    let address = first
        .split("\"address\": \"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .map(str::to_owned)
        .ok_or_else(|| std::io::Error::other(format!("no cluster started: {first:?}")))?;
    Ok((LocalCluster(child), address))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let calls = std::env::var("PYOP_EXAMPLE_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(25);
    let (_cluster, address) = match std::env::var("PYOP_RAY_ADDRESS") {
        Ok(a) if !a.is_empty() => {
            println!("the Ray cluster at {a}");
            (None, a)
        }
        _ => {
            let (c, a) = local_cluster()?;
            println!("a 2-node Ray cluster of this machine at {a} (started for this example)");
            (Some(c), a)
        }
    };
    let threads = 4;
    println!("{threads} threads x {calls} calls, {ROWS} rows each");
    let in_process = throughput(&tokenizer(None)?, threads, calls)?;
    println!("in-process  {in_process:>8.0} calls/s");

    let pool = WorkerPool::ray(RayPool::new(4).address(address));
    let op = tokenizer(Some(&pool))?;
    op.start_workers()?;
    let on_ray = throughput(&op, threads, calls)?;
    println!(
        "Ray, 4 actors {on_ray:>6.0} calls/s  ({:.2}x)",
        on_ray / in_process
    );
    for a in pool.ray_actors() {
        println!(
            "actor {} on node {} ({}), pid {}",
            a.id,
            &a.node[..a.node.len().min(10)],
            a.ip,
            a.pid
        );
    }
    let p = pool.stats();
    println!(
        "pool: size {}, started {} (start time {:.0} ms in all), calls {}, lost {}, timed out {}",
        p.size,
        p.started,
        p.start_time.as_secs_f64() * 1e3,
        p.calls,
        p.lost,
        p.timed_out
    );
    drop(op);
    drop(pool);
    std::thread::sleep(Duration::from_millis(100));
    Ok(())
}
