//! Compile-time checks of `#[py_op]`: every mistake is an error on its own token.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}

/// The expectations hold wherever the target folder is: none names a path under it (trybuild
/// builds the cases there) or on this machine. (CI built every case a second time in a fresh
/// target folder to show this; reading the files shows it in a millisecond.)
#[test]
fn no_expectation_names_a_machines_path() {
    let mut checked = 0;
    for entry in std::fs::read_dir("tests/ui").unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "stderr") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for (i, line) in text.lines().enumerate() {
            for leak in [
                "target/",
                "trybuild",
                "$DIR",
                "$WORKSPACE",
                "$CARGO",
                "/root/",
                "/home/",
                "/tmp/",
                env!("CARGO_MANIFEST_DIR"),
            ] {
                assert!(
                    !line.contains(leak),
                    "{}:{}: `{leak}` is a path of this machine or build: {line}",
                    path.display(),
                    i + 1
                );
            }
        }
        checked += 1;
    }
    assert!(checked >= 25, "{checked} expectations");
}
