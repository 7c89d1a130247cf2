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
    // pyop's own test, example and bench binaries each link candle and libpython (about 40 MB,
    // a quarter of it debug sections): with those compressed (zlib; backtraces and debuggers
    // read them so) CI's target folder is about 200 MB smaller. Only these targets of this
    // package: a crate that uses pyop gets none of it.
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        for targets in ["tests", "examples", "benches"] {
            println!("cargo:rustc-link-arg-{targets}=-Wl,--compress-debug-sections=zlib");
        }
    }
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    println!("cargo:rerun-if-env-changed=PYO3_CONFIG_FILE");
    println!("cargo:rerun-if-changed=build.rs");
    // The `package` folders pyop's own tests declare: a file added to one is embedded by the next
    // build (cargo watches a folder's files, added ones included; a crate whose build script
    // prints no `rerun-if-changed`, as the README's, gets this for all its files).
    for package in ["tests/py/mylib", "tests/py/reloadpkg"] {
        if std::path::Path::new(package).is_dir() {
            println!("cargo:rerun-if-changed={package}");
        }
    }
    // Working on pyop itself (built in its own target folder, not as another crate's
    // dependency): its tests need the venv `scripts/dev.sh` makes. Without it they fail on
    // NumPy; say why first.
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR").map(std::path::PathBuf::from);
    let out = std::env::var_os("OUT_DIR").map(std::path::PathBuf::from);
    if let (Some(manifest), Some(out)) = (manifest, out) {
        if !out.starts_with(manifest.join("target")) {
            return;
        }
        if !std::path::Path::new(".venv/pyvenv.cfg").exists() {
            // Until it exists (a missing path makes cargo run this again on every build).
            println!("cargo:rerun-if-changed=.venv/pyvenv.cfg");
            println!(
                "cargo:warning=pyop's tests and examples need the venv with NumPy that \
                 `scripts/dev.sh` makes: run `scripts/dev.sh test` (or `scripts/dev.sh true` once, \
                 then `cargo test --workspace`)"
            );
        }
    }
}
