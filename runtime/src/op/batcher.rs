//! The queue of a batching op ([`Batch`]): which call leads a batch, which wait, and what a
//! batch is made of. `op::batch` runs the batches.
//!
//! No thread of pyop's own: the calls combine among themselves. Every call joins the op's queue;
//! the one that finds no batch running leads: it waits up to `wait` for company (until as many
//! calls of its kind are queued as the last batch had, `Queue::target`), takes up to `max`
//! queued calls that can share a body call with its own (the same dtypes, trailing shapes,
//! unstacked arguments, device and time limit), runs them, hands every caller its result and
//! passes the lead to the oldest call still queued. The others wait, without the GIL, until
//! their result or the lead reaches them; an awaited call never waits for the lead (its task
//! may not be polled for a while): its batch is led on pyop's threads for it (`Handover`'s
//! `spawn`). A call alone with `wait` zero runs as an unbatched call, with no copy.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, DeviceLocation, Tensor, TensorId};
use smallvec::SmallVec;

use crate::arg::{Arg, OwnedArgs};
use crate::bridge::outputs::Outputs;
use crate::error::{Error, ErrorKind, Result};
use crate::spec::Batch;

/// The queue of one batching op's calls.
pub(crate) struct Batcher {
    pub(crate) batch: Batch,
    /// How many batches may run at once: the size of the op's worker pool (each batch is one
    /// request), 1 in the program (bodies take turns on the GIL anyway).
    side_by_side: usize,
    queue: Mutex<Queue>,
    /// The leader waits here for company.
    company: Condvar,
}

struct Queue {
    /// How many calls the leader waits for: `max` before the first batch; then the size of a
    /// batch that reached it, or halfway down to the size of a batch that fell short (`wait`
    /// ran out). Threads that each call again when answered come back as a batch of their
    /// number, so the leader runs as soon as they are back instead of waiting out `wait` for
    /// calls that are not coming; a late one (a slow wake-up) does not split them into two
    /// smaller batches for good, as taking the last batch's size would; a caller left alone
    /// stops waiting after a few calls (8 → 4 → 2 → 1); calls that queue while a batch runs
    /// raise it at once.
    target: usize,
    /// A batch is being gathered, or run by a leader that keeps the lead until it is done (when
    /// `side_by_side` batches run): its leader hands the lead on.
    led: bool,
    /// Batches running now.
    running: usize,
    /// The leader is waiting for company (arrivals that fill a batch wake it).
    gathering: bool,
    waiting: VecDeque<Arc<Entry>>,
}

/// One queued call.
pub(crate) struct Entry {
    pub(crate) args: OwnedArgs,
    kind: Kind,
    /// Its size along axis 0 of its stacked inputs.
    pub(crate) rows: usize,
    pub(crate) timeout: Option<Duration>,
    pub(crate) device: Option<Device>,
    pub(crate) arrived: Instant,
    /// An awaited call: the lead is not given to it, its batch is led for it.
    awaited: bool,
    turn: Mutex<Slot>,
    /// A blocked caller waits here (an awaited one leaves its waker in the slot).
    ready: Condvar,
}

/// What reaches a queued call, and who to wake for it.
struct Slot {
    turn: Turn,
    waker: Option<std::task::Waker>,
    /// The awaited call was dropped: nothing given reaches it.
    gone: bool,
    /// An awaited call whose batch a job on pyop's threads leads: it stays queued until then.
    led_for: bool,
}

/// Where a call stands once it joined the queue and waited (`Batcher::enter`).
pub(crate) enum Place {
    /// Alone, with its rows: it runs as an unbatched call.
    Alone(usize, Started),
    /// It leads a batch (`Batcher::gather`, then its run).
    Leads(Arc<Entry>),
    /// Another call's batch served it.
    Done(Result<Outputs>),
}

/// Where a call stands once it joined the queue, before any wait (`Batcher::join`).
pub(crate) enum Joined {
    /// Alone, with its rows: it runs as an unbatched call.
    Alone(usize, Started),
    /// It leads a batch.
    Leads(Arc<Entry>),
    /// Queued: its result (or, for a blocked call, the lead) reaches it ([`Waiting`]).
    Queued(Arc<Entry>),
}

/// A batch that started running.
#[derive(Clone, Copy)]
pub(crate) struct Started {
    /// Its leader passed the lead on when it started (fewer than `side_by_side` batches ran);
    /// else it passes it on when done.
    passed: bool,
}

/// What a queued call is waiting for.
enum Turn {
    Waiting,
    /// The lead: the call gathers and runs the next batch.
    Lead,
    Done(Result<Outputs>),
}

/// What calls of one batch must share: per argument, the dtype and the shape past axis 0 of a
/// stacked tensor, the identity of an unstacked tensor, the value of a plain argument; and the
/// call's device and time limit.
#[derive(PartialEq)]
struct Kind {
    args: SmallVec<[Part; 4]>,
    device: Option<DeviceLocation>,
    timeout: Option<Duration>,
}

#[derive(PartialEq)]
enum Part {
    Rows {
        dtype: DType,
        rest: SmallVec<[usize; 4]>,
        device: DeviceLocation,
    },
    Same(SmallVec<[TensorId; 1]>),
    Value(Plain),
}

/// A plain argument's value, compared as written: a float by its bits (`-0.0` is not `0.0`, a
/// NaN is itself, so a call is always of its own kind).
struct Plain(crate::arg::Kept<(), ()>);

impl PartialEq for Plain {
    fn eq(&self, other: &Self) -> bool {
        use crate::arg::Kept as K;
        fn bits<T: Copy, B: PartialEq>(a: &[T], b: &[T], f: impl Fn(T) -> B) -> bool {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| f(*x) == f(*y))
        }
        match (&self.0, &other.0) {
            (K::F64(a), K::F64(b)) => a.to_bits() == b.to_bits(),
            (K::F64s(a), K::F64s(b)) => bits(a, b, f64::to_bits),
            (K::F32s(a), K::F32s(b)) => bits(a, b, f32::to_bits),
            (K::I64(a), K::I64(b)) => a == b,
            (K::Bool(a), K::Bool(b)) => a == b,
            (K::Str(a), K::Str(b)) => a == b,
            (K::I64s(a), K::I64s(b)) => a == b,
            (K::U64(a), K::U64(b)) => a == b,
            (K::Usizes(a), K::Usizes(b)) => a == b,
            (K::None, K::None) => true,
            _ => false,
        }
    }
}

impl Batcher {
    /// A batcher whose batches run `side_by_side` at most at once (at least 1).
    pub(crate) fn new(batch: Batch, side_by_side: usize) -> Self {
        Batcher {
            side_by_side: side_by_side.max(1),
            queue: Mutex::new(Queue {
                target: batch.max,
                running: 0,
                led: false,
                gathering: false,
                waiting: VecDeque::new(),
            }),
            batch,
            company: Condvar::new(),
        }
    }

    /// Whether argument `i` is stacked along axis 0.
    pub(crate) fn stacked(&self, i: usize, arg: &Arg<'_>) -> bool {
        match &self.batch.inputs {
            Some(inputs) => inputs.contains(&i),
            None => matches!(arg, Arg::Tensor(_)),
        }
    }

    /// The leader's wait for company: up to `wait` after `own` came, or until the target's
    /// number of calls of its kind are queued (`Queue::target`); then the batch, taken off the
    /// queue: calls of `own`'s kind in the order they came. `own` is the oldest queued call (a
    /// call leads only when it found the queue empty, or as its oldest), so it is first. While
    /// fewer than `side_by_side` batches run, the lead is passed on at once, so that the next
    /// batch gathers while this one runs (`Started::passed`).
    pub(crate) fn gather(
        &self,
        own: &Arc<Entry>,
        spawn: &(dyn Fn(Arc<Entry>) + Sync),
    ) -> (Vec<Arc<Entry>>, Started) {
        let max = self.batch.max;
        let mut queue = self.lock();
        let deadline = own.arrived + self.batch.wait;
        loop {
            let company = queue.waiting.iter().filter(|e| e.kind == own.kind).count();
            let now = Instant::now();
            if company >= queue.target || now >= deadline {
                break;
            }
            queue.gathering = true;
            queue = self
                .company
                .wait_timeout(queue, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            queue.gathering = false;
        }
        debug_assert!(queue.waiting.front().is_some_and(|e| Arc::ptr_eq(e, own)));
        let mut batch: Vec<Arc<Entry>> = Vec::with_capacity(max.min(queue.waiting.len()));
        batch.push(own.clone());
        let mut kept = VecDeque::with_capacity(queue.waiting.len());
        for e in queue.waiting.drain(..) {
            if Arc::ptr_eq(&e, own) {
                continue;
            }
            if batch.len() < max && e.kind == own.kind {
                batch.push(e);
            } else {
                kept.push_back(e);
            }
        }
        queue.waiting = kept;
        queue.target = if batch.len() >= queue.target {
            batch.len()
        } else {
            (queue.target + batch.len()) / 2
        };
        let started = self.start(&mut queue);
        if started.passed {
            pass_lead_locked(queue, spawn);
        }
        (batch, started)
    }

    /// A batch starts (`queue` locked): whether its leader passes the lead on now.
    fn start(&self, queue: &mut Queue) -> Started {
        queue.running += 1;
        Started {
            passed: queue.running < self.side_by_side,
        }
    }

    /// A call joins the queue and waits, blocked, until its result or the lead reaches it:
    /// alone (none queued, no batch running, no `wait`: it runs as an unbatched call, then hands
    /// over with [`Handover::done`]), or leading a batch, or served by another call's batch; why
    /// it cannot be batched otherwise.
    pub(crate) fn enter(
        &self,
        op: &str,
        args: &[Arg<'_>],
        device: Option<&Device>,
        timeout: Option<Duration>,
    ) -> Result<Place> {
        let entry = match self.join(op, args, device, timeout, false)? {
            Joined::Alone(rows, started) => return Ok(Place::Alone(rows, started)),
            Joined::Leads(entry) => return Ok(Place::Leads(entry)),
            Joined::Queued(entry) => entry,
        };
        // Wait, without the GIL (the leader may need it), for the result or for the lead.
        let turn = crate::python::without_gil(|| {
            let mut slot = entry.slot();
            loop {
                match std::mem::replace(&mut slot.turn, Turn::Waiting) {
                    Turn::Waiting => {
                        slot = entry.ready.wait(slot).unwrap_or_else(|p| p.into_inner())
                    }
                    got => return got,
                }
            }
        });
        Ok(match turn {
            Turn::Done(result) => Place::Done(result),
            Turn::Lead => Place::Leads(entry),
            Turn::Waiting => unreachable!("a turn is returned once it changed"),
        })
    }

    /// A call joins the queue, without waiting (see [`enter`](Self::enter)); `awaited`: the
    /// lead is never given to it (see [`Waiting`]).
    pub(crate) fn join(
        &self,
        op: &str,
        args: &[Arg<'_>],
        device: Option<&Device>,
        timeout: Option<Duration>,
        awaited: bool,
    ) -> Result<Joined> {
        let rows = self.rows(op, args)?;
        if self.batch.wait.is_zero() {
            let mut queue = self.lock();
            if !queue.led && queue.waiting.is_empty() {
                let started = self.start(&mut queue);
                // With room for more batches, the next call leads at once.
                queue.led = !started.passed;
                return Ok(Joined::Alone(rows, started));
            }
        }
        // Made outside the lock; what the queue looks like is read again below.
        let entry = Arc::new(Entry {
            args: OwnedArgs::new(args),
            kind: self.kind(args, device, timeout),
            rows,
            timeout,
            device: device.cloned(),
            arrived: Instant::now(),
            awaited,
            turn: Mutex::new(Slot {
                turn: Turn::Waiting,
                waker: None,
                gone: false,
                led_for: false,
            }),
            ready: Condvar::new(),
        });
        let mut queue = self.lock();
        queue.waiting.push_back(entry.clone());
        if !queue.led {
            queue.led = true;
            return Ok(Joined::Leads(entry));
        }
        if queue.gathering && queue.waiting.len() >= queue.target {
            self.company.notify_one();
        }
        Ok(Joined::Queued(entry))
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A panic while the lock is held leaves the queue as it was (no user code runs under it).
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The call's rows (axis 0 of its stacked inputs), or why it cannot be batched.
    fn rows(&self, op: &str, args: &[Arg<'_>]) -> Result<usize> {
        let mut rows: Option<(usize, usize)> = None;
        for (i, arg) in args.iter().enumerate() {
            if !self.stacked(i, arg) {
                continue;
            }
            let Arg::Tensor(t) = arg else {
                return Err(refused(
                    op,
                    format!("argument {i} is stacked by the op's batching but is not a tensor"),
                ));
            };
            let Some(&n) = t.dims().first() else {
                return Err(refused(
                    op,
                    format!(
                        "argument {i} is a 0-d tensor: a batching op stacks its inputs along \
                         axis 0, so each needs one"
                    ),
                ));
            };
            match rows {
                None => rows = Some((i, n)),
                Some((j, m)) if m != n => {
                    return Err(refused(
                        op,
                        format!(
                            "argument {j} has {m} rows and argument {i} has {n}: a batching \
                             op's stacked inputs have the same size along axis 0"
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        match rows {
            Some((_, rows)) => Ok(rows),
            None => Err(refused(
                op,
                "no argument is stacked: a batching op needs a tensor argument to stack \
                 along axis 0"
                    .into(),
            )),
        }
    }

    /// The call's kind (its arguments checked by [`rows`](Self::rows)).
    fn kind(&self, args: &[Arg<'_>], device: Option<&Device>, timeout: Option<Duration>) -> Kind {
        let parts = args
            .iter()
            .enumerate()
            .map(|(i, arg)| match arg {
                Arg::Tensor(t) if self.stacked(i, arg) => Part::Rows {
                    dtype: t.dtype(),
                    rest: t.dims()[1..].into(),
                    device: t.device().location(),
                },
                Arg::Tensor(t) => Part::Same(smallvec::smallvec![t.id()]),
                Arg::Tensors(ts) => Part::Same(ts.iter().map(Tensor::id).collect()),
                plain => Part::Value(Plain(crate::arg::Kept::new(plain, |_| (), |_| ()))),
            })
            .collect();
        Kind {
            args: parts,
            device: device.map(Device::location),
            timeout,
        }
    }
}

fn refused(op: &str, message: String) -> Error {
    Error::op_failure(op, ErrorKind::InvalidArgument, message)
}

/// The lead passed on when a batch is done, the others' results handed out; on a panic of the
/// leader (unwinding through here), each gets an error instead of waiting for ever.
pub(crate) struct Handover<'a> {
    batcher: &'a Batcher,
    batch: &'a [Arc<Entry>],
    started: Started,
    op: &'a str,
    /// Leads the batch of an awaited call the lead reaches, on pyop's threads.
    spawn: &'a (dyn Fn(Arc<Entry>) + Sync),
}

impl<'a> Handover<'a> {
    /// The handover of a leader's `batch` (the leader's own call first).
    pub(crate) fn of(
        batcher: &'a Batcher,
        batch: &'a [Arc<Entry>],
        started: Started,
        op: &'a str,
        spawn: &'a (dyn Fn(Arc<Entry>) + Sync),
    ) -> Self {
        Handover {
            batcher,
            batch,
            started,
            op,
            spawn,
        }
    }

    /// Hands out the others' results and passes the lead on.
    pub(crate) fn done(self, results: Vec<(Arc<Entry>, Result<Outputs>)>) {
        for (e, r) in results {
            give(&e, Turn::Done(r));
        }
        self.batcher.finish(self.started, self.spawn);
        std::mem::forget(self);
    }
}

impl Drop for Handover<'_> {
    fn drop(&mut self) {
        for e in self.batch {
            give(
                e,
                Turn::Done(Err(Error::op_failure(
                    self.op,
                    ErrorKind::Panic,
                    "the thread running this call's batch panicked",
                ))),
            );
        }
        self.batcher.finish(self.started, self.spawn);
    }
}

impl Entry {
    fn slot(&self) -> MutexGuard<'_, Slot> {
        self.turn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Gives this (awaited) call its result.
    pub(crate) fn answer(&self, result: Result<Outputs>) {
        give(self, Turn::Done(result));
    }
}

/// Gives `e` its turn and wakes it (nothing reaches an awaited call that was dropped).
fn give(e: &Entry, turn: Turn) {
    let mut slot = e.slot();
    if slot.gone {
        return;
    }
    slot.turn = turn;
    if let Some(waker) = slot.waker.take() {
        waker.wake();
    }
    e.ready.notify_one();
}

impl Batcher {
    /// A batch is done: the lead passed on, if its leader kept it.
    fn finish(&self, started: Started, spawn: &(dyn Fn(Arc<Entry>) + Sync)) {
        let mut queue = self.lock();
        queue.running -= 1;
        if !started.passed {
            pass_lead_locked(queue, spawn);
        }
    }
}

/// The oldest queued call leads the next batch: a blocked one itself, an awaited one through
/// `spawn` (dropped ones are skipped); with none queued, the next call leads. Decided under
/// the queue's lock, so that a dropped awaited call ([`Waiting`]'s drop) either leaves the
/// queue before or stays for the batch led for it.
fn pass_lead_locked(mut queue: MutexGuard<'_, Queue>, spawn: &(dyn Fn(Arc<Entry>) + Sync)) {
    loop {
        let Some(next) = queue.waiting.front().cloned() else {
            queue.led = false;
            return;
        };
        let mut slot = next.slot();
        if slot.gone {
            drop(slot);
            queue.waiting.pop_front();
            continue;
        }
        queue.led = true;
        if next.awaited {
            slot.led_for = true;
            drop(slot);
            drop(queue);
            spawn(next);
        } else {
            slot.turn = Turn::Lead;
            next.ready.notify_one();
        }
        return;
    }
}

/// An awaited call's wait in the queue for its result (its batch led by another call, or for it
/// on pyop's threads). Dropped before that, the call leaves the queue (its rows are not run),
/// unless its batch is already being led for it.
pub(crate) struct Waiting<'a> {
    pub(crate) batcher: &'a Batcher,
    pub(crate) entry: Arc<Entry>,
    pub(crate) done: bool,
}

impl std::future::Future for Waiting<'_> {
    type Output = Result<Outputs>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<Outputs>> {
        let mut slot = self.entry.slot();
        match std::mem::replace(&mut slot.turn, Turn::Waiting) {
            Turn::Done(result) => {
                drop(slot);
                self.done = true;
                std::task::Poll::Ready(result)
            }
            Turn::Lead => unreachable!("the lead is not given to an awaited call"),
            Turn::Waiting => {
                match &mut slot.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    w => *w = Some(cx.waker().clone()),
                }
                std::task::Poll::Pending
            }
        }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // The queue's lock before the slot's, as in `pass_lead`.
        let mut queue = self.batcher.lock();
        let mut slot = self.entry.slot();
        slot.gone = true;
        if !slot.led_for {
            queue.waiting.retain(|e| !Arc::ptr_eq(e, &self.entry));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Arg::*;

    fn plain(a: Arg<'_>) -> Plain {
        Plain(crate::arg::Kept::new(&a, |_| (), |_| ()))
    }

    /// Calls share a batch only with the same plain values: each kind of value equals itself
    /// and no other, a different value of one kind differs, floats compare by their bits.
    #[test]
    fn plain_values_are_equal_as_written() {
        let values = [
            F64(1.5),
            F64s(&[1.0, 2.0]),
            F32s(&[1.0]),
            I64(3),
            Bool(true),
            Str("a"),
            I64s(&[1, 2]),
            U64(7),
            Usizes(&[1]),
            Arg::None,
        ];
        for (i, a) in values.iter().enumerate() {
            for (j, b) in values.iter().enumerate() {
                assert_eq!(plain(*a) == plain(*b), i == j, "{a:?} and {b:?}");
            }
        }
        let differ = [
            (F64(1.0), F64(2.0)),
            (F64s(&[1.0]), F64s(&[1.0, 1.0])),
            (F64s(&[1.0, 2.0]), F64s(&[1.0, 3.0])),
            (F32s(&[1.0]), F32s(&[2.0])),
            (I64(1), I64(2)),
            (Bool(true), Bool(false)),
            (Str("a"), Str("b")),
            (I64s(&[1]), I64s(&[2])),
            (U64(1), U64(2)),
            (Usizes(&[1]), Usizes(&[2])),
        ];
        for (a, b) in differ {
            assert!(plain(a) != plain(b), "{a:?} and {b:?}");
        }
        assert!(plain(F64(f64::NAN)) == plain(F64(f64::NAN)));
        assert!(plain(F64s(&[f64::NAN])) == plain(F64s(&[f64::NAN])));
        assert!(plain(F64(0.0)) != plain(F64(-0.0)));
        assert!(plain(F32s(&[0.0])) != plain(F32s(&[-0.0])));
    }
}
