use pyop::{py_op, Tensor};

// A tensor-mode body works on the program's own tensors: it cannot run in a worker process.
#[py_op(code = "def f(x): return x", workers = 2, tout = f32)]
fn f(x: &Tensor) -> pyop::Result<Tensor>;

// A pool needs at least one worker.
#[py_op(code = "def g(x): return x", numpy, workers = 0, tout = f32)]
fn g(x: &Tensor) -> pyop::Result<Tensor>;

// A named pool needs its size.
#[py_op(code = "def h(x): return x", numpy, pool = "text", tout = f32)]
fn h(x: &Tensor) -> pyop::Result<Tensor>;

fn main() {}
