//! Writes the wrapper function, or on error the user's function next to the errors.

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};

use crate::ast::{Function, Item, ParamKind};
use crate::attr::{Code, Grad, Options};
use crate::ctxt::Ctxt;
use crate::valid;

pub fn py_op(args: TokenStream, item: TokenStream) -> TokenStream {
    let item: Item = match syn::parse2(item.clone()) {
        Ok(i) => i,
        Err(e) => {
            let err = e.to_compile_error();
            return quote!(#err #item);
        }
    };
    let cx = Ctxt::new();
    let opts = Options::parse(&cx, args);
    let function = Function::from_item(&cx, &item);
    valid::check(&cx, &opts, &function);
    if !cx.has_errors() {
        // The Python itself, once the declaration is right.
        crate::pycheck::check(&cx, &opts, &function);
    }
    match cx.check() {
        Ok(()) => expand(&opts, &function),
        Err(e) => {
            let errors = e.to_compile_error();
            let fallback = fallback(&item, opts.krate.as_ref().map(|k| &k.value));
            quote!(#errors #fallback)
        }
    }
}

/// The user's function with a body that never runs, and its handle, so one mistake does not
/// cascade into errors at every call site or use of `pyop::op!(name)`.
fn fallback(item: &Item, krate: Option<&syn::Path>) -> TokenStream {
    let sig = &item.sig;
    if sig.receiver().is_some() {
        return TokenStream::new();
    }
    let attrs = &item.attrs;
    let vis = &item.vis;
    let ident = &sig.ident;
    let p = match krate {
        Some(k) => quote!(#k::__private),
        None => quote!(::pyop::__private),
    };
    let handle = handle_ident(ident);
    let cfgs = cfgs(item);
    let async_ident = format_ident!("{}_async", ident, span = ident.span());
    let inputs = &sig.inputs;
    let output = match &sig.output {
        syn::ReturnType::Default => quote!(()),
        syn::ReturnType::Type(_, ty) => quote!(#ty),
    };
    let krate = match krate {
        Some(k) => quote!(#k),
        None => quote!(::pyop),
    };
    quote! {
        #(#attrs)*
        #[allow(unused_variables, clippy::diverging_sub_expression)]
        #vis #sig {
            ::core::unreachable!("#[py_op] declaration has errors")
        }
        #(#cfgs)*
        #[allow(unused_variables, dead_code, unreachable_pub, clippy::too_many_arguments)]
        #vis fn #async_ident(#inputs) -> #krate::OpFuture<#output> {
            ::core::unreachable!("#[py_op] declaration has errors")
        }
        #(#cfgs)*
        #[doc(hidden)]
        #[allow(dead_code, unreachable_pub, non_snake_case)]
        #vis fn #handle() -> &'static #p::StaticOp {
            ::core::unreachable!("#[py_op] declaration has errors")
        }
    }
}

fn expand(opts: &Options, f: &Function<'_>) -> TokenStream {
    let item = f.item;
    let krate = opts.krate.as_ref().map(|a| {
        let p = &a.value;
        quote!(#p)
    });
    let krate = krate.unwrap_or_else(|| quote!(::pyop));
    let p = quote!(#krate::__private);
    let source = match source_tokens(&p, opts) {
        Ok(tokens) => tokens,
        // A package folder that cannot be read: the error, and the function still declared.
        Err(e) => {
            let err = e.to_compile_error();
            let fallback = fallback(item, opts.krate.as_ref().map(|k| &k.value));
            return quote!(#err #fallback);
        }
    };
    let attrs = &item.attrs;
    let vis = &item.vis;
    let sig = &item.sig;
    let ident = &sig.ident;
    let name = ident.to_string();
    let function = opts
        .name
        .as_ref()
        .map(|a| a.value.value())
        .unwrap_or_else(|| name.clone());
    let mode = if opts.numpy.is_some() {
        quote!(#p::Mode::Numpy)
    } else {
        quote!(#p::Mode::Tensor)
    };
    let tout = tout_tokens(&p, opts, f);
    let n_out = tout.len();
    let grad = grad_tokens(&p, opts);
    let timeout = match &opts.timeout_ms {
        None => quote!(::core::option::Option::None),
        Some(a) => {
            let ms = &a.value;
            quote!(::core::option::Option::Some(#ms))
        }
    };
    let workers = match &opts.workers {
        None => quote!(0),
        Some(a) => {
            let n = &a.value;
            quote!(#n)
        }
    };
    let dlpack = opts.dlpack.is_some();
    let pool = match &opts.pool {
        None => quote!(::core::option::Option::None),
        Some(a) => {
            let name = &a.value;
            quote!(::core::option::Option::Some(#name))
        }
    };
    let batch = batch_tokens(&p, opts, f);
    let py_params: Vec<_> = f
        .params
        .iter()
        .filter(|x| x.kind != ParamKind::Device)
        .collect();
    let param_names = py_params.iter().map(|x| x.name.to_string());
    let args = py_params.iter().map(|x| {
        let n = &x.name;
        quote!(#p::Arg::from(#n))
    });
    let device = match f.params.iter().find(|x| x.kind == ParamKind::Device) {
        Some(d) => {
            let n = &d.name;
            quote!(::core::option::Option::Some(#n))
        }
        None => quote!(::core::option::Option::None),
    };
    let output = &f.output;
    let async_ident = format_ident!("{}_async", ident, span = ident.span());
    let async_doc = format!(
        "`{name}` as a future: awaiting it blocks no thread of the caller's runtime, and \
         dropping it cancels the call (see `PyOp::call_async`)."
    );
    let inputs = &sig.inputs;
    let async_args = args.clone();
    let line_span = ident.span();
    let line = quote_spanned!(line_span=> ::core::line!());
    let handle = handle_ident(ident);
    let cfgs = cfgs(item);
    quote! {
        #(#attrs)*
        #vis #sig {
            static __PYOP_TOUT: [#p::OutSpec; #n_out] = [#(#tout),*];
            static __PYOP_DECL: #p::OpDecl = #p::OpDecl::__new(#p::OpDeclParts {
                name: #name,
                module_path: ::core::module_path!(),
                file: ::core::file!(),
                line: #line,
                source: #source,
                function: #function,
                mode: #mode,
                tout: &__PYOP_TOUT,
                grad: #grad,
                params: &[#(#param_names),*],
                timeout_ms: #timeout,
                workers: #workers,
                pool: #pool,
                dlpack: #dlpack,
                batch: #batch,
            });
            static __PYOP_OP: #p::StaticOp = #p::StaticOp::__new(&__PYOP_DECL);
            #p::inventory::submit! { #p::Registration(&__PYOP_OP) }
            #p::inventory::submit! {
                #p::BuildEnv {
                    manifest_dir: ::core::env!("CARGO_MANIFEST_DIR"),
                    pyop_python_env: ::core::option_env!("PYOP_PYTHON_ENV"),
                    virtual_env: ::core::option_env!("VIRTUAL_ENV"),
                }
            }
            let __pyop_outputs = __PYOP_OP.__call(&[#(#args),*], #device)?;
            ::core::result::Result::Ok(#p::FromOutputs::from_outputs(__pyop_outputs))
        }
        #(#cfgs)*
        #[doc = #async_doc]
        // As many parameters as the declaration, whose own lints its author has seen to.
        #[allow(dead_code, unreachable_pub, clippy::too_many_arguments)]
        #vis fn #async_ident(#inputs) -> #krate::OpFuture<#output> {
            // The op the sync function declared, found as its handle finds it (the handle is not
            // callable by name from here when both are associated functions).
            static __PYOP_FOUND: ::std::sync::OnceLock<&'static #p::StaticOp> =
                ::std::sync::OnceLock::new();
            let __pyop_op = __PYOP_FOUND.get_or_init(|| {
                #p::declared_at(::core::module_path!(), ::core::file!(), #line, #name)
            });
            #krate::OpFuture::__new(__pyop_op.__call_async(&[#(#async_args),*], #device))
        }
        // The op's handle, which `pyop::op!(name)` calls: a sibling of the function (an
        // associated function beside it in an `impl`), finding the registry entry the function
        // submitted by where it is declared. No module or type of the function's name, so
        // nothing of the user's (or a crate of that name) is shadowed.
        #(#cfgs)*
        #[doc(hidden)]
        #[allow(dead_code, unreachable_pub, non_snake_case)]
        #vis fn #handle() -> &'static #p::StaticOp {
            static __PYOP_FOUND: ::std::sync::OnceLock<&'static #p::StaticOp> =
                ::std::sync::OnceLock::new();
            __PYOP_FOUND.get_or_init(|| {
                #p::declared_at(::core::module_path!(), ::core::file!(), #line, #name)
            })
        }
    }
}

/// The name of the function that returns the op of the `#[py_op]` function `ident`, its
/// handle: `pyop::op!(path::to::name)` is `path::to::__pyop_op_name()`.
pub fn handle_ident(ident: &syn::Ident) -> syn::Ident {
    format_ident!("__pyop_op_{}", ident, span = ident.span())
}

/// The function's `#[cfg]`s, which its generated items share.
fn cfgs(item: &Item) -> Vec<&syn::Attribute> {
    item.attrs
        .iter()
        .filter(|a| a.path().is_ident("cfg"))
        .collect()
}

/// The `SourceDecl` of the declaration's source.
fn source_tokens(p: &TokenStream, opts: &Options) -> syn::Result<TokenStream> {
    Ok(if let Some(file) = &opts.file {
        let lit = &file.value;
        let path = lit.value();
        let joined = quote_spanned!(lit.span()=> ::core::concat!(::core::env!("CARGO_MANIFEST_DIR"), "/", #lit));
        let include = quote_spanned!(lit.span()=> ::core::include_str!(#joined));
        quote!(#p::SourceDecl::File { path: #path, abs: #joined, text: #include })
    } else if let Some(package) = &opts.package {
        package_source(
            p,
            &package.value,
            opts.module.as_ref().map(|m| m.value.value()),
        )?
    } else if let Some(code) = &opts.code {
        match &code.value {
            Code::Lit(lit) => {
                let line = quote_spanned!(lit.span()=> ::core::line!());
                // Python's line n is the `.rs` file's line `line + n - 1` unless escapes (`\n`,
                // a `\` at a line's end) make the literal's text span other lines than its
                // value.
                let lines_match = lit.value().matches('\n').count()
                    == lit.token().to_string().matches('\n').count();
                quote!(#p::SourceDecl::Code { text: #lit, line: #line, lines_match: #lines_match })
            }
            // A constant or `include_str!`: Python's line numbers are the text's own.
            Code::Expr(e) => {
                let line = quote_spanned!(code.key.ident.span()=> ::core::line!());
                quote!(#p::SourceDecl::Code { text: #e, line: #line, lines_match: false })
            }
        }
    } else {
        let lit = &opts.module.as_ref().expect("validated: one source").value;
        quote!(#p::SourceDecl::Module(#lit))
    })
}

/// One `OutSpec` per declared output.
fn tout_tokens(p: &TokenStream, opts: &Options, f: &Function<'_>) -> Vec<TokenStream> {
    opts.tout
        .as_ref()
        .expect("validated")
        .value
        .outputs
        .iter()
        .map(|o| {
            let v = format_ident!("{}", o.variant, span = o.dtype.span());
            // A parameter's index among those passed to Python (validated: a `&Tensor`).
            let index = |name: &proc_macro2::Ident| {
                f.params
                    .iter()
                    .filter(|x| x.kind != ParamKind::Device)
                    .position(|x| x.name == *name)
                    .unwrap_or(0)
            };
            let dims = o.shape.as_ref().map(|dims| {
                let dims = dims.iter().map(|d| match d {
                    Some(n) => quote!(::core::option::Option::Some(#n)),
                    None => quote!(::core::option::Option::None),
                });
                quote!(&[#(#dims),*])
            });
            if let Some(x) = &o.dtype_of {
                let i = index(x);
                let like = match &o.like {
                    Some(l) => {
                        let l = index(l);
                        quote!(::core::option::Option::Some(#l))
                    }
                    None => quote!(::core::option::Option::None),
                };
                let shape = match dims {
                    Some(d) => quote!(::core::option::Option::Some(#d)),
                    None => quote!(::core::option::Option::None),
                };
                return quote!(#p::OutSpec::__dtype_of(#i, #like, #shape));
            }
            match (&o.like, dims) {
                (Some(like), _) => {
                    let i = index(like);
                    quote!(#p::OutSpec::like(#p::DType::#v, #i))
                }
                (None, None) => quote!(#p::OutSpec::new(#p::DType::#v)),
                (None, Some(d)) => quote!(#p::OutSpec::with_shape(#p::DType::#v, #d)),
            }
        })
        .collect()
}

/// The `Batch`, if the op batches: `inputs` as indices among the parameters passed to Python.
fn batch_tokens(p: &TokenStream, opts: &Options, f: &Function<'_>) -> TokenStream {
    let Some(batch) = opts.batch.as_ref().map(|a| &a.value) else {
        return quote!(::core::option::Option::None);
    };
    // Validated: a positive `usize`, a `u64`, and `&Tensor` parameters. The numbers are written
    // unsuffixed, whatever suffix the attribute gave them.
    let max = batch.max.as_ref().expect("validated: `max` given");
    let max = max
        .value
        .base10_parse::<usize>()
        .expect("validated: a `usize`");
    let max = proc_macro2::Literal::usize_unsuffixed(max);
    let wait_us = batch.wait_us.as_ref().map_or(0, |w| {
        w.value.base10_parse::<u64>().expect("validated: a `u64`")
    });
    let wait_us = proc_macro2::Literal::u64_unsuffixed(wait_us);
    let inputs = match &batch.inputs {
        None => quote!(::core::option::Option::None),
        Some(inputs) => {
            let indices = inputs.value.iter().map(|x| {
                let i = f
                    .params
                    .iter()
                    .filter(|q| q.kind != ParamKind::Device)
                    .position(|q| q.name == *x)
                    .expect("validated: a parameter");
                proc_macro2::Literal::usize_unsuffixed(i)
            });
            quote!(::core::option::Option::Some(&[#(#indices),*]))
        }
    };
    quote!(::core::option::Option::Some(#p::Batch::__declared(#max, #wait_us, #inputs)))
}

/// The `GradDecl`, if a gradient is declared.
fn grad_tokens(p: &TokenStream, opts: &Options) -> TokenStream {
    match opts.grad.as_ref().map(|a| &a.value) {
        None => quote!(::core::option::Option::None),
        Some(Grad::Python(s)) => quote!(::core::option::Option::Some(#p::GradDecl::Python(#s))),
        Some(Grad::Rust(path)) => {
            let text = quote!(#path).to_string().replace(' ', "");
            quote!(::core::option::Option::Some(#p::GradDecl::Rust(#path, #text)))
        }
    }
}

/// `SourceDecl::Package` with every `.py` file of the folder embedded (`include_str!`, so editing
/// one rebuilds; a file added later needs a rebuild to be seen).
fn package_source(
    p: &TokenStream,
    lit: &syn::LitStr,
    module: Option<String>,
) -> syn::Result<TokenStream> {
    let rel = lit.value();
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    let root = std::path::Path::new(&manifest).join(&rel);
    let mut files = Vec::new();
    crate::package::collect_py(&root, "", &mut files).map_err(|e| {
        syn::Error::new(
            lit.span(),
            match e.kind() {
                std::io::ErrorKind::NotFound => format!(
                    "no package folder `{rel}` (a `package` path is relative to the crate's \
                     Cargo.toml)"
                ),
                _ => format!("cannot read the package folder `{rel}`: {e}"),
            },
        )
    })?;
    if files.is_empty() {
        return Err(syn::Error::new(
            lit.span(),
            format!("the package folder `{rel}` has no .py files"),
        ));
    }
    files.sort();
    let name = crate::package::package_name(&rel);
    let module = module.unwrap_or_else(|| name.clone());
    let entries = files.iter().map(|f| {
        let include = quote_spanned!(lit.span()=> ::core::include_str!(::core::concat!(::core::env!("CARGO_MANIFEST_DIR"), "/", #rel, "/", #f)));
        quote!((#f, #include))
    });
    let abs =
        quote_spanned!(lit.span()=> ::core::concat!(::core::env!("CARGO_MANIFEST_DIR"), "/", #rel));
    Ok(
        quote!(#p::SourceDecl::Package { path: #rel, abs: #abs, name: #name, module: #module, files: &[#(#entries),*] }),
    )
}
