//! pyop's compile-error tests live in `tests/`: `ui.rs` has trybuild build each case in
//! `tests/ui/` against this crate's dependencies, pyop alone.
