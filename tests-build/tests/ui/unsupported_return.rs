use pyop::{py_op, Tensor};

#[py_op(code = "def f(x): return x", tout = f32)]
fn f(x: &Tensor) -> Tensor;

#[py_op(code = "def g(x): return x", tout = f32)]
fn g(x: &Tensor) -> pyop::Result<Vec<Tensor>>;

#[py_op(code = "def h(x): return x", tout = f32)]
fn h(x: &Tensor);

fn main() {}
