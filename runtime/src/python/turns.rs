//! Turns on the GIL for op calls: while threads contend for it, one thread at a time has a turn
//! of about a millisecond and makes its calls one after another; the others wait in pyop, parked,
//! instead of in CPython's `take_gil`.
//!
//! Why: CPython's GIL wakes a waiting thread every time it is let go, and a woken thread takes it
//! when it finds it free. A thread calling a short op in a loop lets the GIL go between calls for
//! a fraction of a microsecond; whether woken threads catch it there decides, run by run, whether
//! threads keep the GIL for long stretches (most calls then wait for no one) or hand it over every
//! few calls (each hand-over makes a call wait for a thread to wake: tens of µs). Measured with 8
//! threads on 2 CPUs, the 99th percentile call took 1.4× the median in some runs and 160–250× in
//! others, with half the throughput.
//!
//! The rules (one atomic word, [`STATE`], holds the owner of the turn and the flags):
//! - A call starts at once when the turn is this thread's, or nobody's, or its owner is between
//!   calls and nobody waits (the common, uncontended call: one load and one compare-exchange, and
//!   one more at its end).
//! - Otherwise the thread waits. The first waiter is the *head*: it parks for [`POLL`] at a time
//!   and looks at the owner; other waiters park in a queue and become the head in turn.
//! - An owner calling in a loop (back within [`IDLE`] of its last call, or within twice what its
//!   calls take) keeps its turn while others wait, until the head has waited [`TURN`]; then it
//!   hands the turn over at the end of its call, to the head, woken by pyop with the GIL free for
//!   it. An owner that is not calling in a loop lets its turn go at the end of each call while
//!   others wait, to whoever comes first, as CPython's GIL would. An owner that started no call
//!   for a whole poll (it is away, or inside one long body, perhaps one that let the GIL go)
//!   loses the turn to the head, which goes on to the GIL: the turn never holds anyone back from
//!   a GIL that is free for long. A call seen to last a whole poll also marks calls as long
//!   ([`LONG_CALLS`]): until a call shorter than a poll is seen again, threads that would wait
//!   go straight on to the GIL, as without turns (turns help short calls only).
//! - Every park has a time limit, so no wake-up can be lost for good: a turn handed to a thread
//!   that never takes it is taken from it after four polls. A queue left without a head (its
//!   promoted thread started at once) is given one by the next call that starts.
//! - The turn is advisory, not a lock: a thread holding the GIL (a body calling an op) and a call
//!   nested inside another call of the same thread never wait for it, and a thread that took the
//!   turn from an owner still inside a call goes on to CPython's own GIL, which keeps them apart.
//!   No thread waits on a turn for anything but time or another thread's calls, so it adds no
//!   deadlock: a body that blocks loses its turn within a poll.
//! - In a child after `fork` turns are off (`pthread_atfork`): the threads it inherited as
//!   owner, head or queue do not exist there.
//!
//! `PYOP_GIL_TURNS=0` in the environment turns the turns off (every call goes straight to
//! CPython's GIL, as before pyop 0.4).

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::stats::{TURNS_HANDED, TURNS_TAKEN, TURN_WAITS};

/// How often the head waiter looks at the owner.
const POLL: Duration = Duration::from_micros(100);
/// An owner that stays out of calls longer than this, and longer than twice its calls take, is
/// not calling in a loop: it hands its turn over at the end of each call while others wait, as
/// CPython's GIL would.
const IDLE: Duration = Duration::from_micros(5);
/// How long the head waits while the owner calls in a loop before the turn is handed over.
const TURN: Duration = Duration::from_millis(1);
/// How long a queued waiter parks before it looks for itself (a safety net: queued waiters are
/// woken when they become the head).
const LONG: Duration = Duration::from_millis(50);
/// While others wait, the owner measures one call in this many, and the time from its end to
/// the next call (three clock reads).
const SAMPLE_EVERY: u8 = 8;

/// The owner is inside a call.
const BUSY: u64 = 1;
/// The head has waited a whole [`TURN`]: the owner hands the turn over at the end of its call.
const REQUEST: u64 = 2;
/// The turn was handed to the owner, which has not started its call yet.
const HANDED: u64 = 4;
/// A thread waits as the head (whether parked or looking).
const HEAD: u64 = 8;
/// Threads may be parked in the queue.
const QUEUED: u64 = 16;
/// The count of calls started (27 bits, wrapping): bits 5 to 31. Bits 32 to 63 are the owner's
/// id (0: nobody's turn; ids wrap after 2^32 threads, and two threads with one id at once would
/// only both go on to the GIL, which keeps them apart).
const CALL_ONE: u64 = 32;
const CALLS: u64 = 0xFFFF_FFE0;

/// The owner of the turn and the flags above.
static STATE: AtomicU64 = AtomicU64::new(0);

/// Where a waiting thread parks: the head's place, or the queue.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    Head,
    Queue,
}

/// A parked thread: who it is, where, and how to wake it.
struct Parked {
    id: u32,
    place: Place,
    wake: Arc<Wake>,
}

/// Set when a parked thread is woken (under its own lock, so no wake-up is lost).
#[derive(Default)]
struct Wake {
    woken: Mutex<bool>,
    cond: Condvar,
}

/// The parked threads in the order they parked. (Not parking_lot_core's global table, whose
/// entries point into the parked threads' stacks: a child after `fork` inherits them, and any
/// parking_lot user there whose address hashes to the same bucket would walk them. This list is
/// never touched in such a child: turns are off there.)
static LOT: Mutex<VecDeque<Parked>> = Mutex::new(VecDeque::new());

fn lot() -> MutexGuard<'static, VecDeque<Parked>> {
    LOT.lock().unwrap_or_else(|e| e.into_inner())
}

/// How a park ended.
#[derive(PartialEq, Eq)]
enum Parking {
    Woken,
    TimedOut,
    /// Not parked: the state had changed.
    Invalid,
}

fn owner(s: u64) -> u32 {
    (s >> 32) as u32
}

/// Who has the turn and how many calls were started: what the head compares between polls.
fn calls_and_owner(s: u64) -> u64 {
    s & !(CALL_ONE - 1)
}

/// `s` with `me` starting a call: one more call, the flags of waiters kept.
fn started(s: u64, me: u32, was_head: bool) -> u64 {
    let keep = if was_head { QUEUED } else { QUEUED | HEAD };
    (u64::from(me) << 32) | ((s + CALL_ONE) & CALLS) | (s & keep) | BUSY
}

/// Whether a thread that is not in line may start a call in state `s`: the turn is its own, or
/// nobody's, or its owner is between calls and nobody waits.
fn may_start(s: u64, me: u32) -> bool {
    s & (BUSY | REQUEST | HANDED) == 0
        && (owner(s) == me || owner(s) == 0 || s & (HEAD | QUEUED) == 0)
}

/// Whether a waiting thread may start now: the turn is nobody's, or was handed to it.
fn may_start_waiting(s: u64, me: u32) -> bool {
    s & BUSY == 0 && (owner(s) == 0 || (owner(s) == me && s & REQUEST == 0))
}

struct Local {
    id: Cell<u32>,
    /// Calls started while others waited, counted to [`SAMPLE_EVERY`].
    count: Cell<u8>,
    /// When the call being measured started.
    started_at: Cell<Option<Instant>>,
    /// How long the shorter of the last two measured calls took.
    took: Cell<Duration>,
    /// How long the last measured call took.
    last_took: Cell<Duration>,
    /// When the last measured call ended: the next call measures the time out of calls from it.
    ended_at: Cell<Option<Instant>>,
    /// Whether this thread is not calling in a loop (see [`IDLE`]), as last measured.
    gapped: Cell<bool>,
    /// When this thread's call that went straight on ([`PAST`]) started.
    past_at: Cell<Option<Instant>>,
}

thread_local! {
    static LOCAL: Local = const {
        Local {
            id: Cell::new(0),
            count: Cell::new(0),
            started_at: Cell::new(None),
            took: Cell::new(Duration::ZERO),
            last_took: Cell::new(Duration::ZERO),
            ended_at: Cell::new(None),
            gapped: Cell::new(false),
            past_at: Cell::new(None),
        }
    };
}

static NEXT_ID: AtomicU32 = AtomicU32::new(1);

impl Local {
    fn id(&self) -> u32 {
        let id = self.id.get();
        if id != 0 {
            return id;
        }
        let id = loop {
            let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
            if id != NO_TURN && id != PAST {
                break id;
            }
        };
        self.id.set(id);
        id
    }
}

/// Whether turns are on: not read yet, on, off.
static ENABLED: AtomicU8 = AtomicU8::new(0);

fn enabled() -> bool {
    match ENABLED.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => read_enabled(),
    }
}

#[cold]
fn read_enabled() -> bool {
    static READ: std::sync::Once = std::sync::Once::new();
    READ.call_once(|| {
        let on = std::env::var_os("PYOP_GIL_TURNS").is_none_or(|v| v != "0");
        #[cfg(unix)]
        if on {
            // SAFETY: registers a handler that only stores two atomics (async-signal-safe).
            unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
        }
        ENABLED.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    });
    ENABLED.load(Ordering::Relaxed) == 1
}

/// In a child after `fork` (a body's `os.fork`, `multiprocessing`), only the forking thread
/// lives: the turn it may hold, the waiters and the head it inherits are gone. Turns are off
/// there (a call in progress ends finding the turn no longer its own).
#[cfg(unix)]
extern "C" fn after_fork_in_child() {
    ENABLED.store(2, Ordering::Relaxed);
    STATE.store(0, Ordering::Relaxed);
}

/// Set while calls take longer than a poll (a waiting head saw one call last a whole poll): then
/// threads that would wait for a turn go straight on to the GIL, as without turns, and time their
/// call; the first such call shorter than a poll clears it. Turns help short calls only, and
/// would make a call wait up to a poll behind a long body that lets the GIL go.
static LONG_CALLS: AtomicBool = AtomicBool::new(false);

/// This thread's turn for one call, from [`take`] until dropped: its id, or [`NO_TURN`], or
/// [`PAST`].
pub(crate) struct Turn(u32);

/// No turn: turns are off, or the call is nested in one of this thread's own.
const NO_TURN: u32 = 0;
/// Gone straight on while calls are long ([`LONG_CALLS`]), at the time in `Local::past_at`.
const PAST: u32 = u32::MAX;

/// A call that goes straight on while calls are long: timed from now.
fn past() -> Turn {
    let _ = LOCAL.try_with(|l| l.past_at.set(Some(Instant::now())));
    Turn(PAST)
}

/// Waits for this thread's turn, if it has to, and starts a call: for a call of a thread that
/// does not hold the GIL (the caller checks that). A call nested in one of this thread's own
/// (made from a body through Rust that let the GIL go) goes straight on.
#[inline]
pub(crate) fn take() -> Turn {
    if !enabled() {
        return Turn(NO_TURN);
    }
    // (`LOCAL` has no destructor, so this holds in thread-local destructors too.)
    let Ok(me) = LOCAL.try_with(Local::id) else {
        return Turn(NO_TURN);
    };
    let s = STATE.load(Ordering::Relaxed);
    if s & (BUSY | REQUEST | HANDED | HEAD | QUEUED) == 0
        && STATE
            .compare_exchange(
                s,
                started(s, me, false),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
    {
        return Turn(me);
    }
    take_contended(me)
}

/// [`take`] when others wait, or the turn is another thread's.
#[cold]
fn take_contended(me: u32) -> Turn {
    loop {
        let s = STATE.load(Ordering::Acquire);
        if owner(s) == me && s & BUSY != 0 {
            return Turn(NO_TURN); // nested in this thread's own call
        }
        if LONG_CALLS.load(Ordering::Relaxed) {
            return past();
        }
        LOCAL.with(|l| {
            if let Some(at) = l.ended_at.take() {
                l.gapped.set(at.elapsed() > IDLE.max(2 * l.took.get()));
            }
        });
        let began = if may_start(s, me) {
            STATE
                .compare_exchange(
                    s,
                    started(s, me, false),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
        } else {
            wait(me)
        };
        // A queue left without a head (its promoted thread started without becoming the head)
        // gets one, so that someone watches the owner.
        if STATE.load(Ordering::Acquire) & (QUEUED | HEAD) == QUEUED {
            promote();
        }
        if !began {
            if LONG_CALLS.load(Ordering::Relaxed) {
                return past(); // left the line
            }
            continue; // the compare-exchange lost
        }
        LOCAL.with(measure);
        return Turn(me);
    }
}

/// Counts a call started while others wait, and measures it when its count comes.
fn measure(l: &Local) {
    let n = l.count.get().wrapping_add(1);
    l.count.set(n);
    // The first such call is measured, then one in [`SAMPLE_EVERY`].
    if n % SAMPLE_EVERY == 1 || l.gapped.get() {
        l.started_at.set(Some(Instant::now()));
    }
}

impl Drop for Turn {
    #[inline]
    fn drop(&mut self) {
        let me = self.0;
        if me == NO_TURN {
            return;
        }
        if me == PAST {
            return ended_past();
        }
        let s = STATE.load(Ordering::Relaxed);
        if owner(s) == me
            && s & (REQUEST | HEAD | QUEUED) == 0
            && STATE
                .compare_exchange(s, s & !BUSY, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            return;
        }
        ended(me);
    }
}

/// The end of a call that went straight on: calls are no longer long if it was short.
#[cold]
fn ended_past() {
    let short = LOCAL
        .try_with(|l| l.past_at.take().is_some_and(|at| at.elapsed() < POLL))
        .unwrap_or(false);
    if short {
        LONG_CALLS.store(false, Ordering::Relaxed);
    }
}

/// The end of a call while others wait, or when the turn was taken meanwhile.
#[cold]
fn ended(me: u32) {
    let gapped = LOCAL
        .try_with(|l| {
            if let Some(started) = l.started_at.take() {
                let now = Instant::now();
                // The shorter of the last two: one call delayed (by a CPU it lost, by the GIL
                // held elsewhere) does not make a loop look like one.
                let took = now.duration_since(started);
                l.took.set(took.min(l.last_took.replace(took)));
                l.ended_at.set(Some(now));
            }
            l.gapped.get()
        })
        .unwrap_or(true);
    loop {
        let s = STATE.load(Ordering::Acquire);
        if owner(s) != me || s & BUSY == 0 {
            return; // the turn was taken while this call ran
        }
        if s & REQUEST != 0 {
            hand_over(me);
            return;
        }
        if gapped && s & (HEAD | QUEUED) != 0 {
            give_up(me);
            return;
        }
        if STATE
            .compare_exchange(s, s & !BUSY, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
    }
}

/// Hands `me`'s turn to the head, else to the longest-waiting queued thread, else to nobody.
fn hand_over(me: u32) {
    if !hand_to_parked(Place::Head, me) && !hand_to_parked(Place::Queue, me) {
        let_go(me);
    }
}

/// Makes `me`'s turn nobody's (the waiters' flags kept); false if it was not `me`'s.
fn let_go(me: u32) -> bool {
    loop {
        let s = STATE.load(Ordering::Acquire);
        if owner(s) != me {
            return false;
        }
        let free = s & (QUEUED | HEAD | CALLS);
        if STATE
            .compare_exchange(s, free, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            return true;
        }
    }
}

/// Ends `me`'s call and lets its turn go to whoever comes first, waking the head: an owner that
/// is not calling in a loop, as CPython's GIL lets go (a turn handed to one thread would wait for
/// that thread to get a CPU).
fn give_up(me: u32) {
    if !let_go(me) {
        return;
    }
    TURNS_HANDED.fetch_add(1, Ordering::Relaxed);
    unpark_first(Place::Head, |_, _| {});
}

/// Wakes the first thread parked at `place`, after `f(its id, whether others stay parked there)`
/// ran under the lot's lock; false if none was parked.
fn unpark_first(place: Place, f: impl FnOnce(u32, bool)) -> bool {
    let mut lot = lot();
    let Some(i) = lot.iter().position(|p| p.place == place) else {
        return false;
    };
    let parked = lot.remove(i).expect("a position found");
    f(parked.id, lot.iter().any(|p| p.place == place));
    drop(lot);
    *parked.wake.woken.lock().unwrap_or_else(|e| e.into_inner()) = true;
    parked.wake.cond.notify_one();
    true
}

/// Wakes the first thread parked at `place` and makes the turn its own; false if none was parked.
fn hand_to_parked(place: Place, me: u32) -> bool {
    let handed = unpark_first(place, |to, more| loop {
        let s = STATE.load(Ordering::Acquire);
        if owner(s) != me {
            // Taken meanwhile: the woken thread looks again.
            return;
        }
        let mut handed =
            (u64::from(to) << 32) | ((s + CALL_ONE) & CALLS) | (s & (QUEUED | HEAD)) | HANDED;
        if place == Place::Queue && !more {
            handed &= !QUEUED;
        }
        if STATE
            .compare_exchange(s, handed, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
    });
    if handed {
        TURNS_HANDED.fetch_add(1, Ordering::Relaxed);
    }
    handed
}

/// Wakes one queued thread, to become the head.
fn promote() {
    unpark_first(Place::Queue, |_, more| {
        if !more {
            STATE.fetch_and(!QUEUED, Ordering::AcqRel);
        }
    });
}

/// Parks this thread at `place` until woken or `timeout`, unless it may start already (or, for
/// the queue, there is no head: then it is to become the head).
fn park(place: Place, me: u32, timeout: Duration) -> Parking {
    let queue = place == Place::Queue;
    let wake = Arc::new(Wake::default());
    {
        let mut lot = lot();
        let s = STATE.load(Ordering::Acquire);
        if may_start_waiting(s, me) || (queue && s & HEAD == 0) {
            return Parking::Invalid;
        }
        if queue {
            STATE.fetch_or(QUEUED, Ordering::AcqRel);
        }
        lot.push_back(Parked {
            id: me,
            place,
            wake: Arc::clone(&wake),
        });
    }
    let deadline = Instant::now() + timeout;
    {
        let mut woken = wake.woken.lock().unwrap_or_else(|e| e.into_inner());
        while !*woken {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            woken = wake
                .cond
                .wait_timeout(woken, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        if *woken {
            return Parking::Woken;
        }
    }
    // Timed out, unless a wake-up took it off the lot meanwhile.
    let mut lot = lot();
    match lot.iter().position(|p| Arc::ptr_eq(&p.wake, &wake)) {
        Some(i) => {
            lot.remove(i);
            if queue && !lot.iter().any(|p| p.place == Place::Queue) {
                STATE.fetch_and(!QUEUED, Ordering::AcqRel);
            }
            Parking::TimedOut
        }
        None => Parking::Woken,
    }
}

/// Waits until `me` may start a call, and starts it; false if it left the line instead, calls
/// having turned out long ([`LONG_CALLS`]).
#[cold]
fn wait(me: u32) -> bool {
    TURN_WAITS.fetch_add(1, Ordering::Relaxed);
    let mut head = false;
    // How many polls in a row the head has seen no call start, and since when it is the head.
    let mut still = 0u32;
    let mut head_since = Instant::now();
    loop {
        if LONG_CALLS.load(Ordering::Relaxed) {
            if head {
                STATE.fetch_and(!HEAD, Ordering::AcqRel);
                promote();
            }
            return false;
        }
        let s = STATE.load(Ordering::Acquire);
        if may_start_waiting(s, me) || (!head && may_start(s, me)) {
            if STATE
                .compare_exchange(s, started(s, me, head), Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                if head {
                    promote();
                }
                return true;
            }
            continue;
        }
        if owner(s) == me && s & BUSY == 0 {
            // Asked for this thread's turn while it was between calls.
            hand_over(me);
            continue;
        }
        if !head {
            if s & HEAD == 0 {
                if STATE
                    .compare_exchange(s, s | HEAD, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    head = true;
                    still = 0;
                    head_since = Instant::now();
                }
                continue;
            }
            let before = calls_and_owner(s);
            if park(Place::Queue, me, LONG) == Parking::TimedOut
                && calls_and_owner(STATE.load(Ordering::Acquire)) == before
            {
                // Nothing moved for a long park: whoever should be calling is gone.
                take_over(me);
                return true;
            }
            continue;
        }
        let now = Instant::now();
        if s & REQUEST == 0 && now.duration_since(head_since) >= TURN {
            STATE.fetch_or(REQUEST, Ordering::AcqRel);
        }
        park(Place::Head, me, POLL);
        let after = STATE.load(Ordering::Acquire);
        if calls_and_owner(after) == calls_and_owner(s) && now.elapsed() >= POLL {
            // No call started for a whole poll: the owner is away, or inside one long call
            // (perhaps without the GIL: taking the turn lets this thread go on to the GIL, as
            // it would without turns); or, handed the turn, has not woken for four polls.
            still += 1;
            if (after & HANDED == 0 || still >= 4)
                && !may_start_waiting(after, me)
                && try_take_over(after, me)
            {
                if after & BUSY != 0 {
                    LONG_CALLS.store(true, Ordering::Relaxed);
                }
                return true;
            }
        } else {
            still = 0;
        }
    }
}

/// The head takes the turn from an owner that is not using it (state `s`): false if it moved.
fn try_take_over(s: u64, me: u32) -> bool {
    let taken = STATE
        .compare_exchange(s, started(s, me, true), Ordering::AcqRel, Ordering::Relaxed)
        .is_ok();
    if taken {
        TURNS_TAKEN.fetch_add(1, Ordering::Relaxed);
        promote();
    }
    taken
}

/// Takes the turn whatever its state (nothing has moved for [`LONG`]).
fn take_over(me: u32) {
    loop {
        let s = STATE.load(Ordering::Acquire);
        if STATE
            .compare_exchange(
                s,
                started(s, me, false),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
        {
            TURNS_TAKEN.fetch_add(1, Ordering::Relaxed);
            return;
        }
    }
}
