//! Worker processes where they are not supported (off Linux): the types the pool and the op use,
//! and a start that always fails, saying why. Nothing else can run without a started worker.

use std::sync::Arc;

use super::{Failure, Launch, Reply, Request, StartError};

pub(crate) struct Worker {
    pub id: u64,
    pub pid: u32,
    never: std::convert::Infallible,
}

impl Worker {
    pub(crate) fn start(_id: u64, _launch: &Launch, _threads: usize) -> Result<Worker, StartError> {
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
        _limit: std::time::Duration,
    ) -> Result<serde_json::Value, Failure> {
        match self.never {}
    }

    pub(crate) fn exited(&mut self) -> bool {
        match self.never {}
    }
}
