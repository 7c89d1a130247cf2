//! The shared-memory arenas that carry tensors to and from workers: their mappings, shrinking
//! and giving them back, a returned input named where it lies, copies counted, inputs read-only
//! and crossing as the storage they view, empty results, a worker that cannot map memory.
//!
//! A test whose doc begins "Finding N" is a case of the second audit's finding N
//! (`../shared/reviews/adversarial-findings-2.md`).

use std::time::Duration;

use pyop::candle::{DType, Tensor};
use pyop::{Arg, ErrorKind, OutSpec, PyOp, WorkerPool};

mod common;
use common::cpu;
use common::workers::{arena_mappings, exception, program_op, serial, worker_op};

/// The program's mappings of worker arenas: (inode, size in bytes) of each.
fn arena_maps() -> Vec<(u64, usize)> {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("pyop-worker-arena"))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (a, b) = f[0].split_once('-').unwrap();
            let size =
                usize::from_str_radix(b, 16).unwrap() - usize::from_str_radix(a, 16).unwrap();
            (f[4].parse().unwrap(), size)
        })
        .collect()
}

/// A worker returns an input where it lies: the reply names the place in the input arena, and
/// nothing is copied into a result arena (so the input arena is not held as retained either, and
/// is reused by the next call).
#[test]
fn a_returned_input_is_named_where_it_lies_not_copied() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let op = |name: &str, code: &str| {
        PyOp::builder(name)
            .code(code)
            .function("f")
            .numpy()
            .pool(&pool)
            .tout([OutSpec::new(DType::F32)])
            .build()
            .unwrap()
    };
    let fresh = op(
        "fresh",
        "import numpy as np\ndef f(x):\n    return np.zeros(1, np.float32)",
    );
    let ident = op("ident_in_place", "def f(x):\n    return x");
    let x = Tensor::ones(4 << 20, DType::F32, &cpu()).unwrap(); // 16 MiB
    fresh.call(&[Arg::from(&x)]).unwrap();
    let big = |maps: &[(u64, usize)]| {
        maps.iter()
            .filter(|a| a.1 >= 16 << 20)
            .map(|a| a.0)
            .collect::<Vec<_>>()
    };
    let input = big(&arena_maps());
    assert_eq!(
        input.len(),
        1,
        "one 16 MiB arena, the input's: {:?}",
        arena_maps()
    );
    for _ in 0..2 {
        let before = pool.stats();
        let y = ident.call(&[Arg::from(&x)]).unwrap();
        assert_eq!(y[0].dims(), x.dims());
        // The copies, counted: the input in, nothing out.
        let after = pool.stats();
        assert_eq!(after.bytes_in - before.bytes_in, 16 << 20);
        assert_eq!(after.bytes_out, before.bytes_out, "nothing copied out");
        assert_eq!(
            big(&arena_maps()),
            input,
            "the input arena kept and no 16 MiB result arena made: {:?}",
            arena_maps()
        );
    }
}

/// Bytes of the program's shared-memory arenas that are mapped now.
fn arena_bytes() -> usize {
    arena_mappings()
        .iter()
        .map(|(start, end)| end - start)
        .sum()
}

/// One large call does not pin its memory for the worker's life: after 32 calls in a row that
/// use under a quarter of an arena of 8 MiB or more, the program drops the input arena and gives
/// the worker a small result arena (mutation testing of `process.rs`: `note_use` emptied, or
/// counting the other arena, went unnoticed).
#[test]
fn arenas_shrink_after_a_large_call() {
    let _s = serial();
    let before = arena_bytes();
    let pool = WorkerPool::new(1);
    let op = worker_op(
        &pool,
        "shrink",
        "def f(x):\n    return x + 1",
        &[OutSpec::new(DType::F32)],
    );
    let big = Tensor::zeros(4 << 20, DType::F32, &cpu()).unwrap(); // 16 MiB
    op.call(&[Arg::from(&big)]).unwrap();
    let large = arena_bytes() - before;
    assert!(
        large >= 32 << 20,
        "an input and a result arena of 16 MiB: {large}"
    );
    let small = Tensor::new(&[1f32; 16], &cpu()).unwrap();
    for _ in 0..31 {
        op.call(&[Arg::from(&small)]).unwrap();
    }
    assert_eq!(arena_bytes() - before, large, "kept for 31 small calls");
    // Calls that use more than a quarter of them do not count (and reset the count).
    let half = Tensor::zeros(2 << 20, DType::F32, &cpu()).unwrap(); // 8 MiB
    for _ in 0..33 {
        op.call(&[Arg::from(&half)]).unwrap();
    }
    assert_eq!(
        arena_bytes() - before,
        large,
        "kept for 33 calls of half their size"
    );
    for _ in 0..31 {
        op.call(&[Arg::from(&small)]).unwrap();
    }
    assert_eq!(
        arena_bytes() - before,
        large,
        "kept for 31 small calls again"
    );
    for _ in 0..2 {
        op.call(&[Arg::from(&small)]).unwrap();
    }
    // Two arenas of the smallest size (1 MiB) serve the small calls now.
    let after = arena_bytes() - before;
    assert_eq!(after, 2 << 20, "after 33 small calls");
}

#[test]
fn arenas_given_back_after_a_large_call_do_not_change_results() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let x = Tensor::new(&[1f32, 2., 3., 4.], &cpu()).unwrap();
    // Plain arrays, a pickled tuple, and `out` buffers the body keeps a view of.
    let plain = worker_op(
        &pool,
        "sized",
        "def f(x, n):\n    return np.arange(n, dtype=np.float32) + x[0]",
        &[OutSpec::new(DType::F32)],
    );
    let pickled = worker_op(
        &pool,
        "sized_tuple",
        "def f(x, n):\n    return (np.arange(n, dtype=np.float32)[::-1] + x[0],)",
        &[OutSpec::new(DType::F32)],
    );
    // 16 MiB once, then small calls past the point where the arenas are given back.
    let big = plain
        .call(&[Arg::from(&x), Arg::from(4usize << 20)])
        .unwrap();
    assert_eq!(big[0].dims(), [4 << 20]);
    let big_input = Tensor::ones(4 << 20, DType::F32, &cpu()).unwrap();
    pickled
        .call(&[Arg::from(&big_input), Arg::from(4usize)])
        .unwrap();
    for i in 0..80 {
        let y = plain.call(&[Arg::from(&x), Arg::from(4usize)]).unwrap();
        assert_eq!(
            y[0].to_vec1::<f32>().unwrap(),
            [1., 2., 3., 4.],
            "plain call {i}"
        );
        let y = pickled.call(&[Arg::from(&x), Arg::from(4usize)]).unwrap();
        assert_eq!(
            y[0].to_vec1::<f32>().unwrap(),
            [4., 3., 2., 1.],
            "pickled call {i}"
        );
    }
}

#[test]
fn empty_results_need_no_shared_memory() {
    let _s = serial();
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    for code in [
        "def f(x): return np.zeros((0, 3), np.float32)",
        "def f(x): return (np.zeros((0, 3), np.float32),)",
    ] {
        // A fresh pool: no result arena exists yet.
        let pool = WorkerPool::new(1);
        let y = worker_op(&pool, "empty", code, &[OutSpec::new(DType::F32)])
            .call(&[Arg::from(&x)])
            .unwrap_or_else(|e| panic!("{code}: {e}"));
        assert_eq!(y[0].dims(), [0, 3], "{code}");
    }
}

#[test]
fn a_worker_that_cannot_map_memory_is_replaced() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    // The body keeps its input (so the next call gets a fresh input arena) and caps the
    // worker's address space just above what it uses: the next arena cannot be mapped.
    let op = worker_op(
        &pool,
        "capped",
        "import resource\nkept = []\ndef f(x, cap):\n    if cap:\n        kept.append(x)\n        used = int(open('/proc/self/statm').read().split()[0]) * 4096\n        resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 16), resource.RLIM_INFINITY))\n    return x + 1",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    // Both arenas exist after the first call; the second caps and keeps its input.
    op.call(&[Arg::from(&x), Arg::Bool(false)]).unwrap();
    op.call(&[Arg::from(&x), Arg::Bool(true)]).unwrap();
    let err = op.call(&[Arg::from(&x), Arg::Bool(false)]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::WorkerLost, "{err}");
    let y = op.call(&[Arg::from(&x), Arg::Bool(false)]).unwrap();
    assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2.]);
}

/// The bytes an op's calls copied into and out of workers (`OpStats`).
fn copies(op: &PyOp) -> (u64, u64) {
    let s = op.stats();
    (s.worker_bytes_in, s.worker_bytes_out)
}

#[test]
fn copies_in_and_out_are_counted_and_returned_inputs_are_not_copied() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let x = Tensor::arange(0f32, 1024., &cpu()).unwrap();
    let op = |name: &str, code: &str, tout: OutSpec| worker_op(&pool, name, code, &[tout]);
    let f32_ = OutSpec::new(DType::F32);
    let ident = op("ident_counted", "def f(x):\n    return x", f32_.clone());
    let view = op("view_counted", "def f(x):\n    return x[1:]", f32_.clone());
    let plus = op("plus_counted", "def f(x):\n    return x + 1", f32_.clone());
    let out = op(
        "out_counted",
        "def f(x, out=None):\n    np.add(x, 1, out=out)",
        OutSpec::like(DType::F32, 0),
    );
    ident.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(
        copies(&ident),
        (4096, 0),
        "a returned input is read where it lies"
    );
    let y = view.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(y[0].to_vec1::<f32>().unwrap()[0], 1.);
    assert_eq!(copies(&view), (4096, 0), "so is a view of one");
    plus.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(copies(&plus), (4096, 4096), "a fresh result is copied once");
    out.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(
        copies(&out),
        (4096, 0),
        "an `out` buffer is read where it lies"
    );
    let p = pool.stats();
    assert_eq!(
        (p.bytes_in, p.bytes_out),
        (4 * 4096, 4096),
        "the pool counts them all"
    );
}

/// Finding 4: an input crosses as the storage it views. A broadcast of 2^40 elements is one
/// element in the arena (it aborted the process), and narrowed, transposed and broadcast inputs
/// have the same strides and values in a worker as in the program.
#[test]
fn inputs_cross_as_the_storage_they_view() {
    let _s = serial();
    let pool = WorkerPool::new(1);
    let huge = Tensor::new(&[1f32], &cpu())
        .unwrap()
        .broadcast_as((1usize << 40,))
        .unwrap();
    let head = worker_op(
        &pool,
        "head",
        "def f(x):\n    return np.array(x[:4])",
        &[OutSpec::new(DType::F32)],
    );
    let y = head.call(&[Arg::from(&huge)]).unwrap();
    assert_eq!(y[0].to_vec1::<f32>().unwrap(), [1.; 4]);
    assert_eq!(pool.stats().bytes_in, 4, "one element in the arena");
    let code = "def f(x):\n    return np.array(x.strides + x.shape + (float(x.sum()), x.flags.writeable), np.float64)";
    let worker = worker_op(&pool, "strides", code, &[OutSpec::new(DType::F64)]);
    let program = program_op("strides_p", code, &[OutSpec::new(DType::F64)]);
    let m = Tensor::arange(0f32, 12., &cpu())
        .unwrap()
        .reshape((3, 4))
        .unwrap();
    let cases = [
        m.clone(),
        m.t().unwrap(),
        m.narrow(1, 1, 2).unwrap(),
        m.narrow(0, 1, 2).unwrap().t().unwrap(),
        m.narrow(1, 2, 1).unwrap().broadcast_as((3, 5)).unwrap(),
        Tensor::new(&[7f32], &cpu())
            .unwrap()
            .broadcast_as((2, 3))
            .unwrap(),
        m.narrow(0, 0, 0).unwrap(),
    ];
    for (i, t) in cases.iter().enumerate() {
        let w = worker.call(&[Arg::from(t)]).unwrap()[0]
            .to_vec1::<f64>()
            .unwrap();
        let p = program.call(&[Arg::from(t)]).unwrap()[0]
            .to_vec1::<f64>()
            .unwrap();
        assert_eq!(w, p, "case {i}: {:?} {:?}", t.dims(), t.stride());
    }
}

/// Finding 7: inputs are read-only in a worker as in the program, through every route to their
/// memory, and a thread a body leaves writing to what it kept cannot reach later calls' inputs.
#[test]
fn inputs_are_read_only_and_kept_memory_cannot_reach_later_calls() {
    let _s = serial();
    let code = "\
import threading, time\n\
def f(x, how):\n    \
if how == 'setflags':\n        x.setflags(write=True); x[0] = 42\n    \
elif how == 'base':\n        x.base[...] = 42\n    \
elif how == 'mmap':\n        x.base.base[0:4] = b'\\xff' * 4\n    \
return x.copy()\n";
    let pool = WorkerPool::new(1);
    let tout = [OutSpec::new(DType::F32)];
    let worker = worker_op(&pool, "readonly", code, &tout);
    let program = program_op("readonly_p", code, &tout);
    let x = Tensor::new(&[1f32, 2.], &cpu()).unwrap();
    for how in ["setflags", "base"] {
        let args = [Arg::from(&x), Arg::Str(how)];
        let p = program.call(&args).unwrap_err();
        let w = worker.call(&args).unwrap_err();
        assert_eq!(
            (w.kind(), exception(&w)),
            (p.kind(), exception(&p)),
            "{how}: {w}"
        );
    }
    // The mapping under a worker's input views is read-only too.
    let w = worker.call(&[Arg::from(&x), Arg::Str("mmap")]).unwrap_err();
    assert_eq!(exception(&w), Some("TypeError"), "{w}");
    // Threads left writing through what a body kept: its input's mapping, and its `out`
    // buffer's writable array and mapping.
    let scribble = worker_op(
        &pool,
        "scribble",
        "import os, threading, time, weakref\n\
         def loop(m):\n    \
         while True:\n        \
         try:\n            m[0:16] = b'\\xff' * 16\n        \
         except Exception:\n            return\n        \
         time.sleep(0.0002)\n\
         def weak(w):\n    \
         end = time.time() + 1\n    \
         while time.time() < end:\n        \
         m = w()\n        \
         if m is None: return\n        \
         m[0:16] = b'\\xff' * 16\n        \
         del m\n        \
         time.sleep(0.0002)\n\
         def f(x, how, out=None):\n    \
         if how == 'input': threading.Thread(target=loop, args=(x.base.base,), daemon=True).start()\n    \
         if how == 'out': threading.Thread(target=loop, args=(out.base,), daemon=True).start()\n    \
         if how == 'outmap': threading.Thread(target=loop, args=(out.base.base,), daemon=True).start()\n    \
         if how == 'weak': threading.Thread(target=weak, args=(weakref.ref(out.base.base.obj),), daemon=True).start()\n    \
         if how == 'fork' and os.fork() == 0:\n        \
         end = time.time() + 1\n        \
         while time.time() < end: out[...] = 99\n        \
         os._exit(0)\n    \
         np.add(x, 0, out=out)",
        &[OutSpec::like(DType::F32, 0)],
    );
    let x = Tensor::new(&[1f32, 2., 3., 4.], &cpu()).unwrap();
    for how in ["input", "out", "outmap", "weak", "fork"] {
        let y = scribble.call(&[Arg::from(&x), Arg::Str(how)]).unwrap();
        if how == "fork" {
            // A forked child's writes are its own (a thread's race the body's own output).
            assert_eq!(y[0].to_vec1::<f32>().unwrap(), [1., 2., 3., 4.], "{how}");
        }
        for i in 0..30 {
            let y = scribble.call(&[Arg::from(&x), Arg::Str("")]).unwrap();
            assert_eq!(
                y[0].to_vec1::<f32>().unwrap(),
                [1., 2., 3., 4.],
                "{how}, call {i}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
