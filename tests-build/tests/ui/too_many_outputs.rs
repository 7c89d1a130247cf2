use pyop::{py_op, Tensor};

// The generated code hands back tuples of up to 12 tensors: 13 is the macro's own error, not an
// unexplained trait bound.
#[py_op(code = "def f(x): return (x,) * 13", tout = (f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32))]
fn f(x: &Tensor) -> pyop::Result<(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)>;

fn main() {}
