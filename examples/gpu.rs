//! The seed's op on the GPU when there is one (build with `--features cuda`), else on the CPU:
//! the body's candle ops run on the CUDA tensors in place, gradients flow as on the CPU, and a
//! numpy-mode op copies through the host.
//!
//! ```text
//! $ cargo run --release --features cuda --example gpu
//! device: Cuda(CudaDevice(DeviceId(1)))
//! y = 7.243721, dy/dx = 2.6666667 (on the op's device: true)
//! numpy-mode zscore on the device: [-1.3416407, -0.4472136, 0.4472136, 1.3416407]
//! ```

use pyop::candle::{Device, Var};
use pyop::{py_op, Tensor};

#[py_op(code = r#"
import pyop
def log_huber(x, m):
    if abs(x) <= m:
        return x**2
    else:
        return m**2 * (1 - 2 * pyop.log(m) + pyop.log(x**2))
"#, tout = f32)]
fn log_huber(x: &Tensor, m: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "import numpy as np\ndef zscore(x):\n    return ((x - x.mean()) / x.std()).astype(np.float32)", numpy, tout = f32)]
fn zscore(x: &Tensor) -> pyop::Result<Tensor>;

fn main() -> pyop::Result<()> {
    // A CUDA build on a machine without a GPU (or its driver) runs on the CPU, and says why.
    let device = Device::cuda_if_available(0).unwrap_or_else(|e| {
        eprintln!("no CUDA device ({e}): running on the CPU");
        Device::Cpu
    });
    println!("device: {device:?}");
    let x = Var::new(3.0f32, &device)?;
    let m = Var::new(2.0f32, &device)?;
    let y = log_huber(&x, &m)?;
    let g = y.backward()?.get(&x).expect("x is used").clone();
    println!(
        "y = {}, dy/dx = {} (on the op's device: {})",
        y.to_scalar::<f32>()?,
        g.to_scalar::<f32>()?,
        y.device().same_device(&device) && g.device().same_device(&device)
    );
    let v = Tensor::new(&[1f32, 2., 3., 4.], &device)?;
    let z = zscore(&v)?;
    assert!(z.device().same_device(&device));
    println!("numpy-mode zscore on the device: {:?}", z.to_vec1::<f32>()?);
    Ok(())
}
