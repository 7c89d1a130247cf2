use pyop::{py_op, Tensor};

#[py_op(code = "def f(x): return x", numpy, tout = (f32, bf16))]
fn f(x: &Tensor) -> pyop::Result<(Tensor, Tensor)>;

fn main() {}
