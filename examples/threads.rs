//! Ops called from several threads at once, and what each op cost: calls, errors, time in Python
//! and time waiting for the GIL.
//!
//! ```text
//! $ cargo run --release --example threads
//! 8 threads x 2000 calls in 1.72 s
//! op        calls  errors  python ms  gil wait ms  gil-wait share
//! norm      16000       0     6143.0       1068.0             15%
//! affine    16000       0      568.4       1763.1             76%
//! checked   16000    1000      810.6       1052.9             57%
//! ```
//!
//! Set `PYOP_TRACE=1` to print the `pyop.call` tracing span of every call (op, mode, device), and
//! `PYOP_EXAMPLE_CALLS=N` for N calls per thread instead of 2000.

use std::time::Instant;

use pyop::candle::{Device, Tensor};
use pyop::{py_op, OpStats};

#[py_op(code = "import numpy as np\ndef norm(x):\n    return np.float32(np.sqrt((x * x).sum()))", numpy, tout = f32)]
fn norm(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def affine(x, a, b):\n    return x * a + b", tout = f32)]
fn affine(x: &Tensor, a: f64, b: f64) -> pyop::Result<Tensor>;

#[py_op(code = "def checked(x, i):\n    if i % 16 == 0:\n        raise ValueError('every 16th call fails')\n    return x", numpy, tout = f32)]
fn checked(x: &Tensor, i: i64) -> pyop::Result<Tensor>;

/// The counters of a `#[py_op]` function, found through the registry by name.
fn stats(name: &str) -> OpStats {
    pyop::op_stats(name).expect("declared and called")
}

fn main() -> pyop::Result<()> {
    // The time in Python and waiting for the GIL is counted only while timing is on.
    pyop::set_timing(true);
    if std::env::var_os("PYOP_TRACE").is_some() {
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .init();
    }
    // PYOP_EXAMPLE_CALLS: fewer calls per thread (the example's test runs it short).
    let calls = std::env::var("PYOP_EXAMPLE_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let threads = 8;
    let started = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            std::thread::spawn(move || -> pyop::Result<()> {
                let x = Tensor::ones(4096, pyop::candle::DType::F32, &Device::Cpu)?;
                for i in 0..calls {
                    assert_eq!(norm(&x)?.to_scalar::<f32>()?, 64.0);
                    assert_eq!(
                        affine(&x, 2.0, t as f64)?.get(0)?.to_scalar::<f32>()?,
                        2.0 + t as f32
                    );
                    let _ = checked(&x, i);
                }
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join().expect("thread")?;
    }
    println!(
        "{threads} threads x {calls} calls in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    println!("op        calls  errors  python ms  gil wait ms  gil-wait share");
    for name in ["norm", "affine", "checked"] {
        let s = stats(name);
        let (py, wait) = (
            s.python_time.as_secs_f64() * 1e3,
            s.gil_wait.as_secs_f64() * 1e3,
        );
        println!(
            "{name:<8} {:>6}  {:>6}  {py:>9.1}  {wait:>11.1}  {:>13.0}%",
            s.calls,
            s.errors,
            100.0 * wait / (py + wait)
        );
    }
    Ok(())
}
