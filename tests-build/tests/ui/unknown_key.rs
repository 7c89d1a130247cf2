use pyop::{py_op, Tensor};

#[py_op(code = "def f(x): return x", numpy, tout = f32, dtype = f32)]
fn f(x: &Tensor) -> pyop::Result<Tensor>;

fn main() {}
