//! What crosses between the program and its workers: the same tables as in the program, every
//! argument kind and dtype, results, subclasses and exceptions read as in the program, stand-ins,
//! forged replies, every message kind, `out` buffers, gradients, module state and module keys,
//! many threads through few workers.
//!
//! A test whose doc begins "Finding N" is a case of the second audit's finding N
//! (`../shared/reviews/adversarial-findings-2.md`).

use std::sync::OnceLock;
use std::time::Duration;

use pyop::candle::{DType, Device, Tensor, Var};
use pyop::{py_op, Arg, ErrorKind, OutSpec, PyOp, WorkerPool};

mod common;
use common::workers::{exception, pid_file, program_op, serial, worker_op};
use common::{cpu, tables, within};

/// One pool of two workers for the table tests: every op gets its own module in it.
fn table_pool() -> &'static WorkerPool {
    static POOL: OnceLock<WorkerPool> = OnceLock::new();
    POOL.get_or_init(|| WorkerPool::new(2))
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

/// A worker call whose reply is only bytes (the usual array of the declared dtype, `out`
/// buffers) never takes the program's GIL: it completes while another thread holds it, as a
/// service's other handlers do while their bodies run in the program (with the GIL taken for
/// the reply, each call waited for the holder: ~8 ms a call beside an 8 ms body, in the bench's
/// `worker_ident_1_python_busy`). A reply that needs Python (another dtype: the output check's
/// conversion) still reads it with the GIL, once the holder lets go.
#[test]
fn a_workers_bytes_are_read_without_the_programs_gil() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let f32_ = [OutSpec::new(DType::F32)];
    let twice = worker_op(&pool, "twice", "def f(x):\n    return x * 2", &f32_);
    let plus_out = worker_op(
        &pool,
        "plus_out",
        "def f(x, out):\n    np.add(x, 1, out=out)",
        &[OutSpec::like(DType::F32, 0)],
    );
    let as_f64 = worker_op(
        &pool,
        "as_f64",
        "def f(x):\n    return x.astype('float64')",
        &f32_,
    );
    let x = Tensor::new(&[1f32, 2., 3.], &cpu()).unwrap();
    // Started and loaded first (a worker's start asks the program's interpreter for its paths).
    for op in [&twice, &plus_out, &as_f64] {
        let _ = op.call(&[Arg::from(&x)]);
    }
    let holder = common::GilHolder::start();
    let before = (
        twice.stats().gil_acquisitions,
        plus_out.stats().gil_acquisitions,
    );
    for _ in 0..20 {
        let y = twice.call(&[Arg::from(&x)]).unwrap();
        assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2., 4., 6.]);
        let y = plus_out.call(&[Arg::from(&x)]).unwrap();
        assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2., 3., 4.]);
    }
    assert!(!holder.released(), "the calls waited for the program's GIL");
    assert_eq!(
        (
            twice.stats().gil_acquisitions,
            plus_out.stats().gil_acquisitions
        ),
        before
    );
    // An f64 array for an f32 output is the output check's to convert or refuse, with Python:
    // the call returns only once the holder lets go.
    let converted = std::thread::spawn(move || {
        let e = as_f64.call(&[Arg::from(&x)]).unwrap_err();
        (e.kind(), e.to_string())
    });
    std::thread::sleep(Duration::from_millis(200));
    assert!(!converted.is_finished());
    holder.release();
    let (kind, msg) = converted.join().unwrap();
    assert_eq!(kind, ErrorKind::OutputMismatch);
    assert!(
        msg.contains("expected dtype f32, got a NumPy array of dtype float64"),
        "{msg}"
    );
}

/// A fresh program's first worker call, before pyop has imported NumPy in it: the `out` buffers
/// the worker wrote are read with the GIL then (which imports NumPy, as every reply did), and
/// the next calls' buffers and arrays without it (no time in Python); the same outputs either
/// way.
#[test]
fn a_fresh_programs_first_worker_calls_read_their_replies() {
    let _s = serial();
    let (passed, text) = common::child_test(module_path!(), "first_replies_child", &[]);
    assert!(passed, "{text}");
}

#[test]
#[ignore = "a child process of a_fresh_programs_first_worker_calls_read_their_replies"]
fn first_replies_child() {
    let pool = WorkerPool::new(1);
    let plus_out = worker_op(
        &pool,
        "plus_out",
        "def f(x, out):\n    np.add(x, 1, out=out)",
        &[OutSpec::like(DType::F32, 0)],
    );
    let twice = worker_op(
        &pool,
        "twice",
        "def f(x):\n    return x * 2",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32, 2., 3.], &cpu()).unwrap();
    pyop::set_timing(true);
    for call in 0..3 {
        let y = plus_out.call(&[Arg::from(&x)]).unwrap();
        assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2., 3., 4.]);
        let python = plus_out.stats().python_time;
        if call == 0 {
            assert!(
                python > Duration::ZERO,
                "the first reply was read with the GIL"
            );
        }
        let y = twice.call(&[Arg::from(&x)]).unwrap();
        assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2., 4., 6.]);
        assert_eq!(twice.stats().python_time, Duration::ZERO);
        let y = plus_out.call(&[Arg::from(&x)]).unwrap();
        assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2., 3., 4.]);
        assert_eq!(plus_out.stats().python_time, python);
    }
}

/// Every dtype a worker's plain array can have for a candle dtype (bool as u8, as in the
/// program) is read without Python, exactly; one byte order or kind candle lacks is the output
/// check's to refuse, with Python, in the program's words.
#[test]
fn every_plain_dtype_of_a_workers_array_is_read_without_python() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let x = Tensor::arange(0u32, 6, &cpu())
        .unwrap()
        .reshape((2, 3))
        .unwrap();
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
        let op = worker_op(
            &pool,
            "ident",
            "def f(x):\n    return x + 0",
            &[OutSpec::new(dtype)],
        );
        let xd = x.to_dtype(dtype).unwrap();
        // (An op's first call loads its body, with the program's GIL.)
        op.call(&[Arg::from(&xd)]).unwrap();
        let before = op.stats().gil_acquisitions;
        let y = op.call(&[Arg::from(&xd)]).unwrap();
        assert_eq!(op.stats().gil_acquisitions, before, "{dtype:?}");
        assert_eq!((y[0].dtype(), y[0].dims()), (dtype, &[2, 3][..]));
        assert_eq!(
            y[0].to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap(),
            [[0., 1., 2.], [3., 4., 5.]],
            "{dtype:?}"
        );
    }
    let positive = worker_op(
        &pool,
        "positive",
        "def f(x):\n    return x > 2",
        &[OutSpec::new(DType::U8)],
    );
    positive.call(&[Arg::from(&x)]).unwrap();
    let before = positive.stats().gil_acquisitions;
    let y = positive.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(positive.stats().gil_acquisitions, before);
    assert_eq!(y[0].to_vec2::<u8>().unwrap(), [[0, 0, 0], [1, 1, 1]]);
    let swapped = worker_op(
        &pool,
        "swapped",
        "def f(x):\n    return x.astype('>f4')",
        &[OutSpec::new(DType::F32)],
    );
    let e = swapped.call(&[Arg::from(&x)]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutputMismatch);
    assert!(
        e.to_string().contains("got a NumPy array of dtype >f4"),
        "{e}"
    );
    // Read as bytes or with Python, the same outputs and errors as the same op in the program:
    // a 0-d array, an empty one, int8 (no candle dtype), a shape unlike the argument's.
    let like = [OutSpec::like(DType::F32, 0)];
    let f32_ = [OutSpec::new(DType::F32)];
    for (code, tout) in [
        (
            "def f(x):\n    return np.float32(x.sum()).reshape(())",
            &f32_[..],
        ),
        ("def f(x):\n    return x[:0].astype(np.float32)", &f32_),
        ("def f(x):\n    return x.astype(np.int8)", &f32_),
        ("def f(x):\n    return x[:1].astype(np.float32)", &like),
        ("def f(x):\n    return x.astype(np.float32)", &like),
    ] {
        let run = |op: PyOp| {
            op.call(&[Arg::from(&x)])
                .map(|y| {
                    let values = y[0].flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    (y[0].dims().to_vec(), values)
                })
                .map_err(|e| (e.kind(), e.to_string()))
        };
        let in_worker = run(worker_op(&pool, "same", code, tout));
        assert_eq!(in_worker, run(program_op("same", code, tout)), "{code}");
    }
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

// --- how both sides waited ---

/// Calls from a spawned thread: `calls` quick ones, then a few of a ~5 ms body (the caller
/// sleeps through most of it). Returns the pool's counters.
fn waited_calls(calls: usize) -> pyop::PoolStats {
    let pool = WorkerPool::new(1);
    let quick = worker_op(
        &pool,
        "quick",
        "def f(x):\n    return x",
        &[OutSpec::new(DType::F32)],
    );
    let slow = worker_op(
        &pool,
        "slow",
        "import time\ndef f(x):\n    time.sleep(0.005)\n    return x",
        &[OutSpec::new(DType::F32)],
    );
    std::thread::spawn(move || {
        let x = Tensor::new(&[1f32], &cpu()).unwrap();
        for i in 0..calls {
            let op = if i % 10 == 9 { &slow } else { &quick };
            assert_eq!(
                op.call(&[Arg::from(&x)]).unwrap()[0]
                    .to_vec1::<f32>()
                    .unwrap(),
                [1.]
            );
        }
    })
    .join()
    .unwrap();
    pool.stats()
}

/// Every call counts once on each side of `PoolStats::waits`: caught, missed or slept through,
/// with time spent checking only where a side checked.
#[test]
fn every_call_says_how_both_sides_waited() {
    let _s = serial();
    let s = waited_calls(60);
    let w = s.waits;
    assert_eq!(s.calls, 60, "{s:?}");
    assert_eq!(
        w.caller_caught + w.caller_missed + w.caller_slept,
        60,
        "{w:?}"
    );
    assert_eq!(
        w.worker_caught + w.worker_missed + w.worker_slept,
        60,
        "{w:?}"
    );
    // A side that never checked spent no time checking; one that did, some.
    assert_eq!(
        w.caller_caught + w.caller_missed == 0,
        w.caller_checking.is_zero(),
        "{w:?}"
    );
    assert_eq!(
        w.worker_caught + w.worker_missed == 0,
        w.worker_checking.is_zero(),
        "{w:?}"
    );
    // At most 600 µs of checking a call on the caller's side (its longest window), and the
    // worker's at most 2 ms.
    assert!(
        w.caller_checking <= Duration::from_micros(650) * 60,
        "{w:?}"
    );
    assert!(
        w.worker_checking <= Duration::from_micros(2100) * 60,
        "{w:?}"
    );
    // With `PYOP_WORKER_SPIN=0` neither side ever checks: every message is slept through.
    let (passed, text) = common::child_test(
        module_path!(),
        "waits_without_spinning_child",
        &[("PYOP_WORKER_SPIN", Some(std::ffi::OsStr::new("0")))],
    );
    assert!(passed, "{text}");
    // Without it, a fresh process checks for its replies: its first call checks from its
    // request on, unless a spell of checking before it (the body's load) found the CPUs crowded
    // and turned spinning off, which a spell must have happened to do.
    let (passed, text) = common::child_test(
        module_path!(),
        "waits_with_spinning_child",
        &[("PYOP_WORKER_SPIN", None)],
    );
    assert!(passed, "{text}");
}

#[test]
#[ignore = "a child process of every_call_says_how_both_sides_waited, without PYOP_WORKER_SPIN"]
fn waits_with_spinning_child() {
    let w = waited_calls(1).waits;
    let crowded = pyop::__private::crowded_count();
    assert!(
        w.caller_caught + w.caller_missed == 1 || crowded > 0,
        "{w:?}, crowded {crowded} times"
    );
}

#[test]
#[ignore = "a child process of every_call_says_how_both_sides_waited, with PYOP_WORKER_SPIN=0"]
fn waits_without_spinning_child() {
    let w = waited_calls(30).waits;
    let zero = Duration::ZERO;
    assert_eq!(
        (
            w.caller_caught,
            w.caller_missed,
            w.caller_slept,
            w.caller_checking
        ),
        (0, 0, 30, zero),
        "{w:?}"
    );
    assert_eq!(
        (
            w.worker_caught,
            w.worker_missed,
            w.worker_slept,
            w.worker_checking
        ),
        (0, 0, 30, zero),
        "{w:?}"
    );
}
