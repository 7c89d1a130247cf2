use pyop::{py_op, Tensor};

// The function the op names must be a top-level `def` of the source...
#[py_op(code = "def helper(x):\n    return x\n\ndef other(x):\n    return x", tout = f32)]
fn missing(x: &Tensor) -> pyop::Result<Tensor>;

// ...that accepts the op's positional arguments (defaults, `*args` and `out` honoured)...
#[py_op(code = "def scale(x):\n    return x", tout = f32)]
fn scale(x: &Tensor, k: f64) -> pyop::Result<Tensor>;

#[py_op(code = "def fine(x, k=2.0, *rest, out=None):\n    return x", numpy, tout = f32)]
fn fine(x: &Tensor, k: f64, j: i64) -> pyop::Result<Tensor>;

// ...and so must the gradient, called as `grad(inputs, outputs, grads)`.
#[py_op(code = "def sq(x):\n    return x * x\n\ndef sq_grad(x, g):\n    return 2 * x * g", tout = f32, grad = "sq_grad")]
fn sq(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def cube(x):\n    return x\n", tout = f32, grad = "cube_grad")]
fn cube(x: &Tensor) -> pyop::Result<Tensor>;

// With `name`, the error points at it.
#[py_op(code = "def other(x):\n    return x", name = "othr", tout = f32)]
fn named(x: &Tensor) -> pyop::Result<Tensor>;

// A name bound some other way (an import, a decorator) is left to `pyop::validate()`.
#[py_op(code = "from math import sqrt as root\n", tout = f64)]
fn root(x: f64) -> pyop::Result<Tensor>;

fn main() {}
