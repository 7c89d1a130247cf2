//! Parses the options of `#[py_op(...)]`.

use proc_macro2::{Delimiter, Ident, Span, TokenStream, TokenTree};
use quote::ToTokens;
use syn::{LitInt, LitStr};

use crate::ctxt::Ctxt;

/// The keys `#[py_op]` accepts.
const KEYS: &str =
    "`file`, `code`, `module`, `package`, `name`, `numpy`, `tout`, `grad`, `timeout_ms`, `crate`";

/// The dtypes `tout` accepts: the name written, candle's variant, and whether NumPy has it.
pub const DTYPES: &[(&str, &str, bool)] = &[
    ("u8", "U8", true),
    ("u32", "U32", true),
    ("i16", "I16", true),
    ("i32", "I32", true),
    ("i64", "I64", true),
    ("bf16", "BF16", false),
    ("f16", "F16", true),
    ("f32", "F32", true),
    ("f64", "F64", true),
    ("f8e4m3", "F8E4M3", false),
];

/// A key as written, for spans.
pub struct Key {
    pub ident: Ident,
}

pub struct Attr<T> {
    pub key: Key,
    pub value: T,
}

#[derive(Default)]
pub struct Options {
    pub file: Option<Attr<LitStr>>,
    pub code: Option<Attr<LitStr>>,
    pub module: Option<Attr<LitStr>>,
    pub package: Option<Attr<LitStr>>,
    pub name: Option<Attr<LitStr>>,
    pub numpy: Option<Key>,
    pub tout: Option<Attr<Tout>>,
    pub grad: Option<Attr<Grad>>,
    pub timeout_ms: Option<Attr<LitInt>>,
    pub krate: Option<Attr<syn::Path>>,
    /// Every key written, valid value or not: a key whose value was wrong is not also "missing".
    pub written: Vec<String>,
}

/// `tout`: one output, a tuple of them, or `()`.
pub struct Tout {
    pub tokens: TokenStream,
    pub outputs: Vec<OutDecl>,
}

pub struct OutDecl {
    /// The dtype's name as written.
    pub dtype: Ident,
    /// candle's `DType` variant.
    pub variant: &'static str,
    pub numpy_ok: bool,
    /// `None` = any shape; entries `None` = any size.
    pub shape: Option<Vec<Option<usize>>>,
    /// `f32[x]`: the shape of the tensor parameter `x`.
    pub like: Option<proc_macro2::Ident>,
}

pub enum Grad {
    Python(LitStr),
    Rust(syn::Path),
}

impl Options {
    pub fn parse(cx: &Ctxt, args: TokenStream) -> Options {
        let mut opts = Options::default();
        for entry in split_commas(args) {
            opts.entry(cx, entry);
        }
        opts
    }

    fn entry(&mut self, cx: &Ctxt, entry: Vec<TokenTree>) {
        let mut it = entry.into_iter();
        let ident = match it.next() {
            Some(TokenTree::Ident(i)) => i,
            Some(other) => {
                cx.error_spanned_by(&other, format!("expected a key, one of {KEYS}"));
                return;
            }
            None => return,
        };
        let key = Key { ident };
        let rest: Vec<TokenTree> = it.collect();
        let value = match rest.first() {
            None => None,
            Some(TokenTree::Punct(p)) if p.as_char() == '=' => {
                Some(rest[1..].iter().cloned().collect::<TokenStream>())
            }
            Some(other) => {
                cx.error_spanned_by(other, format!("expected `=` after `{}`", key.ident));
                return;
            }
        };
        let name = key.ident.to_string();
        self.written.push(name.clone());
        if name != "numpy" && value.as_ref().is_none_or(|v| v.is_empty()) {
            if KEYS.contains(&format!("`{name}`")) {
                cx.error_spanned_by(
                    &key.ident,
                    format!("`{name}` needs a value: `{name} = ...`"),
                );
            } else {
                cx.error_spanned_by(
                    &key.ident,
                    format!("unknown key `{name}`; expected one of {KEYS}"),
                );
            }
            return;
        }
        let value = value.unwrap_or_default();
        match name.as_str() {
            "file" => set(cx, &mut self.file, key, parse_lit_str(cx, value, "file")),
            "code" => set(cx, &mut self.code, key, parse_lit_str(cx, value, "code")),
            "module" => set(
                cx,
                &mut self.module,
                key,
                parse_lit_str(cx, value, "module"),
            ),
            "package" => set(
                cx,
                &mut self.package,
                key,
                parse_lit_str(cx, value, "package"),
            ),
            "name" => set(cx, &mut self.name, key, parse_lit_str(cx, value, "name")),
            "numpy" => {
                if !value.is_empty() {
                    cx.error_spanned_by(&value, "`numpy` takes no value: write `numpy` alone");
                } else if self.numpy.is_some() {
                    cx.error_spanned_by(&key.ident, "`numpy` may only be specified once");
                } else {
                    self.numpy = Some(key);
                }
            }
            "tout" => set(cx, &mut self.tout, key, parse_tout(cx, value)),
            "grad" => set(cx, &mut self.grad, key, parse_grad(cx, value)),
            "timeout_ms" => {
                let lit = syn::parse2::<LitInt>(value.clone())
                    .ok()
                    .filter(|l| l.base10_parse::<u64>().is_ok_and(|ms| ms > 0));
                if lit.is_none() {
                    cx.error_spanned_by(
                        &value,
                        "expected a positive number of milliseconds: `timeout_ms = 500`",
                    );
                }
                set(cx, &mut self.timeout_ms, key, lit)
            }
            "crate" => {
                let path =
                    parse_lit_str(cx, value, "crate").and_then(|s| match s.parse::<syn::Path>() {
                        Ok(p) => Some(p),
                        Err(_) => {
                            cx.error_spanned_by(
                                &s,
                                "expected a path: `crate = \"my_crate::pyop\"`",
                            );
                            None
                        }
                    });
                set(cx, &mut self.krate, key, path)
            }
            _ => cx.error_spanned_by(
                &key.ident,
                format!("unknown key `{name}`; expected one of {KEYS}"),
            ),
        }
    }
}

fn set<T>(cx: &Ctxt, slot: &mut Option<Attr<T>>, key: Key, value: Option<T>) {
    if slot.is_some() {
        cx.error_spanned_by(
            &key.ident,
            format!("`{}` may only be specified once", key.ident),
        );
        return;
    }
    if let Some(value) = value {
        *slot = Some(Attr { key, value });
    }
}

/// Splits a token stream at its top-level commas (commas inside groups stay).
fn split_commas(ts: TokenStream) -> Vec<Vec<TokenTree>> {
    let mut out = vec![Vec::new()];
    for tt in ts {
        match &tt {
            TokenTree::Punct(p) if p.as_char() == ',' => out.push(Vec::new()),
            _ => out.last_mut().expect("never empty").push(tt),
        }
    }
    out.retain(|e| !e.is_empty());
    out
}

fn parse_lit_str(cx: &Ctxt, value: TokenStream, key: &str) -> Option<LitStr> {
    match syn::parse2::<LitStr>(value.clone()) {
        Ok(s) => Some(s),
        Err(_) => {
            cx.error_spanned_by(
                &value,
                format!("expected a string literal: `{key} = \"...\"`"),
            );
            None
        }
    }
}

fn parse_grad(cx: &Ctxt, value: TokenStream) -> Option<Grad> {
    if let Ok(s) = syn::parse2::<LitStr>(value.clone()) {
        return Some(Grad::Python(s));
    }
    match syn::parse2::<syn::Path>(value.clone()) {
        Ok(p) => Some(Grad::Rust(p)),
        Err(_) => {
            cx.error_spanned_by(
                &value,
                "expected a Python function's name (`grad = \"my_grad\"`) or a Rust function's path (`grad = my_grad`)",
            );
            None
        }
    }
}

const TOUT_FORMS: &str =
    "a dtype like `f32`, a shaped one like `f32[_, 3]`, a tuple like `(f32, i64)`, or `()`";

fn parse_tout(cx: &Ctxt, value: TokenStream) -> Option<Tout> {
    let tokens = value.clone();
    let trees: Vec<TokenTree> = value.into_iter().collect();
    let specs: Vec<Vec<TokenTree>> = match trees.as_slice() {
        [TokenTree::Group(g)] if g.delimiter() == Delimiter::Parenthesis => {
            split_commas(g.stream())
        }
        _ => vec![trees],
    };
    let mut outputs = Vec::new();
    let mut ok = true;
    for spec in specs {
        match parse_out(cx, spec) {
            Some(o) => outputs.push(o),
            None => ok = false,
        }
    }
    ok.then_some(Tout { tokens, outputs })
}

fn parse_out(cx: &Ctxt, spec: Vec<TokenTree>) -> Option<OutDecl> {
    let mut it = spec.iter();
    let Some(TokenTree::Ident(dtype)) = it.next() else {
        let ts: TokenStream = spec.iter().cloned().collect();
        cx.error_spanned_by(&ts, format!("malformed `tout`: expected {TOUT_FORMS}"));
        return None;
    };
    let name = dtype.to_string();
    let Some(&(_, variant, numpy_ok)) = DTYPES.iter().find(|(n, _, _)| *n == name) else {
        let names: Vec<&str> = DTYPES.iter().map(|d| d.0).collect();
        cx.error_spanned_by(
            dtype,
            format!(
                "unknown dtype `{name}`; expected one of {}",
                names.join(", ")
            ),
        );
        return None;
    };
    let mut like = None;
    let shape = match it.next() {
        None => None,
        Some(TokenTree::Group(g)) if g.delimiter() == Delimiter::Bracket => {
            let inner: Vec<TokenTree> = g.stream().into_iter().collect();
            match inner.as_slice() {
                [TokenTree::Ident(i)] if i != "_" => {
                    like = Some(i.clone());
                    None
                }
                _ => Some(parse_shape(cx, g.stream(), g.span())?),
            }
        }
        Some(other) => {
            cx.error_spanned_by(other, format!("malformed `tout`: expected {TOUT_FORMS}"));
            return None;
        }
    };
    if let Some(extra) = it.next() {
        cx.error_spanned_by(
            extra,
            format!("malformed `tout`: unexpected token; expected {TOUT_FORMS}"),
        );
        return None;
    }
    Some(OutDecl {
        dtype: dtype.clone(),
        variant,
        numpy_ok,
        shape,
        like,
    })
}

fn parse_shape(cx: &Ctxt, ts: TokenStream, span: Span) -> Option<Vec<Option<usize>>> {
    let mut dims = Vec::new();
    let mut ok = true;
    for dim in split_commas(ts) {
        let d: TokenStream = dim.iter().cloned().collect();
        match dim.as_slice() {
            [TokenTree::Ident(i)] if i == "_" => dims.push(None),
            [TokenTree::Literal(_)] => match syn::parse2::<LitInt>(d.clone())
                .ok()
                .and_then(|l| l.base10_parse::<usize>().ok())
            {
                Some(n) => dims.push(Some(n)),
                None => {
                    cx.error_spanned_by(&d, "malformed shape: a size must be a whole number like `3`, or `_` for any size");
                    ok = false;
                }
            },
            _ => {
                cx.error_spanned_by(
                    &d,
                    "malformed shape: expected `_` (any size) or a size like `3`, e.g. `f32[_, 3]`",
                );
                ok = false;
            }
        }
    }
    let _ = span;
    ok.then_some(dims)
}

impl ToTokens for Key {
    fn to_tokens(&self, tokens: &mut TokenStream) {
        self.ident.to_tokens(tokens);
    }
}

/// The package's name: the last component of its folder.
pub fn package_name(path: &str) -> String {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or(path)
        .to_owned()
}
