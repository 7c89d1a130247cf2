//! Helpers shared by the test files (`mod common;` in each). Not every file uses every helper.
#![allow(dead_code)]

pub mod tables;
pub mod workers;

use std::path::PathBuf;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

use pyop::candle::{CpuStorage, Device, Storage, Tensor};

/// Python for the tests of spare input objects (`bridge::tensor::spare`): `kept` holds
/// `(object, its values)` pairs a body kept, `found` the empty `pyop.Tensor`s (spares) a body
/// found through `gc`; `look_and_check(look)` finds them when `look`, checks that every kept
/// object still holds its values and every found spare is still empty, and says how many were
/// found.
#[allow(dead_code)] // used by some of the test binaries that include this module
pub const SPARE_CHECKS: &str = "import gc
import pyop
kept = []
found = []
def look_and_check(look):
    if look:
        found.extend(o for o in gc.get_objects() if type(o) is pyop.Tensor and o.shape == (0,))
    for t, values in kept:
        assert t.tolist() == values, (t.tolist(), values)
    for o in found:
        assert o.shape == (0,), o.shape
    return len(found)
";

pub fn cpu() -> Device {
    Device::Cpu
}

/// A one-element f32 tensor.
pub fn scalar(v: f32) -> Tensor {
    Tensor::new(&[v], &Device::Cpu).unwrap()
}

/// Address of a CPU tensor's first element, for any dtype, honouring its offset in the storage
/// (a view's address is where the view starts).
pub fn data_ptr(t: &Tensor) -> usize {
    let (s, l) = t.storage_and_layout();
    let Storage::Cpu(c) = &*s else {
        panic!("a CPU tensor")
    };
    let base = match c {
        CpuStorage::U8(v) => v.as_ptr() as usize,
        CpuStorage::U32(v) => v.as_ptr() as usize,
        CpuStorage::I16(v) => v.as_ptr() as usize,
        CpuStorage::I32(v) => v.as_ptr() as usize,
        CpuStorage::I64(v) => v.as_ptr() as usize,
        CpuStorage::BF16(v) => v.as_ptr() as usize,
        CpuStorage::F16(v) => v.as_ptr() as usize,
        CpuStorage::F32(v) => v.as_ptr() as usize,
        CpuStorage::F64(v) => v.as_ptr() as usize,
        _ => panic!("a dtype with a Vec storage"),
    };
    base + l.start_offset() * t.dtype().size_in_bytes()
}

/// Runs `f` on its own thread; if it has not finished after `secs`, the whole test binary exits
/// with a failure instead of hanging CI (a deadlocked thread may hold the GIL).
pub fn within<T: Send + 'static>(
    secs: u64,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(v) => v,
        Err(RecvTimeoutError::Timeout) => {
            eprintln!("DEADLOCK: {what} did not finish within {secs} s");
            std::process::exit(101);
        }
        Err(RecvTimeoutError::Disconnected) => match handle.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => unreachable!("sent nothing yet returned"),
        },
    }
}

/// A fresh, empty folder for this process and `name`, removed when the guard drops (also when
/// the test fails).
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("pyop-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A run-time op `name` whose body is `code`, defining `f`, with outputs `tout`: numpy mode
/// with NumPy imported as `np`.
pub fn numpy_op(name: &str, code: &str, tout: &[pyop::OutSpec]) -> pyop::Result<pyop::PyOp> {
    pyop::PyOp::builder(name)
        .code(format!("import numpy as np\n{code}"))
        .function("f")
        .numpy()
        .tout(tout.iter().cloned())
        .build()
}

/// As [`numpy_op`], in tensor mode with `pyop` imported.
pub fn tensor_op(name: &str, code: &str, tout: &[pyop::OutSpec]) -> pyop::Result<pyop::PyOp> {
    pyop::PyOp::builder(name)
        .code(format!("import pyop\n{code}"))
        .function("f")
        .tout(tout.iter().cloned())
        .build()
}

/// Held by the tests that measure this process's resident memory and by those that make it grow
/// by hundreds of MiB: the in-process test modules share one process.
pub fn memory_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Held by the tests whose bodies look through `gc.get_objects()` and by those that assert that
/// nothing else holds what their calls made (the in-process test modules share one interpreter).
/// The list that scan makes holds every object the collector tracks for as long as the body
/// iterates it: among them another thread's argument lists (so its input views outlive its call,
/// and its weak references to them too) and the tuples NumPy makes for a ufunc's operands while
/// another thread runs that ufunc without the GIL (so the ufunc's output array has a second
/// reference when its body returns it, and pyop rightly copies it instead of adopting it). Seen
/// with NumPy 1.26 on busy CPUs: 6 runs in 80 with a scanning test beside the adoption test, none
/// in 80 without.
pub fn gc_scan_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Resident memory of this process in bytes (Linux `/proc/self/statm`, in pages of the
/// system's size). The one copy every test that measures memory uses.
pub fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf takes and returns plain integers.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * usize::try_from(page).unwrap_or(4096)
}

/// The name libtest knows the test `name` of `module` (the caller's `module_path!()`) by: the
/// module path without the crate, so `in_process::executor_tests` + `f` is
/// `executor_tests::f`, and a test at the root of its own binary is just `f`.
pub fn test_name(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_crate, path)) => format!("{path}::{name}"),
        None => name.to_string(),
    }
}

/// Runs the ignored test `name` of `module` (the caller's `module_path!()`) in a child process of
/// this test binary, with `env` changed (`None` removes a variable), for what must not share a
/// process with the other tests; returns whether it passed, and its stdout and stderr together.
pub fn child_test(
    module: &str,
    name: &str,
    env: &[(&str, Option<&std::ffi::OsStr>)],
) -> (bool, String) {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--ignored",
        "--exact",
        &test_name(module, name),
        "--nocapture",
    ]);
    for &(key, value) in env {
        match value {
            Some(v) => cmd.env(key, v),
            None => cmd.env_remove(key),
        };
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // A name that matches no test would pass with nothing run.
    assert!(
        text.contains("running 1 test\n"),
        "the child test {name} did not run:\n{text}"
    );
    (out.status.success(), text)
}

/// The blocks a Markdown file marks `<!-- user-crate: NAME -->` (the README's crate, which
/// `tests/user_crate.rs` builds and the guide repeats), by name, each with its final newline.
pub fn user_crate_blocks(text: &str) -> std::collections::BTreeMap<String, String> {
    let mut blocks = std::collections::BTreeMap::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let Some(name) = line
            .strip_prefix("<!-- user-crate: ")
            .and_then(|r| r.strip_suffix(" -->"))
        else {
            continue;
        };
        let fence = lines.next().expect("a code block after the marker");
        assert!(
            fence.starts_with("```"),
            "{name}: no code block after the marker"
        );
        let body: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
        blocks.insert(name.to_owned(), body.join("\n") + "\n");
    }
    blocks
}

/// Another thread holding the GIL, taken through pyo3 as a program's own code takes it, until
/// [`GilHolder::release`] or for 10 s (a call that needs the GIL gets it then), for the tests
/// of what runs without it.
pub struct GilHolder {
    release: mpsc::Sender<()>,
    released: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl GilHolder {
    /// Returns once the other thread holds the GIL.
    pub fn start() -> GilHolder {
        let (held_tx, held_rx) = mpsc::channel();
        let (release, release_rx) = mpsc::channel::<()>();
        let released = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = {
            let released = released.clone();
            std::thread::spawn(move || {
                pyop::interop::pyo3::Python::attach(|_py| {
                    held_tx.send(()).unwrap();
                    let _ = release_rx.recv_timeout(Duration::from_secs(10));
                    released.store(true, std::sync::atomic::Ordering::SeqCst);
                })
            })
        };
        held_rx.recv().unwrap();
        GilHolder {
            release,
            released,
            thread,
        }
    }

    /// Whether the holder has let go of the GIL (told to, or after its 10 s).
    pub fn released(&self) -> bool {
        self.released.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Lets go of the GIL and ends the holder's thread.
    pub fn release(self) {
        let _ = self.release.send(());
        self.thread.join().unwrap();
    }
}
