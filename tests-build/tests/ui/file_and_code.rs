use pyop::{py_op, Tensor};

#[py_op(file = "ops/f.py", code = "def f(x): return x", tout = f32)]
fn f(x: &Tensor) -> pyop::Result<Tensor>;

fn main() {}
