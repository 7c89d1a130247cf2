//! An op's pool and how its workers load its body: the module key (unique per op, a new
//! generation when hot reload changes the source) and the load request, made once per source.

use std::sync::{Arc, Mutex};

use crate::body::source::Source;
use crate::worker::exchange::Load;
use crate::worker::protocol::{self, LoadSource, ModuleKey, Request};
use crate::worker::WorkerPool;

/// An op's pool and how its workers load its body.
pub(crate) struct Workers {
    pub pool: WorkerPool,
    /// Unique per op: module state in a worker is the op's own, as in the program.
    base: String,
    source: Mutex<Loaded>,
}

struct Loaded {
    /// The source workers load now (hot reload replaces it) and its load request.
    source: Source,
    load: Load,
}

impl Workers {
    pub(crate) fn new(pool: WorkerPool, op: &str, source: &Source) -> Workers {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let base = format!("{op}#{n}");
        let load = load(op, &base, 0, source);
        Workers {
            pool,
            base,
            source: Mutex::new(Loaded {
                source: source.clone(),
                load,
            }),
        }
    }

    /// The module to have loaded for the source in use, after hot reload's `current`.
    pub(crate) fn load(&self, op: &str, current: Option<Source>) -> Load {
        let mut st = self.source.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(src) = current {
            if !same_text(&src, &st.source) {
                st.load = load(op, &self.base, st.load.key.generation + 1, &src);
                st.source = src;
            }
        }
        st.load.clone()
    }
}

impl Drop for Workers {
    /// The op is gone: its workers unload its modules, as the program frees its module.
    fn drop(&mut self) {
        self.pool.forget(&self.base);
    }
}

fn same_text(a: &Source, b: &Source) -> bool {
    match (a, b) {
        (Source::Package { files: x, .. }, Source::Package { files: y, .. }) => x == y,
        _ => a.text() == b.text(),
    }
}

/// The load request for `source` under `base` and `generation`.
fn load(op: &str, base: &str, generation: u64, source: &Source) -> Load {
    let key = ModuleKey {
        base: base.to_owned(),
        generation,
    };
    let source = match source {
        Source::Code {
            code,
            filename,
            first_line,
        } => LoadSource::Code {
            op_name: op,
            text: code,
            filename,
            first_line: *first_line,
        },
        Source::File { path, text } => LoadSource::File {
            op_name: op,
            text,
            filename: path,
        },
        Source::Module(name) => LoadSource::Module { name },
        Source::Package {
            root,
            name,
            module,
            files,
        } => LoadSource::Package {
            name,
            root,
            module,
            files: files
                .iter()
                .map(|(p, t)| (p.as_ref(), t.as_ref()))
                .collect(),
        },
    };
    let message: Arc<str> = protocol::encode(&Request::Load { key: &key, source }).into();
    Load { key, message }
}
