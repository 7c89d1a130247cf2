fn main() {
    // The Python version pyo3 linked, so `validate()` can tell a program running with another.
    let v = pyo3_build_config::get().version();
    println!("cargo:rustc-env=PYOP_BUILT_PYTHON={}.{}", v.major, v.minor);
}
