//! The `pyop` Python module, importable in every body: `pyop.Tensor` wraps a candle tensor (the
//! same storage, the same device) and runs candle ops on it eagerly, so autograd records what a
//! tensor-mode body does.
//!
//! Numerics: a Python number combined with a tensor takes the tensor's dtype and must fit it
//! exactly (an integer tensor with 0.5 is an error); two tensors of different dtypes are an error,
//! as in candle; comparisons give u8 masks; `pyop.tensor(obj)` without a dtype makes f32 from
//! floats, i64 from ints and u8 from bools. Candle's errors are raised as `ValueError`s with
//! candle's message. Work on large tensors runs with the GIL released.
//!
//! One file a part: the class (here), its one `#[pymethods]` block (`methods`) and how those run
//! candle ops (`dispatch`), the module functions (`functions`), and what both share, by job:
//! running candle work (`compute`), checked sizes and integer arithmetic (`checked`), arguments
//! from Python (`parse`), kernels candle lacks (`kernels`), Python values out of a tensor
//! (`values`); the device new tensors land on (`device`), and the module itself (`module`).
//! DLPack lives beside, in `bridge::dlpack`.

mod checked;
mod compute;
pub(crate) mod device;
mod dispatch;
mod functions;
mod kernels;
mod methods;
pub(crate) mod module;
mod parse;
mod values;

use candle_core::Tensor;
use pyo3::prelude::*;

/// A candle tensor as Python sees it (`pyop.Tensor`). Holds the tensor itself: same storage,
/// same device, same place in the autograd graph.
#[pyclass(name = "Tensor", module = "pyop", frozen)]
pub struct PyTensor {
    tensor: Tensor,
    /// For the base object of a NumPy view: the address the view starts at.
    view_data: usize,
    /// Whether that view was handed out writable (an `out` buffer).
    writable: bool,
    /// Whether the tensor may share a `Var`'s storage although autograd no longer tracks it (a
    /// detached view of a `Var`): `__dlpack__` then exports a snapshot, as for tracked tensors.
    var_storage: bool,
}

impl PyTensor {
    /// Wraps a tensor for Python (e.g. to return it from a Rust function called by a body).
    pub fn new(tensor: Tensor) -> Self {
        Self {
            tensor,
            view_data: 0,
            writable: false,
            var_storage: false,
        }
    }

    /// A call's input: `var_storage` when it came from a tracked tensor that was not copied.
    pub(crate) fn input(tensor: Tensor, var_storage: bool) -> Self {
        Self {
            var_storage,
            ..Self::new(tensor)
        }
    }

    /// `tensor`, made from this one by an op that may share its storage (a view, a reshape, a
    /// `detach`): it keeps knowing whether that storage may be a `Var`'s.
    pub(crate) fn derived(&self, tensor: Tensor) -> Self {
        let var_storage = self.var_storage || self.tensor.track_op();
        Self {
            var_storage,
            ..Self::new(tensor)
        }
    }

    /// Whether a consumer of this tensor's memory must get a snapshot (`__dlpack__`).
    pub(crate) fn may_be_written(&self) -> bool {
        self.var_storage || self.tensor.track_op()
    }

    /// The base object of a NumPy view of `tensor` starting at address `data`.
    pub(crate) fn view_base(tensor: Tensor, data: usize, writable: bool) -> Self {
        Self {
            tensor,
            view_data: data,
            writable,
            var_storage: false,
        }
    }

    pub(crate) fn writable(&self) -> bool {
        self.writable
    }

    pub(crate) fn view_data(&self) -> Option<usize> {
        (self.view_data != 0).then_some(self.view_data)
    }

    /// The wrapped tensor.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }
}
