//! The detail of single calls (`cargo bench --bench calls`, divan): what one op call, one
//! run-time op build and one backward pass cost.

use pyop::candle::{DType, Device, Tensor, Var};
use pyop::{py_op, Arg, OutSpec, PyOp};

fn main() {
    pyop::validate().expect("the benchmarked ops are declared right");
    divan::main();
}

#[py_op(code = "def ident(x):\n    return x", name = "ident", numpy, tout = f32)]
fn numpy_ident(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def ident(x):\n    return x", name = "ident", tout = f32)]
fn tensor_ident(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def scale(x, k):\n    return x * k", name = "scale", numpy, tout = f32)]
fn numpy_scale(x: &Tensor, k: f64) -> pyop::Result<Tensor>;

#[py_op(code = "def sq(x):\n    return x * x\ndef sq_grad(i, o, g):\n    return g[0] * 2 * i[0]", name = "sq", numpy, tout = f32, grad = "sq_grad")]
fn square(x: &Tensor) -> pyop::Result<Tensor>;

fn scalar() -> Tensor {
    Tensor::new(&[1.5f32], &Device::Cpu).unwrap()
}

#[divan::bench]
fn numpy_identity_call(b: divan::Bencher) {
    let x = scalar();
    b.bench_local(|| numpy_ident(&x).unwrap());
}

#[divan::bench]
fn tensor_identity_call(b: divan::Bencher) {
    let x = scalar();
    b.bench_local(|| tensor_ident(&x).unwrap());
}

#[divan::bench]
fn numpy_call_with_an_attribute_and_a_copied_output(b: divan::Bencher) {
    let x = scalar();
    b.bench_local(|| numpy_scale(&x, 2.0).unwrap());
}

#[divan::bench]
fn forward_and_backward_through_a_python_gradient(b: divan::Bencher) {
    let x = Var::new(&[1.5f32], &Device::Cpu).unwrap();
    b.bench_local(|| square(x.as_tensor()).unwrap().backward().unwrap());
}

#[divan::bench]
fn build_and_drop_a_runtime_op(b: divan::Bencher) {
    b.bench_local(|| {
        PyOp::builder("tmp")
            .code("def tmp(x):\n    return x")
            .numpy()
            .tout([OutSpec::new(DType::F32)])
            .build()
            .unwrap()
    });
}

#[divan::bench]
fn runtime_op_call(b: divan::Bencher) {
    let op = PyOp::builder("rt")
        .code("def rt(x):\n    return x")
        .numpy()
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap();
    let x = scalar();
    b.bench_local(|| op.call(&[Arg::from(&x)]).unwrap());
}
