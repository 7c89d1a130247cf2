//! Dynamic micro-batching (`Batch`): concurrent calls served by one body call. Each caller's
//! result is exactly what the unbatched op gives; errors, time limits and gradients are each
//! caller's; calls of different dtypes, trailing shapes or unstacked arguments never share a
//! batch.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use pyop::candle::{DType, Device, Tensor, Var};
use pyop::{py_op, Arg, Batch, CallOptions, ErrorKind, OutSpec, PyOp};

use crate::common::within;

/// `f(i)` on `n` threads released together; their results in order.
fn together<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let start = Barrier::new(n);
    std::thread::scope(|s| {
        let calls: Vec<_> = (0..n)
            .map(|i| {
                let (f, start) = (&f, &start);
                s.spawn(move || {
                    start.wait();
                    f(i)
                })
            })
            .collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    })
}

/// A row-wise body with two outputs: `x @ w + b` (exact on these small integers) and each row's
/// sum; and the same op without batching.
const AFFINE: &str = "
import numpy as np
W = np.arange(12, dtype=np.float64).reshape(3, 4) - 5
def affine(x):
    y = x.astype(np.float64) @ W + 1
    return y.astype(x.dtype), x.sum(axis=1)
";

fn affine(batch: Option<Batch>) -> PyOp {
    let mut b = PyOp::builder("affine").code(AFFINE).numpy().tout([
        OutSpec::shaped(DType::F32, vec![None, Some(4)]).with_dtype_of(0),
        OutSpec::shaped(DType::F32, vec![None]).with_dtype_of(0),
    ]);
    if let Some(batch) = batch {
        b = b.batch(batch);
    }
    b.build().unwrap()
}

/// Rows of small integers, seeded: a call's input.
fn rows(seed: u64, n: usize, dtype: DType) -> Tensor {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let v: Vec<f64> = (0..n * 3)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((s >> 40) % 17) as f64 - 8.0
        })
        .collect();
    Tensor::from_vec(v, (n, 3), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn values(t: &Tensor) -> (Vec<usize>, Vec<f64>) {
    let dims = t.dims().to_vec();
    let v = t
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    (dims, v)
}

#[test]
fn each_caller_gets_exactly_what_the_unbatched_op_gives() {
    within(120, "batched affine", || {
        let plain = affine(None);
        let op = affine(Some(Batch::new(16).wait(Duration::from_millis(2))));
        // 8 threads, 25 calls each, 0 to 4 rows a call, f32 and f64, all at once.
        let got = together(8, |t| {
            (0..25)
                .map(|c| {
                    let seed = (t * 100 + c) as u64;
                    let dtype = if (t + c) % 3 == 0 {
                        DType::F64
                    } else {
                        DType::F32
                    };
                    let x = rows(seed, (seed % 5) as usize, dtype);
                    let mine = op.call(&[Arg::from(&x)]).unwrap();
                    (x, mine)
                })
                .collect::<Vec<_>>()
        });
        for (x, mine) in got.iter().flatten() {
            let want = plain.call(&[Arg::from(x)]).unwrap();
            assert_eq!(mine.len(), 2);
            for (m, w) in mine.iter().zip(&want) {
                assert_eq!(m.dtype(), x.dtype());
                assert_eq!(values(m), values(w));
                assert!(
                    !m.track_op(),
                    "an untracked caller's output is not in a graph"
                );
            }
        }
        let stats = op.stats();
        assert_eq!(stats.batched_calls, 200);
        assert!(stats.batches < 200, "no call was batched: {stats:?}");
        assert!(stats.max_batch > 1 && stats.max_batch <= 16, "{stats:?}");
        // One body call a batch.
        assert_eq!(stats.calls, stats.batches);
        assert!(stats.mean_batch() > 1.0);
    });
}

/// The body sees one dtype and one trailing shape a call: it says which it got, and a mixed
/// batch would fail its stacking.
#[test]
fn calls_of_different_dtypes_shapes_or_unstacked_values_never_share_a_batch() {
    within(120, "kinds", || {
        let op = PyOp::builder("scaled")
            .code(
                "import numpy as np\n\
                 def scaled(x, k):\n\
                 \x20   return x * k, np.full(len(x), x.shape[1] * 10 + x.itemsize, dtype=np.int64)",
            )
            .numpy()
            .batch(Batch::new(64).wait(Duration::from_millis(20)).inputs([0]))
            .tout([
                OutSpec::new(DType::F32).with_dtype_of(0),
                OutSpec::shaped(DType::I64, vec![None]),
            ])
            .build()
            .unwrap();
        let got = together(8, |t| {
            let dtype = if t % 2 == 0 { DType::F32 } else { DType::F64 };
            let cols = 2 + t % 3;
            let k = (t / 4) as f64 + 1.0;
            let x = Tensor::ones((2, cols), DType::F32, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let out = op.call(&[Arg::from(&x), Arg::from(k)]).unwrap();
            (dtype, cols, k, out)
        });
        for (dtype, cols, k, out) in got {
            assert_eq!(values(&out[0]), (vec![2, cols], vec![k; 2 * cols]));
            let tag = (cols * 10 + dtype.size_in_bytes()) as i64;
            assert_eq!(out[1].to_vec1::<i64>().unwrap(), [tag, tag]);
        }
        // 2 dtypes × 3 widths × 2 scales: at least 8 kinds for 8 calls of at most 2 alike.
        assert!(op.stats().batches >= 6, "{:?}", op.stats());
    });
}

#[test]
fn an_exception_fails_every_caller_of_its_batch_with_the_same_error() {
    within(120, "batch error", || {
        let op = PyOp::builder("checked")
            .code(
                "def checked(x):\n\
                 \x20   if (x < 0).any():\n\
                 \x20       raise ValueError('a negative row')\n\
                 \x20   return x + 1",
            )
            .numpy()
            .batch(Batch::new(3).wait(Duration::from_secs(30)))
            .tout([OutSpec::new(DType::F32)])
            .build()
            .unwrap();
        // Three calls fill a batch of three; one has a negative row. The leader starts when the
        // third comes, not after its 30 s.
        let started = std::time::Instant::now();
        let got = together(3, |t| {
            let x = Tensor::new(&[[if t == 1 { -1f32 } else { 1. }]], &Device::Cpu).unwrap();
            op.call(&[Arg::from(&x)])
        });
        for r in got {
            let e = r.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
            assert_eq!(e.exception(), Some("ValueError"));
            assert_eq!(
                e.message(),
                "a negative row (the body ran on a batch of 3 calls)"
            );
            assert!(e.traceback().unwrap().contains("in checked"));
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "{:?}",
            started.elapsed()
        );
        let stats = op.stats();
        assert_eq!((stats.batches, stats.max_batch, stats.errors), (1, 3, 1));
        // A call alone fails with the plain message.
        let op1 = PyOp::builder("checked1")
            .code("def checked1(x):\n    raise ValueError('a negative row')")
            .numpy()
            .batch(Batch::new(3))
            .tout([OutSpec::new(DType::F32)])
            .build()
            .unwrap();
        let x = Tensor::new(&[[1f32]], &Device::Cpu).unwrap();
        let e = op1.call(&[Arg::from(&x)]).unwrap_err();
        assert_eq!(e.message(), "a negative row");
    });
}

/// An output without the batch's rows along axis 0 fails the batch; an output with them that
/// breaks one caller's declared shape fails that caller.
#[test]
fn outputs_without_the_batch_rows_are_refused() {
    within(120, "batch outputs", || {
        let op = PyOp::builder("total")
            .code("def total(x):\n    return x.sum(axis=0)")
            .numpy()
            .batch(Batch::new(2).wait(Duration::from_secs(30)))
            .tout([OutSpec::new(DType::F32)])
            .build()
            .unwrap();
        let got = together(2, |_| {
            let x = Tensor::ones((3, 2), DType::F32, &Device::Cpu).unwrap();
            op.call(&[Arg::from(&x)])
        });
        for r in got {
            let e = r.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::OutputMismatch);
            assert_eq!(e.index(), Some(0));
            assert_eq!(
                e.message(),
                "output 0 has shape [2]; a batching op's outputs have the batch's 6 rows along \
                 axis 0 (the body ran on a batch of 2 calls)"
            );
        }
    });
}

#[test]
fn inputs_a_batch_cannot_stack_are_refused_before_the_call() {
    let op = affine(Some(Batch::new(4)));
    let zero_d = Tensor::new(1f32, &Device::Cpu).unwrap();
    let e = op.call(&[Arg::from(&zero_d)]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.message().contains("argument 0 is a 0-d tensor"), "{e}");
    let two = PyOp::builder("pair")
        .code("def pair(x, y):\n    return x + y")
        .numpy()
        .batch(Batch::new(4))
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap();
    let x = Tensor::ones((2, 1), DType::F32, &Device::Cpu).unwrap();
    let y = Tensor::ones((3, 1), DType::F32, &Device::Cpu).unwrap();
    let e = two.call(&[Arg::from(&x), Arg::from(&y)]).unwrap_err();
    assert_eq!(
        e.message(),
        "argument 0 has 2 rows and argument 1 has 3: a batching op's stacked inputs have the same \
         size along axis 0"
    );
    let e = two.call(&[Arg::from(1.0), Arg::from(2.0)]).unwrap_err();
    assert!(e.message().starts_with("no argument is stacked"), "{e}");
    let listed = PyOp::builder("listed")
        .code("def listed(x, k):\n    return x * k")
        .numpy()
        .batch(Batch::new(4).inputs([1]))
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap();
    let e = listed.call(&[Arg::from(&x), Arg::from(2.0)]).unwrap_err();
    assert_eq!(
        e.message(),
        "argument 1 is stacked by the op's batching but is not a tensor"
    );
    assert_eq!(two.stats().calls, 0, "no body call");
}

#[test]
fn a_batching_op_declares_its_outputs_with_a_free_axis_0() {
    let build = |batch: Batch, out: OutSpec| {
        PyOp::builder("f")
            .code("def f(x):\n    return x")
            .numpy()
            .batch(batch)
            .tout([out])
            .build()
    };
    let e = build(Batch::new(0), OutSpec::new(DType::F32)).unwrap_err();
    assert_eq!(
        e.message(),
        "a batch of at most 0 calls: give `max` of 1 or more"
    );
    let e = build(
        Batch::new(4),
        OutSpec::shaped(DType::F32, vec![Some(1), Some(3)]),
    )
    .unwrap_err();
    assert_eq!(
        e.message(),
        "output 0 is declared `f32[1, 3]`, but a batching op's outputs have the batch's rows \
         along axis 0: declare that axis `_`"
    );
    assert!(build(Batch::new(4), OutSpec::shaped(DType::F32, vec![])).is_err());
    let op = build(Batch::new(4), OutSpec::same_as(0)).unwrap();
    assert_eq!(op.batching(), Some(&Batch::new(4)));
}

/// A time limit is each caller's own: calls with different limits are never in one batch, and
/// a batch runs under its calls' limit.
#[test]
fn a_time_limit_is_each_callers_own() {
    within(120, "batch time limits", || {
        let op = PyOp::builder("slow")
            .code(
                "import time\n\
                 def slow(x):\n\
                 \x20   time.sleep(float(x.max()))\n\
                 \x20   return x + 1",
            )
            .numpy()
            .batch(Batch::new(8).wait(Duration::from_millis(50)))
            .tout([OutSpec::new(DType::F32)])
            .build()
            .unwrap();
        let got = together(4, |t| {
            // Two calls limited to 100 ms, with a row that sleeps 0.5 s; two without a limit.
            let limited = t < 2;
            let x = Tensor::new(
                &[[if limited && t == 0 { 0.5f32 } else { 0.0 }]],
                &Device::Cpu,
            )
            .unwrap();
            let options = if limited {
                CallOptions::new().timeout(Duration::from_millis(100))
            } else {
                CallOptions::new()
            };
            op.call_with(&[Arg::from(&x)], &options)
        });
        for (t, r) in got.into_iter().enumerate() {
            if t < 2 {
                let e = r.unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
                assert!(
                    e.message()
                        .ends_with("(the body ran on a batch of 2 calls)"),
                    "{e}"
                );
            } else {
                assert_eq!(r.unwrap()[0].to_vec2::<f32>().unwrap(), [[1.0]]);
            }
        }
        let stats = op.stats();
        assert_eq!((stats.batches, stats.max_batch), (2, 2), "{stats:?}");
    });
}

/// Gradients flow to each caller's own inputs: tensor mode through the body's candle ops,
/// numpy mode through its registered gradient, run on the batch and split back.
#[test]
fn gradients_reach_each_callers_inputs() {
    within(120, "batch gradients", || {
        let tensor = PyOp::builder("cube")
            .code("def cube(x):\n    return x * x * x")
            .batch(Batch::new(8).wait(Duration::from_millis(20)))
            .tout([OutSpec::same_as(0)])
            .build()
            .unwrap();
        let numpy = PyOp::builder("ncube")
            .code(
                "def ncube(x):\n    return x ** 3\n\
                 def ncube_grad(inputs, outputs, grads):\n    (x,), (g,) = inputs, grads\n    return (3 * x * x * g,)",
            )
            .numpy()
            .gradient("ncube_grad")
            .batch(Batch::new(8).wait(Duration::from_millis(20)))
            .tout([OutSpec::same_as(0)])
            .build()
            .unwrap();
        for op in [&tensor, &numpy] {
            let got = together(5, |t| {
                let v = Var::new(&[[t as f32 + 1., -(t as f32)]], &Device::Cpu).unwrap();
                if t == 4 {
                    // A caller whose input is not tracked, in the batch of tracked ones: its
                    // output is in no graph, as an unbatched call's.
                    let y = op.call(&[Arg::from(&v.as_tensor().detach())]).unwrap();
                    assert!(!y[0].track_op(), "{}", op.name());
                    return (
                        t as f32,
                        y[0].to_vec2::<f32>().unwrap(),
                        vec![vec![75., 48.]],
                    );
                }
                let y = op.call(&[Arg::from(v.as_tensor())]).unwrap();
                let grads = y[0].sum_all().unwrap().backward().unwrap();
                let g = grads.get(&v).unwrap().to_vec2::<f32>().unwrap();
                (t as f32, y[0].to_vec2::<f32>().unwrap(), g)
            });
            for (t, y, g) in got {
                let (a, b) = (t + 1., -t);
                assert_eq!(y, [[a * a * a, b * b * b]], "{}", op.name());
                assert_eq!(g, [[3. * a * a, 3. * b * b]], "{}", op.name());
            }
            assert!(op.stats().max_batch > 1, "{}: {:?}", op.name(), op.stats());
        }
    });
}

/// A call alone waits up to `wait` for company, then runs; with `wait` zero it is the ordinary
/// call on the caller's own tensors.
#[test]
fn a_call_alone_waits_at_most_its_wait() {
    let op = affine(Some(Batch::new(4).wait(Duration::from_millis(30))));
    let x = rows(1, 2, DType::F32);
    let y = op.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(
        values(&y[0]),
        values(&affine(None).call(&[Arg::from(&x)]).unwrap()[0])
    );
    let stats = op.stats();
    assert_eq!(
        (stats.batches, stats.batched_calls, stats.max_batch),
        (1, 1, 1)
    );
    assert!(stats.batch_wait >= Duration::from_millis(30), "{stats:?}");
    let eager = PyOp::builder("same")
        .code("def same(x):\n    return x")
        .numpy()
        .batch(Batch::new(4))
        .tout([OutSpec::same_as(0)])
        .build()
        .unwrap();
    let y = eager.call(&[Arg::from(&x)]).unwrap();
    // The input handed back is the input: no stacking, no copy.
    assert_eq!(crate::common::data_ptr(&y[0]), crate::common::data_ptr(&x));
    assert_eq!(eager.stats().batch_wait, Duration::ZERO);
}

/// A batch is one request to a worker process.
#[test]
fn a_batch_is_one_request_to_a_worker() {
    within(180, "batched workers", || {
        let op = PyOp::builder("affine_w")
            .code(AFFINE.replace("def affine", "def affine_w"))
            .numpy()
            .workers(1)
            .batch(Batch::new(8).wait(Duration::from_millis(20)))
            .tout([
                OutSpec::shaped(DType::F32, vec![None, Some(4)]).with_dtype_of(0),
                OutSpec::shaped(DType::F32, vec![None]).with_dtype_of(0),
            ])
            .build()
            .unwrap();
        let plain = affine(None);
        let got = together(6, |t| {
            let x = rows(t as u64, 1 + t % 3, DType::F32);
            let y = op.call(&[Arg::from(&x)]).unwrap();
            (x, y)
        });
        for (x, y) in &got {
            let want = plain.call(&[Arg::from(x)]).unwrap();
            assert_eq!(values(&y[0]), values(&want[0]));
            assert_eq!(values(&y[1]), values(&want[1]));
        }
        let stats = op.stats();
        let pool = op.pool().unwrap().stats();
        assert_eq!(pool.calls, stats.batches, "one request a batch: {pool:?}");
        assert!(stats.max_batch > 1, "{stats:?}");
    });
}

/// A caller left alone stops waiting for company: the leader waits for as many calls as the last
/// batch had, halfway down after one that fell short (8, then 4, 2, 1).
#[test]
fn a_caller_alone_stops_waiting_after_a_few_calls() {
    let op = PyOp::builder("alone_rows")
        .code("def alone_rows(x):\n    return x + 1")
        .numpy()
        .batch(Batch::new(8).wait(Duration::from_millis(30)))
        .tout([OutSpec::same_as(0)])
        .build()
        .unwrap();
    let x = Tensor::new(&[[1f32]], &Device::Cpu).unwrap();
    let waited = |op: &PyOp| {
        let before = op.stats().batch_wait;
        op.call(&[Arg::from(&x)]).unwrap();
        op.stats().batch_wait - before
    };
    // Waiting for 8, 4 and 2 calls: each waits out `wait`.
    for call in 0..3 {
        let w = waited(&op);
        assert!(w >= Duration::from_millis(30), "call {call} waited {w:?}");
    }
    // Then for 1: no wait at all.
    for call in 3..6 {
        let w = waited(&op);
        assert!(w < Duration::from_millis(30), "call {call} waited {w:?}");
    }
}

/// An unstacked tensor is compared by identity: calls with different ones (of the same shape)
/// never share a batch, and each gets its own's result.
#[test]
fn calls_with_different_unstacked_tensors_never_share_a_batch() {
    within(60, "unstacked tensors", || {
        let op = PyOp::builder("times_w")
            .code("def times_w(x, w):\n    return x * w.sum()")
            .numpy()
            .batch(Batch::new(4).wait(Duration::from_millis(30)).inputs([0]))
            .tout([OutSpec::same_as(0)])
            .build()
            .unwrap();
        let ws: Vec<Tensor> = (0..2)
            .map(|i| Tensor::new(&[i as f32 + 1.], &Device::Cpu).unwrap())
            .collect();
        let got = together(4, |t| {
            let x = Tensor::new(&[[10f32]], &Device::Cpu).unwrap();
            let w = &ws[t % 2];
            op.call(&[Arg::from(&x), Arg::from(w)]).unwrap()[0]
                .to_vec2::<f32>()
                .unwrap()
        });
        assert_eq!(got, [[[10.]], [[20.]], [[10.]], [[20.]]]);
        assert!(op.stats().batches >= 2, "{:?}", op.stats());
    });
}

/// On a pool of 2 workers, 2 batches run at once (a batch is one request): each body waits until
/// it sees the other running, and says whether it did.
#[test]
fn batches_run_side_by_side_on_a_pool_of_workers() {
    within(180, "batches side by side", || {
        let dir = std::env::temp_dir().join(format!("pyop-side-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let op = PyOp::builder("side_by_side")
            .code(
                "import os, time\n\
                 def side_by_side(x, d):\n\
                 \x20   open(os.path.join(d, str(os.getpid())), 'w').close()\n\
                 \x20   deadline = time.time() + 10\n\
                 \x20   while len(os.listdir(d)) < 2 and time.time() < deadline:\n\
                 \x20       time.sleep(0.005)\n\
                 \x20   return x * 0 + len(os.listdir(d))",
            )
            .numpy()
            .workers(2)
            .batch(Batch::new(2).wait(Duration::from_millis(50)).inputs([0]))
            .tout([OutSpec::same_as(0)])
            .build()
            .unwrap();
        let d = dir.to_str().unwrap();
        let got = together(4, |t| {
            let x = Tensor::new(&[[t as f32]], &Device::Cpu).unwrap();
            op.call(&[Arg::from(&x), Arg::from(d)]).unwrap()[0]
                .to_vec2::<f32>()
                .unwrap()
        });
        std::fs::remove_dir_all(&dir).unwrap();
        // Every body saw two running (a body alone would have waited out its 10 s and seen 1).
        assert_eq!(got, vec![vec![vec![2f32]]; 4]);
        let stats = op.stats();
        assert_eq!((stats.batches, stats.max_batch), (2, 2), "{stats:?}");
    });
}

/// Many threads hammering a batching op end with every call answered (no lost lead).
#[test]
fn many_callers_many_times_all_answered() {
    within(120, "batch stress", || {
        let op = Arc::new(
            PyOp::builder("inc")
                .code("def inc(x):\n    return x + 1")
                .numpy()
                .batch(Batch::new(3))
                .tout([OutSpec::same_as(0)])
                .build()
                .unwrap(),
        );
        let sums = together(8, |t| {
            let mut total = 0f32;
            for c in 0..300 {
                let x = Tensor::new(&[[(t * 1000 + c) as f32]], &Device::Cpu).unwrap();
                let y = op.call(&[Arg::from(&x)]).unwrap();
                assert_eq!(
                    y[0].to_vec2::<f32>().unwrap(),
                    [[(t * 1000 + c) as f32 + 1.]]
                );
                total += 1.;
            }
            total
        });
        assert_eq!(sums.iter().sum::<f32>(), 2400.);
        let stats = op.stats();
        assert_eq!(stats.batched_calls, 2400);
        // With `wait` 0, calls that queue while a batch runs still form the next one.
        assert!(stats.max_batch > 1 && stats.max_batch <= 3, "{stats:?}");
    });
}

// --- declared with `#[py_op(batch(...))]` ---

/// Row-wise: each row scaled by `k` and shifted by the sum of `w`, which every call of a batch
/// shares (only `x` is stacked).
#[py_op(code = "def scaled(x, k, w):\n    return x * k + w.sum()", numpy,
        batch(max = 8, wait_us = 0, inputs = [x]), tout = f32[_, 3])]
fn scaled(x: &Tensor, k: f64, w: &Tensor) -> pyop::Result<Tensor>;

/// A `&Device` parameter is not passed to Python: `y` is argument 1; every setting but `max`
/// left out is its default.
#[py_op(code = "def shifted(w, y):\n    return y + w", numpy, batch(max = 4, inputs = [y]),
        tout = like(y))]
fn shifted(device: &Device, w: &Tensor, y: &Tensor) -> pyop::Result<Tensor>;

/// Without `inputs`, every tensor argument is stacked.
#[py_op(code = "def added(a, b):\n    return a + b, a + b", numpy, batch(max = 16, wait_us = 2000),
        tout = (f32[_], like(a)))]
fn added(a: &Tensor, b: &Tensor) -> pyop::Result<(Tensor, Tensor)>;

#[test]
fn a_declared_batch_is_the_ops_batch() {
    let op = pyop::op!(scaled);
    let want = Batch::new(8).wait(Duration::ZERO).inputs([0]);
    assert_eq!(op.decl().batch(), Some(&want));
    assert_eq!(op.get().unwrap().batching(), Some(&want));

    let op = pyop::op!(shifted);
    let want = Batch::new(4).inputs([1]);
    assert_eq!(op.decl().params(), ["w", "y"]);
    assert_eq!(op.decl().batch(), Some(&want));
    assert_eq!(op.get().unwrap().batching(), Some(&want));

    let op = pyop::op!(added);
    let want = Batch::new(16).wait(Duration::from_millis(2));
    assert_eq!(op.decl().batch(), Some(&want));
    assert_eq!(op.get().unwrap().batching(), Some(&want));
}

#[test]
fn a_declared_batching_op_gives_each_of_four_threads_its_own_rows() {
    within(120, "declared batching ops", || {
        let w = Tensor::new(&[0.5f32, 0.25], &Device::Cpu).unwrap();
        // Thread i: i + 1 rows of 3, each row filled with 10 i + its index.
        let x = |i: usize| {
            let v: Vec<f32> = (0..=i).flat_map(|r| [(10 * i + r) as f32; 3]).collect();
            Tensor::from_vec(v, (i + 1, 3), &Device::Cpu).unwrap()
        };
        for _ in 0..5 {
            let got = together(4, |i| scaled(&x(i), 2.0, &w).unwrap());
            for (i, y) in got.iter().enumerate() {
                let want: Vec<Vec<f32>> = (0..=i)
                    .map(|r| vec![(10 * i + r) as f32 * 2.0 + 0.75; 3])
                    .collect();
                assert_eq!(y.to_vec2::<f32>().unwrap(), want, "thread {i}");
            }

            let got = together(4, |i| {
                shifted(&Device::Cpu, &w, &x(i).narrow(1, 0, 2).unwrap())
            });
            for (i, y) in got.into_iter().enumerate() {
                let want: Vec<Vec<f32>> = (0..=i)
                    .map(|r| {
                        let v = (10 * i + r) as f32;
                        vec![v + 0.5, v + 0.25]
                    })
                    .collect();
                assert_eq!(y.unwrap().to_vec2::<f32>().unwrap(), want, "thread {i}");
            }

            let got = together(4, |i| {
                let a = Tensor::new(&[i as f32, 10.0 * i as f32], &Device::Cpu).unwrap();
                added(&a, &a).unwrap()
            });
            for (i, (y, z)) in got.iter().enumerate() {
                let want = [2.0 * i as f32, 20.0 * i as f32];
                assert_eq!(y.to_vec1::<f32>().unwrap(), want, "thread {i}");
                assert_eq!(z.to_vec1::<f32>().unwrap(), want, "thread {i}");
            }
        }
        // Every call was served, in batches of at most `max`, one body call each.
        for (op, max) in [
            (pyop::op!(scaled), 8),
            (pyop::op!(shifted), 4),
            (pyop::op!(added), 16),
        ] {
            let stats = op.stats();
            assert_eq!(stats.batched_calls, 20, "{stats:?}");
            assert!(stats.max_batch >= 1 && stats.max_batch <= max, "{stats:?}");
            assert_eq!(stats.calls, stats.batches, "{stats:?}");
        }
        // Waiting 2 ms for company, four callers released together share a body call.
        assert!(
            pyop::op!(added).stats().max_batch > 1,
            "{:?}",
            pyop::op!(added).stats()
        );
    });
}

// --- found by review: calls from inside bodies, awaited calls not polled, a call alone ---

/// A batching op called from inside a body — its own, through `pyop.rust` — runs unbatched: the
/// body's thread leads the batch, and waiting in the queue for itself would never end.
#[test]
fn a_batching_op_called_from_a_body_runs_unbatched() {
    within(60, "nested batching call", || {
        let op = Arc::new(
            PyOp::builder("nested_rows")
                .code(
                    "import pyop\n\
                     def nested_rows(x):\n\
                     \x20   if float(x.sum()) > 100:\n\
                     \x20       return x\n\
                     \x20   return pyop.rust.nested_rows_again(x + 1000)",
                )
                .batch(Batch::new(4).wait(Duration::from_millis(5)))
                .tout([OutSpec::same_as(0)])
                .build()
                .unwrap(),
        );
        let again = op.clone();
        pyop::expose("nested_rows_again", move |args| {
            Ok(pyop::Value::from(
                again.call(&[Arg::from(args[0].tensor()?)])?.remove(0),
            ))
        })
        .unwrap();
        let got = together(3, |t| {
            let x = Tensor::new(&[[t as f32]], &Device::Cpu).unwrap();
            op.call(&[Arg::from(&x)]).unwrap()[0]
                .to_vec2::<f32>()
                .unwrap()
        });
        assert_eq!(got, [[[1000.]], [[1001.]], [[1002.]]]);
        // The nested calls were not queued: every batched call is an outer one.
        assert_eq!(op.stats().batched_calls, 3, "{:?}", op.stats());
    });
}

/// The lead never waits for an awaited call's task to be polled: a queued awaited call's batch
/// is led for it on pyop's threads, so a blocked caller behind it is served at once.
#[test]
fn an_awaited_call_not_polled_holds_up_no_one() {
    within(60, "unpolled awaited call", || {
        let op = Arc::new(
            PyOp::builder("slow_rows")
                .code("import time\ndef slow_rows(x):\n    time.sleep(0.2)\n    return x + 1")
                .numpy()
                .batch(Batch::new(1))
                .tout([OutSpec::same_as(0)])
                .build()
                .unwrap(),
        );
        let row = |v: f32| Tensor::new(&[[v]], &Device::Cpu).unwrap();
        // A call runs alone for 200 ms; an awaited call, polled once, queues behind it; a
        // blocked call queues behind that one.
        let first = {
            let op = op.clone();
            std::thread::spawn(move || op.call(&[Arg::from(&row(1.))]).unwrap())
        };
        std::thread::sleep(Duration::from_millis(50));
        let mut awaited = Box::pin(op.call_async(&[Arg::from(&row(2.))]));
        let once = futures_lite::future::block_on(futures_lite::future::poll_once(&mut awaited));
        assert!(once.is_none());
        std::thread::sleep(Duration::from_millis(20));
        let behind = {
            let op = op.clone();
            std::thread::spawn(move || {
                let started = std::time::Instant::now();
                let y = op.call(&[Arg::from(&row(3.))]).unwrap();
                (started.elapsed(), y[0].to_vec2::<f32>().unwrap())
            })
        };
        first.join().unwrap();
        // Nobody polls the awaited call for 3 s.
        std::thread::sleep(Duration::from_secs(3));
        let (took, y) = behind.join().unwrap();
        assert_eq!(y, [[4.]]);
        assert!(took < Duration::from_secs(2), "held up for {took:?}");
        let y = futures_lite::future::block_on(awaited).unwrap();
        assert_eq!(y[0].to_vec2::<f32>().unwrap(), [[3.]]);
    });
}

/// A call alone gets the checks a batch's calls get: its result does not depend on whether it
/// found company. And an output shaped like an argument the batch does not stack is refused
/// when the op is built.
#[test]
fn a_call_alone_is_checked_as_a_batch_is() {
    let op = PyOp::builder("total_alone")
        .code("def total_alone(x):\n    return x.sum(axis=0)")
        .numpy()
        .batch(Batch::new(2))
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap();
    let x = Tensor::ones((3, 2), DType::F32, &Device::Cpu).unwrap();
    let e = op.call(&[Arg::from(&x)]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutputMismatch);
    assert_eq!(
        e.message(),
        "output 0 has shape [2]; a batching op's outputs have the batch's 3 rows along axis 0"
    );
    let e = PyOp::builder("like_w")
        .code("def like_w(x, w):\n    return w")
        .numpy()
        .batch(Batch::new(2).inputs([0]))
        .tout([OutSpec::same_as(1)])
        .build()
        .unwrap_err();
    assert_eq!(
        e.message(),
        "output 0 takes the shape of argument 1, which the batch does not stack: its axis 0 \
         would not be the batch's rows"
    );
}
