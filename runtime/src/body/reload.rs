//! Hot reload, for development: with `PYOP_HOT_RELOAD=1`, ops whose body came from a file (or a
//! package folder) read it again when it changed, so an edit shows up without a rebuild.
//!
//! The files are looked at most every [`CHECK_EVERY`] (a `stat` each), not on every call. A
//! reload that fails to compile keeps the last good body and reports the error. Without the
//! variable the embedded copy is used and the files are never read.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use pyo3::prelude::*;

use super::package;
use super::source::{self, Source};
use crate::error::{Error, ErrorKind, Result};

/// How often a reloading op looks at its files.
pub const CHECK_EVERY: Duration = Duration::from_millis(250);

static SWITCH: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Turns hot reload on or off for ops built from now on, overriding `PYOP_HOT_RELOAD` (for
/// development tools and tests, which should not change the environment of a running process).
pub fn set_hot_reload(on: bool) {
    SWITCH.store(if on { 2 } else { 1 }, std::sync::atomic::Ordering::Relaxed);
}

/// Whether hot reload is on: [`set_hot_reload`], else `PYOP_HOT_RELOAD` set to anything but `0`
/// or empty (read once).
pub fn enabled() -> bool {
    match SWITCH.load(std::sync::atomic::Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            static ENV: OnceLock<bool> = OnceLock::new();
            *ENV.get_or_init(|| {
                std::env::var("PYOP_HOT_RELOAD").is_ok_and(|v| !v.is_empty() && v != "0")
            })
        }
    }
}

/// What a file's (or a folder's files') modification times and sizes were.
type Stamp = Vec<(PathBuf, Option<SystemTime>, u64)>;

pub(crate) struct Reload {
    shared: bool,
    state: Mutex<State>,
}

struct State {
    source: Source,
    last_check: Instant,
    stamp: Stamp,
    body: Option<Py<PyAny>>,
    gradient: Option<Py<PyAny>>,
    error: Option<String>,
}

/// The body and gradient an op runs now.
pub(crate) struct Current<'py> {
    pub body: Bound<'py, PyAny>,
    pub gradient: Option<Bound<'py, PyAny>>,
}

impl Reload {
    /// A reloader for `source` if hot reload is on and the source has files to watch.
    pub(crate) fn for_source(source: &Source, shared: bool) -> Option<Reload> {
        if !enabled() || !matches!(source, Source::File { .. } | Source::Package { .. }) {
            return None;
        }
        Some(Reload {
            shared,
            state: Mutex::new(State {
                source: source.clone(),
                last_check: Instant::now(),
                // Empty: the first check reads the files, so an edit made between the build and
                // the run is picked up too (the text is compared before anything is reloaded).
                stamp: Vec::new(),
                body: None,
                gradient: None,
                error: None,
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The source in use now (the last one that loaded).
    pub(crate) fn source(&self) -> Source {
        self.lock().source.clone()
    }

    /// The last reload's error, if the last reload failed.
    pub(crate) fn last_error(&self) -> Option<String> {
        self.lock().error.clone()
    }

    /// The current body and gradient, reloading first if the files changed. `function` and
    /// `gradient` are their names; `built` are the ones the op was built with.
    pub(crate) fn current<'py>(
        &self,
        py: Python<'py>,
        op: &str,
        function: &str,
        gradient: Option<&str>,
        built: (&Py<PyAny>, Option<&Py<PyAny>>),
    ) -> Current<'py> {
        // The lock is never held while Python runs: a body may wait for another thread that
        // calls this op.
        let changed = {
            let mut st = self.lock();
            if st.last_check.elapsed() < CHECK_EVERY {
                None
            } else {
                st.last_check = Instant::now();
                let now = stamp(&st.source);
                (now != st.stamp).then(|| {
                    st.stamp = now;
                    st.source.clone()
                })
            }
        };
        if let Some(old) = changed {
            match self.load(py, op, &old, function, gradient) {
                // The files are back to the text of the body in use: it is good again.
                Ok(None) => self.lock().error = None,
                Ok(Some((source, body, grad))) => {
                    // The replaced objects are dropped after the lock is released: freeing a
                    // Python object can run code that releases the GIL.
                    let replaced = {
                        let mut st = self.lock();
                        st.error = None;
                        (
                            std::mem::replace(&mut st.source, source),
                            st.body.replace(body),
                            std::mem::replace(&mut st.gradient, grad),
                        )
                    };
                    drop(replaced);
                }
                Err(e) => {
                    let msg = e.to_string();
                    eprintln!(
                        "pyop: hot reload of op `{op}` failed; keeping the last good body:\n{msg}"
                    );
                    tracing::warn!(op, error = %msg, "pyop hot reload failed");
                    self.lock().error = Some(msg);
                }
            }
        }
        let st = self.lock();
        let body = st.body.as_ref().unwrap_or(built.0).bind(py).clone();
        let gradient = match (&st.body, &st.gradient) {
            (Some(_), g) => g.as_ref().map(|g| g.bind(py).clone()),
            (None, _) => built.1.map(|g| g.bind(py).clone()),
        };
        Current { body, gradient }
    }

    #[allow(clippy::type_complexity)]
    fn load(
        &self,
        py: Python<'_>,
        op: &str,
        old: &Source,
        function: &str,
        gradient: Option<&str>,
    ) -> Result<Option<(Source, Py<PyAny>, Option<Py<PyAny>>)>> {
        let source = reread(op, old)?;
        if same_text(&source, old) {
            return Ok(None);
        }
        let module = match &source {
            Source::Package { .. } => source::package_module(py, op, &source, true)?,
            _ if self.shared => source::replace_shared(py, op, &source)?,
            _ => source::private_module(py, op, &source)?,
        };
        let body = source::function(&module, op, function, &source, source::FnRole::Body)?.unbind();
        let grad = match gradient {
            Some(g) => {
                Some(source::function(&module, op, g, &source, source::FnRole::Gradient)?.unbind())
            }
            None => None,
        };
        Ok(Some((source, body, grad)))
    }
}

fn same_text(a: &Source, b: &Source) -> bool {
    match (a, b) {
        (Source::File { text: x, .. }, Source::File { text: y, .. }) => x == y,
        (Source::Package { files: x, .. }, Source::Package { files: y, .. }) => x == y,
        _ => false,
    }
}

/// The source with its text read again from disk.
fn reread(op: &str, source: &Source) -> Result<Source> {
    let read = |p: &Path| {
        std::fs::read_to_string(p).map_err(|e| {
            Error::op_failure(
                op,
                ErrorKind::Source,
                format!("cannot read {}: {e}", p.display()),
            )
        })
    };
    Ok(match source {
        Source::File { path, .. } => Source::File {
            path: path.clone(),
            text: read(Path::new(path.as_ref()))?.into(),
        },
        Source::Package {
            root, name, module, ..
        } => {
            let files = package::read(Path::new(root.as_ref())).map_err(|e| {
                Error::op_failure(op, ErrorKind::Source, format!("cannot read {root}: {e}"))
            })?;
            Source::Package {
                root: root.clone(),
                name: name.clone(),
                module: module.clone(),
                files,
            }
        }
        other => other.clone(),
    })
}

fn stamp(source: &Source) -> Stamp {
    let of = |p: &Path| {
        let meta = std::fs::metadata(p).ok();
        (
            p.to_path_buf(),
            meta.as_ref().and_then(|m| m.modified().ok()),
            meta.map_or(0, |m| m.len()),
        )
    };
    match source {
        Source::File { path, .. } => vec![of(Path::new(path.as_ref()))],
        Source::Package { root, .. } => {
            let root = Path::new(root.as_ref());
            package::walk(root)
                .unwrap_or_default()
                .into_iter()
                .map(|rel| of(&root.join(rel)))
                .collect()
        }
        _ => Vec::new(),
    }
}
