//! Records which Python this crate was built against, so that a program can tell at run time
//! whether the interpreter it loaded is that one (`validate()`, `python_env()`).

use std::process::Command;

fn main() {
    // `Py_3_13` and kin, as pyo3's own crates see them (`python::thread_state` asks whether the
    // interpreter is finalizing by a function 3.13 renamed).
    pyo3_build_config::use_pyo3_cfgs();
    // pyo3's own switch, set by a user's `RUSTFLAGS` (`bridge::tensor::spare` leaks a thread's
    // spares at its end instead of dropping them where that would abort).
    println!("cargo:rustc-check-cfg=cfg(pyo3_disable_reference_pool)");
    let cfg = pyo3_build_config::get();
    let v = cfg.version();
    println!("cargo:rustc-env=PYOP_BUILT_PYTHON={}.{}", v.major, v.minor);
    println!(
        "cargo:rustc-env=PYOP_BUILT_PYTHON_LIBDIR={}",
        if cfg.shared() {
            cfg.lib_dir().unwrap_or_default()
        } else {
            ""
        }
    );
    println!(
        "cargo:rustc-env=PYOP_BUILT_PYTHON_EXE={}",
        cfg.executable().unwrap_or_default()
    );
    // The full version and the installation prefix are not in pyo3's config: ask the interpreter
    // pyo3 used (absent when cross-compiling from a config file; then only X.Y is checked).
    let (full, prefix) = cfg
        .executable()
        .and_then(|exe| {
            let out = Command::new(exe)
                .args([
                    "-c",
                    "import sys; print('%d.%d.%d' % sys.version_info[:3]); print(sys.base_prefix)",
                ])
                .output()
                .ok()?;
            let text = String::from_utf8(out.stdout).ok()?;
            let mut lines = text.lines();
            Some((lines.next()?.to_owned(), lines.next()?.to_owned()))
        })
        .unwrap_or_default();
    println!("cargo:rustc-env=PYOP_BUILT_PYTHON_VERSION={full}");
    println!("cargo:rustc-env=PYOP_BUILT_PYTHON_PREFIX={prefix}");
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    println!("cargo:rerun-if-env-changed=PYO3_CONFIG_FILE");
    println!("cargo:rerun-if-changed=build.rs");
}
