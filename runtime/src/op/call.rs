//! The forward call's public face: [`PyOp::call`] and [`PyOp::call_with`], the GIL
//! acquisitions counted, and each call sent to the batch queue (`batch`) when the op batches,
//! else straight to its body run (`forward`).

use candle_core::Tensor;

use super::{batch, forward};
use super::{CallOptions, PyOp};
use crate::arg::Arg;
use crate::bridge::outputs::Outputs;
use crate::error::Result;

impl PyOp {
    /// Calls the op: one output tensor per `tout` entry, on the inputs' device. Arguments are
    /// passed to the body positionally, each made with `Arg::from` (or `Arg::None` for `None`).
    ///
    /// ```
    /// use pyop::candle::{DType, Device, Tensor};
    /// use pyop::{Arg, OutSpec, PyOp};
    ///
    /// let clip = PyOp::builder("clip")
    ///     .code("import numpy as np\ndef clip(x, lo, hi):\n    return np.clip(x, lo, hi)")
    ///     .numpy()
    ///     .tout([OutSpec::new(DType::F64)])
    ///     .build()?;
    /// let x = Tensor::new(&[-2f64, 0.5, 3.], &Device::Cpu)?;
    /// let y = clip.call(&[Arg::from(&x), Arg::from(-1.0), Arg::from(1.0)])?;
    /// assert_eq!(y[0].to_vec1::<f64>()?, [-1.0, 0.5, 1.0]);
    /// # Ok::<(), pyop::Error>(())
    /// ```
    pub fn call(&self, args: &[Arg<'_>]) -> Result<Vec<Tensor>> {
        self.call_with(args, &CallOptions::default())
    }

    /// Calls the op with per-call options.
    pub fn call_with(&self, args: &[Arg<'_>], options: &CallOptions<'_>) -> Result<Vec<Tensor>> {
        self.call_outputs(args, options).map(Outputs::into_vec)
    }

    /// [`call_with`](Self::call_with), the outputs held inline (what `#[py_op]` functions use).
    pub(crate) fn call_outputs(
        &self,
        args: &[Arg<'_>],
        options: &CallOptions<'_>,
    ) -> Result<Outputs> {
        let taken = crate::python::acquisitions();
        let result = self.call_counted(args, options);
        let taken = crate::python::acquisitions() - taken;
        self.inner.counters.record_gil(taken);
        result
    }

    /// The call itself; `call_outputs` counts the GIL acquisitions it makes.
    #[inline(always)]
    fn call_counted(&self, args: &[Arg<'_>], options: &CallOptions<'_>) -> Result<Outputs> {
        match &self.inner.batcher {
            Some(batcher) => batch::call(self, batcher, args, options),
            None => forward::call(&self.inner, args, options, None),
        }
    }
}
