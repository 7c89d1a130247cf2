//! Where a body comes from: source modules (`source`), package folders and the embedded importer
//! (`package`), and hot reload (`reload`).

pub(crate) mod package;
pub(crate) mod reload;
pub(crate) mod source;
