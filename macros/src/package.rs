//! A package source's folder (`package = "py/mylib"`): its name, and the `.py` files the
//! generated code embeds and the build check reads.

/// The package's name: the last component of its folder.
pub fn package_name(path: &str) -> String {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or(path)
        .to_owned()
}

/// The `.py` files of a package folder, skipping `__pycache__` and dot-folders: the rule of the
/// runtime's `body::package::walk`, which this proc-macro crate cannot call (`tests/devx_tests.rs`
/// checks that both list the same files).
pub(crate) fn collect_py(
    dir: &std::path::Path,
    prefix: &str,
    out: &mut Vec<String>,
) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.file_type()?.is_dir() {
            if name != "__pycache__" && !name.starts_with('.') {
                collect_py(&entry.path(), &format!("{prefix}{name}/"), out)?;
            }
        } else if name.ends_with(".py") {
            out.push(format!("{prefix}{name}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_names() {
        assert_eq!(package_name("py/mylib"), "mylib");
        assert_eq!(package_name("py/mylib/"), "mylib");
        assert_eq!(package_name("mylib"), "mylib");
    }
}
