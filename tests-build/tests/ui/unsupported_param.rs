use pyop::{py_op, Tensor};

// Each rejected form names the accepted one.
#[py_op(code = "def f(x, n): return x", tout = f32)]
fn f(x: &Tensor, n: u8) -> pyop::Result<Tensor>;

#[py_op(code = "def g(x): return x", tout = f32)]
fn g(x: Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def h(x): return x", tout = f32)]
fn h(x: &mut Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def i(x, v): return x", tout = f32)]
fn i(x: &Tensor, v: Vec<f32>) -> pyop::Result<Tensor>;

#[py_op(code = "def j(x, v): return x", tout = f32)]
fn j(x: &Tensor, v: &[i32]) -> pyop::Result<Tensor>;

#[py_op(code = "def k(x, s): return x", tout = f32)]
fn k(x: &Tensor, s: String) -> pyop::Result<Tensor>;

#[py_op(code = "def l(xs): return xs[0]", tout = f32)]
fn l(xs: Vec<Tensor>) -> pyop::Result<Tensor>;

fn main() {}
