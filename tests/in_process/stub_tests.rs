//! `pyop.pyi` (shipped in `pyop-build`, written out by `pyop_build::write_python_stub`) names
//! exactly what the runtime `pyop` module has: every public module name and `Tensor` member in
//! one is in the other, and every dunder the stub declares exists on the class.

use pyop::candle::{Device, Tensor};
use pyop::interop::pyo3::prelude::*;
use pyop::py_op;

#[py_op(code = "def ident(x):\n    return x", tout = f32)]
fn ident(x: &Tensor) -> pyop::Result<Tensor>;

/// Compares the stub's syntax tree with the live module; returns the differences, one per line.
const COMPARE: &str = r#"
import ast, pyop

tree = ast.parse(stub)
module, tensor, tensor_dunders = set(), set(), set()
for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        module.add(node.name)
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        module.add(node.target.id)
    elif isinstance(node, ast.Assign):
        module.update(t.id for t in node.targets if isinstance(t, ast.Name))
    if isinstance(node, ast.ClassDef) and node.name == "Tensor":
        for m in node.body:
            if isinstance(m, ast.FunctionDef):
                (tensor_dunders if m.name.startswith("__") else tensor).add(m.name)
public = lambda names: {n for n in names if not n.startswith("_")}
runtime_module = public(dir(pyop))
runtime_tensor = public(dir(pyop.Tensor))
problems = []
problems += [f"module: `{n}` in the stub, not in pyop" for n in sorted(public(module) - runtime_module)]
problems += [f"module: `{n}` in pyop, not in the stub" for n in sorted(runtime_module - public(module))]
problems += [f"Tensor: `{n}` in the stub, not in pyop.Tensor" for n in sorted(tensor - runtime_tensor)]
problems += [f"Tensor: `{n}` in pyop.Tensor, not in the stub" for n in sorted(runtime_tensor - tensor)]
own = {n for n in vars(pyop.Tensor) if n.startswith("__") and callable(getattr(pyop.Tensor, n))}
own -= {"__new__", "__init__", "__hash__"}
problems += [f"Tensor: `{n}` in the stub, not on pyop.Tensor" for n in sorted(tensor_dunders - own)]
problems += [f"Tensor: `{n}` on pyop.Tensor, not in the stub" for n in sorted(own - tensor_dunders)]
result = "\n".join(problems)
"#;

fn differences(stub: &str) -> String {
    // Any call sets the interpreter up with the `pyop` module installed.
    ident(&Tensor::new(&[1f32], &Device::Cpu).unwrap()).unwrap();
    Python::attach(|py| {
        let globals = pyop::interop::pyo3::types::PyDict::new(py);
        globals.set_item("stub", stub).unwrap();
        py.run(
            &std::ffi::CString::new(COMPARE).unwrap(),
            Some(&globals),
            None,
        )
        .unwrap();
        globals
            .get_item("result")
            .unwrap()
            .unwrap()
            .extract()
            .unwrap()
    })
}

#[test]
fn the_stub_names_what_the_module_has() {
    let diff = differences(pyop_build::PYTHON_STUB);
    assert!(
        diff.is_empty(),
        "pyop.pyi and the pyop module disagree:\n{diff}"
    );
}

/// The comparison is not vacuous: a stub missing a method, or naming one the module lacks, is
/// caught both ways.
#[test]
fn a_stub_that_drifts_is_caught() {
    let missing = pyop_build::PYTHON_STUB.replace("    def narrow(", "    def _narrow(");
    assert!(differences(&missing).contains("`narrow` in pyop.Tensor, not in the stub"));
    let extra = format!(
        "{}\ndef softmax(x: Tensor) -> Tensor: ...\n",
        pyop_build::PYTHON_STUB
    );
    assert!(differences(&extra).contains("`softmax` in the stub, not in pyop"));
}

/// `write_python_stub` writes it where asked, once.
#[test]
fn the_stub_is_written_out() {
    let dir = std::env::temp_dir().join(format!("pyop-stub-{}", std::process::id()));
    let path = pyop_build::write_python_stub(&dir).unwrap();
    assert_eq!(path, dir.join("pyop.pyi"));
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        pyop_build::PYTHON_STUB
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
