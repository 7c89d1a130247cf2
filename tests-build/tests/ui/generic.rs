use pyop::{py_op, Tensor};

#[py_op(code = "def f(x): return x", tout = f32)]
fn f<T>(x: &Tensor) -> pyop::Result<Tensor>;

fn main() {}
