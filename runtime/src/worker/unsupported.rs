//! Worker processes where they are not supported (off Linux): the types the pool and the op use,
//! and a start that always fails, saying why. Nothing else can run without a started worker.

use std::sync::Arc;
use std::time::Instant;

use memmap2::MmapRaw;

use super::Launch;

/// Why a worker could not start.
#[derive(Debug)]
pub(crate) enum StartError {
    /// NumPy cannot be imported there (never, here).
    #[allow(dead_code)]
    NoNumpy(String),
    Failed(String),
}

/// Why a call got no reply (never, here).
#[derive(Debug)]
#[allow(dead_code)]
pub(crate) enum Failure {
    TimedOut { loading: bool },
    Lost { how: String, loading: bool },
}

pub(crate) struct Reply {
    pub header: serde_json::Value,
    pub payload: Vec<u8>,
    pub input: Arc<MmapRaw>,
    pub result: Option<Arc<MmapRaw>>,
}

pub(crate) struct Request<'a> {
    pub call: serde_json::Value,
    pub inputs: Vec<(usize, &'a [u8])>,
    pub arena_len: usize,
    pub load: Option<(String, Arc<str>)>,
    pub timeout: Option<std::time::Duration>,
}

pub(crate) struct Worker {
    pub id: u64,
    pub pid: u32,
    never: std::convert::Infallible,
}

impl Worker {
    pub(crate) fn start(_id: u64, _launch: &Launch) -> Result<Worker, StartError> {
        Err(StartError::Failed(
            "worker processes run on Linux only (they need memfd shared memory and \
             PR_SET_PDEATHSIG); run this op in the program (without `workers`)"
                .to_owned(),
        ))
    }

    pub(crate) fn call(&mut self, _req: Request<'_>) -> Result<Reply, Failure> {
        match self.never {}
    }

    pub(crate) fn ask(
        &mut self,
        _load: Option<(String, Arc<str>)>,
        _request: serde_json::Value,
        _deadline: Option<Instant>,
    ) -> Result<serde_json::Value, Failure> {
        match self.never {}
    }

    pub(crate) fn exited(&mut self) -> bool {
        match self.never {}
    }
}
