//! Python values out of a tensor: one element's value (`item`), a NumPy copy (`to_numpy`).

use candle_core::{DType, Device, Tensor};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyImportError, PyValueError};
use pyo3::prelude::*;

use crate::spec::with_numpy_element;

use super::checked::allocatable;
use super::compute::value_error;

/// The value of a one-element tensor as f64 (or i64 for integer dtypes).
pub(super) fn item<'py>(py: Python<'py>, t: &Tensor) -> PyResult<Bound<'py, PyAny>> {
    let t = t.to_device(&Device::Cpu).map_err(value_error)?;
    Ok(match t.dtype() {
        DType::U8 | DType::U32 | DType::I16 | DType::I32 | DType::I64 => t
            .to_dtype(DType::I64)
            .and_then(|t| t.to_scalar::<i64>())
            .map_err(value_error)?
            .into_pyobject(py)?
            .into_any(),
        _ => t
            .to_dtype(DType::F64)
            .and_then(|t| t.to_scalar::<f64>())
            .map_err(value_error)?
            .into_pyobject(py)?
            .into_any(),
    })
}

pub(super) fn to_numpy<'py>(py: Python<'py>, t: &Tensor) -> PyResult<Bound<'py, PyAny>> {
    crate::python::numpy::ensure_numpy(py, crate::error::NO_OP)
        .map_err(|e| PyImportError::new_err(e.to_string()))?;
    allocatable(Some(t.elem_count()), t.dtype(), "the NumPy copy")?;
    let dims = t.dims().to_vec();
    let t = t
        .to_device(&Device::Cpu)
        .and_then(|t| t.flatten_all())
        .map_err(value_error)?;
    with_numpy_element!(
        t.dtype(),
        T => Ok(PyArray1::<T>::from_vec(py, t.to_vec1::<T>().map_err(value_error)?)
            .reshape(dims)?
            .into_any()),
        d => Err(PyValueError::new_err(format!(
            "NumPy has no dtype {}; convert with .to_dtype(\"f32\") first",
            d.as_str()
        )))
    )
}
