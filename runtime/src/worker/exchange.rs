//! What the pool and one worker say to each other in Rust: how a worker starts (`Launch`), one
//! call's request and answer, and why either failed. Plain data, shared by the Linux process
//! (`process.rs`) and the stand-in elsewhere (`unsupported.rs`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use memmap2::MmapRaw;

use super::protocol::{ModuleKey, Reply};

/// How workers are started: the interpreter the program embeds (its installation's `python`),
/// the embedded interpreter's `sys.path` (so imports resolve as they do in the program), and the
/// embedded-package importer's code.
#[derive(Clone, Debug)]
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
pub(crate) struct Launch {
    pub python: PathBuf,
    pub sys_path: Vec<String>,
    /// The embedded interpreter's `sys.argv`.
    pub argv: Vec<String>,
    /// The environment's `site-packages`, whose `.pth` files a worker runs as the program did.
    pub site_packages: Option<PathBuf>,
    pub importer: &'static str,
    /// The embedded interpreter's `[major, minor]`: a worker of another version refuses to
    /// start (the program's `sys.path` holds that version's standard library).
    pub version: [u32; 2],
    /// The environment, for messages (`PythonEnv::describe`).
    pub describe: String,
    /// The command that installs NumPy there.
    pub pip_numpy: String,
    /// The command that installs Ray there (for a Ray pool's relays).
    pub pip_ray: String,
}

/// The environment variables that size the thread pools of BLAS, OpenMP and their kin
/// (`WorkerPool::THREAD_VARS`).
pub(crate) const THREAD_VARS: [&str; 7] = [
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "NUMBA_NUM_THREADS",
];

/// Why a worker could not start.
#[derive(Debug)]
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
pub(crate) enum StartError {
    /// NumPy cannot be imported there: the exception, as `Type: message`.
    NoNumpy(String),
    /// Anything else, said in full.
    Failed(String),
    /// A Ray pool's relay has no Ray to import: said in full, with how to install it.
    NoRay(String),
    /// A Ray pool's relay could not join its cluster or start its actor: said in full.
    Cluster(String),
}

impl StartError {
    /// What went wrong, in words.
    pub(crate) fn text(&self) -> &str {
        match self {
            StartError::NoNumpy(s)
            | StartError::Failed(s)
            | StartError::NoRay(s)
            | StartError::Cluster(s) => s,
        }
    }
}

/// How long loading a body's module in a worker may take (its imports: NumPy is already there,
/// a large library may not be).
pub(crate) const LOAD_TIMEOUT: Duration = Duration::from_secs(120);

/// Why a call got no reply.
#[derive(Debug)]
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
pub(crate) enum Failure {
    /// Past the deadline (the call's, or loading the body's); the worker was killed.
    TimedOut { loading: bool },
    /// The worker died, or broke the protocol and was killed: how (`exited with status 3`, `was
    /// killed by signal 11 (SIGSEGV)`, "sent a reply whose `need` …"), and whether while loading
    /// the body rather than running it.
    Lost { how: String, loading: bool },
}

/// A module to have loaded before a request: its key and its load request's JSON text
/// (`protocol::encode`), made once per source and sent to each worker that lacks it.
#[derive(Clone, Debug)]
pub(crate) struct Load {
    pub key: ModuleKey,
    pub message: Arc<str>,
}

/// One call: the module, the inputs to write first, the call's request (`protocol::encode` of a
/// `Request::Call`), and the input arena's size needed.
pub(crate) struct Exchange<'a> {
    pub load: Load,
    /// The function called (how long its calls take is what a caller's wait is paced by).
    pub function: &'a str,
    pub call: String,
    pub inputs: Vec<(usize, &'a [u8])>,
    pub arena_len: usize,
    /// The `out` buffers' sizes the call hands the body (its reply must name as many).
    pub outs: Option<Vec<usize>>,
    /// The call's time limit, counted from when the call is sent: starting a worker and loading
    /// the body have limits of their own.
    pub timeout: Option<Duration>,
}

/// A worker's answer, checked: its reply, its pickle, and the arenas its buffers are in (kept
/// mapped for as long as the answer, or a view of it, lives).
pub(crate) struct Answered {
    pub reply: Reply,
    pub payload: Vec<u8>,
    /// `None` for an answer that names no shared memory (a failed load's).
    pub input: Option<Arc<MmapRaw>>,
    pub result: Option<Arc<MmapRaw>>,
    /// Bytes the program wrote into the input arena for this call.
    pub copied_in: u64,
    /// Bytes the worker copied into the result arena for this reply.
    pub copied_out: u64,
    /// How the program and the worker waited for each other's message.
    pub waits: Waits,
}

/// How the two sides of a call waited: the caller for the reply, the worker for the request
/// (`None` where not known: no call was made, or a relay did not say).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Waits {
    pub caller: Option<super::protocol::Waited>,
    pub worker: Option<super::protocol::Waited>,
}

/// Where an actor of a Ray pool runs (for [`WorkerPool::ray_actors`](crate::WorkerPool::ray_actors)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RayActor {
    /// The pool's number for it (as a worker's, in errors and traces).
    pub id: u64,
    /// Its process on its node.
    pub pid: u32,
    /// Its node's Ray id.
    pub node: String,
    /// Its node's address.
    pub ip: String,
}
