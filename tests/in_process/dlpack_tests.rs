//! DLPack: `pyop.Tensor` handed to NumPy without a copy (`np.from_dlpack`), and DLPack producers
//! returned as outputs. On the CPU, with NumPy, here; with PyTorch and CuPy on CUDA, through the
//! GPU kit.

use pyop::candle::{DType, Device, Tensor};
use pyop::{Arg, ErrorKind, OutSpec, PyOp};

use crate::common;
use common::{cpu, data_ptr, tensor_op};

fn op(code: &str, tout: &[OutSpec]) -> PyOp {
    tensor_op("dl", &format!("import numpy as np\n{code}"), tout).unwrap()
}

#[test]
fn a_tensor_reaches_numpy_without_a_copy_and_read_only() {
    let x = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &cpu()).unwrap();
    let probe = op(
        "def f(x):\n    a = np.from_dlpack(x)\n    return np.array([a.__array_interface__['data'][0], a.flags.writeable, a.shape[0], a.shape[1]], dtype=np.int64)",
        &[OutSpec::new(DType::I64)],
    );
    let got = probe.call(&[Arg::from(&x)]).unwrap()[0]
        .to_vec1::<i64>()
        .unwrap();
    assert_eq!(got[0] as usize, data_ptr(&x), "the same memory");
    assert_eq!(got[1], 0, "read-only (DLPack 1.x, which NumPy asks for)");
    assert_eq!(&got[2..], [2, 3]);
    assert_eq!(
        probe.call(&[Arg::from(&x)]).unwrap()[0]
            .to_vec1::<i64>()
            .unwrap()[0],
        got[0]
    );
}

/// A tracked tensor (a `Var`, or a view of one, which shares its storage) reaches a DLPack
/// consumer as a snapshot: a `Var::set` while the consumer still holds its array (here, from
/// Rust the body calls, between the export and the read) is not seen, and no consumer reads
/// memory `Var::set` writes. An untracked tensor is still exported without a copy.
#[test]
fn a_tracked_tensor_is_exported_as_a_snapshot() {
    use pyop::candle::Var;
    let var = Var::ones(1000, DType::F32, &cpu()).unwrap();
    let setter = var.clone();
    pyop::expose("dlpack_set_var", move |_| {
        setter.set(&Tensor::full(2f32, 1000, &Device::Cpu)?)?;
        Ok(pyop::Value::None)
    })
    .unwrap();
    let probe = op(
        "import pyop\ndef f(x):\n    a = np.from_dlpack(x)\n    pyop.rust.dlpack_set_var()\n    return np.float32(a.max())",
        &[OutSpec::new(DType::F32)],
    );
    // The same through views and detached views the body makes of its input, which autograd no
    // longer tracks but which still share the Var's storage.
    let detached = op(
        "import pyop\ndef f(x):\n    a = np.from_dlpack(x.detach()[1:].detach())\n    pyop.rust.dlpack_set_var()\n    return np.float32(a.max())",
        &[OutSpec::new(DType::F32)],
    );
    for (what, t, probe) in [
        ("the Var", var.as_tensor().clone(), &probe),
        ("a view of it", var.narrow(0, 1, 998).unwrap(), &probe),
        (
            "a detached view of a view",
            var.narrow(0, 1, 998).unwrap(),
            &detached,
        ),
    ] {
        var.set(&Tensor::ones(1000, DType::F32, &cpu()).unwrap())
            .unwrap();
        let seen = probe.call(&[Arg::from(&t)]).unwrap()[0]
            .to_vec0::<f32>()
            .unwrap();
        assert_eq!(
            seen, 1.0,
            "{what}: the consumer saw a Var::set made after the export"
        );
    }
    let ptr = op(
        "def f(x):\n    return np.int64(np.from_dlpack(x).__array_interface__['data'][0])",
        &[OutSpec::new(DType::I64)],
    );
    let same = |t: &Tensor| {
        ptr.call(&[Arg::from(t)]).unwrap()[0]
            .to_vec0::<i64>()
            .unwrap() as usize
            == data_ptr(t)
    };
    assert!(!same(var.as_tensor()), "a Var is copied");
    let plain = Tensor::ones(1000, DType::F32, &cpu()).unwrap();
    assert!(same(&plain), "an untracked tensor is not");
}

#[test]
fn every_dtype_and_layout_arrives_with_its_values() {
    let double = op(
        "def f(x):\n    return np.from_dlpack(x) * 2",
        &[OutSpec::same_as(0)],
    );
    let base = Tensor::arange(0i64, 24, &cpu())
        .unwrap()
        .reshape((4, 6))
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
        let x = base.to_dtype(dtype).unwrap();
        // Contiguous, transposed (strides), and a narrowed view (an offset into its storage).
        for (what, t) in [
            ("contiguous", x.clone()),
            ("transposed", x.t().unwrap()),
            ("narrowed", x.narrow(1, 2, 3).unwrap()),
        ] {
            let y = double.call(&[Arg::from(&t)]).unwrap().remove(0);
            let want = (t.to_dtype(DType::F64).unwrap() * 2.0).unwrap();
            assert_eq!(
                y.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap(),
                want.to_vec2::<f64>().unwrap(),
                "{dtype:?} {what}"
            );
        }
    }
}

#[test]
fn an_exported_array_outlives_the_tensor() {
    let keep = op(
        "kept = []\ndef f(x, read):\n    if not read:\n        kept.append(np.from_dlpack(x))\n        return x\n    return pyop.tensor(float(kept[0].sum()), dtype='f64')",
        &[OutSpec::new(DType::F64)],
    );
    {
        let x = Tensor::new(&[1.5f64, 2.5], &cpu()).unwrap();
        keep.call(&[Arg::from(&x), Arg::Bool(false)]).unwrap();
        // `x` is dropped here; the array NumPy kept still holds its memory.
    }
    let y = Tensor::zeros(2, DType::F64, &cpu()).unwrap();
    let sum = keep.call(&[Arg::from(&y), Arg::Bool(true)]).unwrap()[0]
        .to_scalar::<f64>()
        .unwrap();
    assert_eq!(sum, 4.0);
}

#[test]
fn the_legacy_protocol_and_unconsumed_capsules() {
    let _memory = common::memory_lock();
    // A consumer of the pre-1.0 protocol gets a `dltensor` capsule; NumPy reads it too.
    let legacy = op(
        "class Legacy:\n    def __init__(self, x):\n        self.x = x\n    def __dlpack__(self, **kw):\n        return self.x.__dlpack__()\n    def __dlpack_device__(self):\n        return self.x.__dlpack_device__()\n\
         def f(x):\n    assert x.__dlpack_device__() == (1, 0)\n    cap = x.__dlpack__()\n    assert 'dltensor' in repr(cap) and 'versioned' not in repr(cap)\n    return np.from_dlpack(Legacy(x)) + 0",
        &[OutSpec::same_as(0)],
    );
    let x = Tensor::new(&[3f32, 4.], &cpu()).unwrap();
    assert_eq!(
        legacy.call(&[Arg::from(&x)]).unwrap()[0]
            .to_vec1::<f32>()
            .unwrap(),
        [3., 4.]
    );
    // Capsules nobody consumed free their export: 200 copies of 4 MiB made and dropped (legacy
    // and versioned) leave the process no larger.
    let churn = op(
        "def f(x):\n    for _ in range(100):\n        x.__dlpack__(copy=True)\n        x.__dlpack__(copy=True, max_version=(1, 0))\n    return x",
        &[OutSpec::same_as(0)],
    );
    let big = Tensor::zeros(1 << 20, DType::F32, &cpu()).unwrap();
    churn.call(&[Arg::from(&big)]).unwrap();
    let before = common::rss_bytes();
    churn.call(&[Arg::from(&big)]).unwrap();
    let grown = common::rss_bytes().saturating_sub(before);
    assert!(grown < 100 << 20, "grew {grown} bytes");
}

#[test]
fn dlpack_producers_are_outputs() {
    // Any object with __dlpack__ (a PyTorch tensor, a CuPy or JAX array) is an output, checked
    // against `tout` like any other value.
    let wrap = "class Producer:\n    def __init__(self, a):\n        self.a = a\n    def __dlpack__(self, **kw):\n        return self.a.__dlpack__(**kw)\n    def __dlpack_device__(self):\n        return self.dev\n    dev = (1, 0)\n";
    let x = Tensor::new(&[1f32, 2.], &cpu()).unwrap();
    let ok = op(
        &format!("{wrap}def f(x):\n    return Producer(np.arange(3, dtype=np.float32))"),
        &[OutSpec::new(DType::F32)],
    );
    assert_eq!(
        ok.call(&[Arg::from(&x)]).unwrap()[0]
            .to_vec1::<f32>()
            .unwrap(),
        [0., 1., 2.]
    );
    let wrong = op(
        &format!("{wrap}def f(x):\n    return Producer(np.arange(3, dtype=np.float64))"),
        &[OutSpec::new(DType::F32)],
    );
    let err = wrong.call(&[Arg::from(&x)]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutputMismatch);
    assert!(err.to_string().contains("expected dtype f32"), "{err}");
    // A producer on a GPU is asked for a copy on the host, which then goes to the op's device.
    let gpu = op(
        &format!("{wrap}def f(x):\n    p = Producer(np.arange(3, dtype=np.float32))\n    p.dev = (2, 0)\n    return p"),
        &[OutSpec::new(DType::F32)],
    );
    assert_eq!(
        gpu.call(&[Arg::from(&x)]).unwrap()[0]
            .to_vec1::<f32>()
            .unwrap(),
        [0., 1., 2.]
    );
    // One that cannot make that copy says so.
    let stuck = op(
        "class Stuck:\n    def __dlpack__(self, **kw):\n        raise BufferError('no copy to the host')\n    def __dlpack_device__(self):\n        return (2, 0)\ndef f(x):\n    return Stuck()",
        &[OutSpec::new(DType::F32)],
    );
    let err = stuck.call(&[Arg::from(&x)]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutputMismatch);
    assert!(
        err.to_string()
            .contains("could not be read through DLPack as a copy on the host"),
        "{err}"
    );
    assert!(err.to_string().contains("no copy to the host"), "{err}");
    // pyop.Tensor stays its own fast path (no DLPack round trip): the same storage comes back.
    let same = op("def f(x):\n    return x", &[OutSpec::same_as(0)]);
    let y = same.call(&[Arg::from(&x)]).unwrap().remove(0);
    assert_eq!(data_ptr(&y), data_ptr(&x));
    let _ = Device::Cpu;
}

/// DLPack on CUDA with PyTorch and CuPy, where the GPU kit runs (`--features cuda`, a GPU, and
/// an environment with torch or CuPy, e.g. the GPU machine's `/opt/torch/.venv`). Elsewhere it
/// says which of those is missing and checks nothing.
#[cfg(feature = "cuda")]
#[test]
fn cuda_tensors_reach_torch_and_cupy_and_come_back() {
    let device = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: no CUDA device here ({e})");
            return;
        }
    };
    let x = Tensor::new(&[1f32, 2., 3., 4.], &device).unwrap();
    // The interpreter set up with its environment (PYOP_PYTHON_ENV), where torch and CuPy are.
    pyop::python_env().unwrap();
    for (lib, code) in [
        (
            "torch",
            "def f(x):\n    import torch\n    t = torch.from_dlpack(x)\n    assert t.device.type == 'cuda', t.device\n    assert t.data_ptr() == torch.from_dlpack(x).data_ptr()\n    return t * 2",
        ),
        (
            "cupy",
            "def f(x):\n    import cupy\n    a = cupy.from_dlpack(x)\n    return a * 2",
        ),
    ] {
        let have = pyop::interop::pyo3::Python::attach(|py| py.import(lib).is_ok());
        if !have {
            eprintln!("skipped {lib}: it cannot be imported here");
            continue;
        }
        let op = tensor_op("dl_cuda", code, &[OutSpec::same_as(0)]).unwrap();
        let y = op.call(&[Arg::from(&x)]).unwrap_or_else(|e| panic!("{lib}: {e}"));
        assert!(y[0].device().same_device(&device), "{lib}: on the op's device");
        assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2., 4., 6., 8.], "{lib}");
        println!("{lib}: a CUDA tensor went through DLPack and came back");
    }
}

/// A producer that is nothing but the protocol, around any array: what a torch tensor or a CuPy
/// array looks like to pyop. `legacy` drops `max_version` (a producer of the protocol before 1.0,
/// which raises `TypeError` for it).
const PRODUCER: &str = "class Producer:\n    def __init__(self, a, legacy=False):\n        self.a = a\n        self.legacy = legacy\n    def __dlpack__(self, stream=None, **kw):\n        if self.legacy and kw:\n            raise TypeError('__dlpack__() got an unexpected keyword argument')\n        assert stream is None, stream\n        return self.a.__dlpack__(**kw)\n    def __dlpack_device__(self):\n        return self.a.__dlpack_device__()\n";

fn producer_op(code: &str, tout: &[OutSpec]) -> PyOp {
    op(&format!("{PRODUCER}{code}"), tout)
}

#[test]
fn producers_of_every_dtype_and_layout_are_read_by_pyop_itself() {
    let x = Tensor::new(&[0f32], &cpu()).unwrap();
    // (NumPy expression, tout dtype, the values as f64, row-major).
    let cases: &[(&str, DType, &[f64])] = &[
        (
            "np.arange(6, dtype=np.float32).reshape(2, 3)",
            DType::F32,
            &[0., 1., 2., 3., 4., 5.],
        ),
        (
            "np.arange(6, dtype=np.float64).reshape(2, 3).T",
            DType::F64,
            &[0., 3., 1., 4., 2., 5.],
        ),
        (
            "np.arange(6, dtype=np.float16)[::-1]",
            DType::F16,
            &[5., 4., 3., 2., 1., 0.],
        ),
        (
            "np.lib.stride_tricks.as_strided(np.arange(3, dtype=np.int16), (2, 3), (0, 2))",
            DType::I16,
            &[0., 1., 2., 0., 1., 2.],
        ),
        (
            "np.arange(10, dtype=np.int32)[1::3]",
            DType::I32,
            &[1., 4., 7.],
        ),
        (
            "np.arange(-3, 3, dtype=np.int64).reshape(3, 2)[:, 1:]",
            DType::I64,
            &[-2., 0., 2.],
        ),
        ("np.array([250, 7], dtype=np.uint8)", DType::U8, &[250., 7.]),
        ("np.array([True, False, True])", DType::U8, &[1., 0., 1.]),
        (
            "np.array([4000000000, 1], dtype=np.uint32)",
            DType::U32,
            &[4e9, 1.],
        ),
        ("np.array(2.5)", DType::F64, &[2.5]),
        ("np.zeros((0, 3), dtype=np.float32)", DType::F32, &[]),
        (
            "np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))",
            DType::F32,
            &[0., 1., 2., 3., 4., 5.],
        ),
    ];
    for legacy in [false, true] {
        for (expr, dtype, want) in cases {
            let code = format!(
                "def f(x):\n    return Producer({expr}, legacy={legacy})",
                legacy = if legacy { "True" } else { "False" }
            );
            let p = producer_op(&code, &[OutSpec::new(*dtype)]);
            let y = p
                .call(&[Arg::from(&x)])
                .unwrap_or_else(|e| panic!("{expr} (legacy {legacy}): {e}"))
                .remove(0);
            let got = y.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
            assert_eq!(
                got.to_vec1::<f64>().unwrap(),
                *want,
                "{expr} (legacy {legacy})"
            );
        }
    }
    // The shape comes through as well.
    let p = producer_op(
        "def f(x):\n    return Producer(np.zeros((2, 0, 3), dtype=np.float32))",
        &[OutSpec::new(DType::F32)],
    );
    assert_eq!(p.call(&[Arg::from(&x)]).unwrap()[0].dims(), [2, 0, 3]);
    // bf16, which NumPy lacks, from pyop's own export read back by pyop's import.
    let b = Tensor::new(&[1.5f32, -2.25], &cpu())
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    for legacy in ["False", "True"] {
        let p = producer_op(
            &format!("def f(x):\n    return Producer(x, legacy={legacy})"),
            &[OutSpec::new(DType::BF16)],
        );
        let y = p.call(&[Arg::from(&b)]).unwrap().remove(0);
        assert_eq!(
            y.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(),
            [1.5, -2.25]
        );
        assert_ne!(
            data_ptr(&y),
            data_ptr(&b),
            "one copy: candle owns its storage"
        );
    }
}

#[test]
fn producers_that_do_not_fit_say_why() {
    let x = Tensor::new(&[0f32], &cpu()).unwrap();
    let err_of = |code: &str| {
        let p = producer_op(code, &[OutSpec::new(DType::F32)]);
        p.call(&[Arg::from(&x)]).unwrap_err()
    };
    let e = err_of("def f(x):\n    return Producer(np.zeros(2))");
    assert_eq!(e.kind(), ErrorKind::OutputMismatch);
    assert!(
        e.to_string()
            .contains("output 0: expected dtype f32, got a DLPack tensor of dtype float64"),
        "{e}"
    );
    let e = err_of("def f(x):\n    return Producer(np.zeros(2, dtype=np.uint16))");
    assert!(
        e.to_string()
            .contains("expected dtype f32, got a DLPack tensor of dtype uint16"),
        "{e}"
    );
    let e = err_of("def f(x):\n    return Producer(np.zeros(2, dtype=np.complex64))");
    assert!(e.to_string().contains("dtype complex64"), "{e}");
    // The producer's own failure, with its exception.
    let e = err_of("class Broken(Producer):\n    def __dlpack__(self, **kw):\n        raise RuntimeError('boom')\ndef f(x):\n    return Broken(np.zeros(2, dtype=np.float32))");
    assert_eq!(e.kind(), ErrorKind::OutputMismatch);
    assert!(
        e.to_string()
            .contains("could not be read through DLPack: __dlpack__() failed: RuntimeError: boom"),
        "{e}"
    );
    // Something that is no capsule, and a capsule already consumed.
    let e = err_of("class Liar(Producer):\n    def __dlpack__(self, **kw):\n        return 42\ndef f(x):\n    return Liar(np.zeros(2, dtype=np.float32))");
    assert!(
        e.to_string()
            .contains("__dlpack__() returned int, not an unused DLPack capsule"),
        "{e}"
    );
    let e = err_of("class Once(Producer):\n    cap = None\n    def __dlpack__(self, **kw):\n        if Once.cap is None:\n            Once.cap = self.a.__dlpack__(**kw)\n        return Once.cap\ndef f(x):\n    a = np.zeros(2, dtype=np.float32)\n    np.from_dlpack(Once(a))\n    return Once(a)");
    assert!(
        e.to_string()
            .contains("returned PyCapsule, not an unused DLPack capsule"),
        "{e}"
    );
    // A shape that is not the declared one is the output check's usual error.
    let p = producer_op(
        "def f(x):\n    return Producer(np.zeros((2, 2), dtype=np.float32))",
        &[OutSpec::shaped(DType::F32, vec![Some(3)])],
    );
    let e = p.call(&[Arg::from(&x)]).unwrap_err();
    assert!(
        e.to_string()
            .contains("output 0: expected shape f32[3], got shape [2, 2]"),
        "{e}"
    );
}

#[test]
fn a_read_producer_is_released_once() {
    // NumPy's export holds a reference to its array until the consumer calls the deleter: after
    // pyop read it, the array's reference count is what it was, for both protocol versions.
    let p = producer_op(
        "import sys\nA = np.arange(4, dtype=np.float32)\ndef f(x, legacy, count):\n    if count:\n        return np.array([sys.getrefcount(A)], dtype=np.float32)\n    return Producer(A, legacy=legacy)",
        &[OutSpec::new(DType::F32)],
    );
    let x = Tensor::new(&[0f32], &cpu()).unwrap();
    let count = |p: &PyOp| {
        p.call(&[Arg::from(&x), Arg::Bool(false), Arg::Bool(true)])
            .unwrap()[0]
            .to_vec1::<f32>()
            .unwrap()[0]
    };
    let before = count(&p);
    for legacy in [false, true] {
        for _ in 0..10 {
            let y = p
                .call(&[Arg::from(&x), Arg::Bool(legacy), Arg::Bool(false)])
                .unwrap();
            assert_eq!(y[0].to_vec1::<f32>().unwrap(), [0., 1., 2., 3.]);
        }
        assert_eq!(count(&p), before, "legacy {legacy}: every export released");
    }
}

fn dlpack_op(code: &str, tout: &[OutSpec]) -> pyop::Result<PyOp> {
    PyOp::builder("dl_numpy")
        .code(format!("import numpy as np\nimport pyop\n{code}"))
        .function("f")
        .numpy()
        .dlpack()
        .tout(tout.iter().cloned())
        .build()
}

#[test]
fn a_dlpack_numpy_op_gets_producers_on_the_device_without_a_copy() {
    let x = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &cpu()).unwrap();
    let op = dlpack_op(
        "def f(x, k):\n    assert isinstance(x, pyop.Tensor), type(x)\n    a = np.from_dlpack(x)\n    return np.array([a.__array_interface__['data'][0], a.flags.writeable], dtype=np.int64), a * k",
        &[OutSpec::new(DType::I64), OutSpec::same_as(0)],
    )
    .unwrap();
    assert!(op.passes_dlpack());
    let y = op.call(&[Arg::from(&x), Arg::F64(2.0)]).unwrap();
    let probe = y[0].to_vec1::<i64>().unwrap();
    assert_eq!(probe[0] as usize, data_ptr(&x), "the input's own memory");
    assert_eq!(probe[1], 0, "read-only");
    assert_eq!(
        y[1].to_vec2::<f32>().unwrap(),
        [[2., 4., 6.], [8., 10., 12.]]
    );
    // bf16 in and out, which NumPy views cannot carry: the body hands the producer back.
    let b = x.to_dtype(DType::BF16).unwrap();
    let same = dlpack_op(
        &format!("{PRODUCER}def f(x):\n    return Producer(x)"),
        &[OutSpec::same_as(0)],
    )
    .unwrap();
    let y = same.call(&[Arg::from(&b)]).unwrap().remove(0);
    assert_eq!(y.dtype(), DType::BF16);
    assert_eq!(
        y.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap(),
        x.to_vec2::<f32>().unwrap()
    );
    // fp8 is refused before the body, by name.
    let f8 = x.to_dtype(DType::F8E4M3).unwrap();
    let e = same.call(&[Arg::from(&f8)]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(
        e.to_string()
            .contains("input 0 is f8e4m3, which DLPack cannot carry"),
        "{e}"
    );
}

#[test]
fn a_dlpack_numpy_op_takes_its_python_gradient_through_dlpack() {
    let op = PyOp::builder("dl_square")
        .code("import numpy as np\nimport pyop\ndef f(x):\n    return np.from_dlpack(x) ** 2\ndef g(inputs, outputs, grads):\n    (x,), (y,), (dy,) = inputs, outputs, grads\n    assert all(isinstance(t, pyop.Tensor) for t in (x, y, dy))\n    return 2 * np.from_dlpack(x) * np.from_dlpack(dy)")
        .function("f")
        .gradient("g")
        .numpy()
        .dlpack()
        .tout([OutSpec::same_as(0)])
        .build()
        .unwrap();
    let v = pyop::candle::Var::new(&[1.5f64, -2.0, 3.0], &cpu()).unwrap();
    let y = op.call(&[Arg::from(v.as_tensor())]).unwrap().remove(0);
    assert_eq!(y.to_vec1::<f64>().unwrap(), [2.25, 4.0, 9.0]);
    let w = Tensor::new(&[1f64, 10., 100.], &cpu()).unwrap();
    let grads = (y * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let g = grads.get(v.as_tensor()).unwrap().to_vec1::<f64>().unwrap();
    assert_eq!(g, [3.0, -40.0, 600.0]);
}

#[test]
fn dlpack_is_numpy_modes_option_and_not_for_workers() {
    let e = PyOp::builder("t")
        .code("def t(x):\n    return x")
        .dlpack()
        .tout([OutSpec::same_as(0)])
        .build()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(
        e.to_string().contains("`dlpack` is numpy mode's option"),
        "{e}"
    );
    let e = PyOp::builder("w")
        .code("def w(x):\n    return x")
        .numpy()
        .dlpack()
        .workers(1)
        .tout([OutSpec::same_as(0)])
        .build()
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("a worker process cannot reach: drop the pool or `.dlpack()`"),
        "{e}"
    );
    // Outputs: what DLPack carries (bf16 yes, fp8 no).
    assert!(dlpack_op("def f(x):\n    return x", &[OutSpec::new(DType::BF16)]).is_ok());
    let e = dlpack_op("def f(x):\n    return x", &[OutSpec::new(DType::F8E4M3)]).unwrap_err();
    assert!(
        e.to_string()
            .contains("output 0 is f8e4m3, which DLPack cannot carry"),
        "{e}"
    );
}

#[pyop::py_op(
    code = "import numpy as np\ndef scaled(x, k):\n    return np.from_dlpack(x) * k",
    numpy,
    dlpack,
    tout = f32[x]
)]
fn scaled(x: &Tensor, k: f64) -> pyop::Result<Tensor>;

#[test]
fn a_declared_dlpack_op() {
    let x = Tensor::new(&[[1f32, -2.], [3., 4.5]], &cpu()).unwrap();
    assert_eq!(
        scaled(&x, 2.0).unwrap().to_vec2::<f32>().unwrap(),
        [[2., -4.], [6., 9.]]
    );
    let op = pyop::op!(scaled);
    assert!(op.decl().dlpack());
}

/// A numpy-mode `dlpack` op on CUDA: the body gets device memory (CuPy, torch) and its device
/// results come back device to device. The producer below refuses any copy to the host, so a
/// result that went through the host would fail; it also checks that pyop passed candle's stream.
#[cfg(feature = "cuda")]
#[test]
fn a_dlpack_numpy_op_on_cuda_stays_on_the_device() {
    let device = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: no CUDA device here ({e})");
            return;
        }
    };
    pyop::python_env().unwrap();
    let device_only = "class DeviceOnly:\n    def __init__(self, a):\n        self.a = a\n    def __dlpack__(self, stream=None, **kw):\n        if kw.get('dl_device') is not None or kw.get('copy'):\n            raise BufferError('a copy to the host was asked for')\n        assert isinstance(stream, int) and stream not in (0, -1), stream\n        return self.a.__dlpack__(stream=stream, **kw)\n    def __dlpack_device__(self):\n        return self.a.__dlpack_device__()\n";
    let x = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &device).unwrap();
    for (lib, body) in [
        ("cupy", "    import cupy\n    a = cupy.from_dlpack(x)\n    assert isinstance(a, cupy.ndarray)\n    return DeviceOnly(a * 2)"),
        ("torch", "    import torch\n    t = torch.from_dlpack(x)\n    assert t.is_cuda\n    return DeviceOnly(t * 2)"),
    ] {
        if !pyop::interop::pyo3::Python::attach(|py| py.import(lib).is_ok()) {
            eprintln!("skipped {lib}: it cannot be imported here");
            continue;
        }
        let op = dlpack_op(&format!("{device_only}def f(x):\n{body}"), &[OutSpec::same_as(0)])
            .unwrap();
        let y = op.call(&[Arg::from(&x)]).unwrap_or_else(|e| panic!("{lib}: {e}"));
        assert!(y[0].device().same_device(&device), "{lib}: on the op's device");
        assert_eq!(
            y[0].to_vec2::<f32>().unwrap(),
            [[2., 4., 6.], [8., 10., 12.]],
            "{lib}"
        );
        println!("{lib}: a numpy-mode dlpack op on CUDA returned device memory, copied device to device");
    }
    if pyop::interop::pyo3::Python::attach(|py| py.import("torch").is_ok()) {
        // A transposed result stays on the device (copied as its block, then reordered by
        // candle); a stepped one goes through the host (said in the README); bf16 stays on the
        // device.
        let op = dlpack_op(
            &format!("{device_only}def f(x):\n    import torch\n    t = torch.from_dlpack(x)\n    return DeviceOnly(t.t()), t[:, ::2], DeviceOnly(t.to(torch.bfloat16))"),
            &[
                OutSpec::new(DType::F32),
                OutSpec::new(DType::F32),
                OutSpec::new(DType::BF16),
            ],
        )
        .unwrap();
        let y = op.call(&[Arg::from(&x)]).unwrap();
        assert_eq!(
            y[0].to_vec2::<f32>().unwrap(),
            [[1., 4.], [2., 5.], [3., 6.]]
        );
        assert_eq!(y[1].to_vec2::<f32>().unwrap(), [[1., 3.], [4., 6.]]);
        assert!(y.iter().all(|t| t.device().same_device(&device)));
        assert_eq!(
            y[2].to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap(),
            x.to_vec2::<f32>().unwrap()
        );
        // A large result, still being computed when the body returns (on a side stream the
        // body joins to torch's current stream, as torch asks): the copy is ordered after it.
        let big = Tensor::ones((4096, 4096), DType::F32, &device).unwrap();
        let op = dlpack_op(
            &format!("{device_only}def f(x):\n    import torch\n    s = torch.cuda.Stream()\n    with torch.cuda.stream(s):\n        t = torch.from_dlpack(x)\n        for _ in range(20):\n            t = t * 1.0 + 1.0\n    torch.cuda.current_stream().wait_stream(s)\n    return DeviceOnly(t)"),
            &[OutSpec::same_as(0)],
        )
        .unwrap();
        let y = op.call(&[Arg::from(&big)]).unwrap().remove(0);
        let sum = y.sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(sum, 21.0 * 4096.0 * 4096.0);
        println!("torch: transposed, stepped and bf16 results, and a result made on another stream, are right");
    }
}

/// Producers made by hand with ctypes: capsules of any content, to check what pyop's import
/// does with invalid ones, and that the producer's deleter runs exactly once whenever pyop took
/// the capsule (`calls` counts them).
const CRAFT: &str = r#"
from ctypes import *
class DLDevice(Structure): _fields_=[("device_type",c_int32),("device_id",c_int32)]
class DLDataType(Structure): _fields_=[("code",c_uint8),("bits",c_uint8),("lanes",c_uint16)]
class DLTensor(Structure): _fields_=[("data",c_void_p),("device",DLDevice),("ndim",c_int32),("dtype",DLDataType),("shape",POINTER(c_int64)),("strides",POINTER(c_int64)),("byte_offset",c_uint64)]
DELETER=CFUNCTYPE(None,c_void_p)
class DLMT(Structure): _fields_=[("dl_tensor",DLTensor),("manager_ctx",c_void_p),("deleter",DELETER)]
class DLVer(Structure): _fields_=[("major",c_uint32),("minor",c_uint32)]
class DLMTV(Structure): _fields_=[("version",DLVer),("manager_ctx",c_void_p),("deleter",DELETER),("flags",c_uint64),("dl_tensor",DLTensor)]
PyCapsule_New=pythonapi.PyCapsule_New; PyCapsule_New.restype=py_object; PyCapsule_New.argtypes=[c_void_p,c_char_p,c_void_p]
calls=[]
KEEP=[]
@DELETER
def deleter(p): calls.append(p)
NAMES={True:b"dltensor_versioned", False:b"dltensor", "bad": b"not_dltensor"}
BUF=np.arange(16, dtype=np.float32)
def make(shape, strides=None, data=-1, dtype=(2,32,1), versioned=True, ndim=None, major=1, device=(1,0), offset=0, null_deleter=False, name=None, null_shape=False):
    sh=(c_int64*max(len(shape),1))(*shape)
    st=(c_int64*max(len(shape),1))(*strides) if strides is not None else None
    KEEP.extend([sh, st])
    t=DLTensor(BUF.ctypes.data if data == -1 else data, DLDevice(*device), len(shape) if ndim is None else ndim, DLDataType(*dtype), None if null_shape else sh, st, offset)
    d=DELETER() if null_deleter else deleter
    m=DLMTV(DLVer(major,1), None, d, 0, t) if versioned else DLMT(t, None, d)
    KEEP.append(m)
    return PyCapsule_New(addressof(m), NAMES[name if name is not None else versioned], None)
class Crafted:
    def __init__(self, cap, device=(1,0)): self.cap=cap; self.device=device
    def __dlpack__(self, **kw): return self.cap
    def __dlpack_device__(self): return self.device
CASES = {
  'ok': lambda: Crafted(make([4])),
  'ok_legacy': lambda: Crafted(make([4], versioned=False)),
  'offset': lambda: Crafted(make([4], offset=8)),
  'zero_d': lambda: Crafted(make([], null_shape=True)),
  'reversed': lambda: Crafted(make([4], strides=[-1], offset=15*4)),
  'bcast': lambda: Crafted(make([2, 3], strides=[0, 1])),
  'unit_neg': lambda: Crafted(make([1, 4], strides=[-7, 1])),
  'null_deleter': lambda: Crafted(make([4], null_deleter=True)),
  'neg_ndim': lambda: Crafted(make([4], ndim=-1)),
  'neg_shape': lambda: Crafted(make([-4])),
  'huge': lambda: Crafted(make([2**62])),
  'huge_bcast': lambda: Crafted(make([2**61, 2], strides=[0, 1])),
  'big_stride': lambda: Crafted(make([2], strides=[2**62])),
  'null_data': lambda: Crafted(make([4], data=None)),
  'null_shape': lambda: Crafted(make([4], null_shape=True)),
  'major2': lambda: Crafted(make([4], major=2)),
  'lying_device': lambda: Crafted(make([4], device=(2,0))),
  'f64': lambda: Crafted(make([4], dtype=(2,64,1))),
  'bad_name': lambda: Crafted(make([4], name='bad')),
}
def f(x, case):
    if case == 'count':
        return np.array([len(calls)], dtype=np.float32)
    return CASES[case]()
"#;

#[test]
fn invalid_producers_are_refused_and_every_taken_capsule_released_once() {
    let craft = op(CRAFT, &[OutSpec::new(DType::F32)]);
    let x = Tensor::new(&[0f32], &cpu()).unwrap();
    let deleted = |case: &str| {
        let count = || {
            craft.call(&[Arg::from(&x), Arg::Str("count")]).unwrap()[0]
                .to_vec1::<f32>()
                .unwrap()[0]
        };
        let before = count();
        let r = craft
            .call(&[Arg::from(&x), Arg::Str(case)])
            .map(|mut v| v.remove(0).flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .map_err(|e| e.to_string());
        (r, count() - before)
    };
    let good: &[(&str, &[f32], f32)] = &[
        ("ok", &[0., 1., 2., 3.], 1.),
        ("ok_legacy", &[0., 1., 2., 3.], 1.),
        ("offset", &[2., 3., 4., 5.], 1.),
        ("zero_d", &[0.], 1.),
        ("reversed", &[15., 14., 13., 12.], 1.),
        ("bcast", &[0., 1., 2., 0., 1., 2.], 1.),
        ("unit_neg", &[0., 1., 2., 3.], 1.),
        // A null deleter: nothing to call.
        ("null_deleter", &[0., 1., 2., 3.], 0.),
    ];
    for (case, want, calls) in good {
        let (r, d) = deleted(case);
        assert_eq!(r.as_deref().map_err(|e| e.as_str()), Ok(*want), "{case}");
        assert_eq!(d, *calls, "{case}: deleter calls");
    }
    let bad: &[(&str, &str, f32)] = &[
        ("neg_ndim", "an invalid DLPack tensor: ndim -1", 1.),
        ("neg_shape", "an invalid DLPack tensor: shape [-4]", 1.),
        ("huge", "shape [4611686018427387904] is too large", 1.),
        ("huge_bcast", "is too large", 1.),
        (
            "big_stride",
            "strides [4611686018427387904] reach too far",
            1.,
        ),
        ("null_data", "a DLPack tensor with elements but no data", 1.),
        ("null_shape", "an invalid DLPack tensor: no shape", 1.),
        (
            "major2",
            "the producer gave a DLPack 2.1 tensor; pyop reads 1.x",
            1.,
        ),
        (
            "lying_device",
            "__dlpack_device__() said (1, 0) but the tensor is on (2, 0)",
            1.,
        ),
        (
            "f64",
            "expected dtype f32, got a DLPack tensor of dtype float64",
            1.,
        ),
        // Not a DLPack capsule: not pyop's to release.
        (
            "bad_name",
            "returned PyCapsule, not an unused DLPack capsule",
            0.,
        ),
    ];
    for (case, msg, calls) in bad {
        let (r, d) = deleted(case);
        let e = r.expect_err(case);
        assert!(e.contains(msg), "{case}: {e}");
        assert!(e.contains("output 0"), "{case}: {e}");
        assert_eq!(d, *calls, "{case}: deleter calls");
    }
}

#[test]
fn older_producers_are_still_read() {
    let x = Tensor::new(&[0f32], &cpu()).unwrap();
    // No `__dlpack_device__` (before 2021): asked without a stream, read on the CPU.
    let p = op(
        "class P:\n    def __init__(self, a): self.a = a\n    def __dlpack__(self, **kw): return self.a.__dlpack__(**kw)\ndef f(x):\n    return P(np.arange(3, dtype=np.float32))",
        &[OutSpec::new(DType::F32)],
    );
    assert_eq!(
        p.call(&[Arg::from(&x)]).unwrap()[0]
            .to_vec1::<f32>()
            .unwrap(),
        [0., 1., 2.]
    );
    // A TypeError that is not about `max_version`: both failures are reported.
    let p = op(
        "class T:\n    def __dlpack__(self, **kw):\n        raise TypeError('inner failure %r' % sorted(kw))\n    def __dlpack_device__(self): return (1, 0)\ndef f(x):\n    return T()",
        &[OutSpec::new(DType::F32)],
    );
    let e = p.call(&[Arg::from(&x)]).unwrap_err().to_string();
    assert!(
        e.contains("__dlpack__() failed: TypeError: inner failure [] (asked for DLPack 1.1 first: TypeError: inner failure ['max_version'])"),
        "{e}"
    );
}

#[test]
#[ignore = "run by dlpack_needs_no_numpy in a child process whose NumPy cannot be imported"]
fn dlpack_without_numpy_child() {
    let x = Tensor::new(&[1f32, 2.], &cpu()).unwrap();
    let _ = pyop::python_env();
    let numpy_importable = pyop::interop::pyo3::Python::attach(|py| py.import("numpy").is_ok());
    assert!(!numpy_importable, "this child's NumPy must be broken");
    // Tensor mode: a DLPack output read by pyop itself, no NumPy.
    let t = tensor_op(
        "t_nonp",
        &format!("{PRODUCER}def f(x):\n    return Producer(x)"),
        &[OutSpec::same_as(0)],
    )
    .unwrap();
    let y = t.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(y[0].to_vec1::<f32>().unwrap(), [1., 2.]);
    // A `dlpack` numpy-mode op whose body does not use NumPy (a torch-only environment).
    let d = PyOp::builder("d_nonp")
        .code(format!("{PRODUCER}def f(x):\n    return Producer(x)"))
        .function("f")
        .numpy()
        .dlpack()
        .tout([OutSpec::same_as(0)])
        .build()
        .unwrap();
    let y = d.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(y[0].to_vec1::<f32>().unwrap(), [1., 2.]);
}

#[test]
fn dlpack_needs_no_numpy() {
    let dir = common::TempDir::new("dlpack_no_numpy");
    let fake = dir.path().join("numpy");
    std::fs::create_dir_all(&fake).unwrap();
    std::fs::write(
        fake.join("__init__.py"),
        "raise ImportError('NumPy is broken on purpose')\n",
    )
    .unwrap();
    let (ok, out) = common::child_test(
        module_path!(),
        "dlpack_without_numpy_child",
        &[("PYTHONPATH", Some(dir.path().as_os_str()))],
    );
    assert!(ok, "{out}");
    assert!(out.contains("1 passed"), "{out}");
}

#[test]
fn pyop_tensor_converts_what_has_a_dtype_and_fits_plain_numbers() {
    // A DLPack producer and a NumPy scalar keep their own dtype, then convert to the one asked
    // for (as NumPy arrays do); Python numbers and lists are fitted to it exactly.
    let op = tensor_op(
        "tensor_of",
        &format!(
            "import numpy as np\n{PRODUCER}def f(x):\n    \
             return (pyop.tensor(Producer(np.array([1.5, -2.0], dtype=np.float32)), dtype='f64'),\n            \
             pyop.tensor(np.float32(2.5), dtype='f64'),\n            \
             pyop.tensor([3, 4], dtype='f64'))"
        ),
        &[
            OutSpec::new(DType::F64),
            OutSpec::new(DType::F64),
            OutSpec::new(DType::F64),
        ],
    )
    .unwrap();
    let x = Tensor::new(&[0f32], &cpu()).unwrap();
    let y = op.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(y[0].to_vec1::<f64>().unwrap(), [1.5, -2.0]);
    assert_eq!(y[1].to_scalar::<f64>().unwrap(), 2.5);
    assert_eq!(y[2].to_vec1::<f64>().unwrap(), [3.0, 4.0]);
    // A subclass of int is a Python number too: fitted, not wrapped around.
    for value in ["[300]", "Big(300)"] {
        let e = tensor_op(
            "unfit",
            &format!(
                "class Big(int):\n    pass\ndef f(x):\n    return pyop.tensor({value}, dtype='u8')"
            ),
            &[OutSpec::new(DType::U8)],
        )
        .unwrap()
        .call(&[Arg::from(&x)])
        .unwrap_err();
        assert!(e.to_string().contains("300"), "{value}: {e}");
    }
}
