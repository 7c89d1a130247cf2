use pyop::{py_op, Tensor};

// A misspelt key gets a suggestion, and no second error saying `tout` is missing.
#[py_op(code = "def f(x): return x", tuot = f32)]
fn f(x: &Tensor) -> pyop::Result<Tensor>;

fn main() {}
