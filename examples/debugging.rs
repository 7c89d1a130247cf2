//! Debugging a body: `print` from Python, a `breakpoint()` (only when `PYOP_BREAKPOINT` is set, so
//! this never waits for a debugger unasked), and how a Python traceback reaches a Rust error.
//!
//! ```text
//! $ cargo run --example debugging
//! scaled: got shape (2, 2) and dtype f32
//! result = [[2.0, 4.0], [6.0, 8.0]]
//! error kind: InvalidArgument
//! op `reshaped`: ValueError: Shape mismatch, got buffer of size 4 which is compatible with shape [7]
//! Traceback (most recent call last):
//!   File "<pyop code of debugging::reshaped at examples/debugging.rs:44>", line 3, in reshaped
//!     return helper(x)
//!            ^^^^^^^^^
//!   File "<pyop code of debugging::reshaped at examples/debugging.rs:44>", line 6, in helper
//!     return x.reshape(7)
//!            ^^^^^^^^^^^^
//! ```
//!
//! The first line is Python's `print`, in order with Rust's `println!`.
//! `PYOP_BREAKPOINT=1 cargo run --example debugging` stops in pdb inside `scaled`
//! (`p x.tolist()`, then `c` to go on).

use pyop::candle::Device;
use pyop::{py_op, Tensor};

#[py_op(code = r#"
import os

def scaled(x):
    print(f"scaled: got shape {x.shape} and dtype {x.dtype}")
    if os.environ.get("PYOP_BREAKPOINT"):
        breakpoint()
    return x * 2
"#, tout = f32)]
fn scaled(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = r#"
def reshaped(x):
    return helper(x)

def helper(x):
    return x.reshape(7)
"#, tout = f32)]
fn reshaped(x: &Tensor) -> pyop::Result<Tensor>;

fn main() -> pyop::Result<()> {
    // Checks every op's source, functions and signatures before anything runs.
    pyop::validate()?;
    let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
    println!("result = {:?}", scaled(&x)?.to_vec2::<f32>()?);
    let err = reshaped(&x).unwrap_err();
    println!("error kind: {:?}", err.kind());
    println!("{err}");
    Ok(())
}
