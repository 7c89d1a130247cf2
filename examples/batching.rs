//! Dynamic micro-batching: 8 threads (a request handler each) call a vectorisable body, a linear
//! classifier's `predict`, one row a call; the batching op serves them with one body call per
//! batch. Every result is checked against the unbatched op's.
//!
//! ```text
//! $ cargo run --release --example batching
//! 8 threads x 500 calls, one row each
//! unbatched: 4000 body calls in 473.3 ms
//! batched:   503 body calls (8.0 calls each, at most 8) in 191.6 ms, 0.10 ms waited a call
//! every result equals the unbatched op's
//! ```
//!
//! `PYOP_EXAMPLE_CALLS=N` for N calls per thread instead of 500. How much batching gains
//! depends on how much of the body's cost is per call rather than per row, against the cost of
//! waking a thread (see the guide's chapter on batching).

use std::time::{Duration, Instant};

use pyop::candle::{Device, Tensor};
use pyop::py_op;

/// The classifier, a small network: per call, the input checks a library's `predict` makes; per
/// row, two products with its weights (1 MiB, read once a call however many rows it has). The
/// weights and features are small integers, exact in f32, so batched and unbatched sums agree
/// to the bit.
const PREDICT: &str = r#"
import numpy as np
W1 = (np.arange(256 * 1024, dtype=np.float32).reshape(256, 1024) % 7) - 3
W2 = (np.arange(1024 * 16, dtype=np.float32).reshape(1024, 16) % 5) - 2

def predict(x):
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != W1.shape[0]:
        raise ValueError(f"expected rows of {W1.shape[0]} features, got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("features must be finite")
    scores = np.maximum(x @ W1, 0) @ W2
    return scores.argmax(axis=1).astype(np.int64), scores
"#;

#[py_op(code = PREDICT, name = "predict", numpy, tout = (i64[_], f32[_, 16]))]
fn predict(x: &Tensor) -> pyop::Result<(Tensor, Tensor)>;

#[py_op(code = PREDICT, name = "predict", numpy, batch(max = 64, wait_us = 200),
        tout = (i64[_], f32[_, 16]))]
fn predict_batched(x: &Tensor) -> pyop::Result<(Tensor, Tensor)>;

/// The `i`th request's row of 256 features (small integers).
fn row(i: usize) -> pyop::Result<Tensor> {
    let v: Vec<f32> = (0..256)
        .map(|j| ((i * 31 + j * 7) % 11) as f32 - 5.)
        .collect();
    Ok(Tensor::from_vec(v, (1, 256), &Device::Cpu)?)
}

/// One request's answer: its label and its row of scores.
type Answer = (Vec<i64>, Vec<Vec<f32>>);

/// `calls` requests on each of `threads` threads; every answer, in order.
fn serve(
    threads: usize,
    calls: usize,
    f: fn(&Tensor) -> pyop::Result<(Tensor, Tensor)>,
) -> pyop::Result<(Duration, Vec<Answer>)> {
    let started = Instant::now();
    let answers = std::thread::scope(|s| {
        let handlers: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    (0..calls)
                        .map(|c| {
                            let (label, scores) = f(&row(t * calls + c)?)?;
                            Ok((label.to_vec1::<i64>()?, scores.to_vec2::<f32>()?))
                        })
                        .collect::<pyop::Result<Vec<_>>>()
                })
            })
            .collect();
        handlers
            .into_iter()
            .map(|h| h.join().expect("a handler thread"))
            .collect::<pyop::Result<Vec<_>>>()
    })?;
    Ok((started.elapsed(), answers.into_iter().flatten().collect()))
}

fn main() -> pyop::Result<()> {
    let calls = std::env::var("PYOP_EXAMPLE_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500);
    let threads = 8;
    println!("{threads} threads x {calls} calls, one row each");
    // First calls load the bodies and NumPy.
    predict(&row(0)?)?;
    predict_batched(&row(0)?)?;
    let before = pyop::op!(predict_batched).get()?.stats();

    let (plain_took, plain) = serve(threads, calls, predict)?;
    println!(
        "unbatched: {} body calls in {:.1} ms",
        threads * calls,
        plain_took.as_secs_f64() * 1e3
    );
    let (took, batched) = serve(threads, calls, predict_batched)?;
    let stats = pyop::op!(predict_batched).get()?.stats();
    let (batches, served) = (
        stats.batches - before.batches,
        stats.batched_calls - before.batched_calls,
    );
    println!(
        "batched:   {batches} body calls ({:.1} calls each, at most {}) in {:.1} ms, {:.2} ms \
         waited a call",
        served as f64 / batches as f64,
        stats.max_batch,
        took.as_secs_f64() * 1e3,
        (stats.batch_wait - before.batch_wait).as_secs_f64() * 1e3 / served as f64
    );
    assert_eq!(
        batched, plain,
        "a batched answer differs from the unbatched op's"
    );
    println!("every result equals the unbatched op's");
    Ok(())
}
