//! Python values into tensors: `pyop.Tensor`s, NumPy arrays and scalars of exactly the dtype
//! wanted, and numbers or nested lists fitted to it exactly (nothing truncates or wraps).

use candle_core::{DType, Device, Tensor};
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyMemoryError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList};

use crate::bridge::dlpack::import::ImportError;
use crate::bridge::tensor::PyTensor;
use crate::spec::with_numpy_element;

use super::view::{candle_dtype, unchanged_view};

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

pub(crate) fn dtype_name(d: &Bound<'_, PyArrayDescr>) -> String {
    d.str()
        .map(|s| s.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Why a Python value did not become a tensor.
#[derive(Debug)]
pub(crate) enum ConversionError {
    /// Nothing tensor-like (a dict, a str, None, …): what it is, as [`describe_value`] says.
    NotTensorLike(String),
    /// Tensor-like, but not of the dtype wanted, or a number that does not fit it, or a ragged
    /// list.
    Invalid(String),
    /// Tensor-like, but larger than the memory the system will give (`alloc::check`).
    NoMemory(String),
    /// The conversion was stopped: the call it belongs to ran past its time limit.
    Overdue,
}

impl From<crate::alloc::Refusal> for ConversionError {
    fn from(refusal: crate::alloc::Refusal) -> Self {
        match refusal {
            crate::alloc::Refusal::TooLarge => ConversionError::Invalid(refusal.to_string()),
            crate::alloc::Refusal::NoMemory(msg) => ConversionError::NoMemory(msg),
        }
    }
}

impl From<String> for ConversionError {
    fn from(msg: String) -> Self {
        ConversionError::Invalid(msg)
    }
}

impl std::fmt::Display for ConversionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConversionError::NotTensorLike(what) => write!(f, "cannot make a tensor from {what}"),
            ConversionError::Invalid(msg) | ConversionError::NoMemory(msg) => f.write_str(msg),
            ConversionError::Overdue => {
                f.write_str("reading a list of numbers ran past the call's time limit")
            }
        }
    }
}

/// In Python: `TypeError` for a value that is nothing tensor-like, `ValueError` for one that does
/// not fit.
impl From<ConversionError> for PyErr {
    fn from(e: ConversionError) -> Self {
        match e {
            ConversionError::NotTensorLike(_) => PyTypeError::new_err(e.to_string()),
            ConversionError::Invalid(msg) => PyValueError::new_err(msg),
            ConversionError::NoMemory(msg) => PyMemoryError::new_err(msg),
            // The body's own limit: raised as the watchdog raises it, so the call reports it as
            // its time limit (the body can no more catch it than the watchdog's).
            ConversionError::Overdue => {
                crate::python::exceptions::OpTimeout::new_err(e.to_string())
            }
        }
    }
}

/// Converts a Python value to a tensor (on the CPU, or where a `pyop.Tensor` already is).
///
/// With `dtype`, a `pyop.Tensor` or NumPy array must have exactly that dtype (a bool array passes
/// for u8) and numbers are fitted to it exactly; without, the dtype is the value's own, or f32 for
/// floats, i64 for ints and u8 for bools.
pub(crate) fn to_tensor(
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    dtype: Option<DType>,
) -> std::result::Result<Tensor, ConversionError> {
    convert(py, value, dtype, None)
}

/// As [`to_tensor`], but a value with a dtype of its own (a `pyop.Tensor`, a NumPy array or
/// scalar, a DLPack producer) is converted to `dtype` rather than checked against it; Python
/// numbers and lists are still fitted to it exactly (`pyop.tensor(obj, dtype=…)`).
pub(crate) fn to_tensor_as(
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    dtype: DType,
) -> std::result::Result<Tensor, ConversionError> {
    convert(py, value, None, Some(dtype))
}

/// A value with a dtype of its own must have `own` and is converted to `to`; Python numbers and
/// lists are fitted to whichever is given.
fn convert(
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    own: Option<DType>,
    to: Option<DType>,
) -> std::result::Result<Tensor, ConversionError> {
    let converted = |t: Tensor| match to {
        Some(d) => {
            crate::alloc::check(Some(t.elem_count()), d)?;
            t.to_dtype(d)
                .map_err(|e| ConversionError::Invalid(e.to_string()))
        }
        None => Ok(t),
    };
    // (`cast_exact`: the class is final, and no subtype check is made of every other value.)
    if let Ok(t) = value.cast_exact::<PyTensor>() {
        let t = t.get().tensor().clone();
        return match own {
            Some(d) if d != t.dtype() => Err(ConversionError::Invalid(format!(
                "expected dtype {}, got a pyop.Tensor of dtype {}",
                d.as_str(),
                t.dtype().as_str()
            ))),
            _ => converted(t),
        };
    }
    // Exact Python numbers first (the common case); NumPy scalars before other numbers, since
    // np.float64 is a subclass of float yet must match the declared dtype exactly.
    let exact_number = value.is_exact_instance_of::<PyFloat>()
        || value.is_exact_instance_of::<PyInt>()
        || value.is_exact_instance_of::<PyBool>();
    if !exact_number {
        if let Some(t) = from_numpy(py, value, own)? {
            return converted(t);
        }
    }
    if exact_number
        || value.is_instance_of::<PyInt>()
        || value.is_instance_of::<PyFloat>()
        || value.is_instance_of::<PyList>()
    {
        let leaves = nested_leaves(value, own.or(to))?;
        let (dims, leaves) = (leaves.dims, leaves.values);
        let dtype = own.or(to).unwrap_or_else(|| infer_dtype(&leaves));
        let mut buf = Buffer::new(dtype);
        for s in leaves {
            buf.push(s)?;
        }
        return buf
            .into_tensor(&dims)
            .map_err(|e| ConversionError::Invalid(e.to_string()));
    }
    if let Some(t) = from_dlpack(py, value, own)? {
        return converted(t);
    }
    Err(ConversionError::NotTensorLike(describe_value(value)))
}

/// A NumPy array or scalar (or what `numpy.asarray` reads: the buffer protocol, …) when NumPy is
/// loaded: a fresh array nothing else references becomes the tensor without a copy.
fn from_numpy(
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    dtype: Option<DType>,
) -> std::result::Result<Option<Tensor>, ConversionError> {
    let describe = |e: PyErr| crate::python::describe(py, &e);
    let Some(np) = crate::python::numpy::numpy_if_loaded(py).map_err(describe)? else {
        return Ok(None);
    };
    // A tensor's own view (an input's, or one a Rust function returned), handed back unchanged:
    // that tensor, its storage shared as Tensor::clone shares it. The usual numpy-mode result,
    // so asked first; anything else is adopted or copied below.
    if let Some(t) = unchanged_view(py, value, dtype) {
        return Ok(Some(t));
    }
    if let Some(t) = adopted(py, value, dtype) {
        return Ok(Some(t));
    }
    match as_numpy_array(py, np, value).map_err(describe)? {
        Some(array) => Ok(Some(array_to_tensor(py, dtype, &array)?)),
        None => Ok(None),
    }
}

/// Any other DLPack producer (a PyTorch tensor, a CuPy or JAX array): read with one copy by
/// `dlpack::import` (a CPU producer into candle's `Vec`, a producer on the running op's CUDA device
/// device to device). Other producers (a GPU one for an op on the CPU, a strided CUDA tensor) are
/// asked for a copy on the host through NumPy's `from_dlpack` (DLPack 1.x's `dl_device`, NumPy
/// 2.1's `device="cpu", copy=True`), a fresh array that then becomes the tensor as a NumPy
/// result does.
fn from_dlpack(
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    dtype: Option<DType>,
) -> std::result::Result<Option<Tensor>, ConversionError> {
    if !value
        .hasattr(pyo3::intern!(py, "__dlpack__"))
        .unwrap_or(false)
    {
        return Ok(None);
    }
    let invalid = |what: String| ConversionError::Invalid(what);
    match crate::bridge::dlpack::import::import(py, value, dtype) {
        Ok(Some(t)) => return Ok(Some(t)),
        Ok(None) => {}
        Err(ImportError::Dtype(msg)) => return Err(invalid(msg)),
        Err(ImportError::Read(msg)) => {
            return Err(invalid(format!(
                "{} could not be read through DLPack: {msg}",
                describe_value(value)
            )))
        }
    }
    let through_numpy = || -> PyResult<Bound<'_, PyAny>> {
        let kwargs = pyo3::types::PyDict::new(py);
        kwargs.set_item("device", "cpu")?;
        kwargs.set_item("copy", true)?;
        crate::python::numpy::import_numpy(py)?
            .getattr(pyo3::intern!(py, "from_dlpack"))?
            .call((value,), Some(&kwargs))
    };
    let array = through_numpy().map_err(|e| {
        invalid(format!(
            "{} could not be read through DLPack as a copy on the host (with numpy.from_dlpack): \
             {}",
            describe_value(value),
            crate::python::describe(py, &e)
        ))
    })?;
    match from_numpy(py, &array, dtype)? {
        Some(t) => Ok(Some(t)),
        None => Err(invalid("numpy.from_dlpack returned no array".to_owned())),
    }
}

pub(crate) fn infer_dtype(leaves: &[Scalar]) -> DType {
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

/// The value as a NumPy array if it is one or a NumPy scalar (`np`: NumPy, which the caller found
/// loaded in `sys.modules`, so that tensor mode never imports it).
fn as_numpy_array<'py>(
    py: Python<'py>,
    np: &crate::python::numpy::NumpyRefs,
    value: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyUntypedArray>>> {
    if let Ok(a) = value.cast::<PyUntypedArray>() {
        return Ok(Some(a.clone()));
    }
    if value.is_instance(np.generic.bind(py))? {
        let a = np.asarray.bind(py).call1((value,))?;
        return Ok(Some(a.cast_into::<PyUntypedArray>()?));
    }
    Ok(None)
}

pub(crate) fn array_to_tensor(
    py: Python<'_>,
    dtype: Option<DType>,
    array: &Bound<'_, PyUntypedArray>,
) -> std::result::Result<Tensor, ConversionError> {
    // A masked array's mask would be silently dropped: refuse it, as an object array is. Only
    // ndarray subclasses are asked (a plain ndarray, the common case, costs a pointer compare).
    // SAFETY: reading the type of a live object, and NumPy's ndarray type object.
    let exact = unsafe {
        pyo3::ffi::Py_TYPE(array.as_ptr())
            == numpy::npyffi::get_type_object(py, numpy::npyffi::NpyTypes::PyArray_Type)
    };
    if !exact {
        let module: String = array
            .get_type()
            .getattr("__module__")
            .and_then(|m| m.extract())
            .unwrap_or_default();
        if module.starts_with("numpy.ma") {
            return Err(ConversionError::Invalid(
                "a masked array is not a tensor: fill it first (`a.filled(value)`)".to_owned(),
            ));
        }
    }
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
                " (not a dtype pyop reads: it reads bool, uint8, uint32, int16, int32, int64, \
                 float16, float32, float64, and ml_dtypes' bfloat16 and float8_e4m3fn)"
            } else {
                ""
            };
            let want = want.map_or("a dtype candle has".to_owned(), |w| {
                format!("dtype {}", w.as_str())
            });
            return Err(format!(
                "expected {want}, got a NumPy array of dtype {}{extra}",
                dtype_name(&descr)
            )
            .into());
        }
    };
    let dims = array.shape().to_vec();
    // Copy, so that Python mutating the array later cannot change the tensor. A non-C-contiguous
    // (Fortran-ordered, strided, reversed) array is copied by NumPy in one strided pass.
    // The copy's size, checked before anything allocates it (a broadcast array is small).
    let n: usize = dims.iter().product();
    crate::alloc::check(Some(n), dtype)?;
    if !array.is_c_contiguous() {
        return Ok(super::view::copied_by_numpy(py, dtype, array)?);
    }
    // The array is C-contiguous, of `n` elements of the dtype checked above, and `array`
    // keeps it alive while we copy. It may be unaligned (np.frombuffer at an odd offset), so it
    // is copied as bytes, never read through a typed slice.
    // SAFETY: reading the data pointer of a live array object.
    let data = unsafe { (*array.as_array_ptr()).fields.data } as usize;
    crate::python::copy_without_gil(n * dtype.size_in_bytes(), move || {
        // SAFETY: `n` elements of `dtype` are readable as bytes at `data`.
        unsafe { crate::alloc::tensor_from_bytes(dtype, data as *const u8, dims) }
    })
    .map_err(|e| ConversionError::Invalid(e.to_string()))
}

/// A fresh NumPy array, made during a numpy-mode body by pyop's data allocator (see
/// `python::numpy_alloc`), becomes the tensor without a copy: its buffer already has the layout
/// `Vec<T>` frees with. Only when nothing else can reach the buffer: `value` is an exact
/// `ndarray` with no other reference than the caller's (so no view of it exists; the outputs'
/// caller lets go of the result tuple first), owning its C-contiguous, aligned data of exactly
/// `dtype` (or any candle dtype, without one). NumPy is loaded (the caller checked, before this
/// reads the reference count: from there to `take`, no Python code runs). The array is left a read-only view of the tensor (its base holds it),
/// so even the reference that remains can neither write to candle memory nor outlive it.
fn adopted(py: Python<'_>, value: &Bound<'_, PyAny>, dtype: Option<DType>) -> Option<Tensor> {
    use numpy::npyffi::{self, PY_ARRAY_API};
    // SAFETY: reading the reference count and type of a live object.
    let (refs, ty) = unsafe {
        (
            pyo3::ffi::Py_REFCNT(value.as_ptr()),
            pyo3::ffi::Py_TYPE(value.as_ptr()),
        )
    };
    if refs != 1 {
        return None;
    }
    // SAFETY: NumPy's ndarray type object (NumPy is loaded).
    if ty != unsafe { npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type) } {
        return None;
    }
    let array = value.cast::<PyUntypedArray>().ok()?;
    let dtype = match (candle_dtype(&array.dtype()), dtype) {
        (Some(have), Some(want)) if have == want => have,
        (Some(have), None) => have,
        _ => return None,
    };
    let raw = array.as_array_ptr();
    let want =
        npyffi::NPY_ARRAY_OWNDATA | npyffi::NPY_ARRAY_C_CONTIGUOUS | npyffi::NPY_ARRAY_ALIGNED;
    // SAFETY: reading the fields of a live array object.
    let (flags, base, data, weakrefs) = unsafe {
        (
            (*raw).fields.flags,
            (*raw).fields.base,
            (*raw).fields.data as usize,
            (*raw).fields.weakreflist,
        )
    };
    // A weak reference is a way back to the array that the reference count does not show (as
    // `ndarray.resize` checks too); ndarrays are not tracked by the garbage collector, so with
    // neither, nothing but `value` reaches the array.
    if flags & want != want || !base.is_null() || !weakrefs.is_null() {
        return None;
    }
    let dims = array.shape().to_vec();
    let n: usize = dims.iter().product();
    with_numpy_element!(dtype, T => {
        let layout = std::alloc::Layout::array::<T>(n).ok()?;
        if n == 0 || !crate::python::numpy_alloc::take(data, layout) {
            return None;
        }
        // SAFETY: the buffer is now ours (`take`): NumPy must never free it, so the array stops
        // owning it before anything else happens; it holds `n` elements of `T` written by NumPy
        // (a buffer NumPy allocated for this array, which is its sole owner and fully sized).
        let v = unsafe {
            (*raw).fields.flags &= !(npyffi::NPY_ARRAY_OWNDATA | npyffi::NPY_ARRAY_WRITEABLE);
            Vec::from_raw_parts(data as *mut T, n, n)
        };
        let t = Tensor::from_vec(v, dims, &Device::Cpu).expect("n is the product of the dims");
        let keep = |t: &Tensor| std::mem::forget(t.clone());
        match Bound::new(py, PyTensor::view_base(t.clone(), data, false)) {
            // SAFETY: the array has no base (checked); SetBaseObject steals the reference.
            Ok(owner) => unsafe {
                if PY_ARRAY_API.PyArray_SetBaseObject(py, raw, owner.into_ptr()) != 0 {
                    pyo3::ffi::PyErr_Clear();
                    keep(&t); // the array still points at the buffer: never free it
                }
            },
            Err(_) => keep(&t),
        }
        Some(t)
    }, _ => None)
}

/// NumPy's limit on dimensions, and so on how deeply a list of numbers may nest.
pub(crate) const MAX_DIMS: usize = 64;

/// The numbers of a (nested) list, and its shape.
pub(crate) struct Leaves {
    pub dims: Vec<usize>,
    pub values: Vec<Scalar>,
}

/// How many numbers are read between two looks at the call's deadline.
const DEADLINE_EVERY: usize = 1 << 16;

/// Reads a (nested) list of numbers, checking it is rectangular. A list may hold one item many
/// times (`[v, v]`), so a few bytes of Python can name 2^30 numbers: the shape comes first, from
/// the first item at each level, and the numbers it implies are checked as every allocation a
/// body controls is (`alloc::check`, for the numbers read and for the tensor made of them,
/// `dtype`'s when known) before any is read; reading stops when the call runs past its time
/// limit.
pub(crate) fn nested_leaves(
    value: &Bound<'_, PyAny>,
    dtype: Option<DType>,
) -> std::result::Result<Leaves, ConversionError> {
    let mut dims = Vec::new();
    let mut at = value.clone();
    while let Ok(list) = at.cast::<PyList>() {
        if dims.len() >= MAX_DIMS {
            return Err(ConversionError::Invalid(format!(
                "lists nested more than {MAX_DIMS} levels deep: a tensor has at most {MAX_DIMS} \
                 dimensions, as a NumPy array does"
            )));
        }
        dims.push(list.len());
        let Ok(first) = list.get_item(0) else {
            break;
        };
        at = first;
    }
    let n = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    // The numbers as read (a `Scalar` each), then the tensor made of them.
    let scalars = n.and_then(|n| n.checked_mul(std::mem::size_of::<Scalar>()));
    crate::alloc::check(scalars, DType::U8)?;
    crate::alloc::check(n, dtype.unwrap_or(DType::F64))?;
    let mut values = Vec::with_capacity(n.unwrap_or(0));
    // With no numbers (a 0 in the shape) the walk only checks the lists' lengths, and a list
    // sharing its items can hold 2^40 empty lists: each list is then checked once at each depth.
    let mut checked = (n == Some(0)).then(std::collections::HashSet::new);
    collect_nested(value, 0, &dims, &mut values, &mut checked)?;
    Ok(Leaves { dims, values })
}

/// Walks a (nested) list of numbers of shape `dims` (the first items' lengths), checking it is
/// rectangular: it holds exactly the numbers `dims` implies.
fn collect_nested(
    v: &Bound<'_, PyAny>,
    depth: usize,
    dims: &[usize],
    leaves: &mut Vec<Scalar>,
    checked: &mut Option<std::collections::HashSet<(usize, usize)>>,
) -> std::result::Result<(), ConversionError> {
    if let Ok(list) = v.cast::<PyList>() {
        let Some(&want) = dims.get(depth) else {
            return Err("ragged nested list (not rectangular)".to_owned().into());
        };
        if let Some(checked) = checked {
            // (Alive while `v` is: the address names this list for the whole walk.)
            if !checked.insert((list.as_ptr() as usize, depth)) {
                return Ok(());
            }
        }
        let n = list.len();
        if n != want {
            return Err(format!(
                "ragged nested list: a list of {n} items where {want} were expected"
            )
            .into());
        }
        for item in list.iter() {
            collect_nested(&item, depth + 1, dims, leaves, checked)?;
        }
        return Ok(());
    }
    if depth != dims.len() {
        return Err("ragged nested list: a number where a list was expected"
            .to_owned()
            .into());
    }
    if leaves.len() % DEADLINE_EVERY == DEADLINE_EVERY - 1 && crate::python::timeout::overdue() {
        return Err(ConversionError::Overdue);
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
    } else if let Some(s) = numpy_scalar(v) {
        Ok(s)
    } else {
        Err(format!("expected numbers, got {}", describe_value(v)))
    }
}

/// A NumPy bool, integer or float scalar (`np.float32(1)`) as a [`Scalar`], as one inside a
/// list is taken like a Python number.
fn numpy_scalar(v: &Bound<'_, PyAny>) -> Option<Scalar> {
    let np = crate::python::numpy::numpy_if_loaded(v.py()).ok()??;
    if !v.is_instance(np.generic.bind(v.py())).ok()? {
        return None;
    }
    let kind: String = v
        .getattr("dtype")
        .ok()?
        .getattr("kind")
        .ok()?
        .extract()
        .ok()?;
    match kind.as_str() {
        "b" => Some(Scalar::Bool(v.is_truthy().ok()?)),
        "i" => Some(Scalar::Int(v.call_method0("__int__").ok()?.extract().ok()?)),
        "u" => Some(Scalar::UInt(
            v.call_method0("__int__").ok()?.extract().ok()?,
        )),
        "f" => Some(Scalar::Float(
            v.call_method0("__float__").ok()?.extract().ok()?,
        )),
        _ => None,
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
        /// `narrow` rounds an f64 to the target float type (and back). Python floats may round
        /// to it (as NumPy does) but not overflow to infinity; integers must be exact.
        fn float(
            s: Scalar,
            narrow: fn(f64) -> f64,
            name: &str,
        ) -> std::result::Result<f64, String> {
            let exact = |wide: i128| {
                let v = wide as f64;
                (v as i128 == wide && narrow(v) == v).then_some(v)
            };
            let fits = match s {
                Scalar::Bool(b) => Some(b as u8 as f64),
                Scalar::Float(f) if f.is_finite() && narrow(f).is_infinite() => {
                    return Err(format!("{} is out of the range of dtype {name}", show(s)))
                }
                Scalar::Float(f) => Some(f),
                Scalar::Int(i) => exact(i as i128),
                Scalar::UInt(u) => exact(u as i128),
            };
            fits.ok_or_else(|| format!("{} does not fit dtype {name} exactly", show(s)))
        }
        match self {
            Buffer::U8(v) => v.push(int(s, "u8")?),
            Buffer::U32(v) => v.push(int(s, "u32")?),
            Buffer::I16(v) => v.push(int(s, "i16")?),
            Buffer::I32(v) => v.push(int(s, "i32")?),
            Buffer::I64(v) => v.push(int(s, "i64")?),
            Buffer::BF16(v) => v.push(half::bf16::from_f64(float(
                s,
                |x| half::bf16::from_f64(x).to_f64(),
                "bf16",
            )?)),
            Buffer::F16(v) => v.push(half::f16::from_f64(float(
                s,
                |x| half::f16::from_f64(x).to_f64(),
                "f16",
            )?)),
            Buffer::F32(v) => v.push(float(s, |x| x as f32 as f64, "f32")? as f32),
            Buffer::F64(v) => v.push(float(s, |x| x, "f64")?),
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

pub(crate) fn show(s: Scalar) -> String {
    match s {
        Scalar::Bool(b) => if b { "True" } else { "False" }.to_owned(),
        Scalar::Int(i) => format!("the int {i}"),
        Scalar::UInt(u) => format!("the int {u}"),
        Scalar::Float(f) => format!("the float {f:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fits(dtype: DType, s: Scalar) -> std::result::Result<(), String> {
        Buffer::new(dtype).push(s)
    }

    #[test]
    fn integers_fit_exactly_or_not_at_all() {
        assert!(fits(DType::U8, Scalar::Int(255)).is_ok());
        let err = fits(DType::U8, Scalar::Int(256)).unwrap_err();
        assert_eq!(err, "the int 256 does not fit dtype u8 exactly");
        assert!(fits(DType::U8, Scalar::Int(-1)).is_err());
        assert!(fits(DType::I64, Scalar::UInt(u64::MAX)).is_err());
        assert!(fits(DType::U32, Scalar::Float(3.0)).is_ok());
        assert!(fits(DType::I32, Scalar::Float(3.5)).is_err());
        // No saturation at the edges: -2^63 fits i64, -1e19 does not.
        assert!(fits(DType::I64, Scalar::Float(i64::MIN as f64)).is_ok());
        assert!(fits(DType::I64, Scalar::Float(-1e19)).is_err());
        assert!(fits(DType::I64, Scalar::Float(f64::NAN)).is_err());
    }

    #[test]
    fn floats_round_but_integers_must_be_exact() {
        assert!(fits(DType::F32, Scalar::Float(0.1)).is_ok());
        assert!(fits(DType::F32, Scalar::Int(1 << 24)).is_ok());
        assert!(fits(DType::F32, Scalar::Int((1 << 24) + 1)).is_err());
        // Exactly representable beyond 2^24 is exact: 2^25 fits f32.
        assert!(fits(DType::F32, Scalar::Int(1 << 25)).is_ok());
        assert!(fits(DType::F64, Scalar::Int(i64::MAX)).is_err());
        assert!(fits(DType::F64, Scalar::UInt(1 << 63)).is_ok());
        // A finite float that overflows the dtype is an error, not inf; inf and NaN pass.
        let err = fits(DType::F32, Scalar::Float(1e300)).unwrap_err();
        assert_eq!(err, "the float 1e300 is out of the range of dtype f32");
        assert!(fits(DType::F16, Scalar::Float(70000.0)).is_err());
        assert!(fits(DType::F32, Scalar::Float(f64::INFINITY)).is_ok());
        assert!(fits(DType::F32, Scalar::Float(f64::NAN)).is_ok());
        assert!(fits(DType::F16, Scalar::Int(2048)).is_ok());
        assert!(fits(DType::F16, Scalar::Int(2049)).is_err());
        assert!(fits(DType::F64, Scalar::Bool(true)).is_ok());
    }

    #[test]
    fn buffers_become_tensors_of_their_dtype() {
        let mut b = Buffer::new(DType::I32);
        for i in 0..6 {
            b.push(Scalar::Int(i)).unwrap();
        }
        let t = b.into_tensor(&[2, 3]).unwrap();
        assert_eq!(t.dtype(), DType::I32);
        assert_eq!(t.to_vec2::<i32>().unwrap(), [[0, 1, 2], [3, 4, 5]]);
        assert_eq!(
            infer_dtype(&[Scalar::Int(1), Scalar::Float(2.)]),
            DType::F32
        );
        assert_eq!(infer_dtype(&[Scalar::Bool(true)]), DType::U8);
        assert_eq!(infer_dtype(&[Scalar::Int(1)]), DType::I64);
    }
}
