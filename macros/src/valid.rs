//! Checks the options against the function.

use proc_macro2::Span;

use crate::ast::{Function, Returns};
use crate::attr::Options;
use crate::ctxt::Ctxt;

pub fn check(cx: &Ctxt, opts: &Options, f: &Function<'_>) {
    let sources: Vec<_> = [&opts.file, &opts.code, &opts.module]
        .into_iter()
        .flatten()
        .map(|a| &a.key)
        .collect();
    let written = |k: &str| opts.written.iter().any(|w| w == k);
    match sources.as_slice() {
        [] if ["file", "code", "module"].iter().any(|k| written(k)) => {}
        [] => cx.syn_error(syn::Error::new(
            Span::call_site(),
            "missing the body's source: give one of `file = \"ops/my_op.py\"`, `code = \"def ...\"` or `module = \"name\"`",
        )),
        [_] => {}
        [first, rest @ ..] => {
            for key in rest {
                cx.error_spanned_by(key, format!("`{}` and `{}` cannot both be given: a body has one source", first.ident, key.ident));
            }
        }
    }
    let Some(tout) = &opts.tout else {
        if written("tout") {
            return;
        }
        cx.syn_error(syn::Error::new(
            Span::call_site(),
            "missing `tout`: declare the outputs, e.g. `tout = f32`, `tout = (f32, i64)` or `tout = ()`",
        ));
        return;
    };
    let declared = tout.value.outputs.len();
    if let Some(returns) = &f.returns {
        let returned = returns.count();
        let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
        match (declared, returns) {
            (0, Returns::Unit) => {}
            (0, _) => cx.error_spanned_by(
                &tout.value.tokens,
                format!(
                    "`tout = ()` declares no outputs but the function returns {}",
                    plural(returned, "tensor")
                ),
            ),
            (_, Returns::Unit) => cx.error_spanned_by(
                &f.output,
                format!(
                    "the function returns `()` but `tout` declares {}",
                    plural(declared, "output")
                ),
            ),
            (d, _) if d != returned => cx.error_spanned_by(
                &tout.value.tokens,
                format!(
                    "`tout` has {} but the function returns {}",
                    plural(d, "output"),
                    plural(returned, "tensor")
                ),
            ),
            _ => {}
        }
    }
    if opts.numpy.is_some() {
        for out in &tout.value.outputs {
            if !out.numpy_ok {
                cx.error_spanned_by(
                    &out.dtype,
                    format!("NumPy has no dtype `{}`: numpy mode cannot return it; use tensor mode (drop `numpy`)", out.dtype),
                );
            }
        }
    }
}
