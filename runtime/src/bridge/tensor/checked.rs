//! Checked sizes and integer arithmetic: an allocation checked before candle tries it, shapes
//! whose element count would overflow refused, integer results outside their dtype's range
//! raised as `OverflowError` (in debug and release builds alike).

use candle_core::{DType, Tensor};
use pyo3::exceptions::{PyMemoryError, PyOverflowError, PyValueError};
use pyo3::prelude::*;

use super::compute::value_error;

/// Checks that a tensor of `elems` elements of `dtype` can be allocated before candle tries (its
/// allocations abort the process when they fail; `alloc::check`): `MemoryError` if not, as NumPy
/// raises. `None` (an element count that overflows) is a `ValueError`.
pub(super) fn allocatable(elems: Option<usize>, dtype: DType, what: &str) -> PyResult<()> {
    crate::alloc::check(elems, dtype).map_err(|refusal| match refusal {
        crate::alloc::Refusal::TooLarge => {
            PyValueError::new_err(format!("{what} has too many elements for any tensor"))
        }
        crate::alloc::Refusal::NoMemory(msg) => {
            PyMemoryError::new_err(format!("{msg} for {what} of dtype {}", dtype.as_str()))
        }
    })
}

/// The number of elements of `dims`, `None` if it overflows.
pub(super) fn elem_count(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// A shape from Python, its element count checked: no shape whose count overflows (which would
/// make a tensor larger than its storage) ever reaches candle.
pub(super) fn checked_shape(dims: Vec<usize>) -> PyResult<Vec<usize>> {
    match elem_count(&dims) {
        Some(n) if n.checked_mul(8).is_some_and(|b| b <= isize::MAX as usize) => Ok(dims),
        _ => Err(PyValueError::new_err(format!(
            "the shape {dims:?} has too many elements for any tensor"
        ))),
    }
}

/// Integer arithmetic is checked, in debug and release builds alike: a result outside the
/// dtype's range raises `OverflowError` (as NumPy does for Python ints that do not fit), where
/// candle's kernels would wrap in release and panic in debug. The result is computed in f64
/// first (exact below 2^53) and its range checked; then candle computes it in the dtype.
pub(super) fn check_int_range(wide: &Tensor, dtype: DType, what: &str) -> PyResult<()> {
    let (lo, hi): (f64, f64) = match dtype {
        DType::U8 => (0.0, u8::MAX as f64),
        DType::U32 => (0.0, u32::MAX as f64),
        DType::I16 => (i16::MIN as f64, i16::MAX as f64),
        DType::I32 => (i32::MIN as f64, i32::MAX as f64),
        // 2^63 itself is out of range; every f64 below it is in.
        DType::I64 => (
            i64::MIN as f64,
            f64::from_bits((i64::MAX as f64).to_bits() - 1),
        ),
        _ => return Ok(()),
    };
    if wide.elem_count() == 0 {
        return Ok(());
    }
    let min = wide
        .min_all()
        .and_then(|t| t.to_scalar::<f64>())
        .map_err(value_error)?;
    let max = wide
        .max_all()
        .and_then(|t| t.to_scalar::<f64>())
        .map_err(value_error)?;
    if min < lo || max > hi {
        return Err(int_overflow(what, dtype));
    }
    Ok(())
}

/// The size of a broadcasting op's result, for the allocation check. Shapes that do not
/// broadcast are left to candle's own error (it names the op); only a broadcast too large to
/// count is refused here.
pub(super) fn result_count(a: &Tensor, b: &Tensor) -> PyResult<usize> {
    match broadcast_count(a, b) {
        Ok(n) => Ok(n),
        Err(_) if a.shape().broadcast_shape_binary_op(b.shape(), "").is_err() => {
            Ok(a.elem_count().max(b.elem_count()))
        }
        Err(e) => Err(e),
    }
}

/// The number of elements `a ⊕ b` has (broadcasting), checked.
pub(super) fn broadcast_count(a: &Tensor, b: &Tensor) -> PyResult<usize> {
    // The common cases without building the broadcast shape: equal shapes, or a one-element
    // operand (a Python number), whose broadcast has the other operand's size.
    if a.dims() == b.dims() || b.elem_count() == 1 {
        return Ok(a.elem_count());
    }
    if a.elem_count() == 1 {
        return Ok(b.elem_count());
    }
    let shape = a
        .shape()
        .broadcast_shape_binary_op(b.shape(), "broadcast")
        .map_err(value_error)?;
    elem_count(shape.dims()).ok_or_else(|| {
        PyValueError::new_err(format!(
            "broadcasting {:?} with {:?} gives too many elements for any tensor",
            a.dims(),
            b.dims()
        ))
    })
}

/// The `OverflowError` of a checked integer op.
pub(super) fn int_overflow(what: &str, dtype: DType) -> PyErr {
    PyOverflowError::new_err(format!(
        "integer overflow: {what} gives values outside the range of {} (convert with \
         .to_dtype() first)",
        dtype.as_str()
    ))
}

/// `a ⊕ b` on i64 tensors, checked element by element (`+`, `-` or `*`).
pub(super) fn exact_i64(a: &Tensor, b: &Tensor, what: &str) -> PyResult<()> {
    let op: fn(i64, i64) -> Option<i64> = match what {
        "+" => i64::checked_add,
        "-" => i64::checked_sub,
        "*" => i64::checked_mul,
        _ => return Ok(()),
    };
    let shape = a
        .shape()
        .broadcast_shape_binary_op(b.shape(), "broadcast")
        .map_err(value_error)?;
    let values = |t: &Tensor| {
        t.broadcast_as(shape.clone())
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<i64>())
            .map_err(value_error)
    };
    let (xs, ys) = (values(a)?, values(b)?);
    if xs.iter().zip(&ys).any(|(&x, &y)| op(x, y).is_none()) {
        return Err(int_overflow(what, DType::I64));
    }
    Ok(())
}

/// The number of elements of `a @ b` (matmul's rules: batch dims broadcast, a 1-d operand
/// counts as a row or a column), `None` if it overflows.
pub(super) fn matmul_count(a: &Tensor, b: &Tensor) -> Option<usize> {
    let (ad, bd) = (a.dims(), b.dims());
    let m = if ad.len() >= 2 { ad[ad.len() - 2] } else { 1 };
    let n = if bd.len() >= 2 { bd[bd.len() - 1] } else { 1 };
    let batch = |d: &[usize]| elem_count(&d[..d.len().saturating_sub(2)]);
    let batch = batch(ad)?.max(batch(bd)?);
    elem_count(&[batch, m, n])
}
