//! The in-process tests: one test binary for every area whose tests can share a process, so
//! candle, tokenizers and libpython are linked once instead of once per file (as cargo's own
//! `tests/testsuite/`). Each module was a test file of its own; its tests keep their names
//! (`numpy_tests::zscore_…`), so `cargo test --workspace --test in_process numpy_tests::` runs
//! what `--test numpy_tests` did.
//!
//! Apart, in binaries of their own: the four `worker_*_tests` (they count the program's
//! children, arenas, descriptors and `/dev/shm` entries, which other areas' workers would
//! change), `devx_tests` (its ops are broken on purpose, and `validate()` checks every op of its
//! binary), `leak_tests` (a counting global allocator), `examples_tests` (it builds the
//! examples), `docs`, and the harness-less `hardening`, `python_env` and `user_crate`.

#[path = "../common/mod.rs"]
mod common;

mod batch_tests;
mod device_tests;
mod dlpack_tests;
mod executor_tests;
mod grad_tests;
mod numpy_tests;
mod reload_tests;
mod stub_tests;
mod tensor_tests;
mod tracing_tests;
