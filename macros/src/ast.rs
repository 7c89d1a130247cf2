//! The typed model of the declared function: its parameters and return type.

use proc_macro2::TokenStream;
use syn::parse::{Parse, ParseStream};
use syn::{
    Attribute, FnArg, GenericArgument, Ident, PathArguments, ReturnType, Signature, Token, Type,
    Visibility,
};

use crate::ctxt::Ctxt;

/// `#[attrs] vis fn name(params) -> Result<...>;` as written, before checking.
pub struct Item {
    pub attrs: Vec<Attribute>,
    pub vis: Visibility,
    pub sig: Signature,
    /// A body, which a declaration must not have.
    pub body: Option<syn::Block>,
}

impl Parse for Item {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let attrs = input.call(Attribute::parse_outer)?;
        let vis = input.parse()?;
        let sig = input.parse()?;
        let body = if input.peek(Token![;]) {
            input.parse::<Token![;]>()?;
            None
        } else {
            Some(input.parse()?)
        };
        Ok(Item {
            attrs,
            vis,
            sig,
            body,
        })
    }
}

/// What a parameter is, as Python will see it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ParamKind {
    Tensor,
    Tensors,
    F64,
    I64,
    Bool,
    Str,
    F64s,
    I64s,
    /// `usize`, `u32`, `i32`, `f32`: passed to Python as `int`/`float` without loss.
    Number,
    /// `&[usize]`: dims or sizes, a list of `int`; `&[f32]`: a list of `float`.
    NumberList,
    /// `&Device`: not passed to Python; names the outputs' device.
    Device,
}

pub struct Param {
    pub name: Ident,
    pub kind: ParamKind,
    /// `Option<…>`: may be `None` on a call.
    pub optional: bool,
}

/// What the function returns inside its `Result`.
pub enum Returns {
    Unit,
    One,
    Tuple(usize),
}

pub struct Function<'a> {
    pub item: &'a Item,
    pub params: Vec<Param>,
    pub returns: Option<Returns>,
    /// The `Result<...>` type's tokens, for spans.
    pub output: TokenStream,
}

const PARAM_TYPES: &str = "&Tensor, &[Tensor], f64, f32, i64, i32, u32, usize, bool, &str, \
     &[f64], &[f32], &[i64], &[usize], Option<...> of these, or &Device";
const RETURN_TYPES: &str = "`Result<Tensor>`, `Result<(Tensor, ...)>` or `Result<()>` \
     (`pyop::Result`, `candle_core::Result`, `anyhow::Result`, or any `Result<_, E>` where \
     `E: From<pyop::Error>`)";

impl<'a> Function<'a> {
    pub fn from_item(cx: &Ctxt, item: &'a Item) -> Function<'a> {
        let sig = &item.sig;
        if let Some(body) = &item.body {
            cx.error_spanned_by(
                body,
                "a #[py_op] function has no body (its body is Python): end the signature with `;`",
            );
        }
        if let Some(a) = &sig.asyncness {
            cx.error_spanned_by(
                a,
                "a #[py_op] function cannot be `async`: declare it without, and `#[py_op]` writes \
                 its `_async` sibling, a future",
            );
        }
        if let Some(c) = &sig.constness {
            cx.error_spanned_by(c, "a #[py_op] function cannot be `const`");
        }
        if let Some(u) = &sig.unsafety {
            cx.error_spanned_by(u, "a #[py_op] function cannot be `unsafe`");
        }
        if let Some(abi) = &sig.abi {
            cx.error_spanned_by(abi, "a #[py_op] function cannot have an ABI");
        }
        if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
            cx.error_spanned_by(
                &sig.generics,
                "a #[py_op] function cannot be generic: its parameters have fixed types",
            );
        }
        if let Some(v) = &sig.variadic {
            cx.error_spanned_by(v, "a #[py_op] function cannot be variadic");
        }
        let mut params = Vec::new();
        let mut devices = 0;
        for arg in &sig.inputs {
            match arg {
                FnArg::Receiver(r) => cx.error_spanned_by(
                    r,
                    "a #[py_op] function cannot take `self`: declare it as a free function",
                ),
                FnArg::Typed(pt) => {
                    let syn::Pat::Ident(pi) = &*pt.pat else {
                        cx.error_spanned_by(&pt.pat, "a #[py_op] parameter must be a plain name");
                        continue;
                    };
                    match classify(&pt.ty) {
                        Some((kind, optional)) => {
                            if kind == ParamKind::Device {
                                devices += 1;
                                if devices > 1 {
                                    cx.error_spanned_by(&pt.ty, "only one `&Device` parameter is allowed: it names the outputs' device");
                                }
                            }
                            params.push(Param {
                                name: pi.ident.clone(),
                                kind,
                                optional,
                            })
                        }
                        None => cx.error_spanned_by(
                            &pt.ty,
                            match hint(&pt.ty) {
                                Some(h) => format!("unsupported parameter type: {h}"),
                                None => {
                                    format!("unsupported parameter type; expected {PARAM_TYPES}")
                                }
                            },
                        ),
                    }
                }
            }
        }
        let (returns, output) = match &sig.output {
            ReturnType::Default => {
                cx.error_spanned_by(
                    &sig.ident,
                    format!("a #[py_op] function must return {RETURN_TYPES}"),
                );
                (None, TokenStream::new())
            }
            ReturnType::Type(_, ty) => {
                let r = returns(ty);
                if r.is_none() {
                    cx.error_spanned_by(
                        ty,
                        format!("unsupported return type; expected {RETURN_TYPES}"),
                    );
                }
                (r, quote::quote!(#ty))
            }
        };
        Function {
            item,
            params,
            returns,
            output,
        }
    }
}

fn last_segment(ty: &Type) -> Option<&syn::PathSegment> {
    match ty {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
        _ => None,
    }
}

fn is_named(ty: &Type, name: &str) -> bool {
    last_segment(ty).is_some_and(|s| s.ident == name && s.arguments.is_none())
}

fn generic_args(seg: &syn::PathSegment) -> Vec<&Type> {
    match &seg.arguments {
        PathArguments::AngleBracketed(a) => a
            .args
            .iter()
            .filter_map(|g| match g {
                GenericArgument::Type(t) => Some(t),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

fn classify(ty: &Type) -> Option<(ParamKind, bool)> {
    if let Some(seg) = last_segment(ty) {
        if seg.ident == "Option" {
            let args = generic_args(seg);
            let [inner] = args.as_slice() else {
                return None;
            };
            let (kind, optional) = classify(inner)?;
            return (!optional && kind != ParamKind::Device).then_some((kind, true));
        }
    }
    let kind = match ty {
        Type::Path(_) if is_named(ty, "f64") => ParamKind::F64,
        Type::Path(_) if is_named(ty, "i64") => ParamKind::I64,
        Type::Path(_) if is_named(ty, "bool") => ParamKind::Bool,
        Type::Path(_)
            if ["usize", "u32", "i32", "f32"]
                .iter()
                .any(|n| is_named(ty, n)) =>
        {
            ParamKind::Number
        }
        Type::Reference(r) if r.mutability.is_none() => match &*r.elem {
            t @ Type::Path(_) if is_named(t, "Tensor") => ParamKind::Tensor,
            t @ Type::Path(_) if is_named(t, "Device") => ParamKind::Device,
            t @ Type::Path(_) if is_named(t, "str") => ParamKind::Str,
            Type::Slice(s) if is_named(&s.elem, "Tensor") => ParamKind::Tensors,
            Type::Slice(s) if is_named(&s.elem, "f64") => ParamKind::F64s,
            Type::Slice(s) if is_named(&s.elem, "i64") => ParamKind::I64s,
            Type::Slice(s) if is_named(&s.elem, "usize") || is_named(&s.elem, "f32") => {
                ParamKind::NumberList
            }
            _ => return None,
        },
        _ => return None,
    };
    Some((kind, false))
}

/// The accepted slice for elements named `elem`, if there is one.
fn slice_for(elem: &str) -> Option<&'static str> {
    Some(match elem {
        "Tensor" => "&[Tensor]",
        "f64" => "&[f64]",
        "f32" => "&[f32]",
        "i64" | "i32" | "u32" | "i16" | "u16" | "i8" | "u8" => "&[i64]",
        "usize" | "u64" => "&[usize]",
        _ => return None,
    })
}

/// What to write instead of a type close to an accepted one.
fn hint(ty: &Type) -> Option<String> {
    let elem_name = |t: &Type| last_segment(t).map(|s| s.ident.to_string());
    let form = match ty {
        Type::Path(_) if is_named(ty, "Tensor") => {
            Some("`Tensor` by value; take `&Tensor` (a call only reads its inputs)".to_owned())
        }
        Type::Path(_) if is_named(ty, "String") => Some("`String`; take `&str`".to_owned()),
        Type::Reference(r) if r.mutability.is_some() && is_named(&r.elem, "Tensor") => Some(
            "`&mut Tensor`; take `&Tensor` and return the new value (a body cannot write to \
             its inputs)"
                .to_owned(),
        ),
        Type::Reference(r) if r.mutability.is_some() => {
            Some("a `&mut` reference; take a shared `&` one".to_owned())
        }
        Type::Reference(r) => match &*r.elem {
            Type::Slice(sl) => elem_name(&sl.elem)
                .and_then(|e| slice_for(&e).map(|f| format!("`&[{e}]`; take `{f}`"))),
            _ => None,
        },
        _ => last_segment(ty).filter(|s| s.ident == "Vec").map(|seg| {
            let inner = generic_args(seg).first().and_then(|t| elem_name(t));
            let inner = inner.unwrap_or_else(|| "T".to_owned());
            match slice_for(&inner) {
                Some(f) => format!("`Vec<{inner}>`; take a slice, `{f}`"),
                None => format!("`Vec<{inner}>`; take a slice of an accepted type"),
            }
        }),
    };
    form
}

fn returns(ty: &Type) -> Option<Returns> {
    let seg = last_segment(ty)?;
    if seg.ident != "Result" {
        return None;
    }
    let args = generic_args(seg);
    let ok = args.first()?;
    if args.len() > 2 {
        return None;
    }
    match ok {
        Type::Tuple(t) if t.elems.is_empty() => Some(Returns::Unit),
        Type::Tuple(t) if t.elems.iter().all(|e| is_named(e, "Tensor")) => {
            Some(Returns::Tuple(t.elems.len()))
        }
        t if is_named(t, "Tensor") => Some(Returns::One),
        _ => None,
    }
}

impl Returns {
    pub fn count(&self) -> usize {
        match self {
            Returns::Unit => 0,
            Returns::One => 1,
            Returns::Tuple(n) => *n,
        }
    }
}
