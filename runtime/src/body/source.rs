//! Where a body comes from, and the Python module it lives in.
//!
//! Ops declared with `#[py_op]` from one file, package or module share one module instance, so
//! they share its state; each `code` declaration has a module of its own (its key names where it
//! was declared: text alone would merge unrelated ops whose bodies happen to be equal, and a
//! traceback would name another declaration's lines); ops built at run time get a namespace of
//! their own that dies with the op and never enters `sys.modules`.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyModule};

use super::package::PackageFiles;
use crate::error::{Error, ErrorKind, Result};
use crate::python::errors::python_error;
use crate::python::importing::Importing;

/// The Python source of an op's body.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Source {
    /// Inline code; `filename` is what tracebacks show, and its first line is line
    /// `first_line` there (a `#[py_op]`'s `code` counts lines as its `.rs` file does).
    Code {
        /// The code.
        code: Cow<'static, str>,
        /// The name tracebacks show.
        filename: Cow<'static, str>,
        /// The line number of its first line there.
        first_line: u32,
    },
    /// A file's text (embedded at compile time by `#[py_op(file = ...)]`); `path` is the file's
    /// path, shown in tracebacks.
    File {
        /// The file's path.
        path: Cow<'static, str>,
        /// Its text.
        text: Cow<'static, str>,
    },
    /// A module imported from `sys.path` on first use.
    Module(Cow<'static, str>),
    /// A package served from memory: `files` (paths relative to `root`, `/`-separated) become
    /// the package `name`; the body is in its module `module`.
    Package {
        /// The folder the files came from (for messages).
        root: Cow<'static, str>,
        /// The package's name.
        name: Cow<'static, str>,
        /// The module the body is in.
        module: Cow<'static, str>,
        /// The files, by relative path.
        files: PackageFiles,
    },
}

impl Source {
    /// Where the source came from, as the registry and error messages show it.
    pub fn describe(&self) -> String {
        match self {
            Source::Code {
                filename,
                first_line,
                ..
            } if !filename.starts_with('<') => format!("the code at {filename}:{first_line}"),
            Source::Code { filename, .. } => format!("the code {filename}"),
            Source::File { path, .. } => format!("the file {path}"),
            Source::Module(m) => format!("the module `{m}`"),
            Source::Package { root, module, .. } => {
                format!("the package {root} (module `{module}`)")
            }
        }
    }

    /// The text of the source (empty for an imported module).
    pub fn text(&self) -> &str {
        match self {
            Source::Code { code, .. } => code,
            Source::File { text, .. } => text,
            Source::Module(_) | Source::Package { .. } => "",
        }
    }

    fn key(&self) -> String {
        match self {
            Source::Code {
                code,
                filename,
                first_line,
            } => format!("code:{filename}:{first_line}:{code}"),
            Source::File { path, .. } => format!("file:{path}"),
            Source::Module(m) => format!("module:{m}"),
            Source::Package { name, module, .. } => format!("package:{name}:{module}"),
        }
    }
}

/// Module instances of `#[py_op]` sources, keyed by source. Entries are never removed: a static
/// op lives as long as the program.
static SHARED: Mutex<Option<HashMap<String, Py<PyAny>>>> = Mutex::new(None);

/// The shared module of a static source, loading it on first use.
pub(crate) fn shared_module<'py>(
    py: Python<'py>,
    op: &str,
    source: &Source,
) -> Result<Bound<'py, PyAny>> {
    match source {
        Source::Module(name) => return import(py, op, name),
        Source::Package { .. } => return package_module(py, op, source, false),
        _ => {}
    }
    let key = source.key();
    if let Some(m) = lock(&SHARED).as_ref().and_then(|map| map.get(&key)) {
        return Ok(m.bind(py).clone());
    }
    // Executing the source runs Python, which may release the GIL; the map's lock is not held
    // meanwhile, and if another thread loaded the same source first, its instance wins.
    let module = load(py, op, source, true)?;
    let mut guard = lock(&SHARED);
    let map = guard.get_or_insert_with(HashMap::new);
    Ok(map
        .entry(key)
        .or_insert_with(|| module.clone().unbind())
        .bind(py)
        .clone())
}

/// Loads `source` anew and makes it the shared module of its source (hot reload); ops that
/// reload the same file afterwards get this instance while the text is unchanged.
pub(crate) fn replace_shared<'py>(
    py: Python<'py>,
    op: &str,
    source: &Source,
) -> Result<Bound<'py, PyAny>> {
    let key = source.key();
    let text = source.text().to_owned();
    if let Some(m) = lock(&RELOADED).as_ref().and_then(|map| map.get(&key)) {
        if m.0 == text {
            return Ok(m.1.bind(py).clone());
        }
    }
    let module = load(py, op, source, true)?;
    // The replaced modules are dropped after the locks are released: freeing a module can run
    // Python that releases the GIL, and another thread may then want these locks.
    let replaced = {
        let mut reloaded = lock(&RELOADED);
        let mut shared = lock(&SHARED);
        (
            reloaded
                .get_or_insert_with(HashMap::new)
                .insert(key.clone(), (text, module.clone().unbind())),
            shared
                .get_or_insert_with(HashMap::new)
                .insert(key, module.clone().unbind()),
        )
    };
    drop(replaced);
    Ok(module)
}

/// The text each hot-reloaded shared source was last loaded from.
#[allow(clippy::type_complexity)]
static RELOADED: Mutex<Option<HashMap<String, (String, Py<PyAny>)>>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A module of the op's own (run-time ops), not registered anywhere. Inline code's lines go
/// into `linecache` under its unique filename, for tracebacks; [`forget_lines`] takes them out
/// when the op is dropped.
pub(crate) fn private_module<'py>(
    py: Python<'py>,
    op: &str,
    source: &Source,
) -> Result<Bound<'py, PyAny>> {
    match source {
        Source::Module(name) => import(py, op, name),
        Source::Code { .. } => load(py, op, source, true),
        Source::File { .. } => load(py, op, source, false),
        Source::Package { .. } => package_module(py, op, source, false),
    }
}

/// Installs (or, with `replace`, refreshes) the in-memory importer of a package source and
/// imports the body's module from it.
pub(crate) fn package_module<'py>(
    py: Python<'py>,
    op: &str,
    source: &Source,
    replace: bool,
) -> Result<Bound<'py, PyAny>> {
    let Source::Package {
        root,
        name,
        module,
        files,
    } = source
    else {
        unreachable!("called for packages only")
    };
    let _importing = Importing::begin(py);
    let run = || -> PyResult<Bound<'py, PyAny>> {
        super::package::install(py, name, root, files, replace)?;
        PyModule::import(py, "importlib")?.call_method1("import_module", (module.as_ref(),))
    };
    run().map_err(|e| source_error(py, op, &source.describe(), e))
}

/// Removes a run-time op's inline code from `linecache`.
pub(crate) fn forget_lines(py: Python<'_>, source: &Source) {
    if let Source::Code { filename, .. } = source {
        if let Ok(cache) = PyModule::import(py, "linecache").and_then(|m| m.getattr("cache")) {
            let _ = cache.call_method1("pop", (filename.as_ref(), py.None()));
        }
    }
}

fn import<'py>(py: Python<'py>, op: &str, name: &str) -> Result<Bound<'py, PyAny>> {
    let _importing = Importing::begin(py);
    py.import(name)
        .map(Bound::into_any)
        .map_err(|e| source_error(py, op, &format!("the module `{name}`"), e))
}

/// A Python error met while loading a source: kind [`ErrorKind::Source`], saying which source.
fn source_error(py: Python<'_>, op: &str, what: &str, e: PyErr) -> Error {
    cannot_load(python_error(py, op, e), what)
}

/// A body that failed to load (here or in a worker): `Source`, naming what could not be loaded.
pub(crate) fn cannot_load(err: Error, what: &str) -> Error {
    err.with_kind(ErrorKind::Source, |m| format!("cannot load {what}: {m}"))
}

// Each loader below runs as `Importing`: loading a source imports what it imports (NumPy, …), in
// turns with every other thread's loads (a package imported twice at once can break), and must
// never be interrupted half-way by the time limit of a body that happens to trigger it (a nested
// op's first call, a hot reload).

/// Compiles and runs `source` in a fresh module. `cache_lines` puts its text in `linecache`, so
/// tracebacks through an embedded source show its lines even where the file is absent.
fn load<'py>(
    py: Python<'py>,
    op: &str,
    source: &Source,
    cache_lines: bool,
) -> Result<Bound<'py, PyAny>> {
    let (text, filename, first_line): (&str, &str, u32) = match source {
        Source::Code {
            code,
            filename,
            first_line,
        } => (code, filename, *first_line),
        Source::File { path, text } => (text, path, 1),
        Source::Module(_) | Source::Package { .. } => unreachable!("imported, not loaded"),
    };
    // Blank lines in front make Python count lines as the file holding the code does.
    let padded;
    let text = if first_line > 1 {
        padded = "\n".repeat(first_line as usize - 1) + text;
        padded.as_str()
    } else {
        text
    };
    let _importing = Importing::begin(py);
    let run = || -> PyResult<Bound<'py, PyAny>> {
        let module = PyModule::new(py, &format!("pyop_body_{op}"))?;
        module.setattr("__file__", filename)?;
        if cache_lines {
            cache_source_lines(py, filename, text, first_line)?;
        }
        let builtins = PyModule::import(py, "builtins")?;
        let code = builtins
            .getattr("compile")?
            .call1((text, filename, "exec"))?;
        let globals: Bound<'py, PyDict> = module.dict();
        builtins.getattr("exec")?.call1((code, &globals))?;
        Ok(module.into_any())
    };
    run().map_err(|e| source_error(py, op, &source.describe(), e))
}

/// Puts a source's lines into `linecache` under `filename`. Several `code` literals of one `.rs`
/// file share its name: each fills in its own lines (from `first_line` on), so a traceback through
/// any of them shows the right text even where the `.rs` file is absent. The entry has no
/// modification time, so `linecache.checkcache` keeps it.
fn cache_source_lines(py: Python<'_>, filename: &str, text: &str, first_line: u32) -> PyResult<()> {
    let cache = PyModule::import(py, "linecache")?.getattr("cache")?;
    let mut lines: Vec<String> = match cache.get_item(filename) {
        Ok(entry) if first_line > 1 => entry.get_item(2)?.extract()?,
        _ => Vec::new(),
    };
    let new: Vec<&str> = text.split_inclusive('\n').collect();
    if lines.len() < new.len() {
        lines.resize(new.len(), "\n".to_owned());
    }
    let skip = first_line.saturating_sub(1) as usize;
    for (i, line) in new.iter().enumerate().skip(skip) {
        lines[i] = (*line).to_owned();
    }
    let size: usize = lines.iter().map(String::len).sum();
    cache.set_item(filename, (size, py.None(), lines, filename))
}

/// Which function of a source is looked up: the body, or its gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FnRole {
    Body,
    Gradient,
}

impl std::fmt::Display for FnRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FnRole::Body => "function",
            FnRole::Gradient => "gradient",
        })
    }
}

/// The callable `name` in `module`, or an error naming the op and the source.
pub(crate) fn function<'py>(
    module: &Bound<'py, PyAny>,
    op: &str,
    name: &str,
    source: &Source,
    what: FnRole,
) -> Result<Bound<'py, PyAny>> {
    match module.getattr(name) {
        Ok(f) if f.is_callable() => Ok(f),
        Ok(f) => Err(Error::op_failure(
            op,
            ErrorKind::MissingFunction,
            format!(
                "the {what} `{name}` in {} is not callable (it is {})",
                source.describe(),
                crate::bridge::numbers::describe_value(&f)
            ),
        )),
        Err(_) => {
            let defined = defined_functions(module);
            let hint = match defined.as_slice() {
                [] => String::new(),
                [one] if what == FnRole::Body => {
                    format!("; it defines `{one}`: if that is the body, declare `name = \"{one}\"`")
                }
                many => format!(
                    "; it defines {}",
                    many.iter()
                        .map(|f| format!("`{f}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            Err(Error::op_failure(
                op,
                ErrorKind::MissingFunction,
                format!("{} has no {what} `{name}`{hint}", source.describe()),
            ))
        }
    }
}

/// The functions a module defines itself (not those it imports), in definition order.
fn defined_functions(module: &Bound<'_, PyAny>) -> Vec<String> {
    let Ok(own) = module.getattr("__name__") else {
        return Vec::new();
    };
    let Ok(dict) = module.getattr("__dict__") else {
        return Vec::new();
    };
    let Ok(items) = dict.call_method0("items").and_then(|i| i.try_iter()) else {
        return Vec::new();
    };
    items
        .flatten()
        .filter_map(|item| {
            let (name, value): (String, Bound<'_, PyAny>) = item.extract().ok()?;
            let is_function = value.hasattr("__code__").unwrap_or(false);
            let here = value
                .getattr("__module__")
                .is_ok_and(|m| m.eq(&own).unwrap_or(false));
            (is_function && here && !name.starts_with('_')).then_some(name)
        })
        .collect()
}
