//! Leaks: calls keep the Rust heap, Python's object heap and resident memory flat; dropped
//! run-time ops leave nothing behind in Python.
//!
//! The call test counts what is live rather than waiting for resident memory to show a leak:
//! every byte the Rust heap holds (a counting allocator) and every block Python's allocator
//! holds (`sys.getallocatedblocks`), which see a leak of one byte or one object per call after
//! 20,000 calls of each op, where resident memory needed 10^6 calls (38 s in a debug build) to
//! see ten bytes per call. Resident memory is still checked, for memory neither counts (C's own
//! `malloc` in libpython or NumPy), at 26 bytes per call.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use pyop::candle::{DType, Device, Tensor};
use pyop::interop::pyo3::prelude::*;
use pyop::{py_op, Arg, OutSpec, PyOp};

mod common;

/// The system allocator, counting the bytes it has live.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every method passes its arguments to `System`'s, which upholds the contract; the
// counter is only arithmetic beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `System.alloc`'s caller, with the caller's layout.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `System.alloc_zeroed`'s caller, with the caller's layout.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by this allocator (so by `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `System.realloc`'s caller, with the caller's pointer and layout.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The two tests measure the whole process, so they take turns.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// What is live: Rust heap bytes and Python's allocated blocks (after a collection).
fn live() -> (isize, isize) {
    let blocks = Python::attach(|py| {
        py.import("gc").unwrap().call_method0("collect").unwrap();
        py.import("sys")
            .unwrap()
            .call_method0("getallocatedblocks")
            .unwrap()
            .extract::<isize>()
            .unwrap()
    });
    (LIVE.load(Ordering::Relaxed), blocks)
}

#[py_op(code = "def small(x, k):\n    return x + k", numpy, tout = f32)]
fn small(x: &Tensor, k: f64) -> pyop::Result<Tensor>;

#[py_op(code = "def small_t(x):\n    return x * 2 + 1", tout = f32)]
fn small_t(x: &Tensor) -> pyop::Result<Tensor>;

const CALLS: usize = 20_000;

#[test]
fn calls_keep_memory_flat() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let x = Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap();
    for _ in 0..2_000 {
        small(&x, 1.0).unwrap();
        small_t(&x).unwrap();
    }
    let (heap, blocks) = live();
    let resident = common::rss_bytes();
    for i in 0..CALLS {
        let y = small(&x, 1.0).unwrap();
        let z = small_t(&x).unwrap();
        if i % 5_000 == 0 {
            assert_eq!(y.to_vec1::<f32>().unwrap(), [2., 3.]);
            assert_eq!(z.to_vec1::<f32>().unwrap(), [3., 5.]);
        }
    }
    let (heap_after, blocks_after) = live();
    let grown = common::rss_bytes().saturating_sub(resident);
    println!(
        "over {} calls: Rust heap {:+} bytes, Python blocks {:+}, resident memory +{} KiB",
        2 * CALLS,
        heap_after - heap,
        blocks_after - blocks,
        grown / 1024
    );
    // A byte or an object per call would be 40,000; what is left is a cache's step.
    assert!(
        heap_after - heap < 4096,
        "the Rust heap grew {} bytes over {} calls",
        heap_after - heap,
        2 * CALLS
    );
    assert!(
        blocks_after - blocks < 200,
        "Python's heap grew {} blocks over {} calls",
        blocks_after - blocks,
        2 * CALLS
    );
    // Memory neither counter sees (C's `malloc`): 1 MiB, 26 bytes a call; resident memory moves
    // by pages and by the allocator's arenas, so a tighter bound would be noise.
    assert!(
        grown < 1 << 20,
        "resident memory grew {} KiB over {} calls",
        grown / 1024,
        2 * CALLS
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
