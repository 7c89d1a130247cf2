//! A batch's run ([`Batch`](crate::Batch), queued by `op::batcher`): the calls' inputs stacked
//! along axis 0, the op's ordinary call once on them (in the program, a worker or a Ray actor),
//! every caller's own rows of every output cut out and checked against its own `tout`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use smallvec::SmallVec;

use super::batcher::{Batcher, Entry, Handover, Joined, Place, Started, Waiting};
use super::{forward, CallOptions, PyOp};
use crate::arg::{Arg, OwnedArgs};
use crate::bridge::outputs::Outputs;
use crate::error::{Error, ErrorKind, Result};

/// A call of a batching op: alone and without `wait`, the ordinary call; else through the
/// queue. A call made from inside a body (any op's, through `pyop.rust`) runs unbatched: it
/// may be the leader's own body calling, which would wait for itself.
pub(super) fn call(
    pyop: &PyOp,
    batcher: &Batcher,
    args: &[Arg<'_>],
    options: &CallOptions<'_>,
) -> Result<Outputs> {
    let op = &*pyop.inner;
    let timeout = options.timeout.or(op.timeout);
    if crate::bridge::tensor::device::in_body() {
        let options = CallOptions {
            device: options.device,
            timeout,
        };
        return forward::call(&pyop.inner, args, &options, None);
    }
    match batcher.enter(&op.name, args, options.device, timeout)? {
        Place::Alone(rows, started) => {
            run_alone(pyop, batcher, started, args, rows, options.device, timeout)
        }
        Place::Leads(own) => lead(pyop, batcher, &own).1,
        Place::Done(result) => result,
    }
}

/// A call alone (`Place::Alone`, `Joined::Alone`): the ordinary call on the caller's own
/// tensors, its outputs checked as a batch's, then the lead passed on.
fn run_alone(
    pyop: &PyOp,
    batcher: &Batcher,
    started: Started,
    args: &[Arg<'_>],
    rows: usize,
    device: Option<&candle_core::Device>,
    timeout: Option<Duration>,
) -> Result<Outputs> {
    let op = &*pyop.inner;
    let spawn = |e| spawn_lead(pyop, e);
    let handover = Handover::of(batcher, &[], started, &op.name, &spawn);
    let result = forward::call(&pyop.inner, args, &CallOptions { device, timeout }, Some(1))
        .and_then(|outputs| rows_checked(op, outputs, rows));
    op.counters.record_batch(1, Duration::ZERO);
    handover.done(Vec::new());
    result
}

/// Leads the batch of `own`, an awaited call the lead reached, on pyop's threads; its
/// result goes to its `Waiting` future. The run goes to its end whatever becomes of that.
fn spawn_lead(pyop: &PyOp, own: Arc<Entry>) {
    let me = pyop.clone();
    drop(crate::threads::run_to_end(
        crate::threads::Lane::Bodies,
        move || {
            let batcher = me.inner.batcher.as_ref().expect("a batching op");
            let (own, result) = lead(&me, batcher, &own);
            own.answer(result);
        },
    ));
}

/// An awaited call of a batching op: it joins the queue where the future is polled and
/// waits there as a task, without a thread; only to run alone or to lead a batch does it
/// take one of pyop's threads. That run goes to its end even if the future is dropped (the
/// batch's other calls wait for it); a call dropped while queued leaves the queue.
pub(super) async fn awaited(
    pyop: PyOp,
    args: OwnedArgs,
    device: Option<candle_core::Device>,
    timeout: Option<Duration>,
) -> Result<Outputs> {
    let op = &*pyop.inner;
    let batcher = op.batcher.as_ref().expect("a batching op");
    let timeout = timeout.or(op.timeout);
    let joined = batcher.join(&op.name, &args.args(), device.as_ref(), timeout, true)?;
    let me = pyop.clone();
    let run = match joined {
        Joined::Alone(rows, started) => {
            crate::threads::run_to_end(crate::threads::Lane::Bodies, move || {
                let batcher = me.inner.batcher.as_ref().expect("a batching op");
                run_alone(
                    &me,
                    batcher,
                    started,
                    &args.args(),
                    rows,
                    device.as_ref(),
                    timeout,
                )
            })
        }
        Joined::Leads(own) => crate::threads::run_to_end(crate::threads::Lane::Bodies, move || {
            lead(&me, me.inner.batcher.as_ref().expect("a batching op"), &own).1
        }),
        Joined::Queued(own) => {
            return Waiting {
                batcher,
                entry: own,
                done: false,
            }
            .await
        }
    };
    run.await
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// The leader's part: gather a batch with `own` in it, run it, hand out its rows, pass the
/// lead on; `own` and its result.
fn lead(pyop: &PyOp, batcher: &Batcher, own: &Arc<Entry>) -> (Arc<Entry>, Result<Outputs>) {
    let op = &*pyop.inner;
    let spawn = |e| spawn_lead(pyop, e);
    // Gathered without the GIL: the calls it waits for may need it to reach the queue.
    let (batch, started) = crate::python::without_gil(|| batcher.gather(own, &spawn));
    let now = Instant::now();
    let waited = batch.iter().map(|e| now - e.arrived).sum();
    let handover = Handover::of(batcher, &batch, started, &op.name, &spawn);
    let results = run_batch(pyop, &batch);
    op.counters.record_batch(batch.len(), waited);
    let mut results = results.into_iter();
    let own_result = results.next().expect("one result per call");
    handover.done(batch[1..].iter().cloned().zip(results).collect());
    (own.clone(), own_result)
}

/// Runs one batch: the ordinary call on the stacked inputs, the outputs cut into each
/// call's rows; one result per call, in order.
fn run_batch(pyop: &PyOp, batch: &[Arc<Entry>]) -> Vec<Result<Outputs>> {
    let op = &*pyop.inner;
    let n = batch.len();
    if n == 1 {
        let e = &batch[0];
        let options = CallOptions {
            device: e.device.as_ref(),
            timeout: e.timeout,
        };
        return vec![
            forward::call(&pyop.inner, &e.args.args(), &options, Some(1))
                .and_then(|outputs| rows_checked(op, outputs, e.rows)),
        ];
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
        let outputs = forward::call(&pyop.inner, &args, &options, Some(n))?;
        rows_checked(op, outputs, total)
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

/// A batch's outputs (`rows` rows in all), each with the batch's rows along
/// axis 0, as they must be to be cut into each call's rows; also for a call alone, so that a
/// call's result does not depend on whether it found company.
fn rows_checked(op: &super::OpInner, outputs: Outputs, rows: usize) -> Result<Outputs> {
    for (k, o) in outputs.iter().enumerate() {
        if o.dims().first() != Some(&rows) {
            return Err(Error::mismatch(
                &op.name,
                ErrorKind::OutputMismatch,
                Some(k),
                format!(
                    "output {k} has shape {:?}; a batching op's outputs have the batch's {rows} \
                     rows along axis 0",
                    o.dims()
                ),
            ));
        }
    }
    Ok(outputs)
}

/// One call's rows of a batch's outputs, detached from the graph when none of its own inputs
/// is tracked (its outputs then are what an unbatched call gives). They need no check of their
/// own: the batch's outputs passed the op's output check with every axis but the first, which
/// the build requires free (`_`), and `rows_checked` made the first the batch's rows; an output
/// shaped `like` a stacked input has that input's rows by construction (`like` an unstacked one
/// is refused at build).
fn cut(
    op: &super::OpInner,
    outputs: &Outputs,
    args: &[Arg<'_>],
    start: usize,
    rows: usize,
) -> Result<Outputs> {
    let tracked = super::autograd::any_tracked(args);
    let mut mine = Vec::with_capacity(outputs.len());
    for o in outputs.iter() {
        let t = o
            .narrow(0, start, rows)
            .map_err(|e| Error::from(e).in_op(&op.name))?;
        mine.push(if tracked { t } else { t.detach() });
    }
    Ok(Outputs::from_vec(mine))
}
