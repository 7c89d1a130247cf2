//! How an awaited call waits for its worker's reply: the worker's socket and pidfd registered
//! with a reactor (async-io's, one thread for every call in flight, whatever executor polls the
//! future), and the pacing of a blocked caller's (`pace`), with a longer window: asleep until
//! the reply is due, checking for it during its window in turns, between which the executor runs
//! its other tasks.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Instant;

use async_io::{Async, Timer};
use futures_lite::future;

use super::pace::{self, Checking, Spin, Waited};
use super::wire::{ready_now, RecvError, Wait};

/// How long at least a task checks for a reply before it sleeps (`pace`'s longest window).
const TASK_SPIN: std::time::Duration = super::pace::MAX_SPIN;

/// How long a task checks for a reply before it lets its executor run other tasks: tokio's
/// guidance for the time between two awaits.
const IN_PLACE: std::time::Duration = std::time::Duration::from_micros(100);

/// A worker's socket and pidfd (copies of their descriptors), registered with the reactor.
#[derive(Clone)]
pub(crate) struct Reactor(Arc<Registered>);

struct Registered {
    sock: Async<OwnedFd>,
    pidfd: Option<Async<OwnedFd>>,
}

impl Reactor {
    /// Registers `sock` and `pidfd` (copies: their readiness is the originals').
    pub(crate) fn register(sock: OwnedFd, pidfd: Option<OwnedFd>) -> std::io::Result<Reactor> {
        // `new_nonblocking`: the descriptors stay as they are (blocking), since they are only
        // waited on here, and read and written by the worker's own code.
        Ok(Reactor(Arc::new(Registered {
            sock: Async::new_nonblocking(sock)?,
            pidfd: pidfd.map(Async::new_nonblocking).transpose()?,
        })))
    }
}

/// What ended a sleep.
enum Woke {
    Readable,
    Timer,
}

impl Wait for Reactor {
    async fn readable(
        &mut self,
        sock: &UnixStream,
        deadline: Option<Instant>,
        alive: Option<BorrowedFd<'_>>,
        spin: &mut Spin,
    ) -> Result<(), RecvError> {
        debug_assert_eq!(
            rustix::fs::fstat(sock.as_fd()).map(|s| s.st_ino).ok(),
            rustix::fs::fstat(self.0.sock.as_fd())
                .map(|s| s.st_ino)
                .ok(),
            "the registered socket is the worker's"
        );
        // A task that sleeps is woken through the reactor: two thread wake-ups (the reactor's
        // thread, then the executor's) where a blocked caller has one. So when the reply is due
        // soon it checks from the start, for at least `TASK_SPIN`, in turns of `IN_PLACE` between which its executor
        // runs its other tasks (`spin_window`); not at all while the machine's CPUs are all
        // busy (the window is empty then). Measured with tokio's multi-thread runtime (2
        // threads, 2 CPUs): 0.9-1.25x a blocked caller's round trip; with `pace`'s window alone,
        // 1.55-1.95x.
        // A reply due later than that is waited for asleep until pace's window, as a blocked
        // caller waits: a long body never keeps a runtime thread checking.
        let start = Instant::now();
        if spin.until > spin.from && spin.from <= start + TASK_SPIN {
            spin.from = spin.from.min(start);
            spin.until = spin.until.max(start + TASK_SPIN);
        }
        // The spell of checking under way, measured as a blocked caller's (`pace::Checking`).
        let mut checking: Option<Checking> = None;
        loop {
            if let Some(r) = ready_now(sock, alive) {
                let now = Instant::now();
                spin.waited = Some(match checking.take() {
                    Some(c) => c.end(now, true),
                    // Woken from sleep: after a spell that missed it, or without one.
                    None => spin.waited.unwrap_or(Waited::Slept),
                });
                return r;
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Err(RecvError::TimedOut);
            }
            let window = spin.until > spin.from && pace::spinning_allowed();
            if window && now >= spin.from && now < spin.until {
                // Checked in place for a while, then the executor runs its other tasks: a yield
                // on a work-stealing runtime wakes another of its threads to steal this task
                // (tokio's multi-thread runtime does), a thread wake-up for every yield.
                let c = checking.get_or_insert_with(|| Checking::new(now));
                c.resume(now);
                let stop = spin.until.min(now + IN_PLACE);
                let caught = loop {
                    let now = Instant::now();
                    if now >= stop {
                        break None;
                    }
                    if let Some(r) = ready_now(sock, alive) {
                        break Some((r, now));
                    }
                    // The worker may share this CPU (2 of them here): it gets it meanwhile, as a
                    // blocked caller's check gives it (`wire`). A spin hint instead: 1.26-1.29x
                    // the blocked round trip; with this, 0.90-1.25x.
                    std::thread::yield_now();
                };
                if let Some((r, now)) = caught {
                    spin.waited = checking.take().map(|c| c.end(now, true));
                    return r;
                }
                // The turn ends: what the executor runs next is not this spell's.
                c.pause(Instant::now());
                future::yield_now().await;
                continue;
            }
            // The window closed without the reply: the spell missed it.
            if let Some(c) = checking.take() {
                spin.waited = Some(c.end(now, false));
            }
            // Asleep until the window opens (if it is ahead) or the deadline.
            let wake_at = match (window && now < spin.from, deadline) {
                (true, Some(d)) => Some(spin.from.min(d)),
                (true, None) => Some(spin.from),
                (false, d) => d,
            };
            let timer = async {
                match wake_at {
                    Some(at) => Timer::at(at).await,
                    None => Timer::never().await,
                };
                Ok(Woke::Timer)
            };
            let socket = async {
                self.0.sock.readable().await?;
                Ok(Woke::Readable)
            };
            let exited = async {
                match &self.0.pidfd {
                    Some(p) => {
                        p.readable().await?;
                        Ok(Woke::Readable)
                    }
                    None => future::pending().await,
                }
            };
            let woke: std::io::Result<Woke> = future::or(socket, future::or(exited, timer)).await;
            match woke {
                Err(e) => return Err(RecvError::Io(e)),
                Ok(Woke::Readable) => {
                    if window && Instant::now() < spin.from {
                        // Woken before the window: the estimate was too long.
                        spin.early = true;
                    }
                }
                Ok(Woke::Timer) => {}
            }
        }
    }
}
