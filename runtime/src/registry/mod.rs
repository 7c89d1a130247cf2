//! The registry: every op declared with `#[py_op]` in the program, from any crate, submitted
//! through `inventory` and keyed by Rust path.

pub(crate) mod decl;

use crate::stats::OpStats;
use decl::StaticOp;

/// One registry entry; `#[py_op]` submits one per declared op.
#[doc(hidden)]
pub struct Registration(pub &'static StaticOp);

inventory::collect!(Registration);

/// Every op declared with `#[py_op]` in the program, from any crate, sorted by Rust path (the
/// key: two crates' ops of the same name do not collide). Each is the op's [`StaticOp`]:
/// [`decl`](StaticOp::decl) is its declaration (name, Rust path, file and line, source, `tout`),
/// [`get`](StaticOp::get) the op itself. One op's, typed, is `pyop::op!(name)`.
pub fn registered_ops() -> Vec<&'static StaticOp> {
    let mut all: Vec<&'static StaticOp> = inventory::iter::<Registration>
        .into_iter()
        .map(|r| r.0)
        .collect();
    all.sort_by_key(|op| (op.decl().module_path(), op.decl().name()));
    all
}

/// The op `#[py_op]` declared at `line` of `file`, in `module_path`, as `name`: what `pyop::op!`
/// finds (the declaration registered it); not a public API.
#[doc(hidden)]
pub fn declared_at(module_path: &str, file: &str, line: u32, name: &str) -> &'static StaticOp {
    inventory::iter::<Registration>
        .into_iter()
        .map(|r| r.0)
        .find(|op| {
            let d = op.decl();
            d.line() == line
                && d.name() == name
                && d.module_path() == module_path
                && d.file() == file
        })
        .expect("a #[py_op] function registers its op where its handle finds it")
}

/// The declared op whose Rust path is `key` (`my_crate::ops::zscore`), or whose name is `key` if
/// only one op has that name. Where the function is in scope, `pyop::op!(zscore)` is the same op,
/// checked by the compiler.
pub fn registered_op(key: &str) -> Option<&'static StaticOp> {
    let all = registered_ops();
    if let Some(op) = all.iter().find(|op| op.decl().rust_path() == key) {
        return Some(op);
    }
    let mut named = all.into_iter().filter(|op| op.decl().name() == key);
    match (named.next(), named.next()) {
        (Some(op), None) => Some(op),
        _ => None,
    }
}

/// The counters of the declared op `key` (see [`registered_op`]).
pub fn op_stats(key: &str) -> Option<OpStats> {
    registered_op(key).map(StaticOp::stats)
}
