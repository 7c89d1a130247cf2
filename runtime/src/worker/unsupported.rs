//! Worker processes where they are not supported (off Linux): the types the pool and the op use,
//! and a start that always fails, saying why. Nothing else can run without a started worker.

use super::exchange::{Answered, Exchange, Failure, Launch, Load, StartError};
use super::protocol::Reply;

pub(crate) struct Worker {
    pub id: u64,
    pub pid: u32,
    pub dropped_seen: u64,
    pub actor: Option<super::exchange::RayActor>,
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

    pub(crate) fn call(&mut self, _ex: Exchange<'_>) -> Result<Answered, Failure> {
        match self.never {}
    }

    pub(crate) fn ask(
        &mut self,
        _load: &Load,
        _fns: &[&str],
        _limit: std::time::Duration,
    ) -> Result<Reply, Failure> {
        match self.never {}
    }

    pub(crate) fn unload(&mut self, _dropped: &std::collections::HashSet<String>) {
        match self.never {}
    }

    pub(crate) fn exited(&mut self) -> bool {
        match self.never {}
    }

    pub(crate) fn ask_once(
        &mut self,
        _request: &super::protocol::Request<'_>,
        _fds: &[std::convert::Infallible],
        _limit: std::time::Duration,
    ) -> Result<Reply, Failure> {
        match self.never {}
    }

    pub(crate) fn named(&self) -> String {
        match self.never {}
    }

    pub(crate) fn noun(&self) -> &'static str {
        match self.never {}
    }
}
