//! The module functions of `pyop`: tensors made on the running op's device, `cat`, `stack`,
//! `where`.

use candle_core::{DType, Device, Shape, Tensor};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::checked::*;
use super::compute::*;
use super::device::current_device;
use super::parse::*;
use super::PyTensor;
use crate::bridge::numbers::{to_tensor, to_tensor_as};

/// `pyop.tensor(obj, dtype=None)`: a tensor from a number, a (nested) list, a NumPy array or a
/// tensor, on the running op's device.
#[pyfunction]
#[pyo3(signature = (obj, dtype=None))]
pub(super) fn tensor(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyTensor> {
    let dtype = dtype
        .filter(|d| !d.is_none())
        .map(parse_dtype)
        .transpose()?;
    if let Ok(t) = obj.cast::<PyTensor>() {
        let t = t.get().tensor().clone();
        let t = match dtype {
            Some(d) => {
                allocatable(Some(t.elem_count()), d, "a tensor")?;
                t.to_dtype(d).map_err(value_error)?
            }
            None => t,
        };
        return Ok(wrap(t));
    }
    // A requested dtype is a conversion here, not a check as for outputs.
    let t = match dtype {
        Some(d) => to_tensor_as(py, obj, d)?,
        None => to_tensor(py, obj, None)?,
    };
    Ok(wrap(t.to_device(&current_device()).map_err(value_error)?))
}

/// `pyop.zeros(shape, dtype="f32")` on the running op's device.
#[pyfunction]
#[pyo3(signature = (shape, dtype=None))]
pub(super) fn zeros(
    shape: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyTensor> {
    let (shape, dtype) = (shape_of(shape)?, dtype_or(dtype, DType::F32)?);
    allocatable(Some(shape.elem_count()), dtype, "a tensor")?;
    Tensor::zeros(shape, dtype, &current_device())
        .map(wrap)
        .map_err(value_error)
}

/// `pyop.ones(shape, dtype="f32")` on the running op's device.
#[pyfunction]
#[pyo3(signature = (shape, dtype=None))]
pub(super) fn ones(
    shape: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyTensor> {
    let (shape, dtype) = (shape_of(shape)?, dtype_or(dtype, DType::F32)?);
    allocatable(Some(shape.elem_count()), dtype, "a tensor")?;
    Tensor::ones(shape, dtype, &current_device())
        .map(wrap)
        .map_err(value_error)
}

/// `pyop.full(shape, value, dtype=None)`: dtype from the value (f32, i64 or u8) unless given.
#[pyfunction]
#[pyo3(signature = (shape, value, dtype=None))]
pub(super) fn full(
    py: Python<'_>,
    shape: &Bound<'_, PyAny>,
    value: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyTensor> {
    let one = tensor(py, value, dtype)?;
    let shape = shape_of(shape)?;
    allocatable(Some(shape.elem_count()), one.tensor().dtype(), "a tensor")?;
    one.tensor()
        .reshape(())
        .and_then(|t| t.broadcast_as(shape))
        .and_then(|t| t.contiguous())
        .map(wrap)
        .map_err(value_error)
}

/// `pyop.zeros_like(x, dtype=None)`.
#[pyfunction]
#[pyo3(signature = (x, dtype=None))]
pub(super) fn zeros_like(
    x: &Bound<'_, PyTensor>,
    dtype: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyTensor> {
    like(x, dtype, |s, d, dev| Tensor::zeros(s, d, dev))
}

/// A tensor of `x`'s shape and device (and dtype, unless given), made by `make`.
fn like(
    x: &Bound<'_, PyTensor>,
    dtype: Option<&Bound<'_, PyAny>>,
    make: fn(&Shape, DType, &Device) -> candle_core::Result<Tensor>,
) -> PyResult<PyTensor> {
    let t = x.get().tensor();
    let dtype = dtype_or(dtype, t.dtype())?;
    allocatable(Some(t.elem_count()), dtype, "a tensor")?;
    make(t.shape(), dtype, t.device())
        .map(wrap)
        .map_err(value_error)
}

/// `pyop.ones_like(x, dtype=None)`.
#[pyfunction]
#[pyo3(signature = (x, dtype=None))]
pub(super) fn ones_like(
    x: &Bound<'_, PyTensor>,
    dtype: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyTensor> {
    like(x, dtype, |s, d, dev| Tensor::ones(s, d, dev))
}

/// `pyop.arange(start, end, step=1, dtype=None)` (or `arange(end)`).
#[pyfunction]
#[pyo3(signature = (start, end=None, step=None, dtype=None))]
pub(super) fn arange(
    start: f64,
    end: Option<f64>,
    step: Option<f64>,
    dtype: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyTensor> {
    let (lo, hi) = match end {
        Some(e) => (start, e),
        None => (0.0, start),
    };
    let step = step.unwrap_or(1.0);
    let d = dtype_or(
        dtype,
        if [lo, hi, step].iter().all(|v| v.fract() == 0.0) {
            DType::I64
        } else {
            DType::F32
        },
    )?;
    if step == 0.0 || !(lo.is_finite() && hi.is_finite() && step.is_finite()) {
        return Err(PyValueError::new_err(format!(
            "arange({lo}, {hi}, {step}): the bounds and step must be finite and the step nonzero"
        )));
    }
    // The length first: candle grows its Vec until the allocation fails, which aborts.
    let len = ((hi - lo) / step).ceil().max(0.0);
    let len = (len < usize::MAX as f64).then_some(len as usize);
    allocatable(len, DType::F64, "arange()")?;
    Tensor::arange_step(lo, hi, step, &current_device())
        .and_then(|t| t.to_dtype(d))
        .map(wrap)
        .map_err(value_error)
}

/// The elements of the tensor that joins `ts` (`cat`, `stack`), once that much memory can be had.
fn elems_of(ts: &[Tensor]) -> PyResult<usize> {
    let n = ts
        .iter()
        .try_fold(0usize, |n, t| n.checked_add(t.elem_count()));
    allocatable(
        n,
        ts.first().map_or(DType::F32, Tensor::dtype),
        "the result",
    )?;
    Ok(n.unwrap_or(0))
}

/// `pyop.cat(tensors, dim=0)`.
#[pyfunction]
#[pyo3(signature = (tensors, dim=0))]
pub(super) fn cat(py: Python<'_>, tensors: &Bound<'_, PyAny>, dim: isize) -> PyResult<PyTensor> {
    let ts = tensors_of(tensors)?;
    let rank = ts.first().map_or(1, |t| t.rank());
    let d = self::dim(dim, rank)?;
    let n = elems_of(&ts)?;
    compute(py, n, || Tensor::cat(&ts, d)).map(wrap)
}

/// `pyop.stack(tensors, dim=0)`.
#[pyfunction]
#[pyo3(signature = (tensors, dim=0))]
pub(super) fn stack(py: Python<'_>, tensors: &Bound<'_, PyAny>, dim: isize) -> PyResult<PyTensor> {
    let ts = tensors_of(tensors)?;
    let rank = ts.first().map_or(0, |t| t.rank());
    let d = self::dim(dim, rank + 1)?;
    let n = elems_of(&ts)?;
    compute(py, n, || Tensor::stack(&ts, d)).map(wrap)
}

/// `pyop.where(cond, x, y)`: `x` where `cond` is nonzero, else `y`, broadcasting all three;
/// `x` or `y` may be a number.
#[pyfunction(name = "where")]
pub(super) fn where_(
    py: Python<'_>,
    cond: &Bound<'_, PyTensor>,
    x: &Bound<'_, PyAny>,
    y: &Bound<'_, PyAny>,
) -> PyResult<PyTensor> {
    let c = cond.get().tensor().clone();
    let (x, y) = match (x.cast::<PyTensor>(), y.cast::<PyTensor>()) {
        (Ok(a), _) => {
            let a = a.get();
            let b = a
                .operand(py, y)?
                .ok_or_else(|| PyTypeError::new_err("where() takes tensors or numbers"))?;
            (a.tensor().clone(), b)
        }
        (_, Ok(b)) => {
            let b = b.get();
            let a = b
                .operand(py, x)?
                .ok_or_else(|| PyTypeError::new_err("where() takes tensors or numbers"))?;
            (a, b.tensor().clone())
        }
        _ => {
            return Err(PyTypeError::new_err(
                "where() needs at least one of x and y to be a tensor",
            ))
        }
    };
    let shape = c
        .shape()
        .broadcast_shape_binary_op(x.shape(), "where")
        .and_then(|s| s.broadcast_shape_binary_op(y.shape(), "where"))
        .map_err(value_error)?;
    let n = elem_count(shape.dims());
    allocatable(n, x.dtype(), "the result")?;
    compute(py, n.unwrap_or(0), || {
        c.broadcast_as(shape.clone())?
            .where_cond(&x.broadcast_as(shape.clone())?, &y.broadcast_as(shape)?)
    })
    .map(wrap)
}
