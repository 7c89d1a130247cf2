use pyop::{py_op, Tensor};

// `inputs` names `&Tensor` parameters given on every call.
#[py_op(code = "def f(x, k, m): return x", numpy, batch(max = 8, inputs = [y, k, m]), tout = f32)]
fn f(x: &Tensor, k: f64, m: Option<&Tensor>) -> pyop::Result<Tensor>;

// Without `inputs` every `&Tensor` parameter is stacked: there must be one.
#[py_op(code = "def g(n): return n", numpy, batch(max = 8), tout = f32)]
fn g(n: usize) -> pyop::Result<Tensor>;

// A parameter is named once.
#[py_op(code = "def h(x, y): return x", numpy, batch(max = 8, inputs = [x, y, x]), tout = f32)]
fn h(x: &Tensor, y: &Tensor) -> pyop::Result<Tensor>;

fn main() {}
