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
    let mut g = Graph::new();
    for (module, file) in &modules {
        let text = code(&std::fs::read_to_string(file).unwrap());
        if module.is_empty() {
            // The crate root declares and re-exports every module: not an edge of the layering.
            g.insert(module.clone(), Vec::new());
            continue;
        }
        let mut edges = Vec::new();
        for path in named_paths(module, &text) {
            if let Some(t) = target(&modules, &path) {
                if t != module {
                    edges.push((t.clone(), path.join("::")));
                }
            }
        }
        g.insert(module.clone(), edges);
    }
    (modules, g)
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
