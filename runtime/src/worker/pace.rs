//! How a caller waits for a worker's reply: asleep while the body runs, awake when its reply is
//! due.
//!
//! A thread woken from sleep costs tens of microseconds on a virtual machine (the vCPU it slept
//! on has to be woken too: ~35-40 µs across vCPUs here), and a timed sleep ends ~50-100 µs late
//! (timer slack, the same wake-up); checking the socket instead (spinning) costs a core. So a
//! caller sleeps until shortly before the reply is due, by a moving average of what this
//! function took on this worker before, and checks for it from then until a little after; a
//! reply outside that window wakes it from sleep. A call of unknown length is checked for
//! [`FIRST_SPIN`] first, as a quick body's reply comes back sooner than a wake-up. A reply that
//! woke the caller before its window means the estimate was too long (the time measured then
//! counts a wake-up too, and an average of such times would stay too long): the estimate drops
//! below it.
//!
//! No caller spins while other runnable threads fill every CPU: a spinning thread would take a
//! core from one that works. Each check gives the CPU to any thread waiting for it (a yield), so
//! a spinner on a crowded CPU finds itself off it between checks; a spell of checking that
//! spent more than half its time off the CPU ([`Checking`]) turns spinning off for a while
//! (every caller's; a worker judges its own spins the same way), longer each time it finds the
//! CPUs crowded again. That is measured where the cost falls, by the spinner itself: it sees what a load
//! average cannot (another virtual machine's load on the host's cores, a moment's burst), and it
//! does not see what does not matter (a runnable thread on another CPU that no spinner shares).
//!
//! The worker's side of the same (checking for the next request after a reply) is in
//! `worker.py`, `_wait_awake`; how each side waited is counted per pool ([`WaitStats`](crate::WaitStats)).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub(crate) use super::protocol::Waited;

/// How long a call of unknown length is checked for before the caller sleeps.
pub(crate) const FIRST_SPIN: Duration = Duration::from_micros(50);
/// The longest a caller checks for a reply in one wait: a body whose length varies more than
/// this is waited for asleep.
pub(crate) const MAX_SPIN: Duration = Duration::from_micros(600);
/// How long spinning stays off once a spinner found the CPUs crowded, the first time; doubled
/// each time it finds them crowded again when it tries next, up to [`LONGEST_BACK_OFF`].
pub(crate) const BACK_OFF: Duration = Duration::from_millis(20);
/// The longest spinning stays off at a time.
pub(crate) const LONGEST_BACK_OFF: Duration = Duration::from_secs(1);
/// The least time off the CPU that says a spell of checking found it crowded: another thread's
/// time slice (a scheduler gives a CPU-bound thread 0.75-3 ms at a time). Less is the worker it
/// waits for, sharing its CPU, running a scalar call's 13-30 µs of Python, to which the yield
/// is meant to give the CPU: counting that (any pause over 20 µs between checks) turned
/// spinning off a hundred times in 2,000 scalar calls here.
const OFF_CPU: Duration = Duration::from_micros(200);
/// How many functions' estimates a worker keeps (the most recently called).
const KEPT: usize = 8;

/// When to check for a reply instead of sleeping: from `from` until `until` (none if equal).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Spin {
    pub from: Instant,
    pub until: Instant,
    /// Set when the reply woke the caller before `from`: the estimate was too long.
    pub early: bool,
    /// How the caller waited for the message, once it came.
    pub waited: Option<Waited>,
}

impl Spin {
    /// Checking from now for `d`.
    pub(crate) fn now_for(d: Duration) -> Spin {
        let from = Instant::now();
        Spin {
            from,
            until: from
                + if spinning_allowed() {
                    d
                } else {
                    Duration::ZERO
                },
            early: false,
            waited: None,
        }
    }
}

/// One worker's estimates of how long its calls take, by function.
#[derive(Default)]
pub(crate) struct Pace {
    /// (the function's key, the estimate), most recently used last.
    estimates: Vec<(u64, Duration)>,
}

impl Pace {
    /// When to check for the reply to a call of `function` sent at `sent`.
    pub(crate) fn spin(&self, function: u64, sent: Instant) -> Spin {
        if !spinning_allowed() {
            return Spin {
                from: sent,
                until: sent,
                early: false,
                waited: None,
            };
        }
        let Some(&(_, expect)) = self.estimates.iter().find(|(k, _)| *k == function) else {
            return Spin {
                from: sent,
                until: sent + FIRST_SPIN,
                early: false,
                waited: None,
            };
        };
        window(sent, expect, lead())
    }

    /// Counts a call of `function` that took `took`, send to reply, waited for with `spin`.
    pub(crate) fn record(&mut self, function: u64, took: Duration, spin: &Spin) {
        match self.estimates.iter().position(|(k, _)| *k == function) {
            Some(i) => {
                let (k, old) = self.estimates.remove(i);
                let new = if spin.early {
                    // The reply came while the caller slept, so `took` counts a wake-up too: the
                    // estimate was too long, and one made of such times would stay so. Checked
                    // from well before next time (an estimate found too short only costs a
                    // longer spin).
                    took.min(old).saturating_sub(lead() * 2)
                } else {
                    // A moving average over about the last four calls.
                    (old * 3 + took) / 4
                };
                self.estimates.push((k, new));
            }
            None => {
                if self.estimates.len() == KEPT {
                    self.estimates.remove(0);
                }
                self.estimates.push((function, took));
            }
        }
    }
}

/// The window around a reply expected `expect` after `sent`: from `lead` before it until a little
/// after, at most [`MAX_SPIN`] long.
fn window(sent: Instant, expect: Duration, lead: Duration) -> Spin {
    let from = sent + expect.saturating_sub(lead);
    let after = (expect / 8).max(FIRST_SPIN);
    let until = (sent + expect + after).min(from + MAX_SPIN);
    Spin {
        from,
        until,
        early: false,
        waited: None,
    }
}

/// A key for `function` of the module `base` (a hash: equal names, equal keys).
pub(crate) fn function_key(base: &str, function: &str) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static STATE: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
    let mut h = STATE.get_or_init(Default::default).build_hasher();
    h.write(base.as_bytes());
    h.write_u8(0xff);
    h.write(function.as_bytes());
    h.finish()
}

/// Nanoseconds since the first use, for the atomics below.
fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// When spinning is off, for how long next, and how often it went off.
struct BackOff {
    /// Until when (`now_ns`) spinning is off: a spinner found the CPUs crowded.
    until: AtomicU64,
    /// How long (ns) spinning goes off the next time a spinner finds the CPUs crowded.
    next: AtomicU64,
    /// Spells of checking that found the CPUs crowded so far.
    crowded: AtomicU64,
}

/// The process's: every caller's spinning goes off together (they share the CPUs).
static BACK_OFF_STATE: BackOff = BackOff::new();

impl BackOff {
    const fn new() -> BackOff {
        BackOff {
            until: AtomicU64::new(0),
            next: AtomicU64::new(BACK_OFF.as_nanos() as u64),
            crowded: AtomicU64::new(0),
        }
    }

    /// Judges a spell of checking that lasted `checked`, `off` of it off the CPU, ended at
    /// `now` (`now_ns`): crowded, spinning goes off for the back-off, which doubles for next
    /// time; not crowded, the back-off is the first one again.
    fn judge(&self, checked: Duration, off: Duration, now: u64) {
        if crowded(checked, off) {
            let back_off = self.next.load(Relaxed);
            self.until.fetch_max(now.saturating_add(back_off), Relaxed);
            // Races between spinners only blur it.
            self.next.store(doubled(back_off), Relaxed);
            self.crowded.fetch_add(1, Relaxed);
        } else {
            self.next.store(BACK_OFF.as_nanos() as u64, Relaxed);
        }
    }
}

/// How late a timed sleep ends here (a moving average, in nanoseconds): how early a caller wakes
/// before a reply is due.
static LATE_NS: AtomicU64 = AtomicU64::new(40_000);

/// Whether a process may check for a message instead of sleeping: not while spinning is off
/// (a spinner found the CPUs crowded, less than the back-off ago), nor ever where
/// `PYOP_WORKER_SPIN=0` says so.
#[inline]
pub(crate) fn spinning_allowed() -> bool {
    spinning_wanted() && now_ns() >= BACK_OFF_STATE.until.load(Relaxed)
}

/// `PYOP_WORKER_SPIN`, read once: `0` (or `off`, `false`, `no`) and neither callers nor workers
/// ever check for a message without sleeping (every message pays a wake-up; no CPU time is
/// spent waiting), as `OMP_WAIT_POLICY=passive` does for OpenMP.
pub(crate) fn spinning_wanted() -> bool {
    static WANTED: OnceLock<bool> = OnceLock::new();
    *WANTED.get_or_init(|| {
        std::env::var("PYOP_WORKER_SPIN")
            .map(|v| {
                !matches!(
                    v.trim().to_ascii_lowercase().as_str(),
                    "0" | "off" | "false" | "no"
                )
            })
            .unwrap_or(true)
    })
}

/// A spell of checking for a message (a spin), measured: how long it lasted, and how much of that
/// the thread spent off its CPU (its wall time less its CPU time). Each check yields the CPU to
/// any thread waiting for it, so on a CPU another thread wants the spinner gets little of it.
/// CPU time, not pauses between checks: a virtual machine's host taking the virtual CPU is not
/// a thread of this machine that wants it (a guest without a steal clock counts that time as the
/// thread's own), and spinning on does not take from it.
pub(crate) struct Checking {
    start: Instant,
    /// The turn under way (an awaited call checks in turns, between which its executor runs
    /// other tasks): when it began, and the thread's CPU time then; `None` between turns.
    turn: Option<(Instant, Duration)>,
    /// The turns so far: wall time and CPU time.
    wall: Duration,
    cpu: Duration,
}

impl Checking {
    /// A spell beginning at `now`, its first turn with it.
    pub(crate) fn new(now: Instant) -> Checking {
        Checking {
            start: now,
            turn: Some((now, thread_cpu_time())),
            wall: Duration::ZERO,
            cpu: Duration::ZERO,
        }
    }

    /// A turn ends at `now` (an executor runs other tasks next, on this thread or another).
    pub(crate) fn pause(&mut self, now: Instant) {
        if let Some((began, cpu)) = self.turn.take() {
            self.wall += now.saturating_duration_since(began);
            self.cpu += thread_cpu_time().saturating_sub(cpu);
        }
    }

    /// A turn begins at `now`, on the thread that runs it.
    pub(crate) fn resume(&mut self, now: Instant) {
        if self.turn.is_none() {
            self.turn = Some((now, thread_cpu_time()));
        }
    }

    /// The spell ended at `now`, the message `caught` or not: how the thread waited. A spell
    /// that spent more than half its time, and at least [`OFF_CPU`], off the CPU found it
    /// crowded, and spinning goes off.
    pub(crate) fn end(mut self, now: Instant, caught: bool) -> Waited {
        self.pause(now);
        let checked = now.saturating_duration_since(self.start);
        BACK_OFF_STATE.judge(self.wall, self.wall.saturating_sub(self.cpu), now_ns());
        if caught {
            Waited::Caught { checked }
        } else {
            Waited::Missed { checked }
        }
    }
}

/// This thread's CPU time so far.
fn thread_cpu_time() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Whether a spell of checking `checked` long, `off` of it off the CPU, found it crowded: off it
/// more than half the time, and for at least [`OFF_CPU`].
fn crowded(checked: Duration, off: Duration) -> bool {
    off * 2 > checked && off >= OFF_CPU
}

/// The back-off after `ns`: twice as long, at most [`LONGEST_BACK_OFF`].
fn doubled(ns: u64) -> u64 {
    ns.saturating_mul(2).min(LONGEST_BACK_OFF.as_nanos() as u64)
}

/// How many times a spinner of this process found the CPUs crowded (and spinning went off).
pub(crate) fn crowded_count() -> u64 {
    BACK_OFF_STATE.crowded.load(Relaxed)
}

/// How long before a reply is due a caller wakes: twice the usual lateness of a timed sleep, at
/// least 30 µs and at most 300 µs.
fn lead() -> Duration {
    lead_for(LATE_NS.load(Relaxed))
}

/// [`lead`] for a lateness of `late_ns`.
fn lead_for(late_ns: u64) -> Duration {
    Duration::from_nanos(late_ns.saturating_mul(2))
        .clamp(Duration::from_micros(30), Duration::from_micros(300))
}

/// Counts a timed sleep that was meant to end at `meant` and ended at `ended`.
pub(crate) fn slept(meant: Instant, ended: Instant) {
    let late = u64::try_from(ended.saturating_duration_since(meant).as_nanos()).unwrap_or(u64::MAX);
    // Races between callers only blur the average.
    LATE_NS.store(averaged(LATE_NS.load(Relaxed), late), Relaxed);
}

/// The lateness average `old` with a sleep `late` ns late: a moving average over about the last
/// four, each counted as at most 1 ms (a preempted sleep says nothing of timer slack).
fn averaged(old: u64, late: u64) -> u64 {
    old - old / 4 + late.min(1_000_000) / 4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_opens_before_the_reply_is_due_and_is_bounded() {
        let t = Instant::now();
        let us = Duration::from_micros;
        // A 1 ms body: checked from 900 µs until 1.125 ms.
        let w = window(t, us(1000), us(100));
        assert_eq!((w.from - t, w.until - t), (us(900), us(1125)));
        // A quick body: checked from the send.
        let w = window(t, us(20), us(100));
        assert_eq!((w.from - t, w.until - t), (us(0), us(70)));
        // A long body: at most MAX_SPIN of checking.
        let w = window(t, us(100_000), us(100));
        assert_eq!((w.from - t, w.until - t), (us(99_900), us(100_500)));
    }

    #[test]
    fn estimates_follow_the_last_calls_and_are_kept_per_function() {
        let mut p = Pace::default();
        let us = Duration::from_micros;
        let t = Instant::now();
        let spun = window(t, us(0), us(0));
        p.record(1, us(1000), &spun);
        p.record(2, us(10), &spun);
        p.record(1, us(2000), &spun);
        assert_eq!(p.estimates, vec![(2, us(10)), (1, us(1250))]);
        // A reply that came while the caller slept: the estimate falls below it.
        let early = Spin {
            early: true,
            ..spun
        };
        p.record(1, us(1100), &early);
        assert_eq!(p.estimates[1].1, us(1100) - lead() * 2);
        for k in 10..20 {
            p.record(k, us(1), &spun);
        }
        assert_eq!(p.estimates.len(), KEPT);
        assert!(p.estimates.iter().all(|(k, _)| *k >= 12));
        assert_eq!(function_key("a", "bc"), function_key("a", "bc"));
        assert_ne!(function_key("a", "bc"), function_key("ab", "c"));
    }

    #[test]
    fn callers_wake_twice_the_usual_lateness_early_within_bounds() {
        let us = Duration::from_micros;
        assert_eq!(lead_for(40_000), us(80));
        assert_eq!(lead_for(10_000), us(30));
        assert_eq!(lead_for(400_000), us(300));
        assert_eq!(lead_for(u64::MAX), us(300));
        // The lateness is a moving average over about four sleeps, each at most 1 ms.
        assert_eq!(averaged(40_000, 80_000), 50_000);
        assert_eq!(averaged(40_000, 40_000), 40_000);
        assert_eq!(averaged(40_000, 9_000_000), 280_000);
        assert_eq!(averaged(0, 0), 0);
    }

    #[test]
    fn a_spinner_mostly_off_its_cpu_turns_spinning_off_for_longer_each_time() {
        let us = Duration::from_micros;
        assert!(!crowded(us(1000), us(0)));
        assert!(!crowded(us(1000), us(500)));
        assert!(crowded(us(1000), us(501)));
        assert_eq!(doubled(20_000_000), 40_000_000);
        assert_eq!(doubled(800_000_000), 1_000_000_000);
        assert_eq!(doubled(u64::MAX), 1_000_000_000);
        let b = BackOff::new();
        let ms = |n: u64| n * 1_000_000;
        b.judge(us(1000), us(800), ms(1000));
        assert_eq!(b.until.load(Relaxed), ms(1020));
        b.judge(us(1000), us(800), ms(1010));
        assert_eq!(b.until.load(Relaxed), ms(1050));
        assert_eq!(b.next.load(Relaxed), ms(80));
        // A spell that found the CPU free: the first back-off again, spinning allowed as before.
        b.judge(us(1000), us(300), ms(1100));
        assert_eq!(
            (b.until.load(Relaxed), b.next.load(Relaxed)),
            (ms(1050), ms(20))
        );
        assert_eq!(b.crowded.load(Relaxed), 2);
        // A short spell mostly off the CPU: the worker's turn on it, not another's slice.
        assert!(!crowded(us(60), us(50)));
        assert!(crowded(us(300), us(200)));
        // A spell's wall and CPU time add up over its turns, not the pauses between them.
        let t = Instant::now();
        let mut c = Checking::new(t);
        let spin_for = |d: Duration| {
            let until = Instant::now() + d;
            while Instant::now() < until {}
        };
        spin_for(us(300));
        c.pause(Instant::now());
        std::thread::sleep(Duration::from_millis(5));
        c.resume(Instant::now());
        spin_for(us(300));
        c.pause(Instant::now());
        assert!(
            c.wall >= us(600) && c.wall < Duration::from_millis(5),
            "{:?}",
            c.wall
        );
        assert!(c.cpu <= c.wall + us(50), "{:?} {:?}", c.cpu, c.wall);
        // Asleep in the spell: off the CPU.
        let mut c = Checking::new(Instant::now());
        std::thread::sleep(Duration::from_millis(2));
        c.pause(Instant::now());
        assert!(
            c.wall.saturating_sub(c.cpu) >= Duration::from_millis(1),
            "{:?} {:?}",
            c.wall,
            c.cpu
        );
    }
}
