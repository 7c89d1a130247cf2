use pyop::{py_op, Tensor};

#[py_op(numpy, tout = f32)]
fn f(x: &Tensor) -> pyop::Result<Tensor>;

fn main() {}
