//! Developer tools over the registry and the executor: start-up validation (`validate`), the
//! manifest (`manifest`) and the gradient checker (`gradcheck`).

pub(crate) mod gradcheck;
pub(crate) mod manifest;
pub(crate) mod validate;
