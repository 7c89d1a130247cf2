//! Tells the macro which interpreter checks bodies at build time — the one pyo3 builds against,
//! found the way pyo3-build-config's `find_interpreter` finds it (`PYO3_PYTHON`, the active venv
//! or conda environment, `python`/`python3` on `PATH`) — and whether this rustc lets a macro read
//! span locations (Rust 1.88), which map Python line numbers to `.rs` lines and resolve
//! `include_str!` paths. With a `PYO3_CONFIG_FILE` or `PYO3_CROSS*` (cross-compiling) there is no
//! interpreter to ask and bodies are checked by `validate()` only.
//!
//! Why the search is written here rather than asked of pyo3-build-config, as `build.rs` and
//! `runtime/build.rs` ask it: `pyo3_build_config::get()` reads what `pyo3-ffi`'s build script
//! published (`DEP_PYTHON_PYO3_CONFIG`), which only a crate depending on `pyo3-ffi` directly
//! sees, and a proc-macro crate that did would link libpython into the compiler's process; its
//! `find_interpreter` is private. The rules below are pyo3-build-config 0.30's, step for step.

use std::path::PathBuf;
use std::process::Command;

fn env(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn interpreter() -> Option<PathBuf> {
    // A config file or a cross build: pyo3 does not run this machine's Python, so neither does
    // the check (a host Python of another version could reject the target's syntax).
    let cross = std::env::vars().any(|(k, _)| k.starts_with("PYO3_CROSS"));
    println!("cargo:rerun-if-env-changed=PYO3_CROSS");
    println!("cargo:rerun-if-env-changed=PYO3_CROSS_LIB_DIR");
    println!("cargo:rerun-if-env-changed=PYO3_CROSS_PYTHON_VERSION");
    if env("PYO3_CONFIG_FILE").is_some() || cross {
        return None;
    }
    if let Some(exe) = env("PYO3_PYTHON") {
        return Some(exe.into());
    }
    let bin = |dir: &str, unix: &str, windows: &str| {
        PathBuf::from(dir).join(if cfg!(windows) { windows } else { unix })
    };
    match (env("VIRTUAL_ENV"), env("CONDA_PREFIX")) {
        (Some(dir), None) => return Some(bin(&dir, "bin/python", "Scripts\\python.exe")),
        (None, Some(dir)) => return Some(bin(&dir, "bin/python", "python.exe")),
        _ => {}
    }
    println!("cargo:rerun-if-env-changed=PATH");
    ["python", "python3"]
        .into_iter()
        .map(PathBuf::from)
        .find(|exe| {
            Command::new(exe).arg("--version").output().is_ok_and(|o| {
                o.stdout.starts_with(b"Python 3") || o.stderr.starts_with(b"Python 3")
            })
        })
}

fn main() {
    println!("cargo::rustc-check-cfg=cfg(pyop_span_locations)");
    let exe = interpreter().map(|p| p.display().to_string());
    println!(
        "cargo:rustc-env=PYOP_CHECK_PYTHON={}",
        exe.unwrap_or_default()
    );
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let minor = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|v| v.split('.').nth(1).and_then(|m| m.parse::<u32>().ok()));
    if minor.is_some_and(|m| m >= 88) {
        println!("cargo:rustc-cfg=pyop_span_locations");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
