//! What the methods and the module functions share: running candle work (with the GIL released
//! for large tensors), parsing dtypes, dims and shapes, and a few kernels candle lacks.

use candle_core::{DType, Device, DeviceLocation, Shape, Tensor, D};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{
    PyImportError, PyIndexError, PyMemoryError, PyOverflowError, PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::error::candle_message;
use crate::python::exceptions::RustPanic;
use crate::spec::with_numpy_element;

use super::PyTensor;
use crate::bridge::numbers::{to_tensor, ConversionError};

/// Tensors at least this large are computed with the GIL released.
pub(super) const RELEASE_GIL_AT: usize = 1 << 15;

pub(super) type CResult<T> = candle_core::Result<T>;

pub(super) fn value_error(e: candle_core::Error) -> PyErr {
    PyValueError::new_err(candle_message(&e))
}

/// Runs candle work, with the GIL released when the tensor is large. A panic in it is caught
/// and raised as `pyop.RustPanic` (a BaseException): the body's op then fails with kind
/// `Panic` and the body's traceback, and the executor goes on.
pub(super) fn compute<T: Send>(
    py: Python<'_>,
    elems: usize,
    f: impl FnOnce() -> CResult<T> + Send,
) -> PyResult<T> {
    let run = || std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    let result = if elems >= RELEASE_GIL_AT {
        py.detach(run)
    } else {
        run()
    };
    match result {
        Ok(r) => r.map_err(value_error),
        Err(panic) => Err(RustPanic::new_err(format!(
            "candle panicked: {}",
            crate::error::panic_message(&*panic)
        ))),
    }
}

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

pub(super) fn wrap(t: Tensor) -> PyTensor {
    PyTensor::new(t)
}

/// A dtype named as candle names it (`"f32"`) or as NumPy does (`"float32"`).
pub(super) fn parse_dtype(v: &Bound<'_, PyAny>) -> PyResult<DType> {
    let name: String = match v.extract::<String>() {
        Ok(s) => s,
        Err(_) => v.str()?.to_string(),
    };
    let canonical = match name.as_str() {
        "float16" | "half" => "f16",
        "float32" | "float" => "f32",
        "float64" | "double" => "f64",
        "bfloat16" => "bf16",
        "int16" => "i16",
        "int32" => "i32",
        "int64" | "int" => "i64",
        "uint8" | "bool" => "u8",
        "uint32" => "u32",
        other => other,
    };
    canonical.parse::<DType>().map_err(|_| {
        PyValueError::new_err(format!(
            "unknown dtype '{name}'; expected one of u8, u32, i16, i32, i64, bf16, f16, f32, f64"
        ))
    })
}

pub(super) fn device_name(d: &Device) -> String {
    match d.location() {
        DeviceLocation::Cpu => "cpu".to_owned(),
        DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// A dimension index, negative counting from the end, for a tensor of `rank` dims.
pub(super) fn dim(d: isize, rank: usize) -> PyResult<usize> {
    let r = rank as isize;
    let n = if d < 0 { d + r } else { d };
    if n < 0 || n >= r.max(1) && !(rank == 0 && n == 0) {
        return Err(PyIndexError::new_err(format!(
            "dimension {d} is out of range for a tensor of {rank} dimensions"
        )));
    }
    Ok(n as usize)
}

/// `dim=None`, an int, or a tuple/list of ints.
pub(super) fn dims_arg(v: Option<&Bound<'_, PyAny>>, rank: usize) -> PyResult<Option<Vec<usize>>> {
    let Some(v) = v.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    let raw: Vec<isize> = if let Ok(i) = v.extract::<isize>() {
        vec![i]
    } else {
        v.extract()?
    };
    let mut ds = raw
        .into_iter()
        .map(|d| dim(d, rank))
        .collect::<PyResult<Vec<_>>>()?;
    ds.sort_unstable();
    ds.dedup();
    Ok(Some(ds))
}

/// A shape given as varargs `reshape(2, 3)` or one sequence `reshape((2, 3))`; `-1` is inferred
/// from `elems` when given.
pub(super) fn shape_arg(args: &Bound<'_, PyTuple>, elems: Option<usize>) -> PyResult<Vec<usize>> {
    let raw: Vec<isize> = if args.len() == 1 && args.get_item(0)?.extract::<isize>().is_err() {
        args.get_item(0)?.extract()?
    } else {
        args.extract()?
    };
    let inferred = raw.iter().filter(|&&d| d == -1).count();
    if inferred > 1 || raw.iter().any(|&d| d < -1) {
        return Err(PyValueError::new_err(format!("invalid shape {raw:?}")));
    }
    let given: Vec<usize> = raw
        .iter()
        .filter(|&&d| d >= 0)
        .map(|&d| d as usize)
        .collect();
    let Some(known) = elem_count(&given) else {
        return Err(PyValueError::new_err(format!(
            "the shape {raw:?} has too many elements for any tensor"
        )));
    };
    let dims = raw
        .iter()
        .map(|&d| match (d, elems) {
            (-1, Some(n)) if known > 0 && n % known == 0 => Ok(n / known),
            (-1, _) => Err(PyValueError::new_err(format!(
                "cannot infer -1 in shape {raw:?}"
            ))),
            (d, _) => Ok(d as usize),
        })
        .collect::<PyResult<Vec<usize>>>()?;
    checked_shape(dims)
}

impl PyTensor {
    pub(super) fn n(&self) -> usize {
        self.tensor.elem_count()
    }

    /// Runs a unary candle op.
    pub(super) fn unary(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Tensor) -> CResult<Tensor> + Send,
    ) -> PyResult<PyTensor> {
        let t = &self.tensor;
        allocatable(Some(self.n()), t.dtype(), "the result")?;
        compute(py, self.n(), || f(t)).map(|r| self.derived(r))
    }

    /// Runs a candle op that makes a view of the tensor (same storage, new layout: `narrow`,
    /// `transpose`, `squeeze`, `unsqueeze`, `broadcast_as`), which allocates nothing, so needs no
    /// allocation check: a huge broadcast tensor can still be cut and turned.
    pub(super) fn view(&self, f: impl FnOnce(&Tensor) -> CResult<Tensor>) -> PyResult<PyTensor> {
        f(&self.tensor)
            .map(|t| self.derived(t))
            .map_err(value_error)
    }

    /// An integer op computed in f64 first and range-checked (see [`check_int_range`]); floats
    /// go straight to `f`.
    /// For i64, where f64 is not exact, `exact` does the op per element with Rust's checked
    /// arithmetic instead.
    pub(super) fn int_checked(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl Fn(&Tensor) -> CResult<Tensor> + Send + Sync,
        exact: impl Fn(i64) -> Option<i64>,
    ) -> PyResult<PyTensor> {
        let dtype = self.tensor.dtype();
        if dtype == DType::I64 {
            allocatable(Some(self.n()), DType::I64, "the result")?;
            let values = self
                .tensor
                .flatten_all()
                .and_then(|t| t.to_vec1::<i64>())
                .map_err(value_error)?;
            if values.iter().any(|&v| exact(v).is_none()) {
                return Err(int_overflow(what, dtype));
            }
        } else if !dtype.is_float() {
            allocatable(Some(self.n()), DType::F64, "the result")?;
            let t = &self.tensor;
            let wide = compute(py, self.n(), || f(&t.to_dtype(DType::F64)?))?;
            check_int_range(&wide, dtype, what)?;
        }
        self.unary(py, f)
    }

    /// Runs a float-only candle op (candle's unary kernels have no integer versions).
    pub(super) fn math(
        &self,
        py: Python<'_>,
        name: &str,
        f: impl FnOnce(&Tensor) -> CResult<Tensor> + Send,
    ) -> PyResult<PyTensor> {
        if !self.tensor.dtype().is_float() {
            return Err(PyTypeError::new_err(format!(
                "{name}() needs a float tensor, got {}; convert with .to_dtype(\"f32\") first",
                self.tensor.dtype().as_str()
            )));
        }
        self.unary(py, f)
    }

    /// The other operand of a binary op, as a tensor of this tensor's dtype on its device.
    pub(super) fn operand(
        &self,
        py: Python<'_>,
        other: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Tensor>> {
        if let Ok(o) = other.cast::<PyTensor>() {
            let o = &o.get().tensor;
            if !o.device().same_device(self.tensor.device()) {
                return Err(PyValueError::new_err(format!(
                    "tensors on different devices: {} and {}",
                    device_name(self.tensor.device()),
                    device_name(o.device())
                )));
            }
            return Ok(Some(o.clone()));
        }
        match to_tensor(py, other, Some(self.tensor.dtype())) {
            Ok(t) => Ok(Some(
                t.to_device(self.tensor.device()).map_err(value_error)?,
            )),
            Err(ConversionError::NotTensorLike(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// A binary op with `other` (a tensor, or a Python value made one of this dtype):
    /// `NotImplemented` for anything else, so Python tries the other operand's method.
    pub(super) fn binary(
        &self,
        py: Python<'_>,
        other: &Bound<'_, PyAny>,
        reflected: bool,
        f: impl FnOnce(&Tensor, &Tensor) -> CResult<Tensor> + Send,
    ) -> PyResult<Py<PyAny>> {
        match self.binary_op(py, other, reflected, f)? {
            Some(t) => Ok(Bound::new(py, t)?.into_any().unbind()),
            None => Ok(py.NotImplemented()),
        }
    }

    /// The result of a binary op, or `None` when `other` is nothing tensor-like.
    pub(super) fn binary_op(
        &self,
        py: Python<'_>,
        other: &Bound<'_, PyAny>,
        reflected: bool,
        f: impl FnOnce(&Tensor, &Tensor) -> CResult<Tensor> + Send,
    ) -> PyResult<Option<PyTensor>> {
        let Some(o) = self.operand(py, other)? else {
            return Ok(None);
        };
        let (a, b) = self.ordered(&o, reflected);
        let n = result_count(a, b)?;
        self.run_binary(py, a, b, n, f).map(Some)
    }

    /// `(self, o)`, or `(o, self)` for a reflected operator.
    fn ordered<'a>(&'a self, o: &'a Tensor, reflected: bool) -> (&'a Tensor, &'a Tensor) {
        if reflected {
            (o, &self.tensor)
        } else {
            (&self.tensor, o)
        }
    }

    /// `f(a, b)`, whose result has `n` elements, once that much memory can be had.
    fn run_binary(
        &self,
        py: Python<'_>,
        a: &Tensor,
        b: &Tensor,
        n: usize,
        f: impl FnOnce(&Tensor, &Tensor) -> CResult<Tensor> + Send,
    ) -> PyResult<PyTensor> {
        allocatable(Some(n), self.tensor.dtype(), "the result")?;
        compute(py, n, || f(a, b)).map(wrap)
    }

    /// `self @ other` (or `other @ self`): its result can be far larger than either operand, so
    /// its own size is checked before candle allocates it.
    pub(super) fn matmul_with(
        &self,
        py: Python<'_>,
        other: &Bound<'_, PyAny>,
        reflected: bool,
    ) -> PyResult<Py<PyAny>> {
        let Some(o) = self.operand(py, other)? else {
            return Ok(py.NotImplemented());
        };
        let (a, b) = self.ordered(&o, reflected);
        let n = matmul_count(a, b).ok_or_else(|| {
            PyValueError::new_err("the result of @ has too many elements for any tensor")
        })?;
        // candle copies a broadcast operand to the batch it is broadcast to: that copy can be
        // far larger than the result.
        let (ad, bd) = (a.dims(), b.dims());
        let batch = elem_count(&ad[..ad.len().saturating_sub(2)])
            .zip(elem_count(&bd[..bd.len().saturating_sub(2)]))
            .map(|(x, y)| x.max(y));
        let k = ad.last().copied().unwrap_or(1);
        let rows = |d: &[usize]| if d.len() >= 2 { d[d.len() - 2] } else { 1 };
        for operand in [
            batch.and_then(|b| elem_count(&[b, rows(ad), k])),
            batch.and_then(|b| elem_count(&[b, k, bd.last().copied().unwrap_or(1)])),
        ] {
            allocatable(operand, a.dtype(), "an operand of @, broadcast")?;
        }
        let t = self.run_binary(py, a, b, n, matmul)?;
        Ok(Bound::new(py, t)?.into_any().unbind())
    }

    /// `+ - *` on this tensor: integer results range-checked (see [`check_int_range`]).
    pub(super) fn arith(
        &self,
        py: Python<'_>,
        other: &Bound<'_, PyAny>,
        reflected: bool,
        what: &str,
        f: impl Fn(&Tensor, &Tensor) -> CResult<Tensor> + Send + Sync,
    ) -> PyResult<Py<PyAny>> {
        let Some(o) = self.operand(py, other)? else {
            return Ok(py.NotImplemented());
        };
        let (a, b) = self.ordered(&o, reflected);
        let n = result_count(a, b)?;
        let dtype = self.tensor.dtype();
        // Operands of two dtypes are candle's error to report, in `run_binary`.
        // Shapes that do not broadcast are candle's error to report too.
        if !dtype.is_float() && o.dtype() == dtype && broadcast_count(a, b).is_ok() {
            allocatable(Some(n), DType::F64, "the result")?;
            if dtype == DType::I64 {
                // f64 is not exact for i64: check each element with Rust's own arithmetic.
                exact_i64(a, b, what)?;
            } else {
                let wide = compute(py, n, || {
                    f(&a.to_dtype(DType::F64)?, &b.to_dtype(DType::F64)?)
                })?;
                check_int_range(&wide, dtype, what)?;
            }
        }
        let t = self.run_binary(py, a, b, n, f)?;
        Ok(Bound::new(py, t)?.into_any().unbind())
    }

    pub(super) fn reduce(
        &self,
        py: Python<'_>,
        dim: Option<&Bound<'_, PyAny>>,
        keepdim: bool,
        f: impl Fn(&Tensor, usize) -> CResult<Tensor> + Send + Sync,
    ) -> PyResult<PyTensor> {
        let t = &self.tensor;
        let rank = t.rank();
        let dims = dims_arg(dim, rank)?;
        // A reduction may copy its input first (a broadcast one is made contiguous; integers
        // are summed in f64 and i64).
        let widest = if t.dtype().is_float() {
            t.dtype()
        } else {
            DType::F64
        };
        allocatable(Some(self.n()), widest, "the reduction's input")?;
        // Each step's result too: reducing an empty axis of a tensor with no elements gives the
        // product of the other axes (`zeros((0, 2**40)).sum(0)` has 2^40), which no input check
        // bounds.
        if let Some(dims) = &dims {
            let mut shape = t.dims().to_vec();
            for &d in dims.iter().rev() {
                shape[d] = 1;
                allocatable(elem_count(&shape), widest, "the reduction's result")?;
            }
        }
        compute(py, self.n(), || {
            let Some(dims) = dims else {
                let r = f(&t.flatten_all()?, 0)?;
                return if keepdim {
                    r.reshape(vec![1; rank])
                } else {
                    r.reshape(())
                };
            };
            let mut r = t.clone();
            for &d in dims.iter().rev() {
                r = f(&r, d)?;
            }
            if !keepdim {
                for &d in dims.iter().rev() {
                    r = r.squeeze(d)?;
                }
            }
            Ok(r)
        })
        .map(wrap)
    }

    pub(super) fn one_element(&self, what: &str) -> PyResult<Tensor> {
        if self.n() != 1 {
            return Err(PyValueError::new_err(format!(
                "{what} of a tensor with {} elements is ambiguous; reduce it first (e.g. .sum(), .any())",
                self.n()
            )));
        }
        self.tensor
            .flatten_all()
            .and_then(|t| t.get(0))
            .map_err(value_error)
    }
}

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

pub(super) fn powi(t: &Tensor, e: u64) -> CResult<Tensor> {
    if e == 0 {
        return t.ones_like();
    }
    let mut result: Option<Tensor> = None;
    let mut base = t.clone();
    let mut e = e;
    while e > 0 {
        if e & 1 == 1 {
            result = Some(match result {
                None => base.clone(),
                Some(r) => (r * &base)?,
            });
        }
        e >>= 1;
        if e > 0 {
            base = (&base * &base)?;
        }
    }
    Ok(result.expect("e > 0"))
}

pub(super) fn matmul(a: &Tensor, b: &Tensor) -> CResult<Tensor> {
    let (a1, b1) = (a.rank() == 1, b.rank() == 1);
    let a = if a1 { a.unsqueeze(0)? } else { a.clone() };
    let b = if b1 { b.unsqueeze(1)? } else { b.clone() };
    let mut r = if a.rank() == b.rank() {
        a.matmul(&b)?
    } else {
        a.broadcast_matmul(&b)?
    };
    if b1 {
        r = r.squeeze(D::Minus1)?;
    }
    if a1 {
        r = r.squeeze(if b1 {
            r.rank().saturating_sub(1)
        } else {
            r.rank() - 2
        })?;
    }
    Ok(r)
}

pub(super) fn sigmoid(t: &Tensor) -> CResult<Tensor> {
    (t.neg()?.exp()? + 1.0)?.recip()
}

impl PyTensor {
    pub(super) fn float_only(&self, op: &str) -> PyResult<()> {
        if self.tensor.dtype().is_float() {
            Ok(())
        } else {
            Err(PyTypeError::new_err(format!(
                "`{op}` needs a float tensor, got {}; convert with .to_dtype(\"f32\") first",
                self.tensor.dtype().as_str()
            )))
        }
    }

    pub(super) fn single_dim(&self, d: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<()> {
        match dims_arg(d, self.tensor.rank())? {
            Some(ds) if ds.len() > 1 => Err(PyValueError::new_err(format!(
                "{what} takes one dim, not {}",
                ds.len()
            ))),
            _ => Ok(()),
        }
    }
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

pub(super) fn dtype_or(dtype: Option<&Bound<'_, PyAny>>, default: DType) -> PyResult<DType> {
    dtype
        .filter(|d| !d.is_none())
        .map(parse_dtype)
        .transpose()
        .map(|d| d.unwrap_or(default))
}

pub(super) fn shape_of(shape: &Bound<'_, PyAny>) -> PyResult<Shape> {
    let dims: Vec<i128> = match shape.extract::<i128>() {
        Ok(n) => vec![n],
        Err(_) => shape.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "a shape is an int or a sequence of ints, not {}",
                crate::bridge::numbers::describe_value(shape)
            ))
        })?,
    };
    if dims.iter().any(|&d| d < 0) {
        return Err(PyValueError::new_err(format!(
            "negative dimensions are not allowed: {dims:?}"
        )));
    }
    let dims: Vec<usize> = dims
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<_, _>>()
        .map_err(|_| {
            PyValueError::new_err(format!(
                "the shape {dims:?} has too many elements for any tensor"
            ))
        })?;
    Ok(Shape::from(checked_shape(dims)?))
}

pub(super) fn tensors_of(ts: &Bound<'_, PyAny>) -> PyResult<Vec<Tensor>> {
    let mut out = Vec::new();
    for t in ts.try_iter()? {
        out.push(
            t?.cast::<PyTensor>()
                .map_err(|_| PyTypeError::new_err("expected a sequence of pyop.Tensor"))?
                .get()
                .tensor
                .clone(),
        );
    }
    Ok(out)
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
fn result_count(a: &Tensor, b: &Tensor) -> PyResult<usize> {
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
fn int_overflow(what: &str, dtype: DType) -> PyErr {
    PyOverflowError::new_err(format!(
        "integer overflow: {what} gives values outside the range of {} (convert with \
         .to_dtype() first)",
        dtype.as_str()
    ))
}

/// `a ⊕ b` on i64 tensors, checked element by element (`+`, `-` or `*`).
fn exact_i64(a: &Tensor, b: &Tensor, what: &str) -> PyResult<()> {
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
