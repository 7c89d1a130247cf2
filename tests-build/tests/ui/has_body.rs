use pyop::{py_op, Tensor};

#[py_op(code = "def f(x): return x", tout = f32)]
fn f(x: &Tensor) -> pyop::Result<Tensor> {
    Ok(x.clone())
}

fn main() {}
