//! NumPy arrays over candle memory: read-only views of inputs, whose base object keeps the
//! tensor alive, and the test that an array handed back is such a view, unchanged.

use std::ffi::c_void;

use candle_core::{DType, Tensor};
use numpy::npyffi::{self, npy_intp, PY_ARRAY_API};
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::bridge::ndarray::{spare_views, types};
use crate::bridge::tensor::spare::Made;
use crate::bridge::tensor::PyTensor;
use crate::spec::with_numpy_element;

use super::prepare::Prepared;

/// The NumPy dtype of the same name as a candle dtype.
pub(crate) fn numpy_dtype(py: Python<'_>, dtype: DType) -> Option<Bound<'_, PyArrayDescr>> {
    with_numpy_element!(dtype, T => Some(numpy::dtype::<T>(py)), _ => None)
}

/// A read-only NumPy array over the prepared tensor's memory, whose base object (a `pyop.Tensor`
/// holding a clone of the tensor, from the thread's spares through `made`) keeps that memory
/// alive for as long as the array lives.
///
/// With NumPy 1.22 or later, the whole view (the array, its root and the base) comes from the
/// thread's spare views when one of the same rank and dtype is there (see
/// [`ViewParts::refill`](crate::bridge::ndarray::ViewParts::refill)), and goes
/// back to them when the call lets go of it with no one else holding any part of it.
pub(crate) fn numpy_view<'py>(
    py: Python<'py>,
    p: &Prepared,
    made: &mut Made<'py>,
) -> PyResult<Bound<'py, PyAny>> {
    if !spare_views(py) {
        let base = made.view_base(py, p.tensor.clone(), p.data)?;
        return numpy_array_over(py, p, false, base).map(|(arr, _)| arr);
    }
    let t = &p.tensor;
    let descr = native_descr(py, t.dtype()).expect("checked in prepare");
    if let Some(view) = made.spare_view(py, t.rank(), descr, p) {
        return Ok(view);
    }
    let base = made.fresh_view_base(py, p.tensor.clone(), p.data)?;
    let (view, _) = numpy_array_over(py, p, false, base)?;
    made.keep_view(view.clone());
    Ok(view)
}

/// A NumPy array over `p`'s memory, read-only unless `writable`, and the `pyop.Tensor` keeping
/// that memory alive.
///
/// The array handed to the body is a view of a hidden *root* array, whose base is the
/// `pyop.Tensor`. Every view NumPy makes of it (`x[1:]`, `x.T`, `np.asarray(x)`) takes the root as
/// its base, not the array the body got: so `ndarray.__setstate__` on that array (which swaps in
/// a buffer of its own and drops its base) leaves every other view alive and read-only, and the
/// `out` check still sees them. The root itself is never handed out.
pub(crate) fn numpy_array<'py>(
    py: Python<'py>,
    p: &Prepared,
    writable: bool,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTensor>)> {
    let base = Bound::new(py, PyTensor::view_base(p.tensor.clone(), p.data, writable))?;
    numpy_array_over(py, p, writable, base)
}

/// [`numpy_array`] with its base object given.
fn numpy_array_over<'py>(
    py: Python<'py>,
    p: &Prepared,
    writable: bool,
    base: Bound<'py, PyTensor>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTensor>)> {
    let t = &p.tensor;
    let descr = numpy_dtype(py, t.dtype()).expect("checked in prepare");
    let size = t.dtype().size_in_bytes() as isize;
    let dims: smallvec::SmallVec<[npy_intp; 6]> = t.dims().iter().map(|&d| d as npy_intp).collect();
    let strides: smallvec::SmallVec<[npy_intp; 6]> =
        t.stride().iter().map(|&s| s as isize * size).collect();
    let flags = if writable {
        npyffi::NPY_ARRAY_WRITEABLE
    } else {
        0
    };
    let array_over = |owner: Bound<'py, PyAny>| -> PyResult<Bound<'py, PyAny>> {
        // SAFETY: `data` points into the CPU storage of `t`, which `owner` keeps alive (it is
        // the `pyop.Tensor` holding `t`, or the root array holding that); a candle storage's
        // buffer is never reallocated. Input views are read-only, so Python cannot write to
        // memory candle believes immutable; `out` views are writable only while candle has not
        // yet been handed the tensor (see `OutBuffers`). `NewFromDescr` steals a reference to
        // `descr`, `SetBaseObject` one to `owner`.
        unsafe {
            let arr = PY_ARRAY_API.PyArray_NewFromDescr(
                py,
                npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type),
                descr.clone().into_dtype_ptr(),
                dims.len() as i32,
                dims.as_ptr() as *mut npy_intp,
                strides.as_ptr() as *mut npy_intp,
                p.data as *mut c_void,
                flags,
                std::ptr::null_mut(),
            );
            let arr = Bound::from_owned_ptr_or_err(py, arr)?;
            if PY_ARRAY_API.PyArray_SetBaseObject(py, arr.as_ptr().cast(), owner.into_ptr()) != 0 {
                return Err(PyErr::fetch(py));
            }
            Ok(arr)
        }
    };
    let root = array_over(base.clone().into_any())?;
    let arr = array_over(root)?;
    Ok((arr, base))
}

/// The tensor whose NumPy view `value` is, if it is one, unchanged, in pointer compares and no
/// Python call: `value` is an exact ndarray of NumPy's own dtype object for the tensor's dtype,
/// whose base is the hidden root (an exact ndarray over the same data), whose base is the
/// `pyop.Tensor` that made it; neither array writable (an `out` buffer a body kept is Python's to
/// write); the tensor's shape and strides. Anything else (a view of an ndarray subclass too) is
/// `None`: read as a new array, adopted or copied.
pub(crate) fn unchanged_view(
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    want: Option<DType>,
) -> Option<Tensor> {
    let (ndarray, tensor) = types(py);
    let is = |obj: *mut pyo3::ffi::PyObject, ty: *mut pyo3::ffi::PyTypeObject| {
        // SAFETY: reading the type of a live, non-null object.
        !obj.is_null() && unsafe { pyo3::ffi::Py_TYPE(obj) } == ty
    };
    if !is(value.as_ptr(), ndarray) {
        return None;
    }
    // SAFETY: `value` is an exact ndarray, alive; its base (if any) is alive while it is, and
    // the root's base while the root is. Only fields are read.
    let (view, root) = unsafe {
        let view = &*value.as_ptr().cast::<npyffi::PyArrayObject>();
        if !is(view.fields.base, ndarray) {
            return None;
        }
        (view, &*view.fields.base.cast::<npyffi::PyArrayObject>())
    };
    let writable = npyffi::NPY_ARRAY_WRITEABLE;
    if root.fields.data != view.fields.data
        || !is(root.fields.base, tensor)
        || (view.fields.flags | root.fields.flags) & writable != 0
    {
        return None;
    }
    // SAFETY: the root's base is an exact `pyop.Tensor`, alive while the root is.
    let base = unsafe { Borrowed::from_ptr(py, root.fields.base).cast_unchecked::<PyTensor>() };
    let owner = base.get();
    let t = owner.tensor();
    if owner.writable()
        || owner.view_data() != Some(view.fields.data as usize)
        || want.is_some_and(|w| w != t.dtype())
        || view.fields.descr != native_descr(py, t.dtype())?
    {
        return None;
    }
    let size = t.dtype().size_in_bytes() as isize;
    let rank = t.rank();
    let nd = view.fields.nd as usize;
    if nd != rank {
        return None;
    }
    // SAFETY: `view` is a live array, only read while it is borrowed.
    let (dims, strides) = unsafe { crate::bridge::ndarray::dims_and_strides(&view.fields) };
    let same = t.dims().iter().zip(dims).all(|(&d, &n)| d as isize == n)
        && t.stride()
            .iter()
            .zip(strides)
            .all(|(&s, &b)| s as isize * size == b);
    same.then(|| t.clone())
}

/// NumPy's own dtype object for `dtype` (the one [`numpy_view`] gives its arrays: NumPy keeps one
/// per builtin type for the life of the process), by address; `None` for a dtype NumPy has no
/// builtin type for.
fn native_descr(py: Python<'_>, dtype: DType) -> Option<*mut npyffi::PyArray_Descr> {
    use pyo3::sync::PyOnceLock;
    const DTYPES: [DType; 8] = [
        DType::U8,
        DType::U32,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::F32,
        DType::F64,
    ];
    static DESCRS: PyOnceLock<[usize; 8]> = PyOnceLock::new();
    let descrs = DESCRS.get_or_init(py, || {
        DTYPES.map(|d| numpy_dtype(py, d).map_or(0, |descr| descr.as_ptr() as usize))
    });
    let i = DTYPES.iter().position(|&d| d == dtype)?;
    (descrs[i] != 0).then(|| descrs[i] as *mut npyffi::PyArray_Descr)
}

/// The candle dtype of a NumPy dtype, if candle has one (bool → u8).
pub(crate) fn candle_dtype(descr: &Bound<'_, PyArrayDescr>) -> Option<DType> {
    if descr.is_native_byteorder() == Some(false) || descr.has_fields() || descr.has_subarray() {
        return None;
    }
    match (descr.kind(), descr.itemsize()) {
        (b'V', 1 | 2) => ml_dtype(descr),
        (kind, size) => plain_dtype(kind, size),
    }
}

/// The candle dtype of a NumPy dtype of plain numbers, by its kind and size (bool → u8): the
/// one table, for a dtype object here and for a worker's dtype string (`dtype.str`).
pub(crate) fn plain_dtype(kind: u8, itemsize: usize) -> Option<DType> {
    Some(match (kind, itemsize) {
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

/// ml_dtypes' `bfloat16` and `float8_e4m3fn` (how JAX, TensorFlow and ONNX tools hand such
/// arrays to NumPy code): a void kind to NumPy, known by their scalar type, with the bits of
/// candle's bf16 and f8e4m3.
fn ml_dtype(descr: &Bound<'_, PyArrayDescr>) -> Option<DType> {
    let ty = descr.typeobj();
    if ty.module().ok()?.to_str().ok()? != "ml_dtypes" {
        return None;
    }
    match (ty.name().ok()?.to_str().ok()?, descr.itemsize()) {
        ("bfloat16", 2) => Some(DType::BF16),
        ("float8_e4m3fn", 1) => Some(DType::F8E4M3),
        _ => None,
    }
}

/// A CPU tensor holding a copy of `array`, of `dtype` (its own, checked by the caller) and any
/// strides or alignment, written in one pass by NumPy's strided copy (`PyArray_CopyInto`, which
/// releases the GIL for large arrays) instead of a contiguous copy first and a `memcpy` after.
pub(crate) fn copied_by_numpy(
    py: Python<'_>,
    dtype: DType,
    array: &Bound<'_, PyUntypedArray>,
) -> std::result::Result<Tensor, String> {
    if numpy_dtype(py, dtype).is_none() {
        // ml_dtypes' bf16 and f8e4m3, which candle memory cannot be viewed as: NumPy's C-ordered
        // copy, then its bytes.
        let copy = array
            .call_method1(pyo3::intern!(py, "copy"), ("C",))
            .and_then(|c| Ok(c.cast_into::<PyUntypedArray>()?))
            .map_err(|e| crate::python::describe(py, &e))?;
        // SAFETY: reading the data pointer of a live, C-contiguous array of `dtype`'s size
        // elements (a copy of `array`, whose dtype the caller checked), which `copy` keeps
        // alive.
        return unsafe {
            let data = (*copy.as_array_ptr()).fields.data as *const u8;
            crate::alloc::tensor_from_bytes(dtype, data, copy.shape().to_vec())
        }
        .map_err(|e| crate::error::candle_message(&e));
    }
    // SAFETY: NumPy's copy below writes every element before anything reads them; on its
    // failure the tensor is dropped unread.
    let t = unsafe { crate::alloc::unwritten_tensor(dtype, array.shape().to_vec()) }
        .map_err(|e| crate::error::candle_message(&e))?;
    let prepared = Prepared {
        data: super::prepare::cpu_data_ptr(&t),
        tensor: t.clone(),
        shares_var: false,
    };
    let (view, base) =
        numpy_array(py, &prepared, true).map_err(|e| crate::python::describe(py, &e))?;
    // SAFETY: two live arrays of the same shape and dtype; NumPy writes every element of `view`,
    // which pyop made and hands to no one else.
    let rc =
        unsafe { PY_ARRAY_API.PyArray_CopyInto(py, view.as_ptr().cast(), array.as_array_ptr()) };
    drop((view, base));
    if rc != 0 {
        return Err(crate::python::describe(py, &PyErr::fetch(py)));
    }
    Ok(t)
}
