use pyop::{py_op, Tensor};

#[py_op(file = "ops/does_not_exist.py", tout = f32)]
fn f(x: &Tensor) -> pyop::Result<Tensor>;

fn main() {}
