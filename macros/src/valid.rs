//! Checks the options against the function, one named rule each (as serde's `check.rs`); every
//! mistake is reported, each on its own token.

use proc_macro2::Span;

use crate::ast::{Function, ParamKind, Returns};
use crate::attr::{BatchDecl, KeyName, Options, Tout};
use crate::ctxt::Ctxt;

/// The longest output tuple the runtime's `FromOutputs` covers.
pub const MAX_OUTPUTS: usize = 12;

pub fn check(cx: &Ctxt, opts: &Options, f: &Function<'_>) {
    check_output_count(cx, f);
    check_one_source(cx, opts);
    check_file_exists(cx, opts);
    check_package_module(cx, opts);
    check_workers_mode(cx, opts);
    check_dlpack_mode(cx, opts);
    if let Some(batch) = &opts.batch {
        check_batch_inputs(cx, &batch.value, f);
    }
    if let Some(tout) = tout_declared(cx, opts) {
        check_tout_arity(cx, tout, f);
        check_like_params(cx, tout, f);
        check_numpy_dtypes(cx, opts, tout);
        if let Some(batch) = &opts.batch {
            check_batch_outputs(cx, tout);
            check_batch_like(cx, &batch.value, tout);
        }
    }
}

/// A tuple of at most [`MAX_OUTPUTS`] tensors (what the generated code can hand back).
fn check_output_count(cx: &Ctxt, f: &Function<'_>) {
    if let Some(Returns::Tuple(n)) = &f.returns {
        if *n > MAX_OUTPUTS {
            cx.error_spanned_by(
                &f.output,
                format!(
                    "a #[py_op] function returns at most {MAX_OUTPUTS} tensors, not {n}: return \
                     fewer, or group outputs into one tensor (e.g. `Tensor::stack`)"
                ),
            );
        }
    }
}

/// A body has exactly one source; `module` may name a module inside a `package`. A source key
/// whose value was malformed is not also "missing".
fn check_one_source(cx: &Ctxt, opts: &Options) {
    let module_alone = if opts.package.is_some() {
        &None
    } else {
        &opts.module
    };
    let sources: Vec<_> = [&opts.file, module_alone, &opts.package]
        .into_iter()
        .flatten()
        .map(|a| &a.key)
        .chain(opts.code.as_ref().map(|a| &a.key))
        .collect();
    match sources.as_slice() {
        [] if KeyName::SOURCES.iter().any(|k| opts.written.contains(k)) => {}
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
}

/// A `file` is there, relative to the crate's Cargo.toml (said in the macro's words rather than
/// as `include_str!`'s failure on an absolute path).
fn check_file_exists(cx: &Ctxt, opts: &Options) {
    let Some(file) = &opts.file else {
        return;
    };
    let rel = file.value.value();
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    if !std::path::Path::new(&manifest).join(&rel).is_file() {
        cx.error_spanned_by(
            &file.value,
            format!("no file `{rel}` (a `file` path is relative to the crate's Cargo.toml)"),
        );
    }
}

/// With `package`, `module` names the package or a module inside it.
fn check_package_module(cx: &Ctxt, opts: &Options) {
    if let (Some(package), Some(module)) = (&opts.package, &opts.module) {
        let name = crate::package::package_name(&package.value.value());
        let m = module.value.value();
        if m != name && !m.starts_with(&format!("{name}.")) {
            cx.error_spanned_by(
                &module.value,
                format!("with `package`, `module` names a module inside it: `{name}` or `{name}.<module>`"),
            );
        }
    }
}

/// `tout` is required (unless it was written with a malformed value, already reported).
fn tout_declared<'o>(cx: &Ctxt, opts: &'o Options) -> Option<&'o Tout> {
    match &opts.tout {
        Some(t) => Some(&t.value),
        None => {
            if !opts.written.contains(&KeyName::Tout) {
                cx.syn_error(syn::Error::new(
                    Span::call_site(),
                    "missing `tout`: declare the outputs, e.g. `tout = f32`, `tout = (f32, i64)` or `tout = ()`",
                ));
            }
            None
        }
    }
}

/// `tout` declares as many outputs as the return type has tensors.
fn check_tout_arity(cx: &Ctxt, tout: &Tout, f: &Function<'_>) {
    let Some(returns) = &f.returns else {
        return;
    };
    let declared = tout.outputs.len();
    let returned = returns.count();
    let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    match (declared, returns) {
        (0, Returns::Unit) => {}
        (0, _) => cx.error_spanned_by(
            &tout.tokens,
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
            &tout.tokens,
            format!(
                "`tout` has {} but the function returns {}",
                plural(d, "output"),
                plural(returned, "tensor")
            ),
        ),
        _ => {}
    }
}

/// `f32[x]` and `x.dtype` name a `&Tensor` parameter that is always given.
fn check_like_params(cx: &Ctxt, tout: &Tout, f: &Function<'_>) {
    for out in &tout.outputs {
        let named: Vec<(&proc_macro2::Ident, &str)> = match (&out.like, &out.dtype_of) {
            (Some(l), Some(d)) if l == d => vec![(l, "`like({x})` takes the dtype and shape")],
            (l, d) => l
                .iter()
                .map(|l| (l, "`[{x}]` takes the shape"))
                .chain(d.iter().map(|d| (d, "`{x}.dtype` takes the dtype")))
                .collect(),
        };
        for (x, what) in named {
            let what = what.replace("{x}", &x.to_string());
            match f.params.iter().find(|p| p.name == *x) {
                Some(p) if p.kind == ParamKind::Tensor && p.optional => cx.error_spanned_by(
                    x,
                    format!("`{x}` is optional: {what} of a tensor given on every call"),
                ),
                Some(p) if p.kind == ParamKind::Tensor => {}
                Some(_) => cx.error_spanned_by(
                    x,
                    format!("`{x}` is not a `&Tensor` parameter: {what} of one"),
                ),
                None => cx.error_spanned_by(
                    x,
                    format!("no parameter `{x}`: {what} of a `&Tensor` parameter"),
                ),
            }
        }
    }
}

/// Worker processes run numpy-mode bodies only: a tensor-mode body needs the program's tensors.
fn check_workers_mode(cx: &Ctxt, opts: &Options) {
    if let (Some(p), None) = (&opts.pool, &opts.workers) {
        cx.error_spanned_by(
            &p.key.ident,
            "`pool` names the worker pool that `workers` runs the op in: add `workers = N` (the \
             pool's size)",
        );
    }
    if let (Some(w), None) = (&opts.workers, &opts.numpy) {
        cx.error_spanned_by(
            &w.key.ident,
            "`workers` runs numpy-mode ops only (a tensor-mode body works on the program's own \
             candle tensors, which a worker process cannot reach): add `numpy`, or drop `workers`",
        );
    }
}

/// `dlpack` is numpy mode's option, and keeps inputs on the op's device, which worker processes
/// cannot reach.
fn check_dlpack_mode(cx: &Ctxt, opts: &Options) {
    let Some(d) = &opts.dlpack else {
        return;
    };
    if opts.numpy.is_none() {
        cx.error_spanned_by(
            &d.ident,
            "`dlpack` is numpy mode's option (tensor mode already passes `pyop.Tensor`, a DLPack \
             producer): add `numpy`, or drop `dlpack`",
        );
    }
    if opts.workers.is_some() {
        cx.error_spanned_by(
            &d.ident,
            "`dlpack` keeps inputs on the op's device, which a worker process cannot reach: drop \
             `workers` or `dlpack`",
        );
    }
}

/// Numpy mode returns only dtypes NumPy has; with `dlpack`, those DLPack carries (bf16 too).
fn check_numpy_dtypes(cx: &Ctxt, opts: &Options, tout: &Tout) {
    if opts.numpy.is_none() {
        return;
    }
    for out in &tout.outputs {
        if opts.dlpack.is_some() {
            if !out.dlpack_ok {
                cx.error_spanned_by(
                    &out.dtype,
                    format!(
                        "DLPack has no dtype `{}`: a `dlpack` op cannot return it; use tensor \
                         mode (drop `numpy`)",
                        out.dtype
                    ),
                );
            }
        } else if !out.numpy_ok {
            cx.error_spanned_by(
                &out.dtype,
                format!("NumPy has no dtype `{}`: numpy mode cannot return it; use tensor mode (drop `numpy`), or pass `dlpack` to return it from a DLPack producer (torch)", out.dtype),
            );
        }
    }
}

/// A batching op stacks tensors along axis 0: `inputs` names `&Tensor` parameters given on every
/// call, and without `inputs` (every `&Tensor` parameter stacked) there is one.
fn check_batch_inputs(cx: &Ctxt, batch: &BatchDecl, f: &Function<'_>) {
    let Some(inputs) = &batch.inputs else {
        if !f
            .params
            .iter()
            .any(|p| p.kind == ParamKind::Tensor && !p.optional)
        {
            cx.error_spanned_by(
                &batch.tokens,
                format!(
                    "`batch` stacks the op's `&Tensor` arguments along axis 0, but `{}` has no \
                     `&Tensor` parameter given on every call: add one, or drop `batch`",
                    f.item.sig.ident
                ),
            );
        }
        return;
    };
    for x in &inputs.value {
        match f.params.iter().find(|p| p.name == *x) {
            Some(p) if p.kind == ParamKind::Tensor && p.optional => cx.error_spanned_by(
                x,
                format!(
                    "`{x}` is optional: `inputs` names tensors stacked along axis 0, given on \
                     every call"
                ),
            ),
            Some(p) if p.kind == ParamKind::Tensor => {}
            Some(_) => cx.error_spanned_by(
                x,
                format!(
                    "`{x}` is not a `&Tensor` parameter: `inputs` names the tensors stacked \
                     along axis 0"
                ),
            ),
            None => cx.error_spanned_by(
                x,
                format!(
                    "no parameter `{x}`: `inputs` names the `&Tensor` parameters stacked along \
                     axis 0"
                ),
            ),
        }
    }
}

/// An output shaped like a parameter (`f32[w]`, `like(w)`) of a batching op that `inputs` does
/// not stack would not have the batch's rows along axis 0; the runtime's rule, at compile time.
fn check_batch_like(cx: &Ctxt, batch: &BatchDecl, tout: &Tout) {
    let Some(inputs) = &batch.inputs else {
        return;
    };
    for (i, out) in tout.outputs.iter().enumerate() {
        let Some(x) = &out.like else {
            continue;
        };
        if !inputs.value.iter().any(|n| n == x) {
            cx.error_spanned_by(
                x,
                format!(
                    "output {i} takes the shape of `{x}`, which `inputs` does not stack: its axis \
                     0 would not be the batch's rows; add `{x}` to `inputs`, or declare the \
                     shape with axis 0 free (`f32[_, …]`)"
                ),
            );
        }
    }
}

/// A batching op's outputs have the batch's rows along axis 0, so a declared shape leaves that
/// axis free (`_`); the runtime's rule (`OpBuilder::build`), said at compile time.
fn check_batch_outputs(cx: &Ctxt, tout: &Tout) {
    for (i, out) in tout.outputs.iter().enumerate() {
        let (Some(dims), Some(group)) = (&out.shape, &out.shape_group) else {
            continue;
        };
        if matches!(dims.first(), Some(None)) {
            continue;
        }
        let size = |d: &Option<usize>| d.map_or_else(|| "_".to_owned(), |n| n.to_string());
        let written: Vec<String> = dims.iter().map(size).collect();
        let fixed: Vec<String> = std::iter::once("_".to_owned())
            .chain(dims.iter().skip(1).map(size))
            .collect();
        let dtype = match &out.dtype_of {
            Some(x) => format!("{x}.dtype"),
            None => out.dtype.to_string(),
        };
        let declared = format!("{dtype}[{}]", written.join(", "));
        let meant = format!("{dtype}[{}]", fixed.join(", "));
        // The fixed size, or the empty brackets of a 0-d output.
        let at = group
            .stream()
            .into_iter()
            .next()
            .map_or_else(|| quote::quote!(#group), |t| quote::quote!(#t));
        let what = if dims.is_empty() {
            format!("output {i} is declared `{declared}`, with no axis")
        } else {
            format!("output {i} is declared `{declared}`")
        };
        cx.error_spanned_by(
            at,
            format!(
                "{what}, but a batching op's outputs have the batch's rows along axis 0: declare \
                 that axis `_` (`{meant}`)"
            ),
        );
    }
}
