//! Compile-time checks of `#[py_op]`: every mistake is an error on its own token.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
