//! pyop's link metadata, for the crates that use it (`links = "pyop"`): they read it with
//! `pyop-build` to give their binaries an rpath to the libpython pyo3 linked. It also gives
//! pyop's own tests and examples that rpath.

fn main() {
    let cfg = pyo3_build_config::get();
    let version = cfg.version();
    println!("cargo:PYTHON_VERSION={}.{}", version.major, version.minor);
    if let Some(exe) = cfg.executable() {
        println!("cargo:PYTHON={exe}");
    }
    if cfg.shared() {
        if let Some(dir) = cfg.lib_dir() {
            println!("cargo:LIBDIR={dir}");
        }
    }
    pyo3_build_config::add_libpython_rpath_link_args();
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    println!("cargo:rerun-if-env-changed=PYO3_CONFIG_FILE");
    println!("cargo:rerun-if-changed=build.rs");
}
