use pyop::{py_op, Tensor};

struct Model;

impl Model {
    #[py_op(code = "def f(self, x): return x", tout = f32)]
    fn f(&self, x: &Tensor) -> pyop::Result<Tensor>;
}

fn main() {
    let _ = Model;
    let _: Option<Tensor> = None;
}
