//! DLPack: `pyop.Tensor` handed to NumPy without a copy (`np.from_dlpack`), and DLPack producers
//! returned as outputs. On the CPU, with NumPy, here; with PyTorch and CuPy on CUDA, through the
//! GPU kit.

use pyop::candle::{DType, Device, Tensor};
use pyop::{Arg, ErrorKind, OutSpec, PyOp};

mod common;
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
