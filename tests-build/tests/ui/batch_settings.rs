use pyop::{py_op, Tensor};

// `max` is required, and positive.
#[py_op(code = "def f(x): return x", numpy, batch(wait_us = 200), tout = f32[_, 4])]
fn f(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def g(x): return x", numpy, batch(max = 0), tout = f32[_, 4])]
fn g(x: &Tensor) -> pyop::Result<Tensor>;

// Unknown settings: a suggestion when one is close, else the list.
#[py_op(code = "def h(x): return x", numpy, batch(max = 8, wait_ms = 2, rows = 3), tout = f32)]
fn h(x: &Tensor) -> pyop::Result<Tensor>;

// `wait_us` is a whole number of microseconds; `inputs` a bracketed list of names.
#[py_op(code = "def k(x): return x", numpy, batch(max = 8, wait_us = 0.5, inputs = x), tout = f32)]
fn k(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def l(x): return x", numpy, batch(max = 8, inputs = []), tout = f32)]
fn l(x: &Tensor) -> pyop::Result<Tensor>;

// The settings go in parentheses.
#[py_op(code = "def m(x): return x", numpy, batch = 64, tout = f32)]
fn m(x: &Tensor) -> pyop::Result<Tensor>;

fn main() {}
