use pyop::{py_op, Tensor};

#[py_op(code = "def f(x): pass", tout = ())]
fn f(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def g(x): return x", tout = f32)]
fn g(x: &Tensor) -> pyop::Result<()>;

fn main() {}
