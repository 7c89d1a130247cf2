//! NumPy arrays over candle memory: read-only views of inputs, whose base object keeps the
//! tensor alive, and the test that an array handed back is such a view, unchanged.

use std::ffi::c_void;

use candle_core::{DType, Tensor};
use numpy::npyffi::{self, npy_intp, PY_ARRAY_API};
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::bridge::tensor::PyTensor;
use crate::spec::with_numpy_element;

use super::prepare::Prepared;

/// The NumPy dtype of the same name as a candle dtype.
pub(crate) fn numpy_dtype(py: Python<'_>, dtype: DType) -> Option<Bound<'_, PyArrayDescr>> {
    with_numpy_element!(dtype, T => Some(numpy::dtype::<T>(py)), _ => None)
}

/// A read-only NumPy array over the prepared tensor's memory, whose base object (a `pyop.Tensor`
/// holding a clone of the tensor) keeps that memory alive for as long as the array lives.
pub(crate) fn numpy_view<'py>(py: Python<'py>, p: &Prepared) -> PyResult<Bound<'py, PyAny>> {
    numpy_array(py, p, false)
}

/// A NumPy array over `p`'s memory, read-only unless `writable`.
pub(crate) fn numpy_array<'py>(
    py: Python<'py>,
    p: &Prepared,
    writable: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let t = &p.tensor;
    let descr = numpy_dtype(py, t.dtype()).expect("checked in prepare");
    let size = t.dtype().size_in_bytes() as isize;
    let dims: Vec<npy_intp> = t.dims().iter().map(|&d| d as npy_intp).collect();
    let strides: Vec<npy_intp> = t.stride().iter().map(|&s| s as isize * size).collect();
    let base = Bound::new(py, PyTensor::view_base(t.clone(), p.data, writable))?;
    // SAFETY: `data` points into the CPU storage of `t`, which the base object keeps alive; a
    // candle storage's buffer is never reallocated. Input views are read-only, so Python cannot
    // write to memory candle believes immutable; `out` views are writable only while candle has
    // not yet been handed the tensor (see `OutBuffers`). `SetBaseObject` steals `base`.
    unsafe {
        let arr = PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type),
            descr.into_dtype_ptr(),
            dims.len() as i32,
            dims.as_ptr() as *mut npy_intp,
            strides.as_ptr() as *mut npy_intp,
            p.data as *mut c_void,
            if writable {
                npyffi::NPY_ARRAY_WRITEABLE
            } else {
                0
            },
            std::ptr::null_mut(),
        );
        let arr = Bound::from_owned_ptr_or_err(py, arr)?;
        if PY_ARRAY_API.PyArray_SetBaseObject(py, arr.as_ptr().cast(), base.into_any().into_ptr())
            != 0
        {
            return Err(PyErr::fetch(py));
        }
        Ok(arr)
    }
}

/// Whether Python may write through `array`.
pub(crate) fn writeable(array: &Bound<'_, PyUntypedArray>) -> bool {
    // SAFETY: reading the flags of a live array object.
    unsafe { (*array.as_array_ptr()).fields.flags & npyffi::NPY_ARRAY_WRITEABLE != 0 }
}

/// The tensor whose NumPy view `array` is, if it is one, unchanged (same data, shape, strides).
pub(crate) fn own_view(array: &Bound<'_, PyUntypedArray>) -> Option<Tensor> {
    // SAFETY: reading the fields of a live array object.
    let (data, base) = unsafe {
        let a = &*array.as_array_ptr();
        (a.fields.data as usize, a.fields.base)
    };
    if base.is_null() {
        return None;
    }
    // SAFETY: `base` is the non-null base object of the live `array`, which holds a reference
    // to it for as long as `array` lives; `from_borrowed_ptr` takes a new reference.
    let base = unsafe { Bound::from_borrowed_ptr(array.py(), base) };
    let owner = base.cast::<PyTensor>().ok()?.get();
    let t = owner.tensor();
    // Only read-only views of inputs: an `out` buffer a body kept is Python's to write.
    if owner.writable() || writeable(array) {
        return None;
    }
    if candle_dtype(&array.dtype()) != Some(t.dtype()) {
        return None;
    }
    let size = t.dtype().size_in_bytes() as isize;
    let same = owner.view_data() == Some(data)
        && t.dims() == array.shape()
        && t.stride()
            .iter()
            .zip(array.strides())
            .all(|(&s, &b)| s as isize * size == b);
    same.then(|| t.clone())
}

/// The candle dtype of a NumPy dtype, if candle has one (bool → u8).
pub(crate) fn candle_dtype(descr: &Bound<'_, PyArrayDescr>) -> Option<DType> {
    if descr.is_native_byteorder() == Some(false) || descr.has_fields() || descr.has_subarray() {
        return None;
    }
    Some(match (descr.kind(), descr.itemsize()) {
        (b'u' | b'b', 1) => DType::U8,
        (b'u', 4) => DType::U32,
        (b'i', 2) => DType::I16,
        (b'i', 4) => DType::I32,
        (b'i', 8) => DType::I64,
        (b'f', 2) => DType::F16,
        (b'f', 4) => DType::F32,
        (b'f', 8) => DType::F64,
        _ => return None,
    })
}
