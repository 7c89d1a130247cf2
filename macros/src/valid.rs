//! Checks the options against the function.

use proc_macro2::Span;

use crate::ast::{Function, Returns};
use crate::attr::Options;
use crate::ctxt::Ctxt;

pub fn check(cx: &Ctxt, opts: &Options, f: &Function<'_>) {
    // `module` may name a module inside a `package`; otherwise a body has exactly one source.
    let module_alone = if opts.package.is_some() {
        &None
    } else {
        &opts.module
    };
    let sources: Vec<_> = [&opts.file, &opts.code, module_alone, &opts.package]
        .into_iter()
        .flatten()
        .map(|a| &a.key)
        .collect();
    let written = |k: &str| opts.written.iter().any(|w| w == k);
    match sources.as_slice() {
        [] if ["file", "code", "module", "package"].iter().any(|k| written(k)) => {}
        [] => cx.syn_error(syn::Error::new(
            Span::call_site(),
            "missing the body's source: give one of `file = \"ops/my_op.py\"`, `code = \"def ...\"`, `module = \"name\"` or `package = \"py/mylib\"`",
        )),
        [_] => {}
        [first, rest @ ..] => {
            for key in rest {
                cx.error_spanned_by(
                    key,
                    format!("`{}` and `{}` cannot both be given: a body has one source", first.ident, key.ident),
                );
            }
        }
    }
    if let (Some(package), Some(module)) = (&opts.package, &opts.module) {
        let name = crate::attr::package_name(&package.value.value());
        let m = module.value.value();
        if m != name && !m.starts_with(&format!("{name}.")) {
            cx.error_spanned_by(
                &module.value,
                format!("with `package`, `module` names a module inside it: `{name}` or `{name}.<module>`"),
            );
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
    for out in &tout.value.outputs {
        if let Some(like) = &out.like {
            match f.params.iter().find(|p| p.name == *like) {
                Some(p) if p.kind == crate::ast::ParamKind::Tensor && p.optional => cx.error_spanned_by(
                    like,
                    format!("`{like}` is optional: `[{like}]` needs a tensor on every call"),
                ),
                Some(p) if p.kind == crate::ast::ParamKind::Tensor => {}
                Some(_) => cx.error_spanned_by(
                    like,
                    format!("`{like}` is not a `&Tensor` parameter: `[{like}]` takes the shape of one"),
                ),
                None => cx.error_spanned_by(
                    like,
                    format!("no parameter `{like}`: `[{like}]` takes the shape of a `&Tensor` parameter"),
                ),
            }
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
