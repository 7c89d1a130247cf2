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
pub(crate) mod spare;
mod values;

use std::cell::UnsafeCell;

use candle_core::Tensor;
use pyo3::prelude::*;

/// A candle tensor as Python sees it (`pyop.Tensor`). Holds the tensor itself: same storage,
/// same device, same place in the autograd graph.
///
/// Immutable to Python and to every holder of a reference. The one exception is pyop's own
/// per-thread store of spare input objects (`spare`): a `pyop.Tensor` a call made for an input
/// and got back with no other reference (reference count one, the store's own) gets the next
/// call's input instead of being freed and made again.
#[pyclass(name = "Tensor", module = "pyop", frozen)]
pub struct PyTensor {
    fields: UnsafeCell<Fields>,
}

// SAFETY: `fields` is written only by `spare::replace`, with the GIL held, while
// the caller holds the object's only reference (its reference count is one, read under the GIL,
// and no Python code runs until the write is done). Every `&PyTensor` anywhere is borrowed from a
// reference that counts (a `Py`, a `Bound`, a frame's argument), and a thread without the GIL
// cannot take or give up a reference (pyo3 defers its decrements to the next thread that
// attaches), so no other thread or frame can read the fields while they are written. Otherwise
// they are read only, as a `frozen` class's are. On a free-threaded CPython the store keeps
// nothing, so nothing writes them.
unsafe impl Sync for PyTensor {}

/// What a `pyop.Tensor` holds.
struct Fields {
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
    fn of(fields: Fields) -> Self {
        Self {
            fields: UnsafeCell::new(fields),
        }
    }

    fn fields(&self) -> &Fields {
        // SAFETY: see `impl Sync`: nothing writes the fields while a `&self` exists.
        unsafe { &*self.fields.get() }
    }

    /// Wraps a tensor for Python (e.g. to return it from a Rust function called by a body).
    pub fn new(tensor: Tensor) -> Self {
        Self::of(Fields::new(tensor))
    }

    /// The base object of a NumPy view of `tensor` starting at address `data`.
    pub(crate) fn view_base(tensor: Tensor, data: usize, writable: bool) -> Self {
        Self::of(Fields::view_base(tensor, data, writable))
    }

    /// `tensor`, made from this one by an op that may share its storage (a view, a reshape, a
    /// `detach`): it keeps knowing whether that storage may be a `Var`'s.
    pub(crate) fn derived(&self, tensor: Tensor) -> Self {
        let var_storage = self.fields().var_storage || self.tensor().track_op();
        Self::of(Fields {
            var_storage,
            ..Fields::new(tensor)
        })
    }

    /// Whether a consumer of this tensor's memory must get a snapshot (`__dlpack__`).
    pub(crate) fn may_be_written(&self) -> bool {
        self.fields().var_storage || self.tensor().track_op()
    }

    pub(crate) fn writable(&self) -> bool {
        self.fields().writable
    }

    pub(crate) fn view_data(&self) -> Option<usize> {
        let data = self.fields().view_data;
        (data != 0).then_some(data)
    }

    /// The wrapped tensor.
    pub fn tensor(&self) -> &Tensor {
        &self.fields().tensor
    }
}

impl Fields {
    fn new(tensor: Tensor) -> Self {
        Self {
            tensor,
            view_data: 0,
            writable: false,
            var_storage: false,
        }
    }

    /// A NumPy view's base: `tensor`, the view starting at address `data`.
    fn view_base(tensor: Tensor, data: usize, writable: bool) -> Self {
        Self {
            view_data: data,
            writable,
            ..Self::new(tensor)
        }
    }
}
