use pyop::{py_op, Tensor};

// A batching op's outputs have the batch's rows along axis 0: a declared shape leaves it `_`.
#[py_op(code = "def f(x): return x, x, x", numpy, batch(max = 8), tout = (f32[3, 4], f32[], x.dtype[2]))]
fn f(x: &Tensor) -> pyop::Result<(Tensor, Tensor, Tensor)>;

// An output shaped like a parameter the batch does not stack.
#[py_op(code = "def h(x, w): return w, x", numpy, batch(max = 8, inputs = [x]), tout = (f32[w], like(w)))]
fn h(x: &Tensor, w: &Tensor) -> pyop::Result<(Tensor, Tensor)>;

// These are fine: axis 0 free, the shape or dtype of a stacked input, or no shape at all.
#[py_op(code = "def g(x): return x, x, x, x, x", numpy, batch(max = 8, wait_us = 100, inputs = [x]), tout = (f32[_, 4], f32[x], like(x), x.dtype[_], f32))]
fn g(x: &Tensor) -> pyop::Result<(Tensor, Tensor, Tensor, Tensor, Tensor)>;

fn main() {
    let _ = g;
}
