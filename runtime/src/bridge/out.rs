//! The `out` protocol: fresh candle tensors handed to a numpy-mode body as writable arrays, kept
//! only if Python holds no reference to them once the body returns.

use candle_core::Tensor;

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::bridge::tensor::PyTensor;
use crate::error::{candle_message, Error, ErrorKind, Result, NO_OP};
use crate::spec::OutSpec;

use super::numbers::describe_value;
use super::outputs::OutputCheck;
use super::prepare::{cpu_data_ptr, Prepared};
use super::view::numpy_array;

/// Fresh candle tensors handed to a body as writable NumPy arrays through its `out` keyword, so a
/// numpy-mode body writes its outputs straight into candle memory (`np.add(x, 1, out=out)`).
pub(crate) struct OutBuffers<'py> {
    tensors: Vec<Tensor>,
    bases: Vec<Bound<'py, PyTensor>>,
    /// What the body gets as `out`: one array, or a tuple of them for several outputs.
    pub arg: Bound<'py, PyAny>,
}

/// Allocates the outputs of `tout` with the shapes `shapes` (on the CPU, contents unspecified
/// until the body writes them) and their views.
pub(crate) fn out_buffers<'py>(
    py: Python<'py>,
    tout: &[OutSpec],
    shapes: Vec<Vec<usize>>,
) -> Result<OutBuffers<'py>> {
    let mut tensors = Vec::with_capacity(tout.len());
    let mut bases = Vec::with_capacity(tout.len());
    let mut views = Vec::with_capacity(tout.len());
    for (spec, dims) in tout.iter().zip(shapes) {
        // SAFETY: the tensor's view goes to the body as `out` below before anything reads it;
        // `finish` takes it back after the body returned.
        let t = unsafe { crate::alloc::unwritten_tensor(spec.dtype, dims) }.map_err(|e| {
            Error::op_failure(NO_OP, ErrorKind::ResourceExhausted, candle_message(&e))
        })?;
        let data = cpu_data_ptr(&t);
        let prepared = Prepared {
            tensor: t.clone(),
            data,
            shares_var: false,
        };
        let (view, base) = numpy_array(py, &prepared, true)
            .map_err(|e| crate::python::errors::python_error(py, NO_OP, e))?;
        tensors.push(t);
        bases.push(base);
        views.push(view);
    }
    let arg = match views.len() {
        1 => views.pop().expect("one"),
        _ => PyTuple::new(py, views)
            .map_err(|e| crate::python::errors::python_error(py, NO_OP, e))?
            .into_any(),
    };
    Ok(OutBuffers {
        tensors,
        bases,
        arg,
    })
}

/// The error for a body given `out` that returned something else than None or `out`.
pub(crate) fn returned_instead_of_out(
    check: &OutputCheck<'_>,
    returned: &Bound<'_, PyAny>,
) -> Error {
    check.error(
        None,
        format!(
            "a body given `out` writes its outputs into it and returns None (or `out`), got {}",
            describe_value(returned)
        ),
    )
}

impl OutBuffers<'_> {
    /// The outputs, once the body has returned `None` or `out` itself. A tensor whose memory a
    /// Python object still references (the body kept `out` or a view of it) is copied, so Python
    /// can never write to memory candle holds.
    pub(crate) fn finish(
        self,
        check: &OutputCheck<'_>,
        returned: Bound<'_, PyAny>,
    ) -> Result<super::outputs::Outputs> {
        if !(returned.is_none() || returned.is(&self.arg)) {
            return Err(returned_instead_of_out(check, &returned));
        }
        drop(returned);
        drop(self.arg);
        self.tensors
            .into_iter()
            .zip(self.bases)
            .map(|(t, base)| {
                // SAFETY: reading the reference count of a live object.
                let shared = unsafe { pyo3::ffi::Py_REFCNT(base.as_ptr()) } > 1;
                drop(base);
                Ok(if shared { t.copy()? } else { t }.to_device(check.device)?)
            })
            .collect()
    }
}
