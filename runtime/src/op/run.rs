//! The one call core, shared by the forward call (`forward`) and the backward Python call
//! (`autograd`): the device tensors made in Python land on, the GIL taken once, the op named in
//! errors, time limits, and the counters, kept here and nowhere else.

use std::time::{Duration, Instant};

use candle_core::Device;
use pyo3::prelude::*;

use super::OpInner;
use crate::bridge::tensor::device::DeviceScope;
use crate::bridge::with_gil;
use crate::error::Result;

impl OpInner {
    /// Runs `f` with the GIL held and `device` as the device of tensors made in Python, names the
    /// op in its errors, and records the call: time in Python and time waiting for the GIL.
    #[inline(always)]
    pub(crate) fn run_python<R>(
        &self,
        device: &Device,
        f: impl for<'py> FnOnce(Python<'py>) -> Result<R>,
    ) -> Result<R> {
        // The clock is read only while timing is on (`pyop::set_timing`).
        let started = crate::stats::timing().then(Instant::now);
        let mut taken = None;
        let result = with_gil(&self.name, |py| {
            taken = started.map(|_| Instant::now());
            let _device = DeviceScope::enter(device);
            f(py)
        })
        .map_err(|e| e.in_op(&self.name));
        let took = started.map(|started| match taken {
            Some(taken) => (taken.elapsed(), taken.saturating_duration_since(started)),
            None => (started.elapsed(), Duration::ZERO),
        });
        self.counters.record(result.is_ok(), took);
        result
    }

    /// Runs `f`, Rust code of the op that needs no Python (a Rust gradient), and records it.
    pub(crate) fn run_rust<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let started = crate::stats::timing().then(Instant::now);
        let result = f().map_err(|e| e.in_op(&self.name));
        let took = started.map(|s| (s.elapsed(), Duration::ZERO));
        self.counters.record(result.is_ok(), took);
        result
    }

    /// Records a call that finished without Python and without Rust of the op's own (a worker's
    /// reply read as bytes): counted, with no time in Python.
    pub(crate) fn finished_without_python<T>(&self, result: Result<T>) -> Result<T> {
        let result = result.map_err(|e| e.in_op(&self.name));
        self.counters.record(result.is_ok(), None);
        result
    }

    /// Records a call that failed before it reached Python (devices, input preparation).
    pub(crate) fn failed_before_python<T>(&self, result: Result<T>) -> Result<T> {
        result
            .map_err(|e| e.in_op(&self.name))
            .inspect_err(|_| self.counters.record(false, None))
    }
}
