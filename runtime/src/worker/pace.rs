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
//! below it. No caller spins while the other runnable threads fill every CPU: a spinning thread
//! would take a core from one that works (and the worker is told not to spin either).
//!
//! The worker's side of the same (checking for the next request after a reply) is in
//! `worker.py`, `_wait_awake`.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long a call of unknown length is checked for before the caller sleeps.
pub(crate) const FIRST_SPIN: Duration = Duration::from_micros(50);
/// The longest a caller checks for a reply in one wait: a body whose length varies more than
/// this is waited for asleep.
pub(crate) const MAX_SPIN: Duration = Duration::from_micros(600);
/// How long spinning stays off once the machine was seen oversubscribed.
pub(crate) const BACK_OFF: Duration = Duration::from_millis(20);
/// How many functions' estimates a worker keeps (the most recently called).
const KEPT: usize = 8;

/// When to check for a reply instead of sleeping: from `from` until `until` (none if equal).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Spin {
    pub from: Instant,
    pub until: Instant,
    /// Set when the reply woke the caller before `from`: the estimate was too long.
    pub early: bool,
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
            };
        }
        let Some(&(_, expect)) = self.estimates.iter().find(|(k, _)| *k == function) else {
            return Spin {
                from: sent,
                until: sent + FIRST_SPIN,
                early: false,
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

/// Until when (`now_ns`) spinning is off: the machine was seen oversubscribed.
static SPIN_OFF_UNTIL: AtomicU64 = AtomicU64::new(0);
/// How late a timed sleep ends here (a moving average, in nanoseconds): how early a caller wakes
/// before a reply is due.
static LATE_NS: AtomicU64 = AtomicU64::new(40_000);

/// Whether a process may check for a message instead of sleeping: not while the machine is
/// oversubscribed (or was, less than [`BACK_OFF`] ago).
pub(crate) fn spinning_allowed() -> bool {
    now_ns() >= SPIN_OFF_UNTIL.load(Relaxed) && !oversubscribed()
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

/// Whether more threads are runnable on the machine than it has CPUs (`/proc/loadavg`'s
/// `running/total`, read at most every [`LOOK_EVERY`]): a thread that spins then takes a core
/// from one that works, and spinning is off for [`BACK_OFF`].
fn oversubscribed() -> bool {
    static NEXT_LOOK: AtomicU64 = AtomicU64::new(0);
    let now = now_ns();
    if now < NEXT_LOOK.load(Relaxed) {
        return false;
    }
    NEXT_LOOK.store(now + LOOK_EVERY.as_nanos() as u64, Relaxed);
    let Some(running) = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| runnable(&s))
    else {
        return false;
    };
    // SAFETY: sysconf takes and returns plain integers.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as u64;
    if more_than_cpus(running, cpus) {
        SPIN_OFF_UNTIL.fetch_max(now.saturating_add(BACK_OFF.as_nanos() as u64), Relaxed);
        return true;
    }
    false
}

/// The runnable threads `/proc/loadavg` counts (its fourth field, `running/total`).
fn runnable(loadavg: &str) -> Option<u64> {
    let field = loadavg.split_whitespace().nth(3)?;
    field.split('/').next()?.parse().ok()
}

/// Whether `running` threads leave no CPU to a thread that spins: the reading thread counts
/// itself, so `cpus` others fill every CPU. (Counting one more as not yet, for a kernel thread
/// of a moment, let callers spin beside two workers on 2 CPUs: 1.61-1.71x the program's
/// throughput from 2 threads instead of 1.76-1.82x, same runs.)
fn more_than_cpus(running: u64, cpus: u64) -> bool {
    running > cpus
}

/// How often `oversubscribed` looks.
const LOOK_EVERY: Duration = Duration::from_millis(10);

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
    fn oversubscribed_means_more_runnable_threads_than_cpus() {
        assert_eq!(runnable("0.51 0.42 0.30 3/123 4567\n"), Some(3));
        assert_eq!(runnable("0.51 0.42 0.30 12/900 1"), Some(12));
        assert_eq!(runnable("garbage"), None);
        assert!(!more_than_cpus(2, 2));
        assert!(more_than_cpus(3, 2));
        assert!(!more_than_cpus(1, 1));
        assert!(more_than_cpus(2, 1));
    }
}
