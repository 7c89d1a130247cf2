use pyop::{py_op, Tensor};

#[py_op(code = 42, numpy = yes, tout = f32, timeout_ms = 0, grad = 1 + 2)]
fn f(x: &Tensor) -> pyop::Result<Tensor>;

fn main() {}
