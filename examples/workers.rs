//! A Python-bound preprocessing op — text rows tokenised by a Python loop — called from several
//! threads, in the program (the calls take turns on the GIL) and in a pool of worker processes
//! (they run side by side), with the throughput of each and the pool's counters.
//!
//! ```text
//! $ cargo run --release --example workers
//! 4 threads x 50 calls, 256 rows each
//! in-process        976 calls/s  (gil wait 46% of call time)
//! 2 workers        1632 calls/s  (1.67x)
//! pool: size 2, started 2 (start time 288 ms in all), calls 201, lost 0, timed out 0
//! op tokenize_w: calls 201, errors 0, time in workers 464.8 ms, python 5.6 ms
//! ```

use std::time::{Duration, Instant};

use pyop::candle::{DType, Device, Tensor};
use pyop::{py_op, OpStats, WorkerPool};

/// Lower-cases each row of ASCII bytes, splits it into words and maps each word to an id in
/// 0..4096 by a hash computed in Python: the kind of step that keeps a data pipeline on the GIL.
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

#[py_op(code = TOKENIZE, name = "tokenize", numpy, tout = i64)]
fn tokenize_in_process(rows: &Tensor, width: usize) -> pyop::Result<Tensor>;

#[py_op(code = TOKENIZE, name = "tokenize", numpy, workers = 2, tout = i64)]
fn tokenize_w(rows: &Tensor, width: usize) -> pyop::Result<Tensor>;

const ROWS: usize = 256;
const WIDTH: usize = 16;

/// Bytes of each line of text, padded with spaces.
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

/// Calls per second with `threads` threads making `calls` calls each.
fn throughput(
    threads: usize,
    calls: usize,
    f: fn(&Tensor, usize) -> pyop::Result<Tensor>,
) -> pyop::Result<f64> {
    let rows = text()?;
    let want = f(&rows, WIDTH)?; // warm: the interpreter, NumPy, the workers
    let started = Instant::now();
    std::thread::scope(|s| -> pyop::Result<()> {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> pyop::Result<()> {
                    for _ in 0..calls {
                        let ids = f(&rows, WIDTH)?;
                        assert_eq!(ids.dims(), [ROWS, WIDTH]);
                        assert_eq!(
                            ids.to_vec2::<i64>()?,
                            want.to_vec2::<i64>()?,
                            "the same ids every call"
                        );
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

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() -> pyop::Result<()> {
    // The time in Python and waiting for the GIL is counted only while timing is on.
    pyop::set_timing(true);
    // PYOP_EXAMPLE_CALLS: fewer calls per thread (the example's test runs it short).
    let calls = std::env::var("PYOP_EXAMPLE_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let threads = 4;
    println!("{threads} threads x {calls} calls, {ROWS} rows each");
    let in_process = throughput(threads, calls, tokenize_in_process)?;
    let s: OpStats = pyop::op_stats("tokenize_in_process").expect("called");
    let share = s.gil_wait.as_secs_f64() / (s.gil_wait + s.python_time).as_secs_f64();
    println!(
        "in-process  {in_process:>8.0} calls/s  (gil wait {:.0}% of call time)",
        share * 100.0
    );
    // Both workers start now, side by side, not one by one on the calls that first need them.
    let op = pyop::op!(tokenize_w).get()?;
    op.start_workers()?;
    let in_workers = throughput(threads, calls, tokenize_w)?;
    println!(
        "2 workers   {in_workers:>8.0} calls/s  ({:.2}x)",
        in_workers / in_process
    );
    let pool: &WorkerPool = op.pool().expect("declared with workers = 2");
    let p = pool.stats();
    println!(
        "pool: size {}, started {} (start time {:.0} ms in all), calls {}, lost {}, timed out {}",
        p.size,
        p.started,
        ms(p.start_time),
        p.calls,
        p.lost,
        p.timed_out
    );
    let s = op.stats();
    println!(
        "op tokenize_w: calls {}, errors {}, time in workers {:.1} ms, python {:.1} ms",
        s.calls,
        s.errors,
        ms(s.worker_time),
        ms(s.python_time)
    );
    assert_eq!(DType::I64, tokenize_w(&text()?, WIDTH)?.dtype());
    Ok(())
}
