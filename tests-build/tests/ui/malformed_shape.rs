use pyop::{py_op, Tensor};

#[py_op(code = "def f(x): return x", tout = f32[_, n])]
fn f(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def g(x): return x", tout = f32[2.5])]
fn g(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def h(x): return x", tout = f32 3)]
fn h(x: &Tensor) -> pyop::Result<Tensor>;

fn main() {}
