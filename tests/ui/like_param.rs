use pyop::{py_op, Tensor};

#[py_op(code = "def f(x, k): return x", numpy, tout = f32[y])]
fn f(x: &Tensor, k: f64) -> pyop::Result<Tensor>;

#[py_op(code = "def g(x, k): return x", numpy, tout = f32[k])]
fn g(x: &Tensor, k: f64) -> pyop::Result<Tensor>;

#[py_op(code = "def h(x): return x", numpy, tout = f32[x])]
fn h(x: Option<&Tensor>) -> pyop::Result<Tensor>;

fn main() {}
