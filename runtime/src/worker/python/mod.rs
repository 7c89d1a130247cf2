//! The Python of a worker, kept in this folder as `.py` files (type-checked with `mypy --strict`
//! and tested on their own by `runtime/python-tests/`): a worker's main loop (`worker.py`), what
//! any process running bodies outside the program needs (`host.py`, which a Ray actor runs too)
//! and what a reply's pickle may name (`pickle_names.py`, which the program's reply reader runs
//! too). `process` sends a worker its text at start; `ray` sends Ray an actor's.

/// What a worker's reply pickle may name (`pickle_names.py`): the program's reply reader
/// (`bridge::shared`) runs it before its restricted unpickler, as every worker and Ray actor runs
/// it before its pickler ([`host_py!`]), so both halves of the trust boundary read one list.
pub(crate) const PICKLE_NAMES_PY: &str = include_str!("pickle_names.py");

/// The text any process that runs bodies outside the program runs first: the pickle allow-list
/// (`pickle_names.py`), then `host.py` (loading bodies, the `pyop` stand-in, their exceptions,
/// their results pickled). A macro, not a constant, so that `concat!` can put it before a
/// worker's main loop (`process`) and a Ray actor's class (`ray`) at compile time; its paths are
/// the crate's (`include_str!` in a macro reads paths from the file it is used in).
macro_rules! host_py {
    () => {
        concat!(
            include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/src/worker/python/pickle_names.py"
            )),
            include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/src/worker/python/host.py"
            ))
        )
    };
}
pub(crate) use host_py;
