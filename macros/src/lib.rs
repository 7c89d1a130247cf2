//! The `#[py_op]` attribute of [pyop](https://docs.rs/pyop). Use it through the `pyop` crate.
//!
//! The pipeline, one file a stage: `attr` parses the attribute's options, `ast` parses the
//! function signature into a typed model, `valid` checks the two against each other, and
//! `expand` writes the wrapper; every mistake is collected in a `ctxt::Ctxt` and reported at
//! once, each on its own token, next to a fallback copy of the user's function.

mod ast;
mod attr;
mod ctxt;
mod expand;
mod valid;

use proc_macro::TokenStream;

/// Declares a candle op whose body is a Python function. See the `pyop` crate's documentation.
#[proc_macro_attribute]
pub fn py_op(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::py_op(args.into(), item.into()).into()
}
