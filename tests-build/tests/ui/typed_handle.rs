// `name::op()` is the declared op's `StaticOp`, typed: a misspelt name fails to compile instead of
// returning `None` at run time as `registered_op("…")` does.
use pyop::{py_op, StaticOp, Tensor};

#[py_op(code = "def softclip(x):\n    return x", tout = f64)]
fn softclip(x: &Tensor) -> pyop::Result<Tensor>;

fn main() {
    let op: &'static StaticOp = softclip::op();
    let _ = op.decl().name();
    let _: () = softclip::op();
}
