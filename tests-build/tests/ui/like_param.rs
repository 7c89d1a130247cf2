use pyop::{py_op, Tensor};

#[py_op(code = "def f(x, k): return x", numpy, tout = f32[y])]
fn f(x: &Tensor, k: f64) -> pyop::Result<Tensor>;

#[py_op(code = "def g(x, k): return x", numpy, tout = f32[k])]
fn g(x: &Tensor, k: f64) -> pyop::Result<Tensor>;

#[py_op(code = "def h(x): return x", numpy, tout = f32[x])]
fn h(x: Option<&Tensor>) -> pyop::Result<Tensor>;


// An argument's dtype: the same rules, and only `dtype` may follow the dot.
#[py_op(code = "def i(x, n): return x", tout = (n.dtype, y.dtype))]
fn i(x: &Tensor, n: f64) -> pyop::Result<(Tensor, Tensor)>;

#[py_op(code = "def j(x): return x", tout = x.shape)]
fn j(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def k(x): return x", tout = like(x))]
fn k(x: Option<&Tensor>) -> pyop::Result<Tensor>;

#[py_op(code = "def l(x): return x", tout = like(x)[_, 3])]
fn l(x: &Tensor) -> pyop::Result<Tensor>;

fn main() {}
