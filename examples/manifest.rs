//! Prints every op declared in the program as JSON: the registry that `pyop::validate()` checks
//! at start-up.
//!
//! ```text
//! $ cargo run --example manifest
//! [
//!   {"name":"zscore","rust_path":"manifest::stats::zscore","file":"examples/manifest.rs", ...,
//!    "mode":"numpy","function":"zscore","tout":"f32","grad":null,"batch":null,
//!    "source":{"kind":"file","origin":"examples/ops/stats.py","hash":"..."}},
//!   ...
//! ]
//! ```

use pyop::{py_op, Tensor};

mod stats {
    use pyop::{py_op, Tensor};

    #[py_op(file = "examples/ops/stats.py", numpy, tout = f32)]
    pub fn zscore(x: &Tensor) -> pyop::Result<Tensor>;
}

/// Same name as `stats::zscore`, another module: the registry keys by Rust path.
#[py_op(code = "import pyop\ndef zscore(x):\n    return (x - x.mean()) / (x * x).mean().sqrt()", tout = f32)]
pub fn zscore(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def clip(x, lo, hi):\n    return x.clamp(lo, hi)\ndef clip_grad(i, o, g):\n    return g[0]", tout = f32, grad = "clip_grad")]
pub fn clip(x: &Tensor, lo: f64, hi: f64) -> pyop::Result<Tensor>;

fn main() {
    println!("{}", pyop::manifest_json());
}
