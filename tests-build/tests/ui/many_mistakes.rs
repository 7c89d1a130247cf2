use pyop::{py_op, Tensor};

#[py_op(code = "def f(x): return x", code = "again", numpy, tout = (f33, f32[2, n]), colour = "red")]
async fn f(x: &Tensor, n: u8) -> pyop::Result<Tensor>;

fn main() {
    // The fallback keeps call sites compiling: no cascade of errors here.
    let x = Tensor::new(&[1f32], &pyop::candle::Device::Cpu).unwrap();
    let _ = f(&x, 1);
}
