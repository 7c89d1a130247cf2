//! A few numpy-mode ops of each kind the macro accepts, printing inputs and outputs.
//!
//! ```text
//! $ cargo run --example numpy_ops
//! x = [1.0, 2.0, 4.0, 9.0]
//! zscore(x) = [-0.97332853, -0.64888567, 0.0, 1.6222142]
//! scale(x, 2.5) = [2.5, 5.0, 10.0, 22.5]
//! divmod([7, -7, 9], [2, 2, 4]) = ([3, -4, 2], [1, 1, 1])
//! rows3(arange(6)) = [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
//! log_stats: tag=x sum=16.0 (printed by Python)
//! rows3(arange(4)) fails: InvalidArgument: op `rows3`: ValueError: cannot reshape array of size 4 into shape (3)
//! ```

use pyop::candle::{DType, Device};
use pyop::{py_op, Tensor};

/// Standardises `x`: (x - mean) / std, in float32.
#[py_op(file = "examples/ops/stats.py", numpy, tout = f32)]
pub fn zscore(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def scale(x, k):\n    return x * k", numpy, tout = f32)]
fn scale(x: &Tensor, k: f64) -> pyop::Result<Tensor>;

#[py_op(module = "numpy", name = "divmod", numpy, tout = (i64, i64))]
fn divmod(a: &Tensor, b: &Tensor) -> pyop::Result<(Tensor, Tensor)>;

#[py_op(code = "def rows3(x):\n    return x.reshape(-1, 3)", numpy, tout = f32[_, 3])]
fn rows3(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(file = "examples/ops/stats.py", numpy, tout = ())]
fn log_stats(x: &Tensor, tag: &str) -> pyop::Result<()>;

fn main() -> pyop::Result<()> {
    let cpu = Device::Cpu;
    let x = Tensor::new(&[1f32, 2., 4., 9.], &cpu)?;
    println!("x = {:?}", x.to_vec1::<f32>()?);
    println!("zscore(x) = {:?}", zscore(&x)?.to_vec1::<f32>()?);
    println!("scale(x, 2.5) = {:?}", scale(&x, 2.5)?.to_vec1::<f32>()?);
    let a = Tensor::new(&[7i64, -7, 9], &cpu)?;
    let b = Tensor::new(&[2i64, 2, 4], &cpu)?;
    let (q, r) = divmod(&a, &b)?;
    println!(
        "divmod({:?}, {:?}) = ({:?}, {:?})",
        a.to_vec1::<i64>()?,
        b.to_vec1::<i64>()?,
        q.to_vec1::<i64>()?,
        r.to_vec1::<i64>()?
    );
    let six = Tensor::arange(0f32, 6., &cpu)?;
    println!("rows3(arange(6)) = {:?}", rows3(&six)?.to_vec2::<f32>()?);
    log_stats(&x, "x")?;
    // A mistake is a typed error naming the op and the output.
    let err = rows3(&Tensor::arange(0f32, 4., &cpu)?.to_dtype(DType::F32)?).unwrap_err();
    println!(
        "rows3(arange(4)) fails: {:?}: {}",
        err.kind(),
        err.to_string().lines().next().unwrap_or("")
    );
    Ok(())
}
