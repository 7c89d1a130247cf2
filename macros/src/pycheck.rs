//! Bodies checked at build time, by the interpreter pyo3 builds against (`build.rs` records it):
//! the source compiles (a `SyntaxError` is a compile error naming the file and line, the `.rs`
//! line for inline code, with the source line), and the body and gradient functions exist as
//! top-level `def`s that accept the arguments pyop passes. Nothing is run: the interpreter only
//! compiles and reads the syntax tree (`check.py`). What only running can tell — a name bound
//! by an import or a decorator, a `module` source — is left to `pyop::validate()`.
//!
//! One interpreter process serves every expansion of a rustc run (started on the first check,
//! ended when rustc exits and closes its stdin), so a crate of 50 ops pays one start-up.
//! `PYOP_BUILD_CHECKS=0` turns the checks off; so does the absence of an interpreter (e.g.
//! cross-compiling from a config file), and then `validate()` is the only check.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Mutex;

use proc_macro2::Span;

use crate::ast::{Function, ParamKind};
use crate::attr::{Code, Grad, Options};
use crate::ctxt::Ctxt;

const SCRIPT: &str = include_str!("python/check.py");

struct Checker {
    _child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

/// `None` inside: no interpreter, or it failed; checks are then skipped.
static CHECKER: Mutex<Option<Option<Checker>>> = Mutex::new(None);

enum Answer {
    Ok,
    /// The Python line (0: none) and the message.
    Error(usize, String),
    Defer,
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('\n', "\\n")
        .replace('\t', "\\t")
        .replace('\r', "\\r")
}

fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some('r') => out.push('\r'),
                Some(other) => out.push(other),
                None => out.push('\\'),
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn start() -> Option<Checker> {
    if std::env::var("PYOP_BUILD_CHECKS").is_ok_and(|v| v == "0") {
        return None;
    }
    let exe = env!("PYOP_CHECK_PYTHON");
    if exe.is_empty() {
        return None;
    }
    let mut child = Command::new(exe)
        .args(["-I", "-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let stdin = child.stdin.take()?;
    let stdout = BufReader::new(child.stdout.take()?);
    Some(Checker {
        _child: child,
        stdin,
        stdout,
    })
}

/// Asks the interpreter; `Defer` when there is none or it fails.
fn ask(filename: &str, source: &str, function: &str, names: &[String], role: &str) -> Answer {
    let mut guard = CHECKER.lock().unwrap_or_else(|e| e.into_inner());
    let slot = guard.get_or_insert_with(start);
    let Some(checker) = slot else {
        return Answer::Defer;
    };
    let request = [filename, source, function, &names.join(","), role]
        .map(escape)
        .join("\t");
    let mut line = String::new();
    let answered = writeln!(checker.stdin, "{request}")
        .and_then(|()| checker.stdin.flush())
        .and_then(|()| checker.stdout.read_line(&mut line));
    if !matches!(answered, Ok(n) if n > 0) {
        *slot = None; // the process is gone: stop asking
        return Answer::Defer;
    }
    let mut fields = line.trim_end_matches('\n').splitn(3, '\t');
    match (fields.next(), fields.next(), fields.next()) {
        (Some("ok"), _, _) => Answer::Ok,
        (Some("error"), Some(n), Some(msg)) => Answer::Error(n.parse().unwrap_or(0), unescape(msg)),
        _ => Answer::Defer,
    }
}

/// What the macro knows of a body's text.
struct Text {
    /// How messages name it: `ops/f.py`, or `the inline code`.
    name: String,
    text: String,
    /// For inline code whose lines are the `.rs` file's: the line where the literal starts.
    rs_line: Option<usize>,
    span: Span,
}

/// Checks the body's source, function and gradient; errors go to `cx`, on the source's token.
pub fn check(cx: &Ctxt, opts: &Options, f: &Function<'_>) {
    let Some(t) = body_text(opts) else {
        return;
    };
    let names: Vec<String> = f
        .params
        .iter()
        .filter(|p| p.kind != ParamKind::Device)
        .map(|p| p.name.to_string())
        .collect();
    let function = opts
        .name
        .as_ref()
        .map_or_else(|| f.item.sig.ident.to_string(), |n| n.value.value());
    let grad = match opts.grad.as_ref().map(|g| &g.value) {
        Some(Grad::Python(g)) => Some(g.value()),
        _ => None,
    };
    // The body's request compiles the whole file first; the gradient's finds it compiled.
    let mut asks = vec![(function.as_str(), "body")];
    if let Some(g) = &grad {
        asks.push((g.as_str(), "gradient"));
    }
    for (func, role) in asks {
        if let Answer::Error(line, msg) = ask(&t.name, &t.text, func, &names, role) {
            let msg = match t.rs_line {
                Some(start) if line > 0 => format!(
                    "{msg}\n(line {line} of the inline code is line {} of this file)",
                    start + line - 1
                ),
                _ => msg,
            };
            // A missing function is the `name` (or `grad`) key's mistake as much as the
            // source's: point at it when it was written.
            let span = match (role, msg.contains(" defines no ")) {
                ("body", true) => opts.name.as_ref().map(|n| n.value.span()),
                ("gradient", true) => opts.grad.as_ref().map(|g| g.key.ident.span()),
                _ => None,
            };
            cx.syn_error(syn::Error::new(span.unwrap_or(t.span), msg));
            return; // one error per body: the first one found
        }
    }
}

/// The text of the file that holds the body, for sources the macro can read. In a `package`
/// only that file is judged: another module may never be imported on this Python (`if
/// sys.version_info >= …`), so its syntax is the runtime's to judge when it is imported.
fn body_text(opts: &Options) -> Option<Text> {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    let manifest = std::path::Path::new(&manifest);
    let read = |path: &std::path::Path, name: String, span: Span| {
        let text = std::fs::read_to_string(path).ok()?;
        Some(Text {
            name,
            text,
            rs_line: None,
            span,
        })
    };
    if let Some(file) = &opts.file {
        let rel = file.value.value();
        return read(&manifest.join(&rel), rel, file.value.span());
    }
    if let Some(code) = &opts.code {
        return match &code.value {
            Code::Lit(lit) => {
                let text = lit.value();
                let lines_match =
                    text.matches('\n').count() == lit.token().to_string().matches('\n').count();
                let rs_line = lines_match.then(|| rs_line(lit.span())).flatten();
                Some(Text {
                    name: "the inline code".to_owned(),
                    text,
                    rs_line,
                    span: lit.span(),
                })
            }
            Code::Expr(e) => include_str_text(e),
        };
    }
    if let Some(package) = &opts.package {
        let rel = package.value.value();
        let root = manifest.join(&rel);
        let name = crate::package::package_name(&rel);
        let module = opts
            .module
            .as_ref()
            .map_or(name.clone(), |m| m.value.value());
        // `mylib/__init__.py` for `mylib`; for `mylib.sub`, as CPython's import (and pyop's
        // embedded importer) looks, `mylib/sub/__init__.py` before `mylib/sub.py`.
        let inner: Vec<&str> = module.split('.').skip(1).collect();
        let base = inner.iter().fold(root.clone(), |p, m| p.join(m));
        let body_file = if inner.is_empty() {
            root.join("__init__.py")
        } else if base.join("__init__.py").is_file() {
            base.join("__init__.py")
        } else {
            base.with_extension("py")
        };
        let shown = body_file.strip_prefix(manifest).unwrap_or(&body_file);
        return read(
            &body_file,
            shown.display().to_string(),
            package.value.span(),
        );
    }
    None // `module`: importing it could run anything; validate() checks it
}

/// `include_str!("path")`, read the way rustc will (relative to the file the macro is in), where
/// this rustc tells the macro that file.
fn include_str_text(e: &syn::Expr) -> Option<Text> {
    let syn::Expr::Macro(m) = e else {
        return None; // a constant: its text is not the macro's to see
    };
    if !m.mac.path.is_ident("include_str") {
        return None;
    }
    let lit: syn::LitStr = m.mac.parse_body().ok()?;
    let here = source_file()?;
    let path = here.parent()?.join(lit.value());
    Some(Text {
        name: lit.value(),
        text: std::fs::read_to_string(&path).ok()?,
        rs_line: None,
        span: lit.span(),
    })
}

#[cfg(pyop_span_locations)]
#[allow(clippy::incompatible_msrv)] // only compiled with Rust >= 1.88 (build.rs)
fn source_file() -> Option<std::path::PathBuf> {
    // (Outside a macro expansion, as in unit tests, there is no compiler to ask.)
    proc_macro::is_available()
        .then(|| proc_macro::Span::call_site().local_file())
        .flatten()
}

#[cfg(not(pyop_span_locations))]
fn source_file() -> Option<std::path::PathBuf> {
    None
}

/// The `.rs` line where `span` starts, where this rustc tells the macro.
#[cfg(pyop_span_locations)]
#[allow(clippy::incompatible_msrv)] // only compiled with Rust >= 1.88 (build.rs)
fn rs_line(span: Span) -> Option<usize> {
    proc_macro::is_available().then(|| span.unwrap().line())
}

#[cfg(not(pyop_span_locations))]
fn rs_line(_: Span) -> Option<usize> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ast::Item;
    use quote::quote;

    /// Runs the check on a declaration; the errors, joined.
    fn errors(args: proc_macro2::TokenStream, item: proc_macro2::TokenStream) -> String {
        let cx = Ctxt::new();
        let opts = Options::parse(&cx, args);
        let item: Item = syn::parse2(item).unwrap();
        let f = Function::from_item(&cx, &item);
        check(&cx, &opts, &f);
        cx.check().err().map_or(String::new(), |e| e.to_string())
    }

    /// A package: the body's module is compiled and its function looked up, in the file `module`
    /// names (a sub-package's `__init__.py` before a module of the same name).
    #[test]
    fn packages_are_checked_file_by_file() {
        let root = std::env::temp_dir().join(format!("pyop-pycheck-{}", std::process::id()));
        let pkg = root.join("mylib");
        std::fs::create_dir_all(pkg.join("sub")).unwrap();
        std::fs::write(pkg.join("__init__.py"), "def lib_fn(x):\n    return x\n").unwrap();
        std::fs::write(
            pkg.join("sub/__init__.py"),
            "def deep(x, k):\n    return x\n",
        )
        .unwrap();
        std::fs::write(pkg.join("helpers.py"), "def h(x):\n    return (x\n").unwrap();
        let path = pkg.display().to_string();
        let item = quote!(
            fn lib_fn(x: &Tensor) -> pyop::Result<Tensor>;
        );
        // Another module's syntax is the runtime's to judge (it may never be imported).
        assert_eq!(
            errors(quote!(package = #path, tout = f32), item.clone()),
            ""
        );
        std::fs::write(pkg.join("__init__.py"), "def lib_fn(x):\n    return (x\n").unwrap();
        let e = errors(quote!(package = #path, tout = f32), item.clone());
        assert!(
            e.contains("__init__.py, line 2: '(' was never closed"),
            "{e}"
        );
        std::fs::write(pkg.join("__init__.py"), "def lib_fn(x):\n    return x\n").unwrap();
        assert_eq!(errors(quote!(package = #path, tout = f32), item), "");
        // `module` picks the file the body is in: `mylib.sub` is `sub/__init__.py`.
        let e = errors(
            quote!(package = #path, module = "mylib.sub", name = "deep", tout = f32),
            quote!(
                fn deep(x: &Tensor) -> pyop::Result<Tensor>;
            ),
        );
        assert!(
            e.contains("the body `deep(x, k)` takes at least 2 positional arguments"),
            "{e}"
        );
        let e = errors(
            quote!(package = #path, module = "mylib.sub", tout = f32),
            quote!(
                fn lib_fn(x: &Tensor) -> pyop::Result<Tensor>;
            ),
        );
        assert!(
            e.contains("defines no function `lib_fn`; it defines `deep`"),
            "{e}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// `module` sources are never imported at build time, and a constant's text is not seen.
    #[test]
    fn what_needs_running_is_left_to_validate() {
        let item = quote!(
            fn f(x: &Tensor) -> pyop::Result<Tensor>;
        );
        assert_eq!(
            errors(quote!(module = "no_such_module", tout = f32), item.clone()),
            ""
        );
        assert_eq!(errors(quote!(code = BODY, tout = f32), item.clone()), "");
        // Bound by an import, or decorated: not a plain `def`, so not judged.
        assert_eq!(
            errors(
                quote!(code = "from m import g as f", tout = f32),
                item.clone()
            ),
            ""
        );
        assert_eq!(
            errors(
                quote!(code = "@wrap\ndef f():\n    pass", tout = f32),
                item.clone()
            ),
            ""
        );
        // What may rebind the name, anywhere in the module, and a module `__getattr__`.
        for code in [
            "def f(x, y):\n    pass\nexec('def f(x): pass')",
            "def f(x, y):\n    pass\nclass C:\n    globals()['f'] = len",
            "def f(x, y):\n    pass\ndef g():\n    global f\n    f = len",
            "import sys\ndef f(x, y):\n    pass\nsys.modules[__name__].f = len",
            "def __getattr__(name):\n    return len",
        ] {
            assert_eq!(
                errors(quote!(code = #code, tout = f32), item.clone()),
                "",
                "{code}"
            );
        }
        // A positional `out`, which pyop passes by keyword when it knows the output shapes.
        assert_eq!(
            errors(
                quote!(code = "def f(x, out):\n    pass", numpy, tout = f32[x]),
                item.clone()
            ),
            ""
        );
        // The same mistakes without those escapes are errors.
        let e = errors(quote!(code = "def f(x, y):\n    pass", tout = f32), item);
        assert!(e.contains("takes at least 2 positional arguments"), "{e}");
    }
}
