use pyop::candle::{DType, Device};
use pyop::{py_op, Tensor};

#[py_op(code = "def scale(x, k):\n    return x * k", numpy, tout = f64)]
fn scale(x: &Tensor, k: f64) -> pyop::Result<Tensor>;

#[test]
fn scale_works() {
    let x = Tensor::new(&[1.0f64, 2.0], &Device::Cpu).unwrap();
    let y = scale(&x, 3.0).unwrap();
    assert_eq!(y.dtype(), DType::F64);
    assert_eq!(y.to_vec1::<f64>().unwrap(), [3.0, 6.0]);
}
