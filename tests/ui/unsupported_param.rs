use pyop::{py_op, Tensor};

#[py_op(code = "def f(x, n): return x", tout = f32)]
fn f(x: &Tensor, n: u32) -> pyop::Result<Tensor>;

#[py_op(code = "def g(x): return x", tout = f32)]
fn g(x: Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def h(x): return x", tout = f32)]
fn h(x: &mut Tensor) -> pyop::Result<Tensor>;

fn main() {}
