//! Package sources: the one walk over a package folder (what it embeds, what hot reload reads
//! again and watches), and the in-memory importer that serves an embedded package.
//!
//! `#[py_op(package = ...)]` walks the folder at compile time in `pyop-macros`, which cannot use
//! this crate; its walker follows the same rule, and `tests/devx_tests.rs` checks that both list
//! the same files.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyDict;

/// A package's files: paths relative to its folder (`/`-separated) and their text.
pub(crate) type PackageFiles = Vec<(Cow<'static, str>, Cow<'static, str>)>;

/// The `.py` files under `root`, as sorted relative paths. The one skip rule: `__pycache__` and
/// dot-folders (`.ipynb_checkpoints`, `.git`) are not part of a package.
pub(crate) fn walk(root: &Path) -> std::io::Result<Vec<PathBuf>> {
    fn visit(dir: &Path, rel: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let name = entry.file_name();
            let rel = rel.join(&name);
            if entry.file_type()?.is_dir() {
                let skipped = name == "__pycache__" || name.to_string_lossy().starts_with('.');
                if !skipped {
                    visit(&entry.path(), &rel, out)?;
                }
            } else if Path::new(&name).extension().is_some_and(|x| x == "py") {
                out.push(rel);
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    visit(root, Path::new(""), &mut out)?;
    out.sort();
    Ok(out)
}

/// Reads every file [`walk`] lists.
pub(crate) fn read(root: &Path) -> std::io::Result<PackageFiles> {
    let listed = walk(root)?;
    if listed.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no .py files",
        ));
    }
    listed
        .into_iter()
        .map(|rel| {
            let text = std::fs::read_to_string(root.join(&rel))?;
            let rel = rel.to_string_lossy().replace('\\', "/");
            Ok((rel.into(), text.into()))
        })
        .collect()
}

/// The importer's Python, run once in a namespace of its own under pyop's frame name.
pub(crate) const IMPORTER: &str = include_str!("python/importer.py");

static INSTALL: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// Installs (or, with `replace`, refreshes) the in-memory importer serving package `name`.
pub(crate) fn install(
    py: Python<'_>,
    name: &str,
    root: &str,
    files: &PackageFiles,
    replace: bool,
) -> PyResult<()> {
    let install = INSTALL.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        let namespace = PyDict::new(py);
        crate::python::errors::run_pyop_code(py, IMPORTER, &namespace)?;
        Ok(namespace
            .get_item("_install_package")?
            .expect("importer.py defines _install_package")
            .unbind())
    })?;
    let files_dict = PyDict::new(py);
    for (path, text) in files {
        files_dict.set_item(path.as_ref(), text.as_ref())?;
    }
    install.bind(py).call1((name, root, files_dict, replace))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_skip_rule() {
        let root = std::env::temp_dir().join(format!("pyop-walk-{}", std::process::id()));
        for dir in ["sub", "__pycache__", ".ipynb_checkpoints", "sub/.hidden"] {
            std::fs::create_dir_all(root.join(dir)).unwrap();
        }
        for file in [
            "__init__.py",
            "sub/a.py",
            "sub/notes.txt",
            "__pycache__/x.py",
            ".ipynb_checkpoints/a-checkpoint.py",
            "sub/.hidden/b.py",
        ] {
            std::fs::write(root.join(file), "x = 1\n").unwrap();
        }
        let listed = walk(&root).unwrap();
        assert_eq!(
            listed,
            [PathBuf::from("__init__.py"), PathBuf::from("sub/a.py")]
        );
        let files = read(&root).unwrap();
        assert_eq!(files[1].0, "sub/a.py");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
