//! The build-script helper of [pyop](https://docs.rs/pyop): one call in your crate's `build.rs`
//! gives its binaries, tests and examples an rpath to the libpython pyop was built against, so
//! they start without `LD_LIBRARY_PATH` and never load another `libpythonX.Y.so` of the same name.
//!
//! ```toml
//! [dependencies]
//! pyop = "0.1"
//!
//! [build-dependencies]
//! pyop-build = "0.1"
//! ```
//!
//! ```no_run
//! // build.rs (a build script: compiled here, run by cargo when it builds your crate)
//! fn main() {
//!     pyop_build::link_libpython();
//! }
//! ```
//!
//! It reads what pyop's build script publishes through cargo's `links` metadata, which reaches
//! only crates that depend on `pyop` directly: call it in the crate whose binaries you run (for a
//! workspace, in each crate with binaries, tests or examples that use pyop). pyo3's own
//! `pyo3_build_config::add_libpython_rpath_link_args()` does the same for crates that depend on
//! pyo3 directly; this one needs no pyo3 dependency.
#![warn(missing_docs)]
// The example is a build script: its `fn main` is the point.
#![allow(clippy::needless_doctest_main)]

use std::env;
use std::path::{Path, PathBuf};

/// The type stub of the `pyop` module that `#[py_op]` bodies import (`pyop.pyi`): every
/// `Tensor` method and module function with parameter and return types, `OpTimeout`,
/// `RustError`, `RustPanic` and `rust`.
pub const PYTHON_STUB: &str = include_str!("../pyop.pyi");

/// Writes [`PYTHON_STUB`] to `dir/pyop.pyi` (creating `dir`), unless it is already there, so
/// that editors and type checkers resolve `import pyop` in body files and complete
/// `pyop.relu` or `x.narrow`. Call it from `build.rs`; a relative `dir` is relative to the
/// crate's folder. `"typings"` is where pyright and Pylance look by default; for mypy, add the
/// folder to `mypy_path`.
///
/// ```no_run
/// // build.rs (compiled here; run by cargo, since it writes into your crate's folder)
/// fn main() {
///     pyop_build::link_libpython();
///     pyop_build::write_python_stub("typings").expect("typings/pyop.pyi");
/// }
/// ```
pub fn write_python_stub(dir: impl AsRef<Path>) -> std::io::Result<PathBuf> {
    let path = dir.as_ref().join("pyop.pyi");
    if std::fs::read_to_string(&path).is_ok_and(|s| s == PYTHON_STUB) {
        return Ok(path);
    }
    std::fs::create_dir_all(dir.as_ref())?;
    std::fs::write(&path, PYTHON_STUB)?;
    Ok(path)
}

/// What pyop's build script published, read from the `DEP_PYOP_*` variables cargo sets for a
/// crate that depends on pyop directly.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PythonLink {
    /// The folder of the libpython pyop links (`None` for a static libpython: nothing to find).
    pub lib_dir: Option<String>,
    /// The interpreter pyo3 was configured with (`PYO3_PYTHON`, or `python3` on `PATH`).
    pub executable: Option<String>,
    /// Its version, `X.Y`.
    pub version: String,
}

/// Reads what pyop published. Panics, saying why, outside a build script or without a direct
/// dependency on `pyop`.
pub fn python_link() -> PythonLink {
    let var = |name: &str| env::var(name).ok().filter(|v| !v.is_empty());
    let Some(version) = var("DEP_PYOP_PYTHON_VERSION") else {
        panic!(
            "pyop-build: DEP_PYOP_PYTHON_VERSION is not set. Call pyop_build from the build.rs of \
             a crate that depends on `pyop` directly (cargo passes pyop's link metadata only to \
             its direct dependents)"
        );
    };
    PythonLink {
        lib_dir: var("DEP_PYOP_LIBDIR"),
        executable: var("DEP_PYOP_PYTHON"),
        version,
    }
}

/// Gives the package's binaries, tests, examples and benchmarks an rpath to pyop's libpython
/// (on Linux and macOS; on Windows the DLL is found next to the program or on `PATH`).
pub fn link_libpython() {
    let link = python_link();
    if let Some(arg) = rpath_arg(&link, &env::var("CARGO_CFG_TARGET_OS").unwrap_or_default()) {
        println!("cargo:rustc-link-arg={arg}");
    }
}

/// The linker argument for `target_os`, if it takes one.
fn rpath_arg(link: &PythonLink, target_os: &str) -> Option<String> {
    let dir = link.lib_dir.as_ref()?;
    match target_os {
        "windows" | "wasi" | "" => None,
        _ => Some(format!("-Wl,-rpath,{dir}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_rpath_where_the_platform_has_them() {
        let link = PythonLink {
            lib_dir: Some("/opt/python/lib".into()),
            executable: None,
            version: "3.12".into(),
        };
        assert_eq!(
            rpath_arg(&link, "linux").as_deref(),
            Some("-Wl,-rpath,/opt/python/lib")
        );
        assert_eq!(
            rpath_arg(&link, "macos").as_deref(),
            Some("-Wl,-rpath,/opt/python/lib")
        );
        assert_eq!(rpath_arg(&link, "windows"), None);
        let static_python = PythonLink {
            lib_dir: None,
            ..link
        };
        assert_eq!(rpath_arg(&static_python, "linux"), None);
    }
}
