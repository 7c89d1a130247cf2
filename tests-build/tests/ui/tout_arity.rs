use pyop::{py_op, Tensor};

#[py_op(code = "def f(x): return x, x", tout = (f32, f32))]
fn f(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def g(x): return x", tout = f32)]
fn g(x: &Tensor) -> pyop::Result<(Tensor, Tensor, Tensor)>;

fn main() {}
