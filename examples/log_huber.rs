//! The seed's example: a differentiable op whose body is Python with `if`/`else`.
//!
//! ```text
//! $ cargo run --example log_huber
//! y = 1
//! dy/dx = 2
//! y = 7.243721
//! dy/dx = 2.6666667
//! dy/dm = 3.243721
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

fn main() -> pyop::Result<()> {
    pyop::validate()?; // every op's source, function and signature, checked before anything runs
    for (x0, m0) in [(1.0f32, 2.0f32), (3.0, 2.0)] {
        let x = Var::new(x0, &Device::Cpu)?;
        let m = Var::new(m0, &Device::Cpu)?;
        let y = log_huber(&x, &m)?;
        let grads = y.backward()?;
        println!("y = {}", y.to_scalar::<f32>()?);
        println!(
            "dy/dx = {}",
            grads.get(&x).expect("x is used").to_scalar::<f32>()?
        );
        if let Some(g) = grads.get(&m) {
            println!("dy/dm = {}", g.to_scalar::<f32>()?);
        }
    }
    Ok(())
}
