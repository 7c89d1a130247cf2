//! Helpers of the worker test files (`worker_*_tests.rs`): ops built in a pool or in the
//! program, a lock for the tests that count the program's processes and mappings, `/proc`
//! readers.

use std::sync::{Mutex, MutexGuard};

use pyop::candle::{DType, Tensor};
use pyop::{Arg, OutSpec, PyOp, WorkerPool};

use super::{cpu, TempDir};

/// The tests of a test binary that take this lock run one at a time: some count the program's
/// shared-memory mappings and descriptors, which another test's pool would change.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn worker_op(pool: &WorkerPool, name: &str, code: &str, tout: &[OutSpec]) -> PyOp {
    PyOp::builder(name)
        .code(format!("import numpy as np\n{code}"))
        .function("f")
        .numpy()
        .pool(pool)
        .tout(tout.iter().cloned())
        .build()
        .unwrap()
}

/// The op `worker_op` builds, run in the program instead: the same body to compare against.
pub fn program_op(name: &str, code: &str, tout: &[OutSpec]) -> PyOp {
    PyOp::builder(name)
        .code(format!("import numpy as np\n{code}"))
        .function("f")
        .numpy()
        .tout(tout.iter().cloned())
        .build()
        .unwrap()
}

/// The fields of `/proc/<pid>/stat` after the command name (state, parent, group, …); `None`
/// once the process is reaped.
pub fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit(')').next().unwrap_or("");
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// The program's shared-memory arena mappings: each one's address range.
pub fn arena_mappings() -> Vec<(usize, usize)> {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("pyop-worker-arena"))
        .map(|l| {
            let (start, end) = l.split(' ').next().unwrap().split_once('-').unwrap();
            let hex = |h| usize::from_str_radix(h, 16).unwrap();
            (hex(start), hex(end))
        })
        .collect()
}

/// A file in a fresh temp folder, for a body to leave a process id in.
pub fn pid_file(tmp: &TempDir, name: &str) -> String {
    tmp.path().join(name).display().to_string()
}

/// The Python exception's type name an error carries.
pub fn exception(e: &pyop::Error) -> Option<&str> {
    e.exception()
}

/// The body of the zygote tests: the worker's pid, parent, process group, threads after a
/// matrix product (OpenBLAS's pool then runs), and whether `worker.py` takes itself for the
/// zygote (which never checks for its next request before sleeping).
pub const FAMILY: &str = "import os, sys\ndef f(x):\n    a = np.ones((256, 256))\n    a @ a\n    \
    return np.array([os.getpid(), os.getppid(), os.getpgid(0), \
    len(os.listdir('/proc/self/task')), sys._getframe(1).f_globals['_is_zygote']], \
    dtype=np.int64)";

pub fn family(pool: &WorkerPool) -> [i64; 5] {
    let op = worker_op(pool, "family", FAMILY, &[OutSpec::new(DType::I64)]);
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let v = op.call(&[Arg::from(&x)]).unwrap()[0]
        .to_vec1::<i64>()
        .unwrap();
    [v[0], v[1], v[2], v[3], v[4]]
}
