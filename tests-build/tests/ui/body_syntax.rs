use pyop::{py_op, Tensor};

// A syntax error in inline code is a compile error on the literal, with the `.rs` line. (The
// errors here are ones every Python pyop supports words alike, "invalid syntax": what these
// expectations pin is pyop's part of the message.)
#[py_op(code = r#"
def f(x):
    y = x * 2
    return y $ 2
"#, tout = f32)]
fn f(x: &Tensor) -> pyop::Result<Tensor>;

// In a file read with `include_str!`: the error names the file and its line.
#[py_op(code = include_str!("py/syntax_error.py"), name = "bad", tout = f32)]
fn g(x: &Tensor) -> pyop::Result<Tensor>;

// Syntax only a body's own Python version could reject is left to that interpreter: this is
// valid in every Python pyop supports.
#[py_op(code = "def h(x, /):\n    return (y := x)", tout = f32)]
fn h(x: &Tensor) -> pyop::Result<Tensor>;

fn main() {}
