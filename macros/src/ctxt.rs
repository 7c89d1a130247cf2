//! Collects every error of one expansion, as serde_derive's `Ctxt` does.

use std::cell::RefCell;
use std::fmt::Display;

use quote::ToTokens;

#[derive(Default)]
pub struct Ctxt {
    errors: RefCell<Option<Vec<syn::Error>>>,
}

impl Ctxt {
    pub fn new() -> Self {
        Ctxt {
            errors: RefCell::new(Some(Vec::new())),
        }
    }

    /// Records an error spanning `tokens`.
    pub fn error_spanned_by<T: ToTokens, M: Display>(&self, tokens: T, msg: M) {
        self.syn_error(syn::Error::new_spanned(tokens.into_token_stream(), msg));
    }

    pub fn syn_error(&self, err: syn::Error) {
        self.errors
            .borrow_mut()
            .as_mut()
            .expect("checked once")
            .push(err);
    }

    /// Whether an error has been recorded so far.
    pub fn has_errors(&self) -> bool {
        self.errors.borrow().as_ref().is_some_and(|e| !e.is_empty())
    }

    /// Every error recorded, combined into one; consumes the context.
    pub fn check(self) -> Result<(), syn::Error> {
        let mut errors = self.errors.take().expect("checked once").into_iter();
        let Some(mut combined) = errors.next() else {
            return Ok(());
        };
        for e in errors {
            combined.combine(e);
        }
        Err(combined)
    }
}

impl Drop for Ctxt {
    fn drop(&mut self) {
        if !std::thread::panicking() && self.errors.borrow().is_some() {
            panic!("forgot to check for errors");
        }
    }
}
