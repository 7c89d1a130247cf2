//! Awaited calls: [`PyOp::call_async`], a future that runs the call without blocking the thread
//! that polls it (a tokio worker, any executor's), usable on any executor.
//!
//! An op whose body runs in the program: the whole call (the body, its output check, autograd)
//! runs on one of pyop's own threads (`threads`), the only ones an awaited call lets wait for
//! the GIL. An op whose body runs in a worker process: the inputs are prepared and written where
//! the future is polled (no GIL needed), the future waits for a free worker and for its reply as
//! a task (the pool's event, the reactor), and the usual reply is read back there too, without
//! the GIL; only a read-back that takes the GIL runs on one of pyop's threads (or where the
//! future is polled, when no other thread is in pyop's door into Python). Dropping the future cancels the call: a body in the program is
//! interrupted as a time limit interrupts it (or never starts), a worker running it is killed
//! (as on a time limit), and a request not yet sent is not sent.

use std::future::Future;

use candle_core::{Device, Tensor};

#[cfg(target_os = "linux")]
use super::{forward, worker_call};
use super::{CallOptions, PyOp};
use crate::arg::{Arg, OwnedArgs};
use crate::bridge::outputs::Outputs;
use crate::error::Result;
use crate::python::timeout::Interrupt;
use crate::threads::Lane;

impl PyOp {
    /// [`call`](Self::call) as a future: awaiting it blocks no thread of the caller's runtime
    /// (see the guide's chapter on async). The future owns what it needs (the arguments are
    /// copied: tensors share their storage, slices and strings are cloned), so it is `'static`
    /// and can be spawned; dropping it cancels the call.
    ///
    /// ```
    /// use pyop::candle::{DType, Device, Tensor};
    /// use pyop::{Arg, OutSpec, PyOp};
    ///
    /// let double = PyOp::builder("double")
    ///     .code("def double(x):\n    return x * 2")
    ///     .tout([OutSpec::new(DType::F32)])
    ///     .build()?;
    /// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
    /// let y = futures_lite::future::block_on(double.call_async(&[Arg::from(&x)]))?;
    /// assert_eq!(y[0].to_vec1::<f32>()?, [2., 4.]);
    /// # Ok::<(), pyop::Error>(())
    /// ```
    pub fn call_async(
        &self,
        args: &[Arg<'_>],
    ) -> impl Future<Output = Result<Vec<Tensor>>> + Send + 'static + use<> {
        self.call_async_with(args, &CallOptions::default())
    }

    /// [`call_with`](Self::call_with) as a future (see [`call_async`](Self::call_async)).
    pub fn call_async_with(
        &self,
        args: &[Arg<'_>],
        options: &CallOptions<'_>,
    ) -> impl Future<Output = Result<Vec<Tensor>>> + Send + 'static + use<> {
        let call = self.call_async_outputs(args, options);
        async move { call.await.map(Outputs::into_vec) }
    }

    /// [`call_async_with`](Self::call_async_with), the outputs held inline (what `#[py_op]`'s
    /// `_async` functions use).
    pub(crate) fn call_async_outputs(
        &self,
        args: &[Arg<'_>],
        options: &CallOptions<'_>,
    ) -> impl Future<Output = Result<Outputs>> + Send + 'static + use<> {
        let op = self.clone();
        let args = OwnedArgs::new(args);
        let device = options.device.cloned();
        let timeout = options.timeout;
        async move {
            if op.inner.batcher.is_some() {
                return super::batch::awaited(op, args, device, timeout).await;
            }
            #[cfg(target_os = "linux")]
            if op.inner.workers.is_some() {
                return in_worker(op, args, device, timeout).await;
            }
            let call = crate::threads::run(Lane::Bodies, Interrupt::default(), move || {
                let options = CallOptions {
                    device: device.as_ref(),
                    timeout,
                };
                op.call_outputs(&args.args(), &options)
            });
            call.await
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        }
    }
}

/// An awaited forward call whose body runs in a worker process.
#[cfg(target_os = "linux")]
async fn in_worker(
    pyop: PyOp,
    owned: OwnedArgs,
    device: Option<Device>,
    timeout: Option<std::time::Duration>,
) -> Result<Outputs> {
    use tracing::Instrument;
    let op = &*pyop.inner;
    let workers = op.workers.as_ref().expect("an op with workers");
    let args = owned.args();
    let mut prepared = crate::bridge::prepare::PreparedInputs::new();
    let mut settled = None;
    forward::before(
        op,
        &args,
        device.as_ref(),
        timeout,
        &mut prepared,
        &mut settled,
    )?;
    let before = settled.expect("settled by `before`");
    // With hot reload on, the body's check takes the GIL: on pyop's threads.
    let body = match &op.reload {
        None => (None, op.accepts_out),
        Some(_) => {
            let me = pyop.clone();
            gil(move || worker_call::worker_body_now(&me.inner)).await
        }
    };
    let request = worker_call::worker_request(op, &args, &prepared, body)?;
    // How workers start is found once, with the GIL.
    let launch = match worker_call::launch::found() {
        Some(l) => l,
        None => {
            let name = op.name.clone();
            gil(move || worker_call::launch::launch(&name)).await?
        }
    };
    let answer =
        worker_call::call_in_worker_async(op, workers, &args, &request, before.timeout, launch)
            .instrument(before.span.clone())
            .await?;
    worker_call::record_worker(&answer, &before.span);
    // The usual reply (bytes only) read back and checked here, without the GIL, in the call's
    // span as on the GIL's path.
    {
        let _entered = before.span.enter();
        if let Some(outputs) =
            worker_call::worker_outputs_without_python(op, &args, &request, &answer, &before.device)
        {
            let outputs = outputs?;
            drop(answer);
            return forward::after(&pyop.inner, &args, before.needs_node, prepared, outputs);
        }
    }
    drop(args);
    // Any other reply read back and checked, and the outputs put into the graph, with the GIL:
    // here when no other thread is inside pyop's door into Python (short work of pyop's own:
    // a handover to pyop's thread and back costs two thread wake-ups), else there.
    let read_back = move || {
        let args = owned.args();
        let _entered = before.span.enter();
        let outputs = worker_call::worker_outputs_with_gil(
            &pyop.inner,
            &args,
            &request,
            &answer,
            &before.device,
        )?;
        drop(answer);
        forward::after(&pyop.inner, &args, before.needs_node, prepared, outputs)
    };
    // (The first read-back imports NumPy in the program: milliseconds, on pyop's threads.)
    match crate::python::alone().filter(|_| crate::python::numpy::imported()) {
        Some(_alone) => read_back(),
        None => gil(read_back).await,
    }
}

/// `f`'s result, `f` (short work of pyop's own that takes the GIL) run on pyop's threads; a
/// panic resumes here.
pub(crate) async fn gil<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    crate::threads::run(Lane::Short, Interrupt::default(), f)
        .await
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}
