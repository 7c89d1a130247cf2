use pyop::{py_op, Tensor};

#[py_op(package = "../tests/py/mylib", module = "otherlib.ops", tout = f32)]
fn f(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(package = "../tests/py/no_such_folder", tout = f32)]
fn g(x: &Tensor) -> pyop::Result<Tensor>;

fn main() {}
