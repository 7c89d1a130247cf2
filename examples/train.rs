//! Trains a candle-nn linear regression whose loss is a numpy-mode Python op with a registered
//! Python gradient (a Huber loss, robust to the outliers in the data).
//!
//! ```text
//! $ cargo run --example train
//! step 0 loss 0.7595
//! step 20 loss 0.3562
//! step 40 loss 0.2324
//! ...
//! step 200 loss 0.2320
//! learned w = 2.97, b = -0.43 (true: 3, -0.5)
//! ```
//!
//! The loss levels off at the outliers' share (8 of 64 points, 4 away from the line); the fit
//! itself ignores them, as a Huber loss should.
//! ```text
//! ```

use candle_nn::{Linear, Module, Optimizer, SGD};
use pyop::candle::{DType, Device, Tensor, Var};
use pyop::py_op;

#[py_op(code = r#"
import numpy as np

def huber(pred, target, delta):
    r = pred - target
    small = np.abs(r) <= delta
    return np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)).mean()

def huber_grad(inputs, outputs, grads):
    pred, target, delta = inputs
    (g,) = grads
    r = pred - target
    d = np.clip(r, -delta, delta) / r.size
    return g * d, -g * d
"#, numpy, tout = f32[], grad = "huber_grad")]
fn huber(pred: &Tensor, target: &Tensor, delta: f64) -> pyop::Result<Tensor>;

fn main() -> pyop::Result<()> {
    let device = Device::Cpu;
    let n = 64;
    let xs: Vec<f32> = (0..n)
        .map(|i| -1.0 + 2.0 * i as f32 / (n - 1) as f32)
        .collect();
    // y = 3x - 0.5, with every eighth point a large outlier.
    let ys: Vec<f32> = xs
        .iter()
        .enumerate()
        .map(|(i, x)| 3.0 * x - 0.5 + if i % 8 == 0 { 4.0 } else { 0.0 })
        .collect();
    let x = Tensor::from_vec(xs, (n, 1), &device)?;
    let y = Tensor::from_vec(ys, (n, 1), &device)?;

    // Fixed starting weights (candle's random init cannot be seeded), so every run prints the same.
    let w = Var::zeros((1, 1), DType::F32, &device)?;
    let b = Var::zeros(1, DType::F32, &device)?;
    let model = Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()));
    let mut opt = SGD::new(vec![w.clone(), b.clone()], 0.5)?;
    for step in 0..=200 {
        let loss = huber(&model.forward(&x)?, &y, 0.5)?;
        opt.backward_step(&loss)?;
        if step % 20 == 0 {
            println!("step {step} loss {:.4}", loss.to_scalar::<f32>()?);
        }
    }
    let w = model.weight().flatten_all()?.to_vec1::<f32>()?[0];
    let b = model.bias().expect("bias").to_vec1::<f32>()?[0];
    println!("learned w = {w:.2}, b = {b:.2} (true: 3, -0.5)");
    Ok(())
}
