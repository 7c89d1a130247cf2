// `pyop::op!(name)` is the declared op's `StaticOp`, typed: a misspelt name fails to compile
// instead of returning `None` at run time as `registered_op("…")` does. Nothing else is named
// after the function: an op named `std` leaves `std::` alone, an op can be an associated
// function, and `crate = "…"` may be a path relative to the module.
use pyop::{py_op, StaticOp, Tensor};
use std::collections::HashMap;

#[py_op(code = "def softclip(x):\n    return x", tout = f64)]
fn softclip(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def std(x):\n    return x", numpy, tout = f64)]
fn std(x: &Tensor) -> pyop::Result<Tensor>;

struct Model;

impl Model {
    #[py_op(code = "def scale(x):\n    return x * 2", tout = f64)]
    fn scale(x: &Tensor) -> pyop::Result<Tensor>;

    fn handles() -> [&'static StaticOp; 2] {
        [pyop::op!(Self::scale), pyop::op!(Model::scale)]
    }
}

mod my {
    pub use pyop;
}

#[my::pyop::py_op(crate = "my::pyop", code = "def rel(x):\n    return x", tout = f64)]
fn rel(x: &Tensor) -> my::pyop::Result<Tensor>;

fn main() {
    let op: &'static StaticOp = pyop::op!(softclip);
    let _ = op.decl().name();
    let _: HashMap<u8, usize> = HashMap::from([(1, std::mem::size_of::<u8>())]);
    let _ = (pyop::op!(std), Model::handles(), pyop::op!(rel));
    let _: () = pyop::op!(softclip);
    let _ = pyop::op!(softclp);
}
