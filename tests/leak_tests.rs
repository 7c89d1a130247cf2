//! Leaks: a million calls keep resident memory flat; dropped run-time ops leave nothing behind in
//! Python.

use pyop::candle::{DType, Device, Tensor};
use pyop::interop::pyo3::prelude::*;
use pyop::{py_op, Arg, OutSpec, PyOp};

/// The two tests measure the whole process, so they take turns.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Resident memory of this process, in bytes.
fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[py_op(code = "def small(x, k):\n    return x + k", numpy, tout = f32)]
fn small(x: &Tensor, k: f64) -> pyop::Result<Tensor>;

#[py_op(code = "def small_t(x):\n    return x * 2 + 1", tout = f32)]
fn small_t(x: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn a_million_calls_keep_memory_flat() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let x = Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap();
    for _ in 0..20_000 {
        small(&x, 1.0).unwrap();
        small_t(&x).unwrap();
    }
    let before = rss();
    for i in 0..500_000 {
        let y = small(&x, 1.0).unwrap();
        let z = small_t(&x).unwrap();
        if i % 100_000 == 0 {
            assert_eq!(y.to_vec1::<f32>().unwrap(), [2., 3.]);
            assert_eq!(z.to_vec1::<f32>().unwrap(), [3., 5.]);
        }
    }
    let grown = rss().saturating_sub(before);
    println!("RSS grew {} KiB over 10^6 calls", grown / 1024);
    assert!(
        grown < 10 << 20,
        "resident memory grew {} KiB over 10^6 calls",
        grown / 1024
    );
}

fn python_objects(py: Python<'_>) -> (usize, usize, usize) {
    let gc = py.import("gc").unwrap();
    gc.call_method0("collect").unwrap();
    let objects = gc.call_method0("get_objects").unwrap().len().unwrap();
    let modules = py
        .import("sys")
        .unwrap()
        .getattr("modules")
        .unwrap()
        .len()
        .unwrap();
    let lines = py
        .import("linecache")
        .unwrap()
        .getattr("cache")
        .unwrap()
        .len()
        .unwrap();
    (objects, modules, lines)
}

#[test]
fn dropped_runtime_ops_leave_nothing_behind() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
    let make = |i: usize| {
        let op = PyOp::builder(format!("op{i}"))
            .code(format!(
                "import numpy as np\nstate = [{i}]\ndef f(x):\n    return x + state[0]"
            ))
            .function("f")
            .numpy()
            .tout([OutSpec::new(DType::F32)])
            .build()
            .unwrap();
        assert_eq!(
            op.call(&[Arg::from(&x)]).unwrap()[0]
                .to_vec1::<f32>()
                .unwrap(),
            [1.0 + i as f32]
        );
    };
    make(0); // warm-up: the interpreter, NumPy, pyop's own module
    let before = Python::attach(python_objects);
    for i in 0..1000 {
        make(i);
    }
    let after = Python::attach(python_objects);
    assert_eq!(after.1, before.1, "sys.modules gained entries");
    assert_eq!(after.2, before.2, "linecache kept entries");
    assert!(
        after.0 <= before.0 + 50,
        "Python objects: {} before, {} after 1,000 ops",
        before.0,
        after.0
    );
}
