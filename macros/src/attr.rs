//! Parses the options of `#[py_op(...)]`.

use proc_macro2::{Delimiter, Group, Ident, TokenStream, TokenTree};
use quote::ToTokens;
use syn::{LitInt, LitStr};

use crate::ctxt::Ctxt;

/// The keys `#[py_op]` accepts (serde's `Symbol`, pyo3's `kw::`, as an enum).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyName {
    File,
    Code,
    Module,
    Package,
    Name,
    Numpy,
    Dlpack,
    Tout,
    Grad,
    TimeoutMs,
    Workers,
    Pool,
    Batch,
    Crate,
}

impl KeyName {
    pub const ALL: [KeyName; 14] = [
        KeyName::File,
        KeyName::Code,
        KeyName::Module,
        KeyName::Package,
        KeyName::Name,
        KeyName::Numpy,
        KeyName::Dlpack,
        KeyName::Tout,
        KeyName::Grad,
        KeyName::TimeoutMs,
        KeyName::Workers,
        KeyName::Pool,
        KeyName::Batch,
        KeyName::Crate,
    ];

    /// The keys that give a body its source.
    pub const SOURCES: [KeyName; 4] = [
        KeyName::File,
        KeyName::Code,
        KeyName::Module,
        KeyName::Package,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            KeyName::File => "file",
            KeyName::Code => "code",
            KeyName::Module => "module",
            KeyName::Package => "package",
            KeyName::Name => "name",
            KeyName::Numpy => "numpy",
            KeyName::Dlpack => "dlpack",
            KeyName::Tout => "tout",
            KeyName::Grad => "grad",
            KeyName::TimeoutMs => "timeout_ms",
            KeyName::Workers => "workers",
            KeyName::Pool => "pool",
            KeyName::Batch => "batch",
            KeyName::Crate => "crate",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// The key one or two edits away from `s`, if exactly one is.
    fn near(s: &str) -> Option<Self> {
        near_in(&Self::ALL, Self::as_str, s)
    }
}

/// The settings inside `batch(...)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchKeyName {
    Max,
    WaitUs,
    Inputs,
}

impl BatchKeyName {
    pub const ALL: [BatchKeyName; 3] = [
        BatchKeyName::Max,
        BatchKeyName::WaitUs,
        BatchKeyName::Inputs,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            BatchKeyName::Max => "max",
            BatchKeyName::WaitUs => "wait_us",
            BatchKeyName::Inputs => "inputs",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// The setting one or two edits away from `s`, if exactly one is; any `wait…` is `wait_us`
    /// (`wait`, `wait_ms`).
    fn near(s: &str) -> Option<Self> {
        near_in(&Self::ALL, Self::as_str, s)
            .or_else(|| s.starts_with("wait").then_some(BatchKeyName::WaitUs))
    }
}

/// The one key of `all` one or two edits away from `s`, if exactly one is.
fn near_in<K: Copy>(all: &[K], name: fn(K) -> &'static str, s: &str) -> Option<K> {
    let mut close = all
        .iter()
        .copied()
        .filter(|k| edit_distance(name(*k), s) <= 2);
    match (close.next(), close.next()) {
        (Some(k), None) => Some(k),
        _ => None,
    }
}

/// "`file`, `code`, …": the accepted keys, for messages.
fn keys() -> String {
    listed(&KeyName::ALL, KeyName::as_str)
}

/// "`max`, `wait_us`, `inputs`": the settings `batch(...)` accepts, for messages.
fn batch_keys() -> String {
    listed(&BatchKeyName::ALL, BatchKeyName::as_str)
}

fn listed<K: Copy>(all: &[K], name: fn(K) -> &'static str) -> String {
    all.iter()
        .map(|k| format!("`{}`", name(*k)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Levenshtein distance, for "did you mean".
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// The dtype probably meant by an unknown name: NumPy's and torch's names for candle's dtypes
/// (`float32`, `double`, `long`; `float` and `int` as NumPy means them, f64 and i64), or one edit
/// away from a dtype of the same kind (`f3` is `f32`; `u16` is none).
fn near_dtype(name: &str) -> Option<&'static str> {
    const ALIASES: &[(&str, &str)] = &[
        ("float32", "f32"),
        ("float", "f64"),
        ("float64", "f64"),
        ("double", "f64"),
        ("float16", "f16"),
        ("half", "f16"),
        ("bfloat16", "bf16"),
        ("int64", "i64"),
        ("long", "i64"),
        ("int32", "i32"),
        ("int", "i64"),
        ("int16", "i16"),
        ("short", "i16"),
        ("uint8", "u8"),
        ("uint32", "u32"),
        ("float8_e4m3fn", "f8e4m3"),
    ];
    let lower = name.to_ascii_lowercase();
    if let Some(&(_, d)) = ALIASES.iter().find(|(a, _)| *a == lower) {
        return Some(d);
    }
    // One edit away, and of the same kind (`u16` is no `f16`, `i8` no `u8`).
    DTYPES
        .iter()
        .map(|d| d.0)
        .filter(|d| d.as_bytes().first() == lower.as_bytes().first())
        .map(|d| (edit_distance(&lower, d), d))
        .min()
        .filter(|(distance, _)| *distance <= 1)
        .map(|(_, d)| d)
}

/// The dtypes `tout` accepts: the name written, candle's variant, whether NumPy has it, and
/// whether DLPack carries it.
pub const DTYPES: &[(&str, &str, bool, bool)] = &[
    ("u8", "U8", true, true),
    ("u32", "U32", true, true),
    ("i16", "I16", true, true),
    ("i32", "I32", true, true),
    ("i64", "I64", true, true),
    ("bf16", "BF16", false, true),
    ("f16", "F16", true, true),
    ("f32", "F32", true, true),
    ("f64", "F64", true, true),
    ("f8e4m3", "F8E4M3", false, false),
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
    pub code: Option<Attr<Code>>,
    pub module: Option<Attr<LitStr>>,
    pub package: Option<Attr<LitStr>>,
    pub name: Option<Attr<LitStr>>,
    pub numpy: Option<Key>,
    pub dlpack: Option<Key>,
    pub tout: Option<Attr<Tout>>,
    pub grad: Option<Attr<Grad>>,
    pub timeout_ms: Option<Attr<LitInt>>,
    pub workers: Option<Attr<LitInt>>,
    pub pool: Option<Attr<LitStr>>,
    pub batch: Option<Attr<BatchDecl>>,
    pub krate: Option<Attr<syn::Path>>,
    /// Every key written, valid value or not (and a misspelt one, with its likely meaning): a key
    /// whose value was wrong is not also "missing".
    pub written: Vec<KeyName>,
}

/// `batch(max = 64, wait_us = 200, inputs = [x])`: each setting as written, those given with a
/// valid value (a wrong or missing one is an error already).
pub struct BatchDecl {
    /// `batch(...)`, for errors about the whole.
    pub tokens: TokenStream,
    /// The most calls one body call serves (at least 1).
    pub max: Option<Attr<LitInt>>,
    /// How long a call alone waits for company, in microseconds (default 0).
    pub wait_us: Option<Attr<LitInt>>,
    /// The parameters stacked along axis 0 (default: every `&Tensor` one).
    pub inputs: Option<Attr<Vec<Ident>>>,
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
    pub dlpack_ok: bool,
    /// `None` = any shape; entries `None` = any size.
    pub shape: Option<Vec<Option<usize>>>,
    /// The shape's `[...]` as written, for spans.
    pub shape_group: Option<Group>,
    /// `f32[x]`: the shape of the tensor parameter `x`.
    pub like: Option<proc_macro2::Ident>,
    /// `x.dtype` (or `like(x)`): the dtype of the tensor parameter `x`, known at call time
    /// (`dtype`/`variant` are then a placeholder).
    pub dtype_of: Option<proc_macro2::Ident>,
}

/// `code = …`: a string literal, or an expression of type `&'static str` (a `const`, a
/// `static`, `include_str!(…)`, `concat!(…)`), whose text the macro knows only for a literal.
pub enum Code {
    Lit(LitStr),
    Expr(syn::Expr),
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

    /// One `key = value` (or a flag: `numpy`, `dlpack`; or `batch(...)`) of the attribute.
    fn entry(&mut self, cx: &Ctxt, entry: Vec<TokenTree>) {
        let Some((key, value)) = split_entry(cx, entry, &keys()) else {
            return;
        };
        let name = KeyName::parse(&key.ident.to_string());
        let value = match (name, value) {
            (None, _) => return self.unknown(cx, &key),
            (Some(KeyName::Batch), Value::List(group)) => {
                self.written.push(KeyName::Batch);
                let batch = parse_batch(cx, &key, &group);
                return set(cx, &mut self.batch, key, Some(batch));
            }
            (Some(KeyName::Batch), _) => {
                self.written.push(KeyName::Batch);
                return cx.error_spanned_by(
                    &key.ident,
                    "`batch` takes its settings in parentheses: `batch(max = 64, wait_us = 200)`",
                );
            }
            (Some(_), Value::List(group)) => {
                return cx.error_spanned_by(&group, format!("expected `=` after `{}`", key.ident));
            }
            (Some(_), Value::Flag) => None,
            (Some(_), Value::Eq(v)) => Some(v),
        };
        let flag = matches!(name, Some(KeyName::Numpy | KeyName::Dlpack));
        if !flag && value.as_ref().is_none_or(|v| v.is_empty()) {
            match name {
                Some(k) => cx.error_spanned_by(
                    &key.ident,
                    format!("`{}` needs a value: `{} = ...`", k.as_str(), k.as_str()),
                ),
                None => self.unknown(cx, &key),
            }
            return;
        }
        match name {
            Some(name) => {
                self.written.push(name);
                self.set_value(cx, name, key, value.unwrap_or_default());
            }
            None => self.unknown(cx, &key),
        }
    }

    /// An unknown key: the error says which keys there are, or which one was probably meant (and
    /// that one counts as written, so its absence is not a second error).
    fn unknown(&mut self, cx: &Ctxt, key: &Key) {
        let written = key.ident.to_string();
        match KeyName::near(&written) {
            Some(k) => {
                self.written.push(k);
                cx.error_spanned_by(
                    &key.ident,
                    format!("unknown key `{written}`; did you mean `{}`?", k.as_str()),
                );
            }
            None => cx.error_spanned_by(
                &key.ident,
                format!("unknown key `{written}`; expected one of {}", keys()),
            ),
        }
    }

    fn set_value(&mut self, cx: &Ctxt, name: KeyName, key: Key, value: TokenStream) {
        match name {
            KeyName::File => set(cx, &mut self.file, key, parse_lit_str(cx, value, "file")),
            KeyName::Code => set(cx, &mut self.code, key, parse_code(cx, value)),
            KeyName::Module => set(
                cx,
                &mut self.module,
                key,
                parse_lit_str(cx, value, "module"),
            ),
            KeyName::Package => set(
                cx,
                &mut self.package,
                key,
                parse_lit_str(cx, value, "package"),
            ),
            KeyName::Name => set(cx, &mut self.name, key, parse_lit_str(cx, value, "name")),
            KeyName::Numpy => set_flag(cx, &mut self.numpy, key, value, "numpy"),
            KeyName::Dlpack => set_flag(cx, &mut self.dlpack, key, value, "dlpack"),
            KeyName::Tout => set(cx, &mut self.tout, key, parse_tout(cx, value)),
            KeyName::Grad => set(cx, &mut self.grad, key, parse_grad(cx, value)),
            KeyName::TimeoutMs => set(cx, &mut self.timeout_ms, key, parse_timeout(cx, value)),
            KeyName::Workers => set(cx, &mut self.workers, key, parse_workers(cx, value)),
            KeyName::Pool => set(cx, &mut self.pool, key, parse_lit_str(cx, value, "pool")),
            KeyName::Batch => unreachable!("`batch(...)` is parsed by `entry`"),
            KeyName::Crate => set(cx, &mut self.krate, key, parse_crate(cx, value)),
        }
    }
}

/// A flag (a key without a value), given once.
fn set_flag(cx: &Ctxt, slot: &mut Option<Key>, key: Key, value: TokenStream, name: &str) {
    if !value.is_empty() {
        cx.error_spanned_by(
            &value,
            format!("`{name}` takes no value: write `{name}` alone"),
        );
    } else if slot.is_some() {
        cx.error_spanned_by(&key.ident, format!("`{name}` may only be specified once"));
    } else {
        *slot = Some(key);
    }
}

/// What follows a key.
enum Value {
    /// Nothing: a flag (`numpy`).
    Flag,
    /// `= value` (the value may be empty).
    Eq(TokenStream),
    /// `(...)` and nothing after it: settings (`batch(max = 64)`).
    List(Group),
}

/// `key`, `key = value`, `key(...)` or an error: the key as written and what follows it. `keys`
/// lists the keys accepted here, for the error on something that is not one.
fn split_entry(cx: &Ctxt, entry: Vec<TokenTree>, keys: &str) -> Option<(Key, Value)> {
    let mut it = entry.into_iter();
    let ident = match it.next() {
        Some(TokenTree::Ident(i)) => i,
        Some(other) => {
            cx.error_spanned_by(&other, format!("expected a key, one of {keys}"));
            return None;
        }
        None => return None,
    };
    let key = Key { ident };
    let rest: Vec<TokenTree> = it.collect();
    let value = match rest.as_slice() {
        [] => Value::Flag,
        [TokenTree::Punct(p), ..] if p.as_char() == '=' => {
            Value::Eq(rest[1..].iter().cloned().collect::<TokenStream>())
        }
        [TokenTree::Group(g)] if g.delimiter() == Delimiter::Parenthesis => Value::List(g.clone()),
        [other, ..] => {
            cx.error_spanned_by(other, format!("expected `=` after `{}`", key.ident));
            return None;
        }
    };
    Some((key, value))
}

/// The settings of `batch(...)`: every one checked and reported on its own token; `max` is
/// required.
fn parse_batch(cx: &Ctxt, key: &Key, group: &Group) -> BatchDecl {
    let mut batch = BatchDecl {
        tokens: quote::quote!(#key #group),
        max: None,
        wait_us: None,
        inputs: None,
    };
    let mut written = Vec::new();
    for entry in split_commas(group.stream()) {
        let Some((setting, value)) = split_entry(cx, entry, &batch_keys()) else {
            continue;
        };
        let typed = setting.ident.to_string();
        let Some(name) = BatchKeyName::parse(&typed) else {
            // A misspelt setting counts as written, so its absence is not a second error.
            match BatchKeyName::near(&typed) {
                Some(meant) => {
                    written.push(meant);
                    cx.error_spanned_by(
                        &setting.ident,
                        format!(
                            "unknown key `{typed}` in `batch(...)`; did you mean `{}`?",
                            meant.as_str()
                        ),
                    );
                }
                None => cx.error_spanned_by(
                    &setting.ident,
                    format!(
                        "unknown key `{typed}` in `batch(...)`; expected one of {}",
                        batch_keys()
                    ),
                ),
            }
            continue;
        };
        written.push(name);
        let value = match value {
            Value::Eq(v) if !v.is_empty() => v,
            Value::List(g) => {
                cx.error_spanned_by(&g, format!("expected `=` after `{typed}`"));
                continue;
            }
            Value::Flag | Value::Eq(_) => {
                cx.error_spanned_by(
                    &setting.ident,
                    format!("`{typed}` needs a value: `{typed} = ...`"),
                );
                continue;
            }
        };
        match name {
            BatchKeyName::Max => set(
                cx,
                &mut batch.max,
                setting,
                parse_positive::<usize>(
                    cx,
                    value,
                    "expected a positive number of calls, the most one body call serves: \
                     `max = 64`",
                ),
            ),
            BatchKeyName::WaitUs => set(cx, &mut batch.wait_us, setting, parse_wait(cx, value)),
            BatchKeyName::Inputs => set(cx, &mut batch.inputs, setting, parse_inputs(cx, value)),
        }
    }
    if !written.contains(&BatchKeyName::Max) {
        cx.error_spanned_by(
            &batch.tokens,
            "`batch` needs `max`, the most calls one body call serves: `batch(max = 64)`",
        );
    }
    batch
}

/// `wait_us = 200`: a whole number of microseconds, 0 included.
fn parse_wait(cx: &Ctxt, value: TokenStream) -> Option<LitInt> {
    let lit = syn::parse2::<LitInt>(value.clone())
        .ok()
        .filter(|l| l.base10_parse::<u64>().is_ok());
    if lit.is_none() {
        cx.error_spanned_by(
            &value,
            "expected a whole number of microseconds a call waits for others to batch with: \
             `wait_us = 200` (0: no waiting)",
        );
    }
    lit
}

/// `inputs = [x, y]`: the names of the parameters stacked, at least one, each once.
fn parse_inputs(cx: &Ctxt, value: TokenStream) -> Option<Vec<Ident>> {
    const FORM: &str = "expected the names of the `&Tensor` parameters stacked along axis 0, in \
         brackets: `inputs = [x]` or `inputs = [x, y]`";
    let trees: Vec<TokenTree> = value.clone().into_iter().collect();
    let [TokenTree::Group(g)] = trees.as_slice() else {
        cx.error_spanned_by(&value, FORM);
        return None;
    };
    if g.delimiter() != Delimiter::Bracket {
        cx.error_spanned_by(g, FORM);
        return None;
    }
    let mut names: Vec<Ident> = Vec::new();
    let mut ok = true;
    for entry in split_commas(g.stream()) {
        match entry.as_slice() {
            [TokenTree::Ident(x)] if x != "_" => {
                if names.contains(x) {
                    cx.error_spanned_by(x, format!("`{x}` is named twice in `inputs`"));
                    ok = false;
                } else {
                    names.push(x.clone());
                }
            }
            _ => {
                let ts: TokenStream = entry.iter().cloned().collect();
                cx.error_spanned_by(&ts, FORM);
                ok = false;
            }
        }
    }
    if ok && names.is_empty() {
        cx.error_spanned_by(
            g,
            "`inputs = []` stacks no argument: name the `&Tensor` parameters stacked along axis \
             0, or leave `inputs` out to stack every one",
        );
        return None;
    }
    ok.then_some(names)
}

fn parse_timeout(cx: &Ctxt, value: TokenStream) -> Option<LitInt> {
    parse_positive::<u64>(
        cx,
        value,
        "expected a positive number of milliseconds: `timeout_ms = 500`",
    )
}

fn parse_workers(cx: &Ctxt, value: TokenStream) -> Option<LitInt> {
    parse_positive::<u16>(
        cx,
        value,
        "expected a positive number of worker processes: `workers = 4`",
    )
}

/// A literal integer that fits `N` and is not 0, or `msg` on the value.
fn parse_positive<N>(cx: &Ctxt, value: TokenStream, msg: &str) -> Option<LitInt>
where
    N: std::str::FromStr + Default + PartialOrd,
    N::Err: std::fmt::Display,
{
    let lit = syn::parse2::<LitInt>(value.clone())
        .ok()
        .filter(|l| l.base10_parse::<N>().is_ok_and(|n| n > N::default()));
    if lit.is_none() {
        cx.error_spanned_by(&value, msg);
    }
    lit
}

fn parse_crate(cx: &Ctxt, value: TokenStream) -> Option<syn::Path> {
    parse_lit_str(cx, value, "crate").and_then(|s| match s.parse::<syn::Path>() {
        Ok(p) => Some(p),
        Err(_) => {
            cx.error_spanned_by(&s, "expected a path: `crate = \"my_crate::pyop\"`");
            None
        }
    })
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

fn parse_code(cx: &Ctxt, value: TokenStream) -> Option<Code> {
    if let Ok(s) = syn::parse2::<LitStr>(value.clone()) {
        return Some(Code::Lit(s));
    }
    match syn::parse2::<syn::Expr>(value.clone()) {
        Ok(e @ (syn::Expr::Path(_) | syn::Expr::Macro(_))) => Some(Code::Expr(e)),
        _ => {
            cx.error_spanned_by(
                &value,
                "expected `code = \"...\"`, a `&'static str` constant (`code = BODY`) or \
                 `code = include_str!(\"...\")`",
            );
            None
        }
    }
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

const TOUT_FORMS: &str = "a dtype like `f32`, a shaped one like `f32[_, 3]` or `f32[x]`, a \
     parameter's dtype like `x.dtype` or `x.dtype[_, 3]`, `like(x)`, a tuple like `(f32, i64)`, \
     or `()`";

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
    // `like(x)`: the dtype and shape of parameter `x`; it takes no shape of its own.
    if let [TokenTree::Ident(l), TokenTree::Group(g), extra, ..] = spec.as_slice() {
        if l == "like" && g.delimiter() == Delimiter::Parenthesis {
            cx.error_spanned_by(
                extra,
                format!(
                    "`like{g}` already takes {}'s shape; for its dtype with another shape write \
                     `{}.dtype[_, 3]`",
                    g.stream(),
                    g.stream()
                ),
            );
            return None;
        }
    }
    if let [TokenTree::Ident(l), TokenTree::Group(g)] = spec.as_slice() {
        if l == "like" && g.delimiter() == Delimiter::Parenthesis {
            let inner: Vec<TokenTree> = g.stream().into_iter().collect();
            let [TokenTree::Ident(x)] = inner.as_slice() else {
                cx.error_spanned_by(g, "`like(…)` takes one tensor parameter's name: `like(x)`");
                return None;
            };
            return Some(OutDecl {
                dtype: l.clone(),
                variant: "F32",
                numpy_ok: true,
                dlpack_ok: true,
                shape: None,
                shape_group: None,
                like: Some(x.clone()),
                dtype_of: Some(x.clone()),
            });
        }
    }
    let mut it = spec.iter().peekable();
    let Some(TokenTree::Ident(dtype)) = it.next() else {
        let ts: TokenStream = spec.iter().cloned().collect();
        cx.error_spanned_by(&ts, format!("malformed `tout`: expected {TOUT_FORMS}"));
        return None;
    };
    // `x.dtype`: the dtype of parameter `x`.
    let dtype_of = match it.peek() {
        Some(TokenTree::Punct(p)) if p.as_char() == '.' => {
            it.next();
            match it.next() {
                Some(TokenTree::Ident(d)) if d == "dtype" => Some(dtype.clone()),
                other => {
                    let at = other.map_or_else(|| quote::quote!(#dtype), |t| quote::quote!(#t));
                    cx.error_spanned_by(
                        at,
                        format!("malformed `tout`: after `{dtype}.` only `dtype` (the parameter's dtype) can follow"),
                    );
                    return None;
                }
            }
        }
        _ => None,
    };
    let (variant, numpy_ok, dlpack_ok) = if dtype_of.is_some() {
        ("F32", true, true) // placeholder: the dtype is the parameter's, checked at call time
    } else {
        let name = dtype.to_string();
        let Some(&(_, variant, numpy_ok, dlpack_ok)) = DTYPES.iter().find(|d| d.0 == name) else {
            let names: Vec<&str> = DTYPES.iter().map(|d| d.0).collect();
            let meant = match near_dtype(&name) {
                Some(d) => format!("did you mean `{d}`? "),
                None => String::new(),
            };
            cx.error_spanned_by(
                dtype,
                format!(
                    "unknown dtype `{name}`; {meant}expected one of {}, or `x.dtype` for a \
                     tensor parameter `x`'s",
                    names.join(", ")
                ),
            );
            return None;
        };
        (variant, numpy_ok, dlpack_ok)
    };
    let mut like = None;
    let mut shape_group = None;
    let shape = match it.next() {
        None => None,
        Some(TokenTree::Group(g)) if g.delimiter() == Delimiter::Bracket => {
            let inner: Vec<TokenTree> = g.stream().into_iter().collect();
            match inner.as_slice() {
                [TokenTree::Ident(i)] if i != "_" => {
                    like = Some(i.clone());
                    None
                }
                _ => {
                    shape_group = Some(g.clone());
                    Some(parse_shape(cx, g.stream())?)
                }
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
        dlpack_ok,
        shape,
        shape_group,
        like,
        dtype_of,
    })
}

fn parse_shape(cx: &Ctxt, ts: TokenStream) -> Option<Vec<Option<usize>>> {
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
    ok.then_some(dims)
}

impl ToTokens for Key {
    fn to_tokens(&self, tokens: &mut TokenStream) {
        self.ident.to_tokens(tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_keys() {
        assert_eq!(edit_distance("tuot", "tout"), 2);
        assert_eq!(KeyName::near("tuot"), Some(KeyName::Tout));
        assert_eq!(KeyName::near("nmae"), Some(KeyName::Name));
        assert_eq!(KeyName::near("timeout"), None);
        assert_eq!(KeyName::near("xyz"), None);
        assert_eq!(KeyName::near("bacth"), Some(KeyName::Batch));
        assert_eq!(BatchKeyName::near("maxx"), Some(BatchKeyName::Max));
        assert_eq!(BatchKeyName::near("wait"), Some(BatchKeyName::WaitUs));
        assert_eq!(BatchKeyName::near("wait_ms"), Some(BatchKeyName::WaitUs));
        assert_eq!(BatchKeyName::near("input"), Some(BatchKeyName::Inputs));
        assert_eq!(BatchKeyName::near("rows"), None);
        assert_eq!(batch_keys(), "`max`, `wait_us`, `inputs`");
    }
}

#[cfg(test)]
mod parse_tests {
    use super::*;
    use quote::quote;

    fn tout(ts: TokenStream) -> (Option<Tout>, Result<(), syn::Error>) {
        let cx = Ctxt::new();
        let t = parse_tout(&cx, ts);
        (t, cx.check())
    }

    #[test]
    fn shapes_and_tuples() {
        let (t, ok) = tout(quote!(f32[_, 3]));
        ok.unwrap();
        let out = &t.unwrap().outputs[0];
        assert_eq!(out.variant, "F32");
        assert_eq!(out.shape, Some(vec![None, Some(3)]));
        let (t, ok) = tout(quote!((f64, i64[], u8[x])));
        ok.unwrap();
        let t = t.unwrap();
        assert_eq!(t.outputs.len(), 3);
        assert_eq!(t.outputs[1].shape, Some(vec![]));
        assert_eq!(t.outputs[2].like.as_ref().unwrap().to_string(), "x");
        // A parameter's dtype, with any shape, a fixed one, or its shape too.
        let (t, ok) = tout(quote!((x.dtype, x.dtype[_, 3], x.dtype[y], like(x))));
        ok.unwrap();
        let t = t.unwrap();
        let name = |o: &Option<proc_macro2::Ident>| o.as_ref().map(|i| i.to_string());
        for o in &t.outputs {
            assert_eq!(name(&o.dtype_of).as_deref(), Some("x"));
        }
        assert_eq!(t.outputs[0].shape, None);
        assert_eq!(t.outputs[1].shape, Some(vec![None, Some(3)]));
        assert_eq!(name(&t.outputs[2].like).as_deref(), Some("y"));
        assert_eq!(name(&t.outputs[3].like).as_deref(), Some("x"));
        let (_, err) = tout(quote!(x.shape));
        assert!(err.unwrap_err().to_string().contains("only `dtype`"));
        let (t, ok) = tout(quote!(()));
        ok.unwrap();
        assert!(t.unwrap().outputs.is_empty());
    }

    fn options(ts: TokenStream) -> (Options, Result<(), syn::Error>) {
        let cx = Ctxt::new();
        let o = Options::parse(&cx, ts);
        (o, cx.check())
    }

    fn messages(ts: TokenStream) -> Vec<String> {
        let (_, err) = options(ts);
        err.unwrap_err()
            .into_iter()
            .map(|e| e.to_string())
            .collect()
    }

    #[test]
    fn batch_settings() {
        let (o, ok) = options(quote!(
            numpy,
            batch(max = 64, wait_us = 200, inputs = [x, y])
        ));
        ok.unwrap();
        let b = &o.batch.unwrap().value;
        let n = |l: &Option<Attr<LitInt>>| l.as_ref().unwrap().value.base10_parse::<u64>().unwrap();
        assert_eq!(n(&b.max), 64);
        assert_eq!(n(&b.wait_us), 200);
        let inputs: Vec<String> = b
            .inputs
            .as_ref()
            .unwrap()
            .value
            .iter()
            .map(|i| i.to_string())
            .collect();
        assert_eq!(inputs, ["x", "y"]);
        // `wait_us` and `inputs` are optional; `wait_us = 0` is no waiting.
        let (o, ok) = options(quote!(batch(max = 1)));
        ok.unwrap();
        let b = &o.batch.unwrap().value;
        assert!(b.wait_us.is_none() && b.inputs.is_none());
        options(quote!(batch(max = 8, wait_us = 0))).1.unwrap();
    }

    #[test]
    fn batch_mistakes() {
        assert_eq!(
            messages(quote!(batch(wait_us = 200))),
            ["`batch` needs `max`, the most calls one body call serves: `batch(max = 64)`"]
        );
        // A wrong `max` is not also a missing one; nor a misspelt one.
        assert_eq!(messages(quote!(batch(max = 0))).len(), 1);
        assert!(
            messages(quote!(batch(max = 0)))[0].starts_with("expected a positive number of calls")
        );
        assert_eq!(
            messages(quote!(batch(maxx = 4))),
            ["unknown key `maxx` in `batch(...)`; did you mean `max`?"]
        );
        assert_eq!(
            messages(quote!(batch(max = 4, rows = 2))),
            ["unknown key `rows` in `batch(...)`; expected one of `max`, `wait_us`, `inputs`"]
        );
        assert_eq!(
            messages(quote!(batch(max = 4, max = 8))),
            ["`max` may only be specified once"]
        );
        assert_eq!(
            messages(quote!(batch(max))),
            ["`max` needs a value: `max = ...`"]
        );
        assert!(messages(quote!(batch(max = 4, wait_us = -1)))[0]
            .starts_with("expected a whole number of microseconds"));
        assert!(messages(quote!(batch(max = 4, inputs = x)))[0].starts_with("expected the names"));
        assert!(
            messages(quote!(batch(max = 4, inputs = [x, 1])))[0].starts_with("expected the names")
        );
        assert_eq!(
            messages(quote!(batch(max = 4, inputs = [x, x]))),
            ["`x` is named twice in `inputs`"]
        );
        assert!(messages(quote!(batch(max = 4, inputs = [])))[0]
            .starts_with("`inputs = []` stacks no argument"));
        // The settings go in parentheses.
        for ts in [quote!(batch), quote!(batch = 64)] {
            assert_eq!(
                messages(ts),
                ["`batch` takes its settings in parentheses: `batch(max = 64, wait_us = 200)`"]
            );
        }
        // Another key with parentheses, and a misspelt `batch`.
        assert_eq!(messages(quote!(tout(f32))), ["expected `=` after `tout`"]);
        assert_eq!(
            messages(quote!(bacth(max = 4))),
            ["unknown key `bacth`; did you mean `batch`?"]
        );
    }

    #[test]
    fn mistakes() {
        let (_, err) = tout(quote!(float32));
        assert!(err
            .unwrap_err()
            .to_string()
            .starts_with("unknown dtype `float32`; did you mean `f32`? expected one of u8"));
        for (written, meant) in [("double", "f64"), ("long", "i64"), ("F64", "f64")] {
            assert_eq!(near_dtype(written), Some(meant), "{written}");
        }
        assert_eq!(near_dtype("f3"), Some("f32"));
        assert_eq!(near_dtype("i63"), Some("i64"));
        assert_eq!(near_dtype("complex64"), None);
        // Not across kinds; NumPy's `float` and `int`.
        assert_eq!(near_dtype("u16"), None);
        assert_eq!(near_dtype("u64"), None);
        assert_eq!(near_dtype("i8"), None);
        assert_eq!(near_dtype("float"), Some("f64"));
        assert_eq!(near_dtype("int"), Some("i64"));
        assert_eq!(near_dtype("x"), None);
        let (_, err) = tout(quote!(f32[2.5]));
        assert!(err.unwrap_err().to_string().starts_with("malformed shape"));
        let (_, err) = tout(quote!(bf16));
        err.unwrap(); // valid for tensor mode; numpy mode rejects it in `valid`
    }
}
