//! Numpy-mode ops run in worker processes.

use pyop::candle::{DType, Device, Tensor};
use pyop::{Arg, OutSpec, PyOp, WorkerPool};

#[test]
fn smoke() {
    let pool = WorkerPool::new(1);
    let op = PyOp::builder("plus1")
        .code("import numpy as np\ndef plus1(x, k):\n    return x + k")
        .numpy()
        .pool(&pool)
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap();
    let x = Tensor::new(&[1f32, 2., 3.], &Device::Cpu).unwrap();
    let y = op.call(&[Arg::from(&x), Arg::from(1i64)]).unwrap();
    assert_eq!(y[0].to_vec1::<f32>().unwrap(), [2., 3., 4.]);
    println!("{:?} {:?}", pool.stats(), op.stats());
}
