//! Frames on the socket to a worker: a 4-byte little-endian length, then the frame (what a frame
//! holds is `protocol`'s), with file descriptors attached to a frame's first bytes when an arena
//! changes.

use std::future::Future;
use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

use super::pace::{self, Spin};

/// Why no reply came.
#[derive(Debug)]
pub(crate) enum RecvError {
    /// The deadline passed first.
    TimedOut,
    /// The worker closed its end: it exited or was killed.
    Closed,
    Io(std::io::Error),
}

/// Sends one frame, with `fds` attached.
pub(crate) fn send(sock: &UnixStream, frame: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    let len = u32::try_from(frame.len())
        .map_err(|_| std::io::Error::other("a request frame over 4 GiB"))?
        .to_le_bytes();
    let mut sent = 0usize;
    if !fds.is_empty() {
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        assert!(
            control.push(SendAncillaryMessage::ScmRights(fds)),
            "room for two descriptors"
        );
        let iov = [IoSlice::new(&len), IoSlice::new(frame)];
        sent = rustix::net::sendmsg(sock.as_fd(), &iov, &mut control, SendFlags::NOSIGNAL)?;
    }
    let mut rest: Vec<&[u8]> = Vec::new();
    let (a, b) = (&len[..], frame);
    if sent < a.len() {
        rest.push(&a[sent..]);
        rest.push(b);
    } else {
        rest.push(&b[sent - a.len()..]);
    }
    let mut w = sock;
    for part in rest {
        w.write_all(part)?;
    }
    Ok(())
}

/// How a caller waits for its worker's socket: a thread, blocked ([`Blocking`]), or a future
/// that sleeps on a reactor (`op::awaited`'s `Reactor`). The frames, the protocol and the pacing
/// are the same code for both.
pub(crate) trait Wait {
    /// Waits until the socket has bytes (or its peer closed it), the deadline passes, or the
    /// worker (its pidfd) exits, checking without sleeping during `spin`.
    fn readable(
        &mut self,
        sock: &UnixStream,
        deadline: Option<Instant>,
        alive: Option<BorrowedFd<'_>>,
        spin: &mut Spin,
    ) -> impl Future<Output = Result<(), RecvError>> + Send;
}

/// Waiting as a blocked thread: its future is ready when first polled.
pub(crate) struct Blocking;

impl Wait for Blocking {
    fn readable(
        &mut self,
        sock: &UnixStream,
        deadline: Option<Instant>,
        alive: Option<BorrowedFd<'_>>,
        spin: &mut Spin,
    ) -> impl Future<Output = Result<(), RecvError>> + Send {
        std::future::ready(wait_readable(sock, deadline, alive, spin))
    }
}

/// The output of `f`, a future that never waits (one that only waits [`Blocking`]ly).
pub(crate) fn block_now<F: Future>(f: F) -> F::Output {
    let f = std::pin::pin!(f);
    match f.poll(&mut std::task::Context::from_waker(std::task::Waker::noop())) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => unreachable!("a blocking wait is ready when polled"),
    }
}

/// Waits for one frame until `deadline`, as a blocked thread (see [`recv_with`]).
#[cfg(test)]
pub(crate) fn recv(
    sock: &UnixStream,
    deadline: Option<Instant>,
    alive: Option<BorrowedFd<'_>>,
    spin: &mut Spin,
) -> Result<Vec<u8>, RecvError> {
    block_now(recv_with(sock, deadline, alive, spin, &mut Blocking))
}

/// Waits for one frame until `deadline`, every byte of it, checking for its first bytes without
/// sleeping during `spin` (which says whether they came before it). `alive` is the worker's
/// pidfd, when the kernel has them: a worker that died is noticed even if a process it forked
/// still holds its end of the socket open.
pub(crate) async fn recv_with<W: Wait>(
    sock: &UnixStream,
    deadline: Option<Instant>,
    alive: Option<BorrowedFd<'_>>,
    spin: &mut Spin,
    wait: &mut W,
) -> Result<Vec<u8>, RecvError> {
    let mut len = [0u8; 4];
    read_full(sock, &mut len, deadline, alive, spin, wait).await?;
    let n = u32::from_le_bytes(len) as usize;
    let too_large = || RecvError::Io(std::io::Error::other(format!("a reply frame of {n} bytes")));
    if n as u64 > super::protocol::need_cap() {
        return Err(too_large());
    }
    // Allocated only if the memory is there: a frame never aborts the program.
    let mut frame = Vec::new();
    frame.try_reserve_exact(n).map_err(|_| too_large())?;
    frame.resize(n, 0);
    // The rest follows at once (or as fast as the worker writes it).
    read_full(
        sock,
        &mut frame,
        deadline,
        alive,
        &mut Spin::now_for(pace::FIRST_SPIN),
        wait,
    )
    .await?;
    Ok(frame)
}

/// Fills `buf`, waiting (until `deadline`) before every read: a worker that stops half-way
/// through a frame cannot hold the caller past its time limit.
async fn read_full<W: Wait>(
    mut sock: &UnixStream,
    buf: &mut [u8],
    deadline: Option<Instant>,
    alive: Option<BorrowedFd<'_>>,
    spin: &mut Spin,
    wait: &mut W,
) -> Result<(), RecvError> {
    let mut got = 0;
    while got < buf.len() {
        wait.readable(sock, deadline, alive, spin).await?;
        match sock.read(&mut buf[got..]) {
            Ok(0) => return Err(RecvError::Closed),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Err(RecvError::Closed)
            }
            Err(e) => return Err(RecvError::Io(e)),
        }
    }
    Ok(())
}

/// What the socket and the worker's pidfd say now, without waiting: `Some(Ok)` when there are
/// bytes to read (or the peer closed it), `Some(Err(Closed))` when the worker exited with nothing
/// left to read, `None` when neither.
pub(crate) fn ready_now(
    sock: &UnixStream,
    alive: Option<BorrowedFd<'_>>,
) -> Option<Result<(), RecvError>> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let pidfd = alive.unwrap_or(sock.as_fd());
    let mut fds = [
        PollFd::new(sock, PollFlags::IN),
        PollFd::from_borrowed_fd(pidfd, PollFlags::IN),
    ];
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    loop {
        match poll(&mut fds, Some(&zero)) {
            Ok(0) => return None,
            Ok(_) => {
                if !fds[0].revents().is_empty() {
                    return Some(Ok(()));
                }
                if alive.is_some() && !fds[1].revents().is_empty() {
                    return Some(Err(RecvError::Closed));
                }
                return None;
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Some(Err(RecvError::Io(e.into()))),
        }
    }
}

/// Waits until the socket has bytes (or its peer closed it), the deadline passes, or the worker
/// (its pidfd) exits: asleep, except during `spin`, when it checks without sleeping (`pace`).
fn wait_readable(
    sock: &UnixStream,
    deadline: Option<Instant>,
    alive: Option<BorrowedFd<'_>>,
    spin: &mut Spin,
) -> Result<(), RecvError> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    // The socket, and the pidfd when there is one (else the socket twice): no allocation in the
    // loop a call spins in.
    let poll_fds = || {
        let pidfd = alive.unwrap_or(sock.as_fd());
        [
            PollFd::new(sock, PollFlags::IN),
            PollFd::from_borrowed_fd(pidfd, PollFlags::IN),
        ]
    };
    let ready = |fds: &[PollFd<'_>]| -> Option<Result<(), RecvError>> {
        if !fds[0].revents().is_empty() {
            return Some(Ok(()));
        }
        // The worker exited and nothing is left to read: it died.
        if alive.is_some() && !fds[1].revents().is_empty() {
            return Some(Err(RecvError::Closed));
        }
        None
    };
    // Sleeps until `until` (or the deadline, if sooner; `None`: the deadline); `Ok(None)` when
    // it passed with nothing to read.
    let sleep = |until: Option<Instant>| -> Result<Option<()>, RecvError> {
        loop {
            let end = match (until, deadline) {
                (Some(u), Some(d)) => Some(u.min(d)),
                (u, d) => u.or(d),
            };
            let timeout = match end {
                None => None,
                Some(e) => {
                    let left = e.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        if deadline.is_some_and(|d| d <= e) {
                            return Err(RecvError::TimedOut);
                        }
                        return Ok(None);
                    }
                    Some(Timespec {
                        tv_sec: left.as_secs() as i64,
                        tv_nsec: i64::from(left.subsec_nanos()),
                    })
                }
            };
            let mut fds = poll_fds();
            match poll(&mut fds, timeout.as_ref()) {
                Ok(0) => continue, // the checks above end the loop
                Ok(_) => {
                    if let Some(r) = ready(&fds) {
                        return r.map(Some);
                    }
                }
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(RecvError::Io(e.into())),
            }
        }
    };
    let mut missed = None;
    if spin.until > spin.from {
        if Instant::now() < spin.from {
            let woke = sleep(Some(spin.from))?;
            let now = Instant::now();
            if now >= spin.from {
                // The sleep ended late (the reply may have come meanwhile).
                pace::slept(spin.from, now);
            }
            if woke.is_some() {
                spin.early = now < spin.from;
                spin.waited = Some(pace::Waited::Slept);
                return Ok(());
            }
        }
        // Not if spinning went off while this caller slept.
        if pace::spinning_allowed() {
            let checking = pace::Checking::new(Instant::now());
            loop {
                let now = Instant::now();
                if now >= spin.until || deadline.is_some_and(|d| now >= d) {
                    missed = Some(checking.end(now, false));
                    break;
                }
                if let Some(r) = ready_now(sock, alive) {
                    spin.waited = Some(checking.end(now, true));
                    return r;
                }
                // Gives the core to any other runnable thread (a worker, another caller)
                // meanwhile.
                std::thread::yield_now();
            }
        }
    }
    let r = sleep(None).map(|_| ());
    spin.waited = Some(missed.unwrap_or(pace::Waited::Slept));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spin() -> Spin {
        Spin::now_for(pace::FIRST_SPIN)
    }

    #[test]
    fn frames_round_trip_with_descriptors() {
        let (a, b) = UnixStream::pair().unwrap();
        let arena = super::super::arena::Arena::with_room_for(1).unwrap();
        send(&a, b"{\"op\":\"ping\"}", &[arena.fd()]).unwrap();
        send(&a, b"second", &[]).unwrap();
        // The receiving side reads frames as worker.py does (the descriptor is discarded here).
        assert_eq!(
            recv(&b, None, None, &mut spin()).unwrap(),
            b"{\"op\":\"ping\"}"
        );
        assert_eq!(recv(&b, None, None, &mut spin()).unwrap(), b"second");
        let deadline = Instant::now() + std::time::Duration::from_millis(20);
        assert!(matches!(
            recv(&b, Some(deadline), None, &mut spin()),
            Err(RecvError::TimedOut)
        ));
        // A frame that stops half-way does not hold the reader past its deadline.
        (&a).write_all(&[10, 0, 0, 0, b'x']).unwrap();
        let deadline = Instant::now() + std::time::Duration::from_millis(20);
        assert!(matches!(
            recv(&b, Some(deadline), None, &mut spin()),
            Err(RecvError::TimedOut)
        ));
        drop(a);
        assert!(matches!(
            recv(&b, None, None, &mut spin()),
            Err(RecvError::Closed)
        ));
    }
}
