//! Dynamic micro-batching ([`Batch`]): concurrent calls of one op gathered into one body call.
//!
//! No thread of pyop's own: the calls combine among themselves. Every call joins the op's queue;
//! the one that finds no batch running leads: it waits up to `wait` for company (or until `max`
//! calls of its kind are queued), takes up to `max` queued calls that can share a body call with
//! its own (the same dtypes, trailing shapes, unstacked arguments, device and time limit), stacks
//! their inputs along axis 0, runs the op's ordinary call once on them (in the program, a worker
//! or a Ray actor), hands every caller its own rows of every output, and passes the lead to the
//! oldest call still queued. The others wait, without the GIL, until their rows or the lead
//! reach them. A call alone with `wait` zero runs as an unbatched call, with no copy.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use smallvec::SmallVec;

use super::awaited::OwnedArgs;
use super::{CallOptions, PyOp};
use crate::arg::Arg;
use crate::bridge::outputs::Outputs;
use crate::error::{Error, ErrorKind, Result};
use crate::spec::{Batch, OutSpec};

/// The queue of one batching op's calls.
pub(crate) struct Batcher {
    pub batch: Batch,
    queue: Mutex<Queue>,
    /// The leader waits here for company.
    company: Condvar,
}

#[derive(Default)]
struct Queue {
    /// A batch is being gathered or run: its leader hands the lead on when done.
    led: bool,
    /// The leader is waiting for company (arrivals that fill a batch wake it).
    gathering: bool,
    waiting: VecDeque<Arc<Entry>>,
}

/// One queued call.
struct Entry {
    args: OwnedArgs,
    kind: Kind,
    rows: usize,
    timeout: Option<Duration>,
    device: Option<Device>,
    arrived: Instant,
    turn: Mutex<Turn>,
    ready: Condvar,
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
    device: Option<candle_core::DeviceLocation>,
    timeout: Option<Duration>,
}

#[derive(PartialEq)]
enum Part {
    Rows {
        dtype: DType,
        rest: SmallVec<[usize; 4]>,
        device: candle_core::DeviceLocation,
    },
    Same(SmallVec<[candle_core::TensorId; 1]>),
    /// A plain value, compared as written (a float by its bits).
    Value(String),
}

impl Batcher {
    pub(crate) fn new(batch: Batch) -> Self {
        Batcher {
            batch,
            queue: Mutex::new(Queue::default()),
            company: Condvar::new(),
        }
    }

    fn stacked(&self, i: usize, arg: &Arg<'_>) -> bool {
        match &self.batch.inputs {
            Some(inputs) => inputs.contains(&i),
            None => matches!(arg, Arg::Tensor(_)),
        }
    }

    /// The leader's wait for company: up to `wait` after `own` came, or until `max` calls of its
    /// kind are queued; then the batch, taken off the queue: calls of `own`'s kind in the order
    /// they came. `own` is the oldest queued call (a call leads only when it found the queue
    /// empty, or as its oldest), so it is first.
    fn gather(&self, own: &Arc<Entry>) -> Vec<Arc<Entry>> {
        let max = self.batch.max;
        let mut queue = self.lock();
        let deadline = own.arrived + self.batch.wait;
        loop {
            let company = queue.waiting.iter().filter(|e| e.kind == own.kind).count();
            let now = Instant::now();
            if company >= max || now >= deadline {
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
        let mut kept = VecDeque::with_capacity(queue.waiting.len());
        for e in queue.waiting.drain(..) {
            if batch.len() < max && e.kind == own.kind {
                batch.push(e);
            } else {
                kept.push_back(e);
            }
        }
        queue.waiting = kept;
        batch
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A panic while the lock is held leaves the queue as it was (no user code runs under it).
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The call's kind and its rows (axis 0 of its stacked inputs), or why it cannot be batched.
    fn kind(&self, op: &str, args: &[Arg<'_>], options: &CallOptions<'_>) -> Result<(Kind, usize)> {
        let mut rows: Option<(usize, usize)> = None;
        let mut parts = SmallVec::new();
        for (i, arg) in args.iter().enumerate() {
            let part = if self.stacked(i, arg) {
                let Arg::Tensor(t) = arg else {
                    return Err(refused(
                        op,
                        format!("argument {i} is stacked by the op's batching but is not a tensor"),
                    ));
                };
                let Some((&n, rest)) = t.dims().split_first() else {
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
                Part::Rows {
                    dtype: t.dtype(),
                    rest: rest.into(),
                    device: t.device().location(),
                }
            } else {
                match arg {
                    Arg::Tensor(t) => Part::Same(smallvec::smallvec![t.id()]),
                    Arg::Tensors(ts) => Part::Same(ts.iter().map(Tensor::id).collect()),
                    Arg::F64(v) => Part::Value(format!("f{:x}", v.to_bits())),
                    Arg::F64s(v) => Part::Value(format!(
                        "fs{:x?}",
                        v.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    )),
                    Arg::F32s(v) => Part::Value(format!(
                        "f32s{:x?}",
                        v.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    )),
                    other => Part::Value(format!("{other:?}")),
                }
            };
            parts.push(part);
        }
        let Some((_, rows)) = rows else {
            return Err(refused(
                op,
                "no argument is stacked: a batching op needs a tensor argument to stack \
                 along axis 0"
                    .into(),
            ));
        };
        Ok((
            Kind {
                args: parts,
                device: options.device.map(Device::location),
                timeout: options.timeout,
            },
            rows,
        ))
    }
}

fn refused(op: &str, message: String) -> Error {
    Error::op_failure(op, ErrorKind::InvalidArgument, message)
}

impl PyOp {
    /// A call of a batching op: alone and without `wait`, the ordinary call; else through the
    /// queue.
    pub(super) fn call_batched(
        &self,
        batcher: &Batcher,
        args: &[Arg<'_>],
        options: &CallOptions<'_>,
    ) -> Result<Outputs> {
        let op = &*self.inner;
        let options = CallOptions {
            device: options.device,
            timeout: options.timeout.or(op.timeout),
        };
        let (kind, rows) = batcher.kind(&op.name, args, &options)?;
        let mut queue = batcher.lock();
        if !queue.led && queue.waiting.is_empty() && batcher.batch.wait.is_zero() {
            // Alone, and no reason to wait: the ordinary call on the caller's own tensors.
            queue.led = true;
            drop(queue);
            let handover = Handover {
                batcher,
                batch: &[],
            };
            let result = self.call_unbatched(args, &options, Some(1));
            op.counters.record_batch(1, Duration::ZERO);
            handover.done(Vec::new());
            return result;
        }
        let entry = Arc::new(Entry {
            args: OwnedArgs::new(args),
            kind,
            rows,
            timeout: options.timeout,
            device: options.device.cloned(),
            arrived: Instant::now(),
            turn: Mutex::new(Turn::Waiting),
            ready: Condvar::new(),
        });
        queue.waiting.push_back(entry.clone());
        let leads = !queue.led;
        if leads {
            queue.led = true;
        } else if queue.gathering && queue.waiting.len() >= batcher.batch.max {
            batcher.company.notify_one();
        }
        drop(queue);
        if !leads {
            // Wait, without the GIL (the leader may need it), for the rows or for the lead.
            let turn = crate::python::without_gil(|| {
                let mut turn = entry.turn.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    match std::mem::replace(&mut *turn, Turn::Waiting) {
                        Turn::Waiting => {
                            turn = entry.ready.wait(turn).unwrap_or_else(|p| p.into_inner())
                        }
                        got => return got,
                    }
                }
            });
            match turn {
                Turn::Done(result) => return result,
                Turn::Lead => {}
                Turn::Waiting => unreachable!("a turn is returned once it changed"),
            }
        }
        self.lead(batcher, &entry)
    }

    /// The leader's part: gather a batch with `own` in it, run it, hand out its rows, pass the
    /// lead on; `own`'s result.
    fn lead(&self, batcher: &Batcher, own: &Arc<Entry>) -> Result<Outputs> {
        let op = &*self.inner;
        // Gathered without the GIL: the calls it waits for may need it to reach the queue.
        let batch = crate::python::without_gil(|| batcher.gather(own));
        let started = Instant::now();
        let waited = batch.iter().map(|e| started - e.arrived).sum();
        let handover = Handover {
            batcher,
            batch: &batch,
        };
        let results = self.run_batch(&batch);
        op.counters.record_batch(batch.len(), waited);
        let mut results = results.into_iter();
        let own_result = results.next().expect("one result per call");
        handover.done(batch[1..].iter().cloned().zip(results).collect());
        own_result
    }

    /// Runs one batch: the ordinary call on the stacked inputs, the outputs cut into each
    /// call's rows; one result per call, in order.
    fn run_batch(&self, batch: &[Arc<Entry>]) -> Vec<Result<Outputs>> {
        let op = &*self.inner;
        let n = batch.len();
        if n == 1 {
            let e = &batch[0];
            let options = CallOptions {
                device: e.device.as_ref(),
                timeout: e.timeout,
            };
            return vec![self.call_unbatched(&e.args.args(), &options, Some(1))];
        }
        let all: Vec<SmallVec<[Arg<'_>; 4]>> = batch.iter().map(|e| e.args.args()).collect();
        let first = &all[0];
        let batcher = op.batcher.as_ref().expect("a batching op");
        let stacked: Result<Vec<Option<Tensor>>> = (0..first.len())
            .map(|i| {
                if !batcher.stacked(i, &first[i]) {
                    return Ok(None);
                }
                let parts: Vec<&Tensor> = all
                    .iter()
                    .map(|args| match args[i] {
                        Arg::Tensor(t) => t,
                        _ => unreachable!("a stacked argument is a tensor (checked on arrival)"),
                    })
                    .collect();
                Tensor::cat(&parts, 0).map(Some).map_err(|e| e.into())
            })
            .collect();
        let total: usize = batch.iter().map(|e| e.rows).sum();
        let outputs = stacked.and_then(|stacked| {
            let args: SmallVec<[Arg<'_>; 4]> = first
                .iter()
                .zip(&stacked)
                .map(|(a, s)| match s {
                    Some(t) => Arg::Tensor(t),
                    None => *a,
                })
                .collect();
            let options = CallOptions {
                device: batch[0].device.as_ref(),
                timeout: batch[0].timeout,
            };
            let outputs = self.call_unbatched(&args, &options, Some(n))?;
            for (k, o) in outputs.iter().enumerate() {
                if o.dims().first() != Some(&total) {
                    return Err(Error::mismatch(
                        &op.name,
                        ErrorKind::OutputMismatch,
                        Some(k),
                        format!(
                            "output {k} has shape {:?}; a batching op's outputs have the batch's \
                             {total} rows along axis 0",
                            o.dims()
                        ),
                    ));
                }
            }
            Ok(outputs)
        });
        let outputs = match outputs {
            Ok(o) => o,
            Err(e) => return (0..n).map(|_| Err(e.of_batch(&op.name, n))).collect(),
        };
        let mut start = 0;
        batch
            .iter()
            .zip(&all)
            .map(|(e, args)| {
                let rows = e.rows;
                let mine = cut(op, &outputs, args, start, rows);
                start += rows;
                mine
            })
            .collect()
    }
}

/// One call's rows of a batch's outputs, checked against its own `tout`; detached from the graph
/// when none of its own inputs is tracked (its outputs then are what an unbatched call gives).
fn cut(
    op: &super::OpInner,
    outputs: &Outputs,
    args: &[Arg<'_>],
    start: usize,
    rows: usize,
) -> Result<Outputs> {
    let tracked = super::autograd::any_tracked(args);
    let tout = op.resolved_tout(args)?;
    let mut mine = Vec::with_capacity(outputs.len());
    for (k, (o, spec)) in outputs.iter().zip(tout.iter()).enumerate() {
        let t = o
            .narrow(0, start, rows)
            .map_err(|e| Error::from(e).in_op(&op.name))?;
        check_rows(op, k, spec, &t, args)?;
        mine.push(if tracked { t } else { t.detach() });
    }
    Ok(Outputs::from_vec(mine))
}

/// A call's rows of output `k` against its declared shape (the batch's outputs passed the check
/// of dtypes and of every other axis).
fn check_rows(
    op: &super::OpInner,
    k: usize,
    spec: &OutSpec,
    t: &Tensor,
    args: &[Arg<'_>],
) -> Result<()> {
    let like = spec.like.and_then(|i| match args.get(i) {
        Some(Arg::Tensor(x)) => Some(x.dims()),
        _ => None,
    });
    let fits = spec.shape_matches(t.dims()) && like.is_none_or(|d| d == t.dims());
    if fits {
        Ok(())
    } else {
        Err(Error::mismatch(
            &op.name,
            ErrorKind::OutputMismatch,
            Some(k),
            format!(
                "output {k}: this call's rows of the batch have shape {:?}, not the declared {spec}",
                t.dims()
            ),
        ))
    }
}

/// The lead passed on when a batch is done, the others' results handed out; on a panic of the
/// leader (unwinding through here), each gets an error instead of waiting for ever.
struct Handover<'a> {
    batcher: &'a Batcher,
    batch: &'a [Arc<Entry>],
}

impl Handover<'_> {
    fn done(self, results: Vec<(Arc<Entry>, Result<Outputs>)>) {
        for (e, r) in results {
            give(&e, Turn::Done(r));
        }
        pass_lead(self.batcher);
        std::mem::forget(self);
    }
}

impl Drop for Handover<'_> {
    fn drop(&mut self) {
        for e in self.batch {
            give(
                e,
                Turn::Done(Err(Error::op_failure(
                    None::<&str>,
                    ErrorKind::Panic,
                    "the thread running this call's batch panicked",
                ))),
            );
        }
        pass_lead(self.batcher);
    }
}

fn give(e: &Entry, turn: Turn) {
    let mut t = e.turn.lock().unwrap_or_else(|p| p.into_inner());
    *t = turn;
    e.ready.notify_one();
}

/// The oldest queued call leads the next batch; with none queued, the next call leads.
fn pass_lead(batcher: &Batcher) {
    let mut queue = batcher.lock();
    match queue.waiting.front() {
        Some(next) => {
            let next = next.clone();
            drop(queue);
            give(&next, Turn::Lead);
        }
        None => queue.led = false,
    }
}
