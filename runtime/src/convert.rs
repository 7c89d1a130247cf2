//! The one conversion layer between candle and Python, both ways.
//!
//! In: [`Arg`]s become Python values — tensors as read-only NumPy views of the candle storage
//! (numpy mode) or as `pyop.Tensor`s wrapping the candle tensor itself (tensor mode).
//! Out: whatever the body returned is checked against `tout` by one rule for every mode
//! ([`outputs_from_python`]) and turned into candle tensors on the op's device.

use std::ffi::c_void;

use candle_core::{CpuStorage, DType, Device, Shape, Storage, Tensor};
use numpy::npyffi::{self, npy_intp, PY_ARRAY_API};
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::error::{Error, ErrorKind, Result};
use crate::spec::{numpy_can_hold, with_numpy_element, Mode, OutSpec};
use crate::tensor::PyTensor;

/// One argument of an op call, in declaration order. Plain values reach Python as `float`, `int`,
/// `bool`, `str`, lists of them, or `None`.
#[derive(Clone, Copy, Debug)]
pub enum Arg<'a> {
    Tensor(&'a Tensor),
    Tensors(&'a [Tensor]),
    F64(f64),
    I64(i64),
    Bool(bool),
    Str(&'a str),
    F64s(&'a [f64]),
    I64s(&'a [i64]),
    /// An absent `Option<…>`.
    None,
}

impl<'a> From<&'a Tensor> for Arg<'a> {
    fn from(t: &'a Tensor) -> Self {
        Arg::Tensor(t)
    }
}
impl<'a> From<&'a [Tensor]> for Arg<'a> {
    fn from(t: &'a [Tensor]) -> Self {
        Arg::Tensors(t)
    }
}
impl From<f64> for Arg<'_> {
    fn from(v: f64) -> Self {
        Arg::F64(v)
    }
}
impl From<i64> for Arg<'_> {
    fn from(v: i64) -> Self {
        Arg::I64(v)
    }
}
impl From<bool> for Arg<'_> {
    fn from(v: bool) -> Self {
        Arg::Bool(v)
    }
}
impl<'a> From<&'a str> for Arg<'a> {
    fn from(v: &'a str) -> Self {
        Arg::Str(v)
    }
}
impl<'a> From<&'a [f64]> for Arg<'a> {
    fn from(v: &'a [f64]) -> Self {
        Arg::F64s(v)
    }
}
impl<'a> From<&'a [i64]> for Arg<'a> {
    fn from(v: &'a [i64]) -> Self {
        Arg::I64s(v)
    }
}
impl<'a, T: Into<Arg<'a>>> From<Option<T>> for Arg<'a> {
    fn from(v: Option<T>) -> Self {
        v.map_or(Arg::None, Into::into)
    }
}

impl<'a> Arg<'a> {
    /// Calls `f` on every tensor of the argument.
    pub(crate) fn for_each_tensor(&self, mut f: impl FnMut(&'a Tensor)) {
        match self {
            Arg::Tensor(t) => f(t),
            Arg::Tensors(ts) => ts.iter().for_each(f),
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// In: candle → Python
// ---------------------------------------------------------------------------------------------

/// A tensor made ready for Python outside the GIL: on the CPU (numpy mode), snapshotted if it is
/// a `Var` (so a concurrent `Var::set` is seen entirely or not at all), with its data pointer.
pub(crate) struct Prepared {
    pub tensor: Tensor,
    /// Address of the first element, for NumPy views (numpy mode only).
    data: usize,
}

/// Prepares every tensor of `args`, in order. Runs without the GIL: it may copy and lock.
pub(crate) fn prepare_inputs(op: &str, mode: Mode, args: &[Arg<'_>]) -> Result<Vec<Prepared>> {
    let mut out = Vec::new();
    let mut err = None;
    let mut index = 0;
    for arg in args {
        arg.for_each_tensor(|t| {
            if err.is_none() {
                match prepare(op, mode, t, index) {
                    Ok(p) => out.push(p),
                    Err(e) => err = Some(e),
                }
            }
            index += 1;
        });
    }
    err.map_or(Ok(out), Err)
}

fn prepare(op: &str, mode: Mode, t: &Tensor, index: usize) -> Result<Prepared> {
    // A Var's storage can be overwritten in place by `Var::set` while the body reads it; candle's
    // `copy` takes the storage's read lock, so the snapshot is all old or all new values. `copy`
    // is differentiable, so gradients still reach the Var. NumPy reads without any lock, so in
    // numpy mode every tracked input is snapshotted too: it may be a view of a Var (`narrow`,
    // `t()`, `reshape`), which shares the Var's storage. On another device, the move to the host
    // below is the snapshot.
    let on_cpu = t.device().is_cpu();
    let snapshot = t.is_variable() || (mode == Mode::Numpy && t.track_op());
    let t = if snapshot && (on_cpu || mode == Mode::Tensor) {
        t.copy()?
    } else {
        t.clone()
    };
    match mode {
        Mode::Tensor => Ok(Prepared { tensor: t, data: 0 }),
        Mode::Numpy => {
            if !numpy_can_hold(t.dtype()) {
                return Err(Error::mismatch(
                    op,
                    ErrorKind::InvalidArgument,
                    Some(index),
                    format!(
                        "input {index} is {}, which NumPy cannot hold; convert it with `to_dtype` \
                         or use tensor mode",
                        t.dtype().as_str()
                    ),
                ));
            }
            let t = if t.device().is_cpu() {
                t
            } else {
                t.to_device(&Device::Cpu)?
            };
            let data = {
                let (storage, layout) = t.storage_and_layout();
                let Storage::Cpu(cpu) = &*storage else {
                    unreachable!("moved to the CPU above")
                };
                element_ptr(cpu, layout.start_offset())
            };
            Ok(Prepared { tensor: t, data })
        }
    }
}

fn element_ptr(cpu: &CpuStorage, offset: usize) -> usize {
    macro_rules! at {
        ($v:expr) => {
            $v.as_ptr().wrapping_add(offset) as usize
        };
    }
    match cpu {
        CpuStorage::U8(v) => at!(v),
        CpuStorage::U32(v) => at!(v),
        CpuStorage::I16(v) => at!(v),
        CpuStorage::I32(v) => at!(v),
        CpuStorage::I64(v) => at!(v),
        CpuStorage::F16(v) => at!(v),
        CpuStorage::F32(v) => at!(v),
        CpuStorage::F64(v) => at!(v),
        // `prepare` rejects the dtypes NumPy cannot hold before asking.
        _ => 0,
    }
}

/// The NumPy dtype of the same name as a candle dtype.
pub(crate) fn numpy_dtype(py: Python<'_>, dtype: DType) -> Option<Bound<'_, PyArrayDescr>> {
    with_numpy_element!(dtype, T => Some(numpy::dtype::<T>(py)), _ => None)
}

/// A read-only NumPy array over the prepared tensor's memory, whose base object (a `pyop.Tensor`
/// holding a clone of the tensor) keeps that memory alive for as long as the array lives.
fn numpy_view<'py>(py: Python<'py>, p: &Prepared) -> PyResult<Bound<'py, PyAny>> {
    numpy_array(py, p, false)
}

/// A NumPy array over `p`'s memory, read-only unless `writable`.
fn numpy_array<'py>(py: Python<'py>, p: &Prepared, writable: bool) -> PyResult<Bound<'py, PyAny>> {
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

/// How `&[Tensor]` arguments reach Python: a list for the body, a tuple for a gradient.
#[derive(Clone, Copy)]
pub(crate) enum Lists {
    AsLists,
    AsTuples,
}

/// The Python positional arguments of a call: every argument in declaration order.
pub(crate) fn python_args<'py>(
    py: Python<'py>,
    mode: Mode,
    args: &[Arg<'_>],
    prepared: &[Prepared],
    lists: Lists,
) -> PyResult<Bound<'py, PyTuple>> {
    let mut next = prepared.iter();
    let mut tensor = |py: Python<'py>| -> PyResult<Bound<'py, PyAny>> {
        let p = next.next().expect("one prepared input per tensor");
        match mode {
            Mode::Numpy => numpy_view(py, p),
            Mode::Tensor => Ok(Bound::new(py, PyTensor::new(p.tensor.clone()))?.into_any()),
        }
    };
    let mut items = Vec::with_capacity(args.len());
    for arg in args {
        items.push(match arg {
            Arg::Tensor(_) => tensor(py)?,
            Arg::Tensors(ts) => {
                let items = ts
                    .iter()
                    .map(|_| tensor(py))
                    .collect::<PyResult<Vec<_>>>()?;
                match lists {
                    Lists::AsLists => PyList::new(py, items)?.into_any(),
                    Lists::AsTuples => PyTuple::new(py, items)?.into_any(),
                }
            }
            Arg::F64(v) => PyFloat::new(py, *v).into_any(),
            Arg::I64(v) => v.into_pyobject(py)?.into_any(),
            Arg::Bool(v) => PyBool::new(py, *v).to_owned().into_any(),
            Arg::Str(v) => PyString::new(py, v).into_any(),
            Arg::F64s(v) => PyList::new(py, v.iter())?.into_any(),
            Arg::I64s(v) => PyList::new(py, v.iter())?.into_any(),
            Arg::None => py.None().into_bound(py),
        });
    }
    PyTuple::new(py, items)
}

// ---------------------------------------------------------------------------------------------
// Out: Python → candle
// ---------------------------------------------------------------------------------------------

/// What [`outputs_from_python`] checks against: the op's name and `tout`, and where outputs go.
pub(crate) struct OutputCheck<'a> {
    pub op: &'a str,
    pub tout: &'a [OutSpec],
    pub device: &'a Device,
    /// "output" for a body's results, "gradient" for a gradient function's.
    pub what: &'a str,
    /// The call's arguments, for outputs declared with the shape of one (`f32[x]`).
    pub args: &'a [Arg<'a>],
}

/// The shape `spec` demands, when it is fully known before the call: declared without `_`, or
/// that of an argument (`f32[x]`).
pub(crate) fn known_shape(spec: &OutSpec, args: &[Arg<'_>]) -> Option<Vec<usize>> {
    if let Some(i) = spec.like {
        return match args.get(i) {
            Some(Arg::Tensor(t)) => Some(t.dims().to_vec()),
            _ => None,
        };
    }
    spec.shape.as_ref()?.iter().copied().collect()
}

impl OutputCheck<'_> {
    fn error(&self, index: Option<usize>, msg: String) -> Error {
        let kind = if self.what == "gradient" {
            ErrorKind::GradientMismatch
        } else {
            ErrorKind::OutputMismatch
        };
        Error::mismatch(self.op, kind, index, msg)
    }
}

/// Applies the rule table to a body's return value: one output takes a value or a 1-tuple; M ≥ 2
/// outputs take a tuple or list of exactly M values; `()` takes `None`.
pub(crate) fn outputs_from_python(
    py: Python<'_>,
    check: &OutputCheck<'_>,
    result: &Bound<'_, PyAny>,
) -> Result<Vec<Tensor>> {
    let m = check.tout.len();
    if m == 0 {
        if result.is_none() {
            return Ok(Vec::new());
        }
        return Err(check.error(
            None,
            format!(
                "`tout = ()` expects the body to return None, got {}",
                describe_value(result)
            ),
        ));
    }
    let items: Vec<Bound<'_, PyAny>> = if let Ok(t) = result.cast::<PyTuple>() {
        if m == 1 && t.len() != 1 {
            return Err(check.error(
                None,
                format!(
                    "expected 1 {}, got a tuple of {} values",
                    check.what,
                    t.len()
                ),
            ));
        }
        t.iter().collect()
    } else if m >= 2 {
        match result.cast::<PyList>() {
            Ok(l) => l.iter().collect(),
            Err(_) => {
                return Err(check.error(
                    None,
                    format!(
                        "expected a tuple of {m} {}s, got {}",
                        check.what,
                        describe_value(result)
                    ),
                ))
            }
        }
    } else {
        vec![result.clone()]
    };
    if items.len() != m {
        return Err(check.error(
            None,
            format!("expected {m} {}s, got {}", check.what, items.len()),
        ));
    }
    items
        .iter()
        .zip(check.tout)
        .enumerate()
        .map(|(i, (value, spec))| value_to_tensor(py, check, i, spec, value))
        .collect()
}

/// `a float`, `a dict`, `a numpy.ndarray of dtype float64`: for error messages.
pub(crate) fn describe_value(v: &Bound<'_, PyAny>) -> String {
    if v.is_none() {
        return "None".to_owned();
    }
    if let Ok(a) = v.cast::<PyUntypedArray>() {
        return format!(
            "a NumPy array of dtype {} and shape {:?}",
            dtype_name(&a.dtype()),
            a.shape()
        );
    }
    let ty = v.get_type();
    let name = ty
        .qualname()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into());
    format!("a value of type `{name}`")
}

fn dtype_name(d: &Bound<'_, PyArrayDescr>) -> String {
    d.str()
        .map(|s| s.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Converts one returned value to a tensor of `spec`'s dtype and shape on the op's device.
pub(crate) fn value_to_tensor(
    py: Python<'_>,
    check: &OutputCheck<'_>,
    index: usize,
    spec: &OutSpec,
    value: &Bound<'_, PyAny>,
) -> Result<Tensor> {
    let what = check.what;
    let tensor = match to_tensor(py, value, Some(spec.dtype)) {
        Ok(Some(t)) => t,
        Ok(None) => {
            return Err(check.error(
                Some(index),
                format!(
                    "{what} {index}: expected {spec} (a pyop.Tensor, NumPy array, number or list), got {}",
                    describe_value(value)
                ),
            ))
        }
        Err(msg) => return Err(check.error(Some(index), format!("{what} {index}: {msg}"))),
    };
    let shape_ok = match spec.like {
        Some(_) => known_shape(spec, check.args).is_some_and(|want| want == tensor.dims()),
        None => spec.shape_matches(tensor.dims()),
    };
    if !shape_ok {
        let want = match (spec.like, known_shape(spec, check.args)) {
            (Some(i), Some(dims)) => format!("{dims:?} (the shape of argument {i})"),
            _ => spec.to_string(),
        };
        return Err(check.error(
            Some(index),
            format!(
                "{what} {index}: expected shape {want}, got shape {:?}",
                tensor.dims()
            ),
        ));
    }
    Ok(tensor.to_device(check.device)?)
}

/// Converts a Python value to a tensor (on the CPU, or where a `pyop.Tensor` already is).
///
/// With `dtype`, a `pyop.Tensor` or NumPy array must have exactly that dtype (a bool array passes
/// for u8) and numbers are fitted to it exactly; without, the dtype is the value's own, or f32 for
/// floats, i64 for ints and u8 for bools. `Ok(None)`: the value is nothing tensor-like.
pub(crate) fn to_tensor(
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    dtype: Option<DType>,
) -> std::result::Result<Option<Tensor>, String> {
    if let Ok(t) = value.cast::<PyTensor>() {
        let t = t.get().tensor().clone();
        return match dtype {
            Some(d) if d != t.dtype() => Err(format!(
                "expected dtype {}, got a pyop.Tensor of dtype {}",
                d.as_str(),
                t.dtype().as_str()
            )),
            _ => Ok(Some(t)),
        };
    }
    // Exact Python numbers first (the common case); NumPy scalars before other numbers, since
    // np.float64 is a subclass of float yet must match the declared dtype exactly.
    let exact_number = value.is_exact_instance_of::<PyFloat>()
        || value.is_exact_instance_of::<PyInt>()
        || value.is_exact_instance_of::<PyBool>();
    if !exact_number {
        if let Some(array) =
            as_numpy_array(py, value).map_err(|e| crate::python::describe(py, &e))?
        {
            return array_to_tensor(py, dtype, &array).map(Some);
        }
    }
    let is_number =
        exact_number || value.is_instance_of::<PyInt>() || value.is_instance_of::<PyFloat>();
    if is_number || value.is_instance_of::<PyList>() {
        let mut leaves = Vec::new();
        let mut dims = Vec::new();
        collect_nested(value, 0, &mut dims, &mut leaves)?;
        let dtype = dtype.unwrap_or_else(|| infer_dtype(&leaves));
        let mut buf = Buffer::new(dtype);
        for s in leaves {
            buf.push(s)?;
        }
        return buf.into_tensor(&dims).map(Some).map_err(|e| e.to_string());
    }
    Ok(None)
}

fn infer_dtype(leaves: &[Scalar]) -> DType {
    if leaves.iter().any(|s| matches!(s, Scalar::Float(_))) {
        DType::F32
    } else if leaves
        .iter()
        .any(|s| matches!(s, Scalar::Int(_) | Scalar::UInt(_)))
    {
        DType::I64
    } else if leaves.is_empty() {
        DType::F32
    } else {
        DType::U8
    }
}

/// The value as a NumPy array if it is one or a NumPy scalar. NumPy is looked up in
/// `sys.modules` only, so tensor mode never imports it.
fn as_numpy_array<'py>(
    py: Python<'py>,
    value: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyUntypedArray>>> {
    let Some(np) = crate::tensor::numpy_if_loaded(py)? else {
        return Ok(None);
    };
    if let Ok(a) = value.cast::<PyUntypedArray>() {
        return Ok(Some(a.clone()));
    }
    if value.is_instance(np.generic.bind(py))? {
        let a = np.asarray.bind(py).call1((value,))?;
        return Ok(Some(a.cast_into::<PyUntypedArray>()?));
    }
    Ok(None)
}

/// The candle dtype of a NumPy dtype, if candle has one (bool → u8).
fn candle_dtype(descr: &Bound<'_, PyArrayDescr>) -> Option<DType> {
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

fn array_to_tensor(
    py: Python<'_>,
    dtype: Option<DType>,
    array: &Bound<'_, PyUntypedArray>,
) -> std::result::Result<Tensor, String> {
    let descr = array.dtype();
    let dtype = match (candle_dtype(&descr), dtype) {
        (Some(have), Some(want)) if have == want => want,
        (Some(_), None) => candle_dtype(&descr).expect("some"),
        (have, want) => {
            let extra = if descr.has_object() {
                " (object arrays are not tensors)"
            } else if descr.has_fields() {
                " (structured arrays are not tensors)"
            } else if have.is_none() {
                " (candle has no such dtype)"
            } else {
                ""
            };
            let want = want.map_or("a dtype candle has".to_owned(), |w| {
                format!("dtype {}", w.as_str())
            });
            return Err(format!(
                "expected {want}, got a NumPy array of dtype {}{extra}",
                dtype_name(&descr)
            ));
        }
    };
    let dims = array.shape().to_vec();
    // A tensor's own view (an input's, or one a Rust function returned), handed back unchanged:
    // share that tensor's storage, as Tensor::clone does.
    if let Some(t) = own_view(array) {
        return Ok(t);
    }
    // Copy, so that Python mutating the array later cannot change the tensor. A non-C-contiguous
    // (Fortran-ordered, strided) array is made contiguous by NumPy first.
    let contiguous = if array.is_c_contiguous() {
        array.clone()
    } else {
        py.import("numpy")
            .and_then(|np| np.call_method1("ascontiguousarray", (array,)))
            .and_then(|a| Ok(a.cast_into::<PyUntypedArray>()?))
            .map_err(|e| crate::python::describe(py, &e))?
    };
    let n: usize = dims.iter().product();
    // The array is C-contiguous, of `n` elements of the dtype checked above, and `contiguous`
    // keeps it alive while we copy. It may be unaligned (np.frombuffer at an odd offset), so it
    // is copied as bytes, never read through a typed slice.
    let data = unsafe { (*contiguous.as_array_ptr()).fields.data } as usize;
    let shape = Shape::from(dims);
    let copy = move || -> candle_core::Result<Tensor> {
        with_numpy_element!(dtype, T => {
            // SAFETY: `n` elements of `T` (plain numbers) are readable as bytes at `data`.
            let v = unsafe { crate::alloc::copied_from_bytes::<T>(data as *const u8, n) };
            Tensor::from_vec(v, shape, &Device::Cpu)
        }, _ => unreachable!("candle_dtype gives only NumPy dtypes"))
    };
    // Large copies run without the GIL, so other threads' Python goes on meanwhile.
    let t = if n * dtype.size_in_bytes() >= 1 << 20 {
        py.detach(copy)
    } else {
        copy()
    };
    t.map_err(|e| e.to_string())
}

/// Whether Python may write through `array`.
fn writeable(array: &Bound<'_, PyUntypedArray>) -> bool {
    // SAFETY: reading the flags of a live array object.
    unsafe { (*array.as_array_ptr()).fields.flags & npyffi::NPY_ARRAY_WRITEABLE != 0 }
}

/// The tensor whose NumPy view `array` is, if it is one, unchanged (same data, shape, strides).
fn own_view(array: &Bound<'_, PyUntypedArray>) -> Option<Tensor> {
    // SAFETY: reading the fields of a live array object.
    let (data, base) = unsafe {
        let a = &*array.as_array_ptr();
        (a.fields.data as usize, a.fields.base)
    };
    if base.is_null() {
        return None;
    }
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

/// Walks a (nested) list of numbers, checking it is rectangular.
fn collect_nested(
    v: &Bound<'_, PyAny>,
    depth: usize,
    dims: &mut Vec<usize>,
    leaves: &mut Vec<Scalar>,
) -> std::result::Result<(), String> {
    if let Ok(list) = v.cast::<PyList>() {
        let n = list.len();
        if depth == dims.len() {
            if !leaves.is_empty() {
                return Err("ragged nested list (not rectangular)".into());
            }
            dims.push(n);
        } else if dims[depth] != n {
            return Err(format!(
                "ragged nested list: a list of {n} items where {} were expected",
                dims[depth]
            ));
        }
        for item in list.iter() {
            collect_nested(&item, depth + 1, dims, leaves)?;
        }
        return Ok(());
    }
    if depth != dims.len() {
        return Err("ragged nested list: a number where a list was expected".into());
    }
    leaves.push(scalar(v)?);
    Ok(())
}

/// A Python bool, int or float as a [`Scalar`].
pub(crate) fn scalar(v: &Bound<'_, PyAny>) -> std::result::Result<Scalar, String> {
    if v.is_instance_of::<PyBool>() {
        Ok(Scalar::Bool(
            v.extract::<bool>().map_err(|e| e.to_string())?,
        ))
    } else if v.is_instance_of::<PyInt>() {
        match v.extract::<i64>() {
            Ok(i) => Ok(Scalar::Int(i)),
            Err(_) => match v.extract::<u64>() {
                Ok(u) => Ok(Scalar::UInt(u)),
                Err(_) => Err(format!("the int {v} does not fit any tensor dtype")),
            },
        }
    } else if v.is_instance_of::<PyFloat>() {
        Ok(Scalar::Float(
            v.extract::<f64>().map_err(|e| e.to_string())?,
        ))
    } else if v.is_instance_of::<PyDict>() {
        Err("expected numbers, got a dict".into())
    } else {
        Err(format!("expected numbers, got {}", describe_value(v)))
    }
}

/// A Python number, before it is fitted to a dtype.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Scalar {
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
}

/// Typed storage filled from Python numbers, refusing any value that does not fit exactly
/// (floats may round to a narrower float; nothing truncates or wraps).
pub(crate) enum Buffer {
    U8(Vec<u8>),
    U32(Vec<u32>),
    I16(Vec<i16>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    BF16(Vec<half::bf16>),
    F16(Vec<half::f16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Unsupported(DType),
}

impl Buffer {
    pub(crate) fn new(dtype: DType) -> Self {
        match dtype {
            DType::U8 => Buffer::U8(Vec::new()),
            DType::U32 => Buffer::U32(Vec::new()),
            DType::I16 => Buffer::I16(Vec::new()),
            DType::I32 => Buffer::I32(Vec::new()),
            DType::I64 => Buffer::I64(Vec::new()),
            DType::BF16 => Buffer::BF16(Vec::new()),
            DType::F16 => Buffer::F16(Vec::new()),
            DType::F32 => Buffer::F32(Vec::new()),
            DType::F64 => Buffer::F64(Vec::new()),
            d => Buffer::Unsupported(d),
        }
    }

    pub(crate) fn push(&mut self, s: Scalar) -> std::result::Result<(), String> {
        fn int<T: TryFrom<i64> + TryFrom<u64> + TryFrom<i128>>(
            s: Scalar,
            name: &str,
        ) -> std::result::Result<T, String> {
            let bad = || format!("{} does not fit dtype {name} exactly", show(s));
            match s {
                Scalar::Bool(b) => T::try_from(b as i64).map_err(|_| bad()),
                Scalar::Int(i) => T::try_from(i).map_err(|_| bad()),
                Scalar::UInt(u) => T::try_from(u).map_err(|_| bad()),
                Scalar::Float(f) => {
                    // Integral and well inside i128, so `as` is exact; the target type's range
                    // is then checked exactly (no saturation at i64::MIN or u64::MAX).
                    if f.fract() == 0.0 && f.is_finite() && f.abs() < 1e30 {
                        T::try_from(f as i128).map_err(|_| bad())
                    } else {
                        Err(bad())
                    }
                }
            }
        }
        fn float(s: Scalar, mantissa: u32, name: &str) -> std::result::Result<f64, String> {
            // Python floats may round to a narrower float (as NumPy does); integers must be exact.
            let limit = 1u64 << mantissa;
            match s {
                Scalar::Bool(b) => Ok(b as u8 as f64),
                Scalar::Float(f) => Ok(f),
                Scalar::Int(i) if i.unsigned_abs() <= limit => Ok(i as f64),
                Scalar::UInt(u) if u <= limit => Ok(u as f64),
                _ => Err(format!("{} does not fit dtype {name} exactly", show(s))),
            }
        }
        match self {
            Buffer::U8(v) => v.push(int(s, "u8")?),
            Buffer::U32(v) => v.push(int(s, "u32")?),
            Buffer::I16(v) => v.push(int(s, "i16")?),
            Buffer::I32(v) => v.push(int(s, "i32")?),
            Buffer::I64(v) => v.push(int(s, "i64")?),
            Buffer::BF16(v) => v.push(half::bf16::from_f64(float(s, 8, "bf16")?)),
            Buffer::F16(v) => v.push(half::f16::from_f64(float(s, 11, "f16")?)),
            Buffer::F32(v) => v.push(float(s, 24, "f32")? as f32),
            Buffer::F64(v) => v.push(float(s, 53, "f64")?),
            Buffer::Unsupported(d) => {
                return Err(format!(
                    "Python numbers cannot make a tensor of dtype {}",
                    d.as_str()
                ))
            }
        }
        Ok(())
    }

    pub(crate) fn into_tensor(self, dims: &[usize]) -> candle_core::Result<Tensor> {
        let cpu = &Device::Cpu;
        match self {
            Buffer::U8(v) => Tensor::from_vec(v, dims, cpu),
            Buffer::U32(v) => Tensor::from_vec(v, dims, cpu),
            Buffer::I16(v) => Tensor::from_vec(v, dims, cpu),
            Buffer::I32(v) => Tensor::from_vec(v, dims, cpu),
            Buffer::I64(v) => Tensor::from_vec(v, dims, cpu),
            Buffer::BF16(v) => Tensor::from_vec(v, dims, cpu),
            Buffer::F16(v) => Tensor::from_vec(v, dims, cpu),
            Buffer::F32(v) => Tensor::from_vec(v, dims, cpu),
            Buffer::F64(v) => Tensor::from_vec(v, dims, cpu),
            Buffer::Unsupported(d) => Err(candle_core::Error::Msg(format!(
                "Python numbers cannot make a tensor of dtype {}",
                d.as_str()
            ))),
        }
    }
}

fn show(s: Scalar) -> String {
    match s {
        Scalar::Bool(b) => if b { "True" } else { "False" }.to_owned(),
        Scalar::Int(i) => format!("the int {i}"),
        Scalar::UInt(u) => format!("the int {u}"),
        Scalar::Float(f) => format!("the float {f:?}"),
    }
}

impl Prepared {
    /// The same input, cut from the autograd graph (its storage is shared).
    pub(crate) fn detached(self) -> Self {
        Prepared {
            tensor: self.tensor.detach(),
            data: self.data,
        }
    }
}

/// Fresh candle tensors handed to a body as writable NumPy arrays through its `out` keyword, so a
/// numpy-mode body writes its outputs straight into candle memory (`np.add(x, 1, out=out)`).
pub(crate) struct OutBuffers<'py> {
    tensors: Vec<Tensor>,
    bases: Vec<Bound<'py, PyTensor>>,
    /// What the body gets as `out`: one array, or a tuple of them for several outputs.
    pub arg: Bound<'py, PyAny>,
}

/// Allocates the outputs of `tout` with the shapes `shapes` (on the CPU) and their views.
pub(crate) fn out_buffers<'py>(
    py: Python<'py>,
    tout: &[OutSpec],
    shapes: Vec<Vec<usize>>,
) -> Result<OutBuffers<'py>> {
    let mut tensors = Vec::with_capacity(tout.len());
    let mut bases = Vec::with_capacity(tout.len());
    let mut views = Vec::with_capacity(tout.len());
    for (spec, dims) in tout.iter().zip(shapes) {
        let t = zeroed_tensor(spec.dtype, dims)?;
        let data = {
            let (storage, layout) = t.storage_and_layout();
            let Storage::Cpu(cpu) = &*storage else {
                unreachable!("made on the CPU")
            };
            element_ptr(cpu, layout.start_offset())
        };
        let prepared = Prepared {
            tensor: t.clone(),
            data,
        };
        let view =
            numpy_array(py, &prepared, true).map_err(|e| crate::python::python_error(py, "", e))?;
        // SAFETY: the view was made just above with a `PyTensor` base.
        let base = unsafe {
            let base = (*view.as_ptr().cast::<npyffi::PyArrayObject>()).fields.base;
            Bound::from_borrowed_ptr(py, base).cast_into_unchecked::<PyTensor>()
        };
        tensors.push(t);
        bases.push(base);
        views.push(view);
    }
    let arg = match views.len() {
        1 => views.pop().expect("one"),
        _ => PyTuple::new(py, views)
            .map_err(|e| crate::python::python_error(py, "", e))?
            .into_any(),
    };
    Ok(OutBuffers {
        tensors,
        bases,
        arg,
    })
}

impl OutBuffers<'_> {
    /// The outputs, once the body has returned `None` or `out` itself. A tensor whose memory a
    /// Python object still references (the body kept `out` or a view of it) is copied, so Python
    /// can never write to memory candle holds.
    pub(crate) fn finish(
        self,
        check: &OutputCheck<'_>,
        returned: Bound<'_, PyAny>,
    ) -> Result<Vec<Tensor>> {
        if !(returned.is_none() || returned.is(&self.arg)) {
            return Err(check.error(
                None,
                format!(
                    "a body given `out` writes its outputs into it and returns None (or `out`), got {}",
                    describe_value(&returned)
                ),
            ));
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

/// A zeroed CPU tensor in a buffer from `alloc::zeroed` (huge pages for large ones).
fn zeroed_tensor(dtype: DType, dims: Vec<usize>) -> candle_core::Result<Tensor> {
    let n = dims.iter().product();
    with_numpy_element!(
        dtype,
        T => Tensor::from_vec(crate::alloc::zeroed::<T>(n), dims, &Device::Cpu),
        d => Tensor::zeros(dims, d, &Device::Cpu)
    )
}
