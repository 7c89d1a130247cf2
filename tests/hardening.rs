//! Regression tests for the adversarial audits (`../shared/reviews/adversarial-findings.md`,
//! F1–F16; the third audit's findings as `a3_*`): no crash, abort or memory error reachable from a body, panics and time limits that
//! hold. Each scenario runs in a child process of its own (this binary, `harness = false`, runs
//! itself again with `PYOP_HARDENING=<scenario>`), so that a regression that aborts or segfaults
//! fails that scenario instead of the whole run.

use std::process::Command;
use std::time::{Duration, Instant};

use pyop::candle::{DType, Device, Tensor};
use pyop::interop::pyo3;
use pyop::{expose, py_op, Arg, CallOptions, ErrorKind, OutSpec, PyOp, Value};

fn t(v: &[f32]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

fn tensor_op(name: &str, code: &str, dtype: DType) -> PyOp {
    PyOp::builder(name)
        .code(code)
        .tout([OutSpec::new(dtype)])
        .build()
        .unwrap()
}

fn numpy_op(name: &str, code: &str) -> PyOp {
    PyOp::builder(name)
        .code(code)
        .numpy()
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap()
}

/// Calls `op` on `x`, expecting an error of `kind` whose text contains `text`.
fn expect_err(op: &PyOp, x: &Tensor, kind: ErrorKind, text: &str) {
    let err = op.call(&[Arg::from(x)]).unwrap_err();
    assert_eq!(err.kind(), kind, "{}: {err}", op.name());
    assert!(err.to_string().contains(text), "{}: {err}", op.name());
}

// --- F1: `ndarray.__setstate__` on a view pyop handed out ---

#[py_op(code = r#"
import numpy as np
def setstate_write(x):
    v = x[:]
    x.__setstate__((1, x.shape, x.dtype, False, bytes(x.nbytes)))
    try:
        v.setflags(write=True)
        v[0] = 100
        return np.float32(1)
    except ValueError:
        return np.float32(0)
"#, numpy, tout = f32)]
fn setstate_write(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = r#"
import sys
import numpy as np
def setstate_out(x, out=None):
    np.add(x, 1, out=out)
    v = out[:]
    out.__setstate__((1, out.shape, out.dtype, False, bytes(out.nbytes)))
    sys._pyop_kept = v
    return None
"#, numpy, tout = f32[x])]
fn setstate_out(x: &Tensor) -> pyop::Result<Tensor>;

fn f1_setstate() {
    let x = t(&[1., 2., 3., 4.]);
    // The view stays read-only: writing through it is refused, the input is unchanged.
    assert_eq!(setstate_write(&x).unwrap().to_scalar::<f32>().unwrap(), 0.0);
    assert_eq!(x.to_vec1::<f32>().unwrap(), [1., 2., 3., 4.]);
    // `out` swapped out from under a kept view: the output is copied, a later write through the
    // view does not reach it.
    let y = setstate_out(&x).unwrap();
    assert_eq!(y.to_vec1::<f32>().unwrap(), [2., 3., 4., 5.]);
    let poke = numpy_op("poke", "import sys\nimport numpy as np\ndef poke(x):\n    sys._pyop_kept[...] = 42\n    return np.float32(0)");
    poke.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(y.to_vec1::<f32>().unwrap(), [2., 3., 4., 5.]);
    // A view kept after its array's buffer was swapped still keeps the storage alive: no
    // use-after-free once Rust drops the tensor (4 MiB, so freeing it unmaps it).
    let keep = numpy_op("keep_view", "import sys\nimport numpy as np\ndef keep_view(x):\n    v = x[:]\n    x.__setstate__((1, x.shape, x.dtype, False, bytes(x.nbytes)))\n    sys._pyop_kept_input = v\n    return np.float32(0)");
    let big = Tensor::ones(1 << 20, DType::F32, &Device::Cpu).unwrap();
    keep.call(&[Arg::from(&big)]).unwrap();
    drop(big);
    let churn: Vec<Tensor> = (0..8)
        .map(|_| Tensor::zeros(1 << 20, DType::F32, &Device::Cpu).unwrap())
        .collect();
    drop(churn);
    let read = numpy_op("read_kept", "import sys\nimport numpy as np\ndef read_kept(x):\n    return np.float32(sys._pyop_kept_input.sum())");
    let sum = read.call(&[Arg::from(&x)]).unwrap()[0]
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(sum, (1 << 20) as f32);
}

// --- F2: shapes whose element count overflows ---

fn f2_shapes() {
    let x = t(&[1.]);
    for (name, code) in [
        (
            "zeros",
            "import pyop\ndef zeros(x):\n    return pyop.zeros((2**32, 2**32))",
        ),
        (
            "reshape",
            "import pyop\ndef reshape(x):\n    return pyop.zeros((0,)).reshape(2**32, 2**32)",
        ),
        (
            "reshape_infer",
            "def reshape_infer(x):\n    return x.reshape(2**62, 2**62, -1)",
        ),
        (
            "bcast",
            "def bcast(x):\n    return x.broadcast_to(2**32, 2**32)",
        ),
    ] {
        expect_err(
            &tensor_op(name, code, DType::F32),
            &x,
            ErrorKind::InvalidArgument,
            "too many elements",
        );
    }
    expect_err(
        &tensor_op(
            "negative",
            "import pyop\ndef negative(x):\n    return pyop.zeros(-1)",
            DType::F32,
        ),
        &x,
        ErrorKind::InvalidArgument,
        "negative dimensions are not allowed",
    );
}

// --- F3: deeply nested lists; F4: recursion through Rust (on a 2 MiB thread too) ---

fn on_small_thread(f: impl FnOnce() + Send + 'static) {
    std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(f)
        .unwrap()
        .join()
        .unwrap();
}

fn f3_deep_lists() {
    expose("echo", |args| {
        Ok(args.into_iter().next().unwrap_or(Value::None))
    })
    .unwrap();
    let deep = "    a = [1.0]\n    for _ in range(100_000):\n        a = [a]\n";
    let x = t(&[1.]);
    let out = tensor_op(
        "deep_out",
        &format!("def deep_out(x):\n{deep}    return a"),
        DType::F32,
    );
    let made = tensor_op(
        "deep_tensor",
        &format!("import pyop\ndef deep_tensor(x):\n{deep}    return pyop.tensor(a)"),
        DType::F32,
    );
    let added = tensor_op(
        "deep_add",
        &format!("def deep_add(x):\n{deep}    return x + a"),
        DType::F32,
    );
    let rust = tensor_op(
        "deep_rust",
        &format!("import pyop\ndef deep_rust(x):\n{deep}    return pyop.rust.echo(a)"),
        DType::F32,
    );
    on_small_thread(move || {
        expect_err(
            &out,
            &x,
            ErrorKind::OutputMismatch,
            "nested more than 64 levels",
        );
        expect_err(
            &made,
            &x,
            ErrorKind::InvalidArgument,
            "nested more than 64 levels",
        );
        expect_err(
            &added,
            &x,
            ErrorKind::InvalidArgument,
            "nested more than 64 levels",
        );
        expect_err(&rust, &x, ErrorKind::ResourceExhausted, "RecursionError");
    });
}

fn f4_recursion_through_rust() {
    let op = tensor_op(
        "rec",
        "import pyop\ndef rec(x, n):\n    return pyop.rust.again(x, n + 1)",
        DType::F32,
    );
    let inner = op.clone();
    expose("again", move |a| {
        let y = inner.call(&[Arg::from(a[0].tensor()?), Arg::I64(a[1].i64()?)])?;
        Ok(Value::from(y.into_iter().next().unwrap()))
    })
    .unwrap();
    let x = t(&[1.]);
    let check = move || {
        let err = op.call(&[Arg::from(&x), Arg::I64(0)]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ResourceExhausted, "{err}");
        assert!(err.to_string().contains("RecursionError"), "{err}");
    };
    let on_thread = check.clone();
    check();
    on_small_thread(on_thread);
}

// --- F5: allocations too large abort nothing ---

fn f5_allocations() {
    let x = t(&[1.]);
    for (name, code) in [
        (
            "big_zeros",
            "import pyop\ndef big_zeros(x):\n    return pyop.zeros((1 << 45,))",
        ),
        (
            "big_ones",
            "import pyop\ndef big_ones(x):\n    return pyop.ones((1 << 45,))",
        ),
        (
            "big_full",
            "import pyop\ndef big_full(x):\n    return pyop.full((1 << 45,), 1.0)",
        ),
        (
            "big_arange",
            "import pyop\ndef big_arange(x):\n    return pyop.arange(0, 1e15)",
        ),
        (
            "big_bcast",
            "def big_bcast(x):\n    return x.broadcast_to(1 << 45).contiguous()",
        ),
        (
            "big_add",
            "def big_add(x):\n    return x.broadcast_to(1 << 45) + 1",
        ),
    ] {
        expect_err(
            &tensor_op(name, code, DType::F32),
            &x,
            ErrorKind::ResourceExhausted,
            "MemoryError",
        );
    }
}

// --- Second audit, finding 5: copies of a huge broadcast tensor abort nothing ---

/// What a body can do with `B`, a 2^40-element broadcast of one element (4 bytes of storage):
/// every expression that would copy it to its full size is a `MemoryError`, never an abort.
const BROADCAST_COPIES: &[&str] = &[
    "B.numpy()",
    "np.asarray(B)",
    "np.array(B)",
    "B.tolist()",
    "pyop.cat([B, B])",
    "pyop.stack([B, B])",
    "x[pyop.tensor([0]).broadcast_to(2**40)]",
    "B.contiguous()",
    "B + 1",
    "B.sum()",
    "B.sum(0)",
    "B.mean()",
    "B.max()",
    "B.argmax()",
    "B.to_dtype('f64')",
    "B.reshape(2**40)",
    "B.flatten()",
    "B.exp()",
    "B == 1",
    "B.clamp(0, 1)",
    "B.maximum(B)",
    "pyop.where(U, B, B)",
    "pyop.zeros_like(B)",
    "pyop.tensor(B, dtype='f64')",
    "I.sum()",
    "I * 2",
    "I.tolist()",
    "-pyop.zeros(1, dtype='i64').broadcast_to(2**40)",
    "abs(pyop.zeros(1, dtype='i64').broadcast_to(2**40))",
    "pyop.zeros(1, dtype='i64').broadcast_to(2**40) ** 2",
    "pyop.zeros(1, dtype='u8').broadcast_to(2**33).to_dtype('f64')",
    "pyop.zeros((1, 2**16)) @ pyop.zeros((1, 1, 1)).broadcast_to(2**20, 2**16, 1)",
    "pyop.tensor(np.broadcast_to(np.float32(1), 2**40))",
    "pyop.tensor(np.broadcast_to(np.float32(1), 2**40), dtype='f64')",
    "pyop.tensor(np.broadcast_to(np.int16(1), 2**40), dtype='f64')",
];

/// And what stays a view of its 4 bytes, or allocates what the machine has, so succeeds.
const BROADCAST_VIEWS: &[&str] = &[
    "assert pyop.zeros(2**24).numel() == 2**24",
    "assert (pyop.ones(1).broadcast_to(2**24) + 1).sum().item() == 2**25",
    "assert np.from_dlpack(B).strides == (0,)",
    "assert B.narrow(0, 5, 2**39).numel() == 2**39",
    "assert B[3:].shape == (2**40 - 3,)",
];

fn a5_broadcast_copies() {
    let x = t(&[1.]);
    let cases = BROADCAST_COPIES
        .iter()
        .map(|e| (e, false))
        .chain(BROADCAST_VIEWS.iter().map(|e| (e, true)));
    for (i, (expr, view)) in cases.enumerate() {
        println!("trying {expr}");
        let code = format!(
            "import numpy as np\nimport pyop\ndef f(x):\n    B = pyop.ones(1).broadcast_to(2**40)\n    \
             I = pyop.tensor([1]).broadcast_to(2**40)\n    \
             U = pyop.ones(1, dtype='u8').broadcast_to(2**40)\n    {expr}\n    return x"
        );
        let op = PyOp::builder(format!("copy{i}"))
            .code(code)
            .function("f")
            .tout([OutSpec::new(DType::F32)])
            .build()
            .unwrap();
        if view {
            op.call(&[Arg::from(&x)]).unwrap();
            continue;
        }
        let err = op.call(&[Arg::from(&x)]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ResourceExhausted, "{expr}: {err}");
        assert!(err.to_string().contains("MemoryError"), "{expr}: {err}");
    }
    // A numpy-mode body returning a huge broadcast array: its copy into candle is refused.
    let op = numpy_op(
        "big_output",
        "import numpy as np\ndef big_output(x):\n    return np.broadcast_to(np.float32(1), 2**40)",
    );
    expect_err(&op, &x, ErrorKind::ResourceExhausted, "MemoryError");
}

// --- F6, F7: a panic under a timed call is an error, and leaves no armed watchdog ---

#[pyo3::pyfunction]
#[pyo3(crate = "pyop::interop::pyo3")]
fn boom(_x: pyo3::Bound<'_, pyo3::PyAny>) -> i64 {
    panic!("boom in Rust")
}

fn f6_f7_panics() {
    let panicking = pyo3::Python::attach(|py| {
        pyo3::wrap_pyfunction!(boom, py)
            .unwrap()
            .into_any()
            .unbind()
    });
    let op = PyOp::builder("boom")
        .callable(panicking)
        .tout([OutSpec::new(DType::F32)])
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let x = t(&[1.]);
    let err = op.call(&[Arg::from(&x)]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Panic, "{err}");
    assert!(err.to_string().contains("boom in Rust"), "{err}");
    // The executor goes on, and the dead call's limit never fires into later code.
    let slow = tensor_op("slow", "import time\ndef slow(x):\n    t0 = time.time()\n    while time.time() - t0 < 1.0:\n        pass\n    return x", DType::F32);
    assert_eq!(
        slow.call(&[Arg::from(&x)]).unwrap()[0]
            .to_vec1::<f32>()
            .unwrap(),
        [1.]
    );
    // Checked integer arithmetic: the same OverflowError in debug and release builds.
    let overflow = tensor_op(
        "u8_overflow",
        "import pyop\ndef u8_overflow(x):\n    return pyop.tensor([200], dtype='u8') + 100",
        DType::U8,
    );
    expect_err(&overflow, &x, ErrorKind::OutOfRange, "integer overflow");
    let sum = tensor_op(
        "u8_sum",
        "import pyop\ndef u8_sum(x):\n    return pyop.tensor([250, 10], dtype='u8').sum()",
        DType::U8,
    );
    expect_err(&sum, &x, ErrorKind::OutOfRange, "integer overflow: sum()");
    let neg = tensor_op(
        "u32_sub",
        "import pyop\ndef u32_sub(x):\n    return pyop.tensor([1], dtype='u32') - 2",
        DType::U32,
    );
    expect_err(&neg, &x, ErrorKind::OutOfRange, "outside the range of u32");
    let fits = tensor_op("i16_ok", "import pyop\ndef i16_ok(x):\n    return pyop.tensor([30000, -30000, 5], dtype='i16').sum() * 2", DType::I16);
    assert_eq!(
        fits.call(&[Arg::from(&x)]).unwrap()[0]
            .to_scalar::<i16>()
            .unwrap(),
        10
    );
}

// --- F5, F6 corners: i64 checked exactly (f64 is not), a matmul larger than its operands ---

fn f5_f6_corners() {
    let x = t(&[1.]);
    for (name, code) in [
        (
            "i64_min_minus",
            "import pyop\ndef i64_min_minus(x):\n    return pyop.tensor([-2**63]) - 1",
        ),
        (
            "i64_mul",
            "import pyop\ndef i64_mul(x):\n    return pyop.tensor([89547301328687144]) * 103",
        ),
        (
            "i64_abs",
            "import pyop\ndef i64_abs(x):\n    return abs(pyop.tensor([-2**63]))",
        ),
        (
            "i64_neg",
            "import pyop\ndef i64_neg(x):\n    return -pyop.tensor([-2**63])",
        ),
        (
            "i64_pow",
            "import pyop\ndef i64_pow(x):\n    return pyop.tensor([2**32]) ** 2",
        ),
    ] {
        expect_err(
            &tensor_op(name, code, DType::I64),
            &x,
            ErrorKind::OutOfRange,
            "integer overflow",
        );
    }
    // i64::MAX passes through `+ 0`, `* 1` and `abs` unrefused.
    let i64_max = tensor_op(
        "i64_max",
        "import pyop\ndef i64_max(x):\n    m = pyop.tensor([2**63 - 1])\n    return (m + 0) * 1 + abs(m) * 0",
        DType::I64,
    );
    assert_eq!(
        i64_max.call(&[Arg::from(&x)]).unwrap()[0]
            .to_vec1::<i64>()
            .unwrap(),
        [i64::MAX]
    );
    let matmul = tensor_op(
        "big_matmul",
        "import pyop\ndef big_matmul(x):\n    n = 1 << 23\n    return pyop.zeros((n, 2)) @ pyop.zeros((2, n))",
        DType::F32,
    );
    expect_err(&matmul, &x, ErrorKind::ResourceExhausted, "MemoryError");
}

// --- F8: `Duration::MAX` is no limit ---

fn f8_duration_max() {
    let x = t(&[1.]);
    let op = PyOp::builder("ident")
        .code("def ident(x):\n    return x")
        .tout([OutSpec::new(DType::F32)])
        .timeout(Duration::MAX)
        .build()
        .unwrap();
    op.call(&[Arg::from(&x)]).unwrap();
    let plain = tensor_op("ident2", "def ident2(x):\n    return x", DType::F32);
    plain
        .call_with(&[Arg::from(&x)], &CallOptions::new().timeout(Duration::MAX))
        .unwrap();
    plain
        .call_with(
            &[Arg::from(&x)],
            &CallOptions::new().timeout(Duration::from_secs(u64::MAX)),
        )
        .unwrap();
}

// --- F9: a limit firing inside a nested op stays a BaseException ---

fn f9_nested_timeout() {
    let inner = tensor_op(
        "inner",
        "import time\ndef inner(x):\n    time.sleep(0.02)\n    return x",
        DType::F32,
    );
    expose("call_inner", move |a| {
        Ok(Value::from(
            inner.call(&[Arg::from(a[0].tensor()?)])?.remove(0),
        ))
    })
    .unwrap();
    let outer = PyOp::builder("outer")
        .code("import time\nimport pyop\ndef outer(x):\n    t0 = time.time(); n = 0\n    while time.time() - t0 < 3.0:\n        try:\n            pyop.rust.call_inner(x)\n        except Exception:\n            n += 1\n    return x + n")
        .tout([OutSpec::new(DType::F32)])
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let started = Instant::now();
    let err = outer.call(&[Arg::from(&t(&[1.]))]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "{:?}",
        started.elapsed()
    );
}

// --- F10: the process's first NumPy import under a time limit ---

fn f10_numpy_first_import() {
    let np_inner = PyOp::builder("np_inner")
        .code("def np_inner(x):\n    import numpy\n    return numpy.asarray(x) + 1")
        .numpy()
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap();
    let for_rust = np_inner.clone();
    expose("np_inner", move |a| {
        Ok(Value::from(
            for_rust.call(&[Arg::from(a[0].tensor()?)])?.remove(0),
        ))
    })
    .unwrap();
    let timed = PyOp::builder("timed")
        .code("import pyop\ndef timed(x):\n    return pyop.rust.np_inner(x)")
        .tout([OutSpec::new(DType::F32)])
        .timeout(Duration::from_millis(5))
        .build()
        .unwrap();
    let x = t(&[1.]);
    // Interrupted or not, NumPy works afterwards.
    let _ = timed.call(&[Arg::from(&x)]);
    assert_eq!(
        np_inner.call(&[Arg::from(&x)]).unwrap()[0]
            .to_vec1::<f32>()
            .unwrap(),
        [2.]
    );
}

// --- F11, F12, F14: tensor-mode numerics ---

fn f11_f12_f14_numerics() {
    let x = t(&[1.]);
    let flags = tensor_op(
        "flags",
        "import pyop\n\
         def flags(x):\n\
         \x20   out = []\n\
         \x20   try:\n\
         \x20       x + None\n\
         \x20       out.append(0)\n\
         \x20   except TypeError:\n\
         \x20       out.append(1)\n\
         \x20   out.append(1 if (x == 'a') is False else 0)\n\
         \x20   out.append(1 if (x != None) is True else 0)\n\
         \x20   class S:\n\
         \x20       def __rmul__(self, o):\n\
         \x20           return 'S.__rmul__'\n\
         \x20   out.append(1 if x * S() == 'S.__rmul__' else 0)\n\
         \x20   try:\n\
         \x20       pyop.tensor([1, 2, 3]).mean()\n\
         \x20       out.append(0)\n\
         \x20   except TypeError:\n\
         \x20       out.append(1)\n\
         \x20   out.append(1 if abs(pyop.tensor([200, 100], dtype='u8')).tolist() == [200, 100] else 0)\n\
         \x20   try:\n\
         \x20       int(pyop.tensor(float('nan')))\n\
         \x20       out.append(0)\n\
         \x20   except ValueError:\n\
         \x20       out.append(1)\n\
         \x20   try:\n\
         \x20       int(pyop.tensor(float('inf')))\n\
         \x20       out.append(0)\n\
         \x20   except OverflowError:\n\
         \x20       out.append(1)\n\
         \x20   out.append(1 if int(pyop.tensor(1e30, dtype='f64')) == int(1e30) else 0)\n\
         \x20   return out\n",
        DType::I64,
    );
    let got = flags.call(&[Arg::from(&x)]).unwrap()[0]
        .to_vec1::<i64>()
        .unwrap();
    assert_eq!(got, [1; 9], "NotImplemented, mean, abs, int(): {got:?}");
    let huge = tensor_op("huge", "def huge(x):\n    return 1e300", DType::F32);
    expect_err(
        &huge,
        &x,
        ErrorKind::OutputMismatch,
        "out of the range of dtype f32",
    );
    let exact = tensor_op("exact", "def exact(x):\n    return 2**25", DType::F32);
    assert_eq!(
        exact.call(&[Arg::from(&x)]).unwrap()[0]
            .to_scalar::<f32>()
            .unwrap(),
        33554432.0
    );
}

#[py_op(code = r#"
import numpy as np
def list_sum(xs):
    return xs[0].sum()
def list_sum_grad(inputs, outputs, grads):
    return (np.ones_like(inputs[0][0]) * grads[0],)
"#, numpy, tout = f32, grad = "list_sum_grad")]
fn list_sum(xs: &[Tensor]) -> pyop::Result<Tensor>;

fn f14_outputs_and_gradients() {
    let x = t(&[1.]);
    let masked = numpy_op(
        "masked",
        "import numpy as np
def masked(x):
    return np.ma.masked_array(np.float32([1, 2, 3]), mask=[0, 1, 0])",
    );
    expect_err(
        &masked,
        &x,
        ErrorKind::OutputMismatch,
        "a masked array is not a tensor",
    );
    let scalars = numpy_op(
        "scalars",
        "import numpy as np
def scalars(x):
    return [np.float32(1), np.float32(2)]",
    );
    let got = scalars.call(&[Arg::from(&x)]).unwrap()[0]
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(got, [1., 2.]);
    // A `&[Tensor]` of one tensor: its gradient may come as `(g,)`, as for two it is `(g1, g2)`.
    let v = pyop::candle::Var::new(&[1f32, 2.], &Device::Cpu).unwrap();
    let y = list_sum(&[v.as_tensor().clone()]).unwrap();
    let g = y.backward().unwrap();
    assert_eq!(g.get(&v).unwrap().to_vec1::<f32>().unwrap(), [1., 1.]);
}

// --- F13: a bad PYTHONHOME is an error, not a process exit ---

fn f13_pythonhome() {
    let err = pyop::python_env().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PythonUnavailable, "{err}");
    assert!(
        err.to_string()
            .contains("PYTHONHOME is /nonexistent/python"),
        "{err}"
    );
    let err = tensor_op_err();
    assert_eq!(err.kind(), ErrorKind::PythonUnavailable, "{err}");
}

fn tensor_op_err() -> pyop::Error {
    PyOp::builder("never")
        .code("def never(x):\n    return x")
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap_err()
}

// --- F16: unclear errors ---

fn f16_errors() {
    let bad_str = tensor_op(
        "bad_str",
        "class BadStr(Exception):\n    def __str__(self):\n        raise RuntimeError('no')\ndef bad_str(x):\n    raise BadStr('the args')",
        DType::F32,
    );
    let err = bad_str.call(&[Arg::from(&t(&[1.]))]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unknown);
    // Its `repr` stands in for the `str` that raised (before: an empty message).
    assert!(
        err.to_string()
            .starts_with("op `bad_str`: BadStr: BadStr('the args')\n"),
        "{err}"
    );
}

// --- Threads keep their Python thread states: the program still ends at once ---

/// The main thread keeps a thread state of pyop's (the interpreter was started by another
/// thread), and when `main` returns another thread's body holds the GIL in C code that never
/// lets it go (a regex that backtracks for ages): the program ends at once. Its thread-local
/// destructors run inside `exit()`, and the main thread's kept state is not freed there, which
/// would wait for the GIL.
fn t1_exit_while_a_body_holds_the_gil() {
    let x = t(&[1.]);
    let ident = tensor_op("ident", "def ident(x):\n    return x", DType::F32);
    // Another thread starts the interpreter, so the main thread's state is pyop's own.
    std::thread::scope(|s| {
        s.spawn(|| ident.call(&[Arg::from(&x)]).unwrap());
    });
    ident.call(&[Arg::from(&x)]).unwrap();
    static INSIDE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    expose("entered_regex", |_| {
        INSIDE.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(Value::None)
    })
    .unwrap();
    let stuck = tensor_op(
        "stuck",
        "import re, pyop\ndef stuck(x):\n    pyop.rust.entered_regex()\n    re.match(r'(a+)+$', 'a' * 64 + 'b')\n    return x",
        DType::F32,
    );
    std::thread::spawn(move || stuck.call(&[Arg::from(&t(&[1.]))]));
    while !INSIDE.load(std::sync::atomic::Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    // Dropping an op takes the GIL (its Python objects go with it), which the stuck body holds.
    std::mem::forget(ident);
}

// --- The third audit (`../shared/reviews/adversarial-findings-3.md`) ---

/// A body whose result is a list sharing its items: `levels` doublings of `[1.0, 2.0]`, so
/// 2^(levels+1) numbers in a few hundred bytes of Python.
fn shared_list_body(name: &str, levels: u32) -> String {
    format!(
        "def {name}(x):\n    v = [1.0, 2.0]\n    for _ in range({levels}):\n        v = [v, v]\n    return v"
    )
}

fn worker_numpy_op(name: &str, code: &str, pool: &pyop::WorkerPool) -> PyOp {
    PyOp::builder(name)
        .code(code)
        .numpy()
        .pool(pool)
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap()
}

/// Finding 2: a list that names 2^40 numbers (16 TiB read as numbers) is a `MemoryError`, from
/// a body in the program and from a worker's reply (a few hundred bytes pickled), never an
/// abort. A tensor-mode body's `pyop.tensor(v)` too.
fn a3_2_shared_lists() {
    let x = t(&[1.]);
    let body = shared_list_body("shared", 39);
    expect_err(
        &numpy_op("shared", &body),
        &x,
        ErrorKind::ResourceExhausted,
        "MemoryError: Unable to allocate",
    );
    let pool = pyop::WorkerPool::new(1);
    expect_err(
        &worker_numpy_op("shared", &body, &pool),
        &x,
        ErrorKind::ResourceExhausted,
        "MemoryError: Unable to allocate",
    );
    let made = tensor_op(
        "shared_tensor",
        "import pyop\ndef shared_tensor(x):\n    v = [1.0, 2.0]\n    for _ in range(39):\n        v = [v, v]\n    return pyop.tensor(v)",
        DType::F32,
    );
    expect_err(&made, &x, ErrorKind::ResourceExhausted, "MemoryError");
    // Passed to a Rust function: its values are counted (each list once) before any is made.
    expose("a3_count", |args| {
        fn count(v: &Value) -> i64 {
            match v {
                Value::List(items) => 1 + items.iter().map(count).sum::<i64>(),
                _ => 1,
            }
        }
        Ok(Value::I64(args.iter().map(count).sum()))
    })
    .unwrap();
    let to_rust = tensor_op(
        "shared_rust",
        "import pyop
def shared_rust(x):
    v = [1.0, 2.0]
    for _ in range(39):
        v = [v, v]
    return pyop.rust.a3_count(v)",
        DType::I64,
    );
    expect_err(&to_rust, &x, ErrorKind::ResourceExhausted, "MemoryError");
    let shared_ok = tensor_op(
        "shared_rust_ok",
        "import pyop
def shared_rust_ok(x):
    return pyop.rust.a3_count([[0.0] * 3] * 2)",
        DType::I64,
    );
    assert_eq!(
        shared_ok.call(&[Arg::from(&x)]).unwrap()[0]
            .to_scalar::<i64>()
            .unwrap(),
        1 + 2 * (1 + 3)
    );
    // A list subclass is read at C level, as it was counted: its `__iter__` is not asked.
    let endless = tensor_op(
        "endless",
        "import itertools, pyop\nclass L(list):\n    def __iter__(self):\n        return itertools.repeat(0, 10**11)\ndef endless(x):\n    return pyop.rust.a3_count(L([1.0, 2.0]))",
        DType::I64,
    );
    assert_eq!(
        endless.call(&[Arg::from(&x)]).unwrap()[0]
            .to_scalar::<i64>()
            .unwrap(),
        3
    );
    // A list of 2^40 empty lists (shared) is a tensor with no elements, read at once: each
    // list is checked once at each depth.
    let empty = numpy_op(
        "empty_shared",
        "def empty_shared(x):\n    v = []\n    for _ in range(40):\n        v = [v, v]\n    return v",
    );
    let started = Instant::now();
    let out = empty.call(&[Arg::from(&x)]).unwrap().remove(0);
    assert_eq!(out.dims().len(), 41);
    assert_eq!(out.elem_count(), 0);
    assert!(started.elapsed() < Duration::from_secs(5));
    // A list that fits is read whole, and a ragged one is refused as before.
    let fits = numpy_op("fits", &shared_list_body("fits", 3));
    let out = fits.call(&[Arg::from(&x)]).unwrap().remove(0);
    assert_eq!(out.dims(), [2, 2, 2, 2]);
    assert_eq!(
        out.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        [1., 2.].repeat(8)
    );
    expect_err(
        &numpy_op("ragged", "def ragged(x):\n    return [[1.0], [2.0, 3.0]]"),
        &x,
        ErrorKind::OutputMismatch,
        "ragged nested list: a list of 2 items where 1 were expected",
    );
    expect_err(
        &numpy_op(
            "ragged_deep",
            "def ragged_deep(x):\n    return [1.0, [2.0]]",
        ),
        &x,
        ErrorKind::OutputMismatch,
        "ragged nested list (not rectangular)",
    );
}

/// Finding 9: a call's time limit covers the check of its outputs: a list of 2^25 numbers that
/// takes a second or more to read stops at the limit, in the program and from a worker. (A
/// release build read 2^23 of them within 300 ms on a quiet machine: the check passed the limit.)
fn a3_9_limit_covers_the_output_check() {
    let x = t(&[1.]);
    let limit = Duration::from_millis(100);
    let body = shared_list_body("amplify", 24);
    let pool = pyop::WorkerPool::new(1);
    for op in [
        numpy_op("amplify", &body),
        worker_numpy_op("amplify", &body, &pool),
    ] {
        let started = Instant::now();
        let err = op
            .call_with(&[Arg::from(&x)], &CallOptions::new().timeout(limit))
            .unwrap_err();
        let took = started.elapsed();
        assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
        assert!(
            err.to_string()
                .contains("reading a list of numbers ran past the call's time limit"),
            "{err}"
        );
        // Stopped at the limit, not before it.
        assert!(
            took >= limit && took < limit + Duration::from_millis(1500),
            "{took:?}"
        );
    }
    // The limit ends with its call: a later call on this thread without one reads a long list
    // whole (2^18 numbers, past the first deadline check).
    let whole = numpy_op("whole", &shared_list_body("whole", 17));
    assert_eq!(
        whole.call(&[Arg::from(&x)]).unwrap()[0].elem_count(),
        1 << 18
    );
    // Waiting for a worker does not count: two calls at once on a pool of one, each body
    // within the limit, each reading 2^17 numbers at the end, both succeed.
    let one = pyop::WorkerPool::new(1);
    let late = worker_numpy_op(
        "late",
        "import time\ndef late(x):\n    time.sleep(0.6)\n    return [1.0] * (1 << 17)",
        &one,
    );
    std::thread::scope(|s| {
        let calls: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    late.call_with(
                        &[Arg::from(&x)],
                        &CallOptions::new().timeout(Duration::from_millis(1000)),
                    )
                })
            })
            .collect();
        for c in calls {
            assert_eq!(c.join().unwrap().unwrap()[0].elem_count(), 1 << 17);
        }
    });
    // A Python gradient's result is read within the op's limit too (2^24 numbers and a limit
    // of 50 ms: past it in a release build as well).
    let graded_limit = Duration::from_millis(50);
    let graded = PyOp::builder("graded")
        .code("def graded(x):\n    return x\ndef graded_grad(inputs, outputs, grads):\n    v = [1.0, 2.0]\n    for _ in range(23):\n        v = [v, v]\n    return [v]")
        .numpy()
        .gradient("graded_grad")
        .timeout(graded_limit)
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap();
    let v = pyop::candle::Var::new(&[1f32][..], &Device::Cpu).unwrap();
    let y = graded.call(&[Arg::from(v.as_tensor())]).unwrap().remove(0);
    let started = Instant::now();
    let err = pyop::Error::from(y.sum_all().unwrap().backward().unwrap_err());
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(started.elapsed() < graded_limit + Duration::from_millis(1500));
    // In a body, `pyop.tensor` of such a list stops at the body's limit as well.
    let made = tensor_op(
        "amplify_tensor",
        "import pyop\ndef amplify_tensor(x):\n    v = [1.0, 2.0]\n    for _ in range(22):\n        v = [v, v]\n    return pyop.tensor(v)",
        DType::F32,
    );
    let started = Instant::now();
    let err = made
        .call_with(&[Arg::from(&x)], &CallOptions::new().timeout(limit))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(started.elapsed() < limit + Duration::from_millis(1500));
}

/// Finding 3: reducing the empty axis of a tensor with no elements makes the product of the other
/// axes: a `MemoryError` when that is too large, never an abort.
fn a3_3_empty_reductions() {
    let x = t(&[1.]);
    for (name, expr) in [
        ("sum0", "pyop.zeros((0, 2**40)).sum(0)"),
        ("mean0", "pyop.zeros((0, 2**40)).mean(0)"),
        ("sum1", "pyop.zeros((2**40, 0)).sum(1)"),
        ("sum_keep", "pyop.zeros((0, 2**40)).sum(0, keepdim=True)"),
        (
            "sum_view",
            "x[:0].reshape(0, 1).broadcast_to((0, 2**40)).sum(0)",
        ),
    ] {
        let code = format!("import pyop\ndef {name}(x):\n    return {expr}");
        expect_err(
            &tensor_op(name, &code, DType::F32),
            &x,
            ErrorKind::ResourceExhausted,
            "MemoryError",
        );
    }
    // One that fits gives the zeros it should.
    let small = tensor_op(
        "sum_small",
        "import pyop\ndef sum_small(x):\n    return pyop.zeros((0, 3)).sum(0)",
        DType::F32,
    );
    assert_eq!(
        small.call(&[Arg::from(&x)]).unwrap()[0]
            .to_vec1::<f32>()
            .unwrap(),
        [0.0; 3]
    );
}

/// Finding 6: a `threading.local` value whose `__del__` calls Rust that takes the GIL (an exposed
/// function using `Python::attach`, one calling an op) while the thread's kept thread state is
/// deleted at the thread's end.
fn a3_6_local_del_reenters() {
    expose("a3_attach", |_| {
        Ok(Value::I64(
            pyo3::Python::attach(|py| py.import("sys").is_ok()) as i64,
        ))
    })
    .unwrap();
    let inner = tensor_op("a3_inner", "def a3_inner(x):\n    return x + 1", DType::F32);
    let inner = std::sync::Arc::new(inner);
    let called = inner.clone();
    expose("a3_op", move |_| {
        let y = called.call(&[Arg::from(&t(&[1.]))])?;
        Ok(Value::F64(y[0].to_vec1::<f32>().unwrap()[0] as f64))
    })
    .unwrap();
    static DELS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    expose("a3_deleted", |_| {
        DELS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(Value::None)
    })
    .unwrap();
    for f in ["a3_attach", "a3_op"] {
        let code = format!(
            "import threading, pyop\n_local = threading.local()\nclass Reenter:\n    def __del__(self):\n        pyop.rust.{f}()\n        pyop.rust.a3_deleted()\ndef keep(x):\n    _local.keep = Reenter()\n    return x + 1"
        );
        let op = std::sync::Arc::new(tensor_op("keep", &code, DType::F32));
        for _ in 0..20 {
            let op = op.clone();
            std::thread::spawn(move || op.call(&[Arg::from(&t(&[1.]))]).unwrap())
                .join()
                .unwrap();
        }
    }
    // Every thread's `__del__` ran to its end.
    assert_eq!(DELS.load(std::sync::atomic::Ordering::SeqCst), 40);
}

/// Finding 7: an op called from a user's thread-local destructor, registered before the thread's
/// first op call (so destroyed after pyop's thread-locals), works: tensor mode, numpy mode, a
/// time limit, a gradient through candle.
fn a3_7_op_in_a_user_tls_destructor() {
    use std::cell::RefCell;
    use std::sync::{Arc, Mutex};
    static RESULTS: Mutex<Vec<String>> = Mutex::new(Vec::new());
    struct CallsOnDrop(Vec<Arc<PyOp>>);
    impl Drop for CallsOnDrop {
        fn drop(&mut self) {
            for op in &self.0 {
                // The tensor-mode op's input is tracked (its gradient is candle's own); the
                // numpy-mode one, which has no gradient, gets a plain tensor.
                let x = pyop::candle::Var::new(&[2.0f32][..], &Device::Cpu).unwrap();
                let x_in = match op.name() {
                    "square" => x.as_tensor().clone(),
                    _ => x.as_tensor().detach(),
                };
                let r = op
                    .call_with(
                        &[Arg::from(&x_in)],
                        &CallOptions::new().timeout(Duration::from_secs(5)),
                    )
                    .and_then(|y| {
                        let g = y[0].sum_all()?.backward()?;
                        let dx = g.get(&x).map(|d| d.to_vec1::<f32>()).transpose()?;
                        Ok(format!("{:?} {:?}", y[0].to_vec1::<f32>()?, dx))
                    });
                RESULTS.lock().unwrap().push(format!(
                    "{}: {}",
                    op.name(),
                    r.unwrap_or_else(|e| e.to_string())
                ));
            }
        }
    }
    thread_local! {
        static MINE: RefCell<Option<CallsOnDrop>> = const { RefCell::new(None) };
    }
    let square = Arc::new(tensor_op(
        "square",
        "def square(x):\n    return x * x",
        DType::F32,
    ));
    let twice = Arc::new(numpy_op("twice", "def twice(x):\n    return x * 2"));
    let ops = vec![square.clone(), twice.clone()];
    std::thread::spawn(move || {
        // Set before the first op call: destroyed after pyop's own thread-locals.
        MINE.with(|m| *m.borrow_mut() = Some(CallsOnDrop(ops)));
        square.call(&[Arg::from(&t(&[1.]))]).unwrap();
        twice.call(&[Arg::from(&t(&[1.]))]).unwrap();
    })
    .join()
    .unwrap();
    assert_eq!(
        *RESULTS.lock().unwrap(),
        ["square: [4.0] Some([4.0])", "twice: [4.0] None"]
    );
}

/// Finding 5: `exit()` on a spawned thread that holds the GIL, after that thread kept a thread
/// state: the process ends with the status given (it hung for ever waiting for its own GIL).
/// Each case in a child of its own: one exits from Rust inside `Python::attach`, one from a
/// body through libc.
fn a3_5_exit_holding_the_gil() {
    for (child, status) in [("a3_5_exit_in_attach", 7), ("a3_5_exit_from_body", 5)] {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.env("PYOP_HARDENING", child).env_remove("PYTHONHOME");
        let out = output_within(cmd, Duration::from_secs(30))
            .unwrap_or_else(|| panic!("{child}: did not end within 30 s"));
        assert_eq!(
            out.status.code(),
            Some(status),
            "{child}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn a3_5_exit_in_attach() {
    let op = tensor_op("ident", "def ident(x):\n    return x", DType::F32);
    std::thread::spawn(move || {
        op.call(&[Arg::from(&t(&[1.]))]).unwrap();
        pyo3::Python::attach(|_py| std::process::exit(7));
    })
    .join()
    .unwrap();
    unreachable!("the thread exits the process");
}

fn a3_5_exit_from_body() {
    let op = tensor_op(
        "exits",
        "import ctypes\ndef exits(x):\n    ctypes.PyDLL(None).exit(5)",
        DType::F32,
    );
    std::thread::spawn(move || op.call(&[Arg::from(&t(&[1.]))]))
        .join()
        .unwrap()
        .unwrap();
    unreachable!("the body exits the process");
}

/// Scenarios run only as another scenario's child (they end the process themselves).
const CHILDREN: &[(&str, fn())] = &[
    ("a3_5_exit_in_attach", a3_5_exit_in_attach),
    ("a3_5_exit_from_body", a3_5_exit_from_body),
];

const SCENARIOS: &[(&str, fn())] = &[
    ("f1_setstate", f1_setstate),
    ("f2_shapes", f2_shapes),
    ("f3_deep_lists", f3_deep_lists),
    ("f4_recursion_through_rust", f4_recursion_through_rust),
    ("f5_allocations", f5_allocations),
    ("f6_f7_panics", f6_f7_panics),
    ("f5_f6_corners", f5_f6_corners),
    ("f8_duration_max", f8_duration_max),
    ("f9_nested_timeout", f9_nested_timeout),
    ("f10_numpy_first_import", f10_numpy_first_import),
    ("f11_f12_f14_numerics", f11_f12_f14_numerics),
    ("f14_outputs_and_gradients", f14_outputs_and_gradients),
    ("f13_pythonhome", f13_pythonhome),
    ("f16_errors", f16_errors),
    ("a5_broadcast_copies", a5_broadcast_copies),
    (
        "t1_exit_while_a_body_holds_the_gil",
        t1_exit_while_a_body_holds_the_gil,
    ),
    ("a3_2_shared_lists", a3_2_shared_lists),
    (
        "a3_9_limit_covers_the_output_check",
        a3_9_limit_covers_the_output_check,
    ),
    ("a3_3_empty_reductions", a3_3_empty_reductions),
    ("a3_6_local_del_reenters", a3_6_local_del_reenters),
    (
        "a3_7_op_in_a_user_tls_destructor",
        a3_7_op_in_a_user_tls_destructor,
    ),
    ("a3_5_exit_holding_the_gil", a3_5_exit_holding_the_gil),
];

/// Runs `cmd` to its end and returns what it printed, or kills it and returns `None` if it runs
/// past `limit` (a scenario that hangs fails instead of stalling the run).
fn output_within(mut cmd: Command, limit: Duration) -> Option<std::process::Output> {
    use std::process::Stdio;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pipe = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let out = pipe(Box::new(child.stdout.take().unwrap()));
    let err = pipe(Box::new(child.stderr.take().unwrap()));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Some(std::process::Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    })
}

fn main() {
    if let Ok(name) = std::env::var("PYOP_HARDENING") {
        let (_, f) = SCENARIOS
            .iter()
            .chain(CHILDREN)
            .find(|(n, _)| *n == name)
            .expect("a scenario");
        f();
        println!("ok {name}");
        return;
    }
    let (mut passed, mut failed) = (0, 0);
    for (name, _) in SCENARIOS {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.env("PYOP_HARDENING", name).env_remove("PYTHONHOME");
        if *name == "f13_pythonhome" {
            cmd.env("PYTHONHOME", "/nonexistent/python");
        }
        let Some(out) = output_within(cmd, Duration::from_secs(120)) else {
            println!("test {name} ... FAILED (did not end within 120 s)");
            failed += 1;
            continue;
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        if out.status.success() && stdout.contains(&format!("ok {name}")) {
            println!("test {name} ... ok");
            passed += 1;
        } else {
            println!(
                "test {name} ... FAILED ({})\n{stdout}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            failed += 1;
        }
    }
    println!("\n{passed} passed, {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
}
