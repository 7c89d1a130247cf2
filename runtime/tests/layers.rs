//! Keeps the runtime's layering as `src/lib.rs` states it: each file uses only its own layer and
//! those below, no two files use each other (directly or around a longer loop), and none reaches
//! a module through the crate root's re-exports (which would hide the edge). The macro crate's
//! files are held to the no-cycle rule. Reads the sources; no dependency needed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The layer of each top-level module; files at the root are layer 0.
const LAYERS: &[(&str, u8)] = &[
    ("error", 0),
    ("spec", 0),
    ("arg", 0),
    ("stats", 0),
    ("alloc", 0),
    ("python", 1),
    ("threads", 1),
    ("worker", 1),
    ("bridge", 2),
    ("body", 3),
    ("op", 4),
    ("registry", 5),
    ("tools", 5),
];

fn layer(module: &[String]) -> u8 {
    let top = module.first().map(String::as_str).unwrap_or("");
    LAYERS
        .iter()
        .find(|(name, _)| *name == top)
        .map(|(_, l)| *l)
        .unwrap_or_else(|| panic!("module `{top}` has no layer: add it to LAYERS and to lib.rs"))
}

/// Every `.rs` file under `src`, by module path (`bridge/tensor/mod.rs` is `bridge::tensor`).
fn modules(src: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(src, &mut files);
    files
        .into_iter()
        .map(|f| {
            let rel = f.strip_prefix(src).unwrap().with_extension("");
            let mut path: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(path.last().map(String::as_str), Some("mod" | "lib")) {
                path.pop();
            }
            (path, f)
        })
        .collect()
}

/// The code of a file without comments (doc links are not dependencies) and without its unit
/// tests (`#[cfg(test)] mod tests` closes each file; its `super::` is the file itself).
fn code(text: &str) -> String {
    let text = text.find("#[cfg(test)]\nmod ").map_or(text, |i| &text[..i]);
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) if !l[..i].contains('"') => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules a file declares (`mod x;`, any visibility): its children.
fn children(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l
                .strip_prefix("pub(crate) ")
                .or_else(|| l.strip_prefix("pub "))
                .unwrap_or(l);
            l.strip_prefix("mod ")?
                .strip_suffix(';')
                .map(|n| n.trim().to_owned())
        })
        .collect()
}

/// The paths a file names through `crate::` or `super::`, or through one of its own child modules
/// (`child::x`, `self::child::x`, `use child::{..}`), made absolute; `{a, b::c}` groups are
/// expanded. A parent's use of its child is an edge like any other: a parent and a child may not
/// use each other either.
fn named_paths(module: &[String], text: &str) -> Vec<Vec<String>> {
    let mut out = crate_paths(module, text);
    let bytes = text.as_bytes();
    for child in children(text) {
        let needle = format!("{child}::");
        let mut from = 0;
        while let Some(k) = text[from..].find(&needle) {
            let i = from + k;
            from = i + needle.len();
            // A path's first segment: not `a::child::` nor `a_child::`; `self::child::` is.
            let before = text[..i].trim_end_matches("self::");
            let prev = before.as_bytes().last().copied();
            let starts = i == 0
                || before.len() < i
                || !(prev.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':'));
            if !starts || (before.len() == i && i > 0 && bytes[i - 1] == b'$') {
                continue;
            }
            let (paths, _) = path_tree(text, from);
            for p in paths {
                let mut full = module.to_vec();
                full.push(child.clone());
                full.extend(p);
                out.push(full);
            }
        }
    }
    out
}

/// The paths a file names through `crate::` or `super::`, made absolute.
fn crate_paths(module: &[String], text: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < text.len() {
        if !text.is_char_boundary(i) {
            i += 1;
            continue;
        }
        let rest = &text[i..];
        // `$crate::` in a macro_rules body is the crate root of the macro's caller, not an edge.
        let at_word_start = i == 0
            || !(bytes[i - 1].is_ascii_alphanumeric()
                || bytes[i - 1] == b'_'
                || bytes[i - 1] == b'$');
        let (mut base, mut j) = if at_word_start && rest.starts_with("crate::") {
            (Vec::new(), i + 7)
        } else if at_word_start && rest.starts_with("super::") {
            // `super` of `a::b` (file a/b.rs or a/b/mod.rs) is `a`.
            let mut base = module.to_vec();
            base.pop();
            (base, i + 7)
        } else {
            i += 1;
            continue;
        };
        while text[j..].starts_with("super::") {
            base.pop();
            j += 7;
        }
        let (paths, end) = path_tree(text, j);
        for p in paths {
            let mut full = base.clone();
            full.extend(p);
            out.push(full);
        }
        i = end.max(i + 1);
    }
    out
}

/// Parses `a::b::{c, d::e}` starting at `start`; returns the paths and where parsing stopped.
fn path_tree(text: &str, start: usize) -> (Vec<Vec<String>>, usize) {
    let ident_end = |from: usize| {
        text[from..]
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .map_or(text.len(), |k| from + k)
    };
    let mut prefix = Vec::new();
    let mut i = start;
    loop {
        let t = text[i..].trim_start();
        i = text.len() - t.len();
        if t.starts_with('{') {
            let mut paths = Vec::new();
            i += 1;
            loop {
                let t = text[i..].trim_start();
                i = text.len() - t.len();
                if t.starts_with('}') {
                    i += 1;
                    break;
                }
                if t.starts_with(',') {
                    i += 1;
                    continue;
                }
                let (sub, end) = path_tree(text, i);
                for s in sub {
                    let mut p = prefix.clone();
                    p.extend(s);
                    paths.push(p);
                }
                if end == i {
                    // Not a path (`*`, `self as x`): skip a character.
                    i += t.chars().next().map_or(1, char::len_utf8);
                } else {
                    i = end;
                }
            }
            return (paths, i);
        }
        let end = ident_end(i);
        if end == i {
            return (vec![prefix], i);
        }
        prefix.push(text[i..end].to_owned());
        i = end;
        if text[i..].starts_with("::") {
            i += 2;
        } else {
            return (vec![prefix], i);
        }
    }
}

/// The module a path points into: its longest prefix that is a module.
fn target<'m>(
    modules: &'m BTreeMap<Vec<String>, PathBuf>,
    path: &[String],
) -> Option<&'m Vec<String>> {
    (0..=path.len())
        .rev()
        .find_map(|n| modules.get_key_value(&path[..n]).map(|(k, _)| k))
}

/// The file-level dependency graph of a crate's `src`, and the problems found building it.
type Graph = BTreeMap<Vec<String>, Vec<(Vec<String>, String)>>;

fn graph(src: &Path) -> (BTreeMap<Vec<String>, PathBuf>, Graph) {
    let modules = modules(src);
    let texts: BTreeMap<&Vec<String>, String> = modules
        .iter()
        .map(|(m, f)| (m, code(&std::fs::read_to_string(f).unwrap())))
        .collect();
    let g = graph_of(&texts);
    (modules, g)
}

/// The graph of files given by module path and code: the paths each names, and the methods it
/// calls that are defined in another file than their type (`spread_methods`).
fn graph_of(texts: &BTreeMap<&Vec<String>, String>) -> Graph {
    let modules: BTreeMap<Vec<String>, PathBuf> = texts
        .keys()
        .map(|m| ((*m).clone(), PathBuf::new()))
        .collect();
    let methods = spread_methods(texts);
    let mut g = Graph::new();
    for (module, text) in texts {
        if module.is_empty() {
            // The crate root declares and re-exports every module: not an edge of the layering.
            g.insert((*module).clone(), Vec::new());
            continue;
        }
        let mut edges = Vec::new();
        for path in named_paths(module, text) {
            if let Some(t) = target(&modules, &path) {
                if t != *module {
                    edges.push((t.clone(), path.join("::")));
                }
            }
        }
        for m in &methods {
            if m.file != **module && calls(text, &m.name) {
                edges.push((m.file.clone(), format!("{}::{} (a method)", m.ty, m.name)));
            }
        }
        g.insert((*module).clone(), edges);
    }
    g
}

/// A method of an inherent `impl` that is not in the file defining its type.
#[derive(Debug, PartialEq)]
struct Method {
    ty: String,
    name: String,
    file: Vec<String>,
}

/// The methods defined away from their type's definition (`impl OpInner { pub(crate) fn x }` in
/// another file than `struct OpInner`), visible to other files, whose names no other function
/// of the crate has. A call of one (`op.x(..)`, `OpInner::x(..)`) names no path, so without
/// these the graph would not see that the caller uses the method's file: a back-edge through a
/// method call would go unnoticed. A type defined in two files (one per platform: `Worker` in
/// `process.rs` and `unsupported.rs`) has no one home, and its methods are not followed.
fn spread_methods(texts: &BTreeMap<&Vec<String>, String>) -> Vec<Method> {
    // A type's file, or None where two files define a type by that name.
    let mut defined_in: BTreeMap<String, Option<Vec<String>>> = BTreeMap::new();
    let mut fn_count: BTreeMap<String, usize> = BTreeMap::new();
    let mut found = Vec::new();
    for (module, text) in texts {
        for ty in type_definitions(text) {
            let home = defined_in
                .entry(ty)
                .or_insert_with(|| Some((*module).clone()));
            if home.as_ref() != Some(*module) {
                *home = None;
            }
        }
        for name in words_after(text, "fn ") {
            *fn_count.entry(name).or_default() += 1;
        }
        for (ty, names) in inherent_impls(text) {
            for name in names {
                found.push(Method {
                    ty: ty.clone(),
                    name,
                    file: (*module).clone(),
                });
            }
        }
    }
    found
        .into_iter()
        .filter(|m| {
            defined_in
                .get(&m.ty)
                .is_some_and(|home| home.as_ref().is_some_and(|h| *h != m.file))
        })
        .filter(|m| fn_count.get(&m.name) == Some(&1))
        .collect()
}

/// The identifiers that follow `keyword` at a word's start (`fn name`, `struct Name`).
fn words_after(text: &str, keyword: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(k) = text[from..].find(keyword) {
        let i = from + k;
        from = i + keyword.len();
        let prev = text[..i].chars().next_back();
        if prev.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = text[from..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.push(name);
        }
    }
    out
}

/// The structs and enums a file defines.
fn type_definitions(text: &str) -> Vec<String> {
    let mut out = words_after(text, "struct ");
    out.extend(words_after(text, "enum "));
    out
}

/// Each inherent `impl` block of a file (`impl Type`, `impl<T> Type<T>`, not `impl Trait for
/// Type`): the type's name and the functions defined directly in the block.
fn inherent_impls(text: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(k) = text[from..].find("impl") {
        let i = from + k;
        from = i + 4;
        let at_line_start = text[..i].ends_with('\n') || i == 0;
        let Some(open) = text[i..].find('{').map(|o| i + o) else {
            break;
        };
        let header = &text[i + 4..open];
        // `#[pymethods]` blocks are Python's view of a class: called from Python, and named as
        // candle's own tensor methods (`max`, `detach`), which Rust code calls on tensors.
        let python_facing = text[..i].trim_end().ends_with("#[pymethods]");
        if !at_line_start || python_facing || header.contains(" for ") || header.contains(';') {
            continue;
        }
        // `impl<'a, T: X> path::Type<'a, T> where ..`: the last segment before generics.
        let header = header.split(" where").next().unwrap_or(header).trim();
        let header = match header.strip_prefix('<') {
            Some(rest) => skip_generics(rest),
            None => header,
        };
        let ty = header.split('<').next().unwrap_or("").trim();
        let ty = ty.rsplit("::").next().unwrap_or(ty).to_owned();
        let body = block(text, open);
        let fns = fn_names_at_depth_one(body);
        out.push((ty, fns));
        from = open + body.len();
    }
    out
}

/// The text after the generics that `rest` (just past a `<`) starts inside.
fn skip_generics(rest: &str) -> &str {
    let mut depth = 1;
    for (k, c) in rest.char_indices() {
        match c {
            '<' => depth += 1,
            // The `>` of `->` (`impl<F: Fn() -> u8> Foo<F>`) closes nothing.
            '>' if rest[..k].ends_with('-') => {}
            '>' => {
                depth -= 1;
                if depth == 0 {
                    return rest[k + 1..].trim_start();
                }
            }
            _ => {}
        }
    }
    ""
}

/// The block that opens at `open` (a `{`), braces inside string and char literals skipped.
fn block(text: &str, open: usize) -> &str {
    let b = text.as_bytes();
    let mut depth = 0usize;
    let mut i = open;
    while i < b.len() {
        match b[i] {
            b'"' => {
                // A raw string (`r"..."`, `r#"..."#`) has no escapes.
                let hashes = text[..i].bytes().rev().take_while(|&c| c == b'#').count();
                let raw = text[..i - hashes].ends_with('r');
                i += 1;
                while i < b.len() {
                    if !raw && b[i] == b'\\' {
                        i += 2;
                        continue;
                    }
                    if b[i] == b'"' && text[i + 1..].bytes().take(hashes).all(|c| c == b'#') {
                        i += hashes;
                        break;
                    }
                    i += 1;
                }
            }
            // A char literal ('{', '\'', '\\'); a lifetime ('a) has no closing quote.
            b'\'' if b.get(i + 2) == Some(&b'\'') => i += 2,
            b'\'' if b.get(i + 1) == Some(&b'\\') => {
                i += 2;
                while i < b.len() && b[i] != b'\'' {
                    i += 1;
                }
            }
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return &text[open..=i];
                }
            }
            _ => {}
        }
        i += 1;
    }
    &text[open..]
}

/// The names of the functions defined directly in a block (not in nested blocks).
fn fn_names_at_depth_one(body: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = &body[1..];
    loop {
        let next_brace = rest.find('{');
        let next_fn = words_after(rest, "fn ")
            .into_iter()
            .next()
            .and_then(|name| {
                let at = rest.find(&format!("fn {name}"))?;
                Some((at, name))
            });
        match (next_fn, next_brace) {
            (Some((at, name)), brace) if brace.is_none_or(|b| at < b) => {
                // Only a method other files can call (`pub`, `pub(crate)`, `pub(super)`): a
                // private one named as a foreign method (`backward`) would be a false edge.
                let head = rest[..at].rsplit(['}', ';', '{']).next().unwrap_or("");
                if head.contains("pub") {
                    out.push(name.clone());
                }
                rest = &rest[at + 3 + name.len()..];
            }
            (_, Some(b)) => {
                let inner = block(rest, b);
                rest = &rest[b + inner.len()..];
            }
            _ => return out,
        }
    }
}

/// Whether a file calls a method by this name: `.name(`, `.name::<`, `::name(`.
fn calls(text: &str, name: &str) -> bool {
    [".", "::"].iter().any(|sep| {
        [format!("{sep}{name}("), format!("{sep}{name}::<")]
            .iter()
            .any(|needle| text.contains(needle.as_str()))
    })
}

fn show(module: &[String], modules: &BTreeMap<Vec<String>, PathBuf>, root: &Path) -> String {
    modules[module]
        .strip_prefix(root)
        .unwrap()
        .display()
        .to_string()
}

/// Every cycle of files, as the files on it.
fn cycles(g: &Graph) -> Vec<Vec<Vec<String>>> {
    // Tarjan's strongly connected components.
    struct State<'g> {
        g: &'g Graph,
        index: BTreeMap<&'g Vec<String>, usize>,
        low: BTreeMap<&'g Vec<String>, usize>,
        stack: Vec<&'g Vec<String>>,
        on: BTreeMap<&'g Vec<String>, bool>,
        out: Vec<Vec<Vec<String>>>,
    }
    fn visit<'g>(s: &mut State<'g>, v: &'g Vec<String>) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on.insert(v, true);
        for (w, _) in &s.g[v] {
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on.get(w).copied().unwrap_or(false) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.insert(w, false);
                component.push(w.clone());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let mut s = State {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeMap::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

fn cycle_report(g: &Graph, modules: &BTreeMap<Vec<String>, PathBuf>, root: &Path) -> Vec<String> {
    cycles(g)
        .into_iter()
        .map(|c| {
            let files: Vec<String> = c.iter().map(|m| show(m, modules, root)).collect();
            let edges: Vec<String> = c
                .iter()
                .flat_map(|m| {
                    g[m].iter()
                        .filter(|(t, _)| c.contains(t))
                        .map(move |(_, via)| format!("{} uses {via}", show(m, modules, root)))
                })
                .collect();
            format!(
                "import cycle among {}: {}",
                files.join(", "),
                edges.join("; ")
            )
        })
        .collect()
}

#[test]
fn every_runtime_file_uses_only_its_layer_and_below() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (modules, g) = graph(&root);
    let mut problems = Vec::new();
    for (module, edges) in &g {
        if module.is_empty() {
            continue; // lib.rs declares and re-exports everything
        }
        for (t, via) in edges {
            if t.is_empty() {
                problems.push(format!(
                    "{} uses crate::{via} through the crate root: name the module it is defined in",
                    show(module, &modules, &root)
                ));
            } else if layer(t) > layer(module) {
                problems.push(format!(
                    "{} (layer {}) uses crate::{via} (layer {}): a layer above its own",
                    show(module, &modules, &root),
                    layer(module),
                    layer(t)
                ));
            }
        }
    }
    problems.extend(cycle_report(&g, &modules, &root));
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

/// One door into Python: the GIL is taken only in `python::attach`, which counts it
/// (`OpStats::gil_acquisitions`); any other `Python::attach` would go uncounted.
#[test]
fn the_gil_is_taken_in_one_place() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (modules, _) = graph(&root);
    let mut others = Vec::new();
    for (module, file) in &modules {
        let text = code(&std::fs::read_to_string(file).unwrap());
        let allowed = module.as_slice() == ["python".to_owned()];
        let n = text.matches("Python::attach").count() + text.matches("Python::try_attach").count();
        if n > 0 && !(allowed && n == 1) {
            others.push(show(module, &modules, &root));
        }
    }
    assert!(
        others.is_empty(),
        "Python::attach outside python::attach: {others:?}"
    );
}

#[test]
fn the_macro_crate_has_no_import_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("macros")
        .join("src");
    let (modules, g) = graph(&root);
    assert!(g.len() >= 5, "read the macro crate: {:?}", g.keys());
    let problems = cycle_report(&g, &modules, &root);
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn the_checker_sees_groups_super_and_cycles() {
    let module = vec!["bridge".to_owned(), "out".to_owned()];
    let text = "use super::{numbers::describe_value, view::numpy_array};\nuse crate::error::{Error, Result};\n// crate::op::PyOp in a comment\nlet x = crate::python::errors::python_error(py, e);";
    let paths: Vec<String> = named_paths(&module, &code(text))
        .iter()
        .map(|p| p.join("::"))
        .collect();
    assert_eq!(
        paths,
        [
            "bridge::numbers::describe_value",
            "bridge::view::numpy_array",
            "error::Error",
            "error::Result",
            "python::errors::python_error"
        ]
    );
    // A parent naming its child, directly or in a `use`; `std::child::` is not the child.
    let parent = vec!["worker".to_owned()];
    let text = "pub(crate) mod process;\nmod wire;\nuse process::Worker;\nuse self::wire::{send, recv};\nlet c = std::process::Command::new(x);\nlet d = my_process::y;";
    let paths: Vec<String> = named_paths(&parent, &code(text))
        .iter()
        .map(|p| p.join("::"))
        .collect();
    assert_eq!(
        paths,
        [
            "worker::process::Worker",
            "worker::wire::send",
            "worker::wire::recv"
        ]
    );
    let a = vec!["a".to_owned()];
    let b = vec!["b".to_owned()];
    let c = vec!["c".to_owned()];
    let mut g = Graph::new();
    g.insert(a.clone(), vec![(b.clone(), "b::x".into())]);
    g.insert(b.clone(), vec![(c.clone(), "c::y".into())]);
    g.insert(c.clone(), vec![(a.clone(), "a::z".into())]);
    assert_eq!(cycles(&g), [vec![a.clone(), b.clone(), c]]);
    g.insert(b, vec![]);
    assert!(cycles(&g).is_empty());
}

#[test]
fn the_checker_sees_calls_of_methods_defined_away_from_their_type() {
    let m = |s: &str| s.split("::").map(str::to_owned).collect::<Vec<_>>();
    let files = [
        ("op", "pub(crate) struct Inner { n: u8 }\nimpl Inner {\n    fn here(&self) {}\n}\n"),
        (
            "op::run",
            "use super::Inner;\nimpl Inner {\n    pub(crate) fn far_away(&self, x: &str) -> String {\n        format!(\"{x}{{\")\n    }\n    pub fn new_len(&self) {}\n    fn private_one(&self) {}\n}\nimpl<F: Fn() -> u8> Inner<F> {\n    pub fn through_generics(&self) {}\n}\nimpl std::fmt::Debug for Inner {\n    fn fmt(&self) {}\n}\n#[pymethods]\nimpl Inner {\n    fn from_python(&self) {}\n}\n",
        ),
        ("op::call", "fn go(op: &Inner) { op.far_away(\"a\"); op.here(); op.from_python(); }\nfn new_len() {}\n"),
        ("op::other", "fn f(v: Vec<u8>) { v.new_len(); }\n"),
    ];
    let texts: BTreeMap<Vec<String>, String> = files.iter().map(|(k, v)| (m(k), code(v))).collect();
    let texts: BTreeMap<&Vec<String>, String> = texts.iter().map(|(k, v)| (k, v.clone())).collect();
    // `far_away` and `through_generics` only: `here` is in the type's own file, `new_len` is not
    // a unique name, `private_one` is private to its file, `fmt` belongs to a trait, and
    // `from_python` to Python's view of the class.
    assert_eq!(
        spread_methods(&texts),
        [
            Method {
                ty: "Inner".into(),
                name: "far_away".into(),
                file: m("op::run"),
            },
            Method {
                ty: "Inner".into(),
                name: "through_generics".into(),
                file: m("op::run"),
            }
        ]
    );
    // The method's file uses the caller's (a path), the caller calls the method: a cycle.
    let mut texts = texts;
    let run = m("op::run");
    let text = format!("use super::call::go;\n{}", texts[&run]);
    texts.insert(&run, code(&text));
    let g = graph_of(&texts);
    assert_eq!(cycles(&g), [vec![m("op::call"), m("op::run")]]);
    assert!(calls("op.far_away(\"a\")", "far_away"));
    assert!(calls("Inner::far_away(op)", "far_away"));
    assert!(!calls("op.far_away_too()", "far_away"));
}

/// The op's inner type keeps its methods in two rooms: accessors beside its definition
/// (`op/mod.rs`) and the call core (`op/run.rs`). The conductors (`forward`, `worker_call`,
/// `batch`, `awaited`) are free functions taking `&OpInner`, so their calls are paths.
#[test]
fn the_inner_op_has_methods_in_two_files_only() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (modules, _) = graph(&root);
    let with_impl: Vec<String> = modules
        .iter()
        .filter(|(_, f)| {
            inherent_impls(&code(&std::fs::read_to_string(f).unwrap()))
                .iter()
                .any(|(ty, _)| ty == "OpInner")
        })
        .map(|(m, _)| show(m, &modules, &root))
        .collect();
    assert_eq!(with_impl, ["op/mod.rs", "op/run.rs"]);
}
