//! The `pyop` Python module, importable in every body: `pyop.Tensor` wraps a candle tensor (the
//! same storage, the same device) and runs candle ops on it eagerly, so autograd records what a
//! tensor-mode body does.
//!
//! Numerics: a Python number combined with a tensor takes the tensor's dtype and must fit it
//! exactly (an integer tensor with 0.5 is an error); two tensors of different dtypes are an error,
//! as in candle; comparisons give u8 masks; `pyop.tensor(obj)` without a dtype makes f32 from
//! floats, i64 from ints and u8 from bools. Candle's errors are raised as `ValueError`s with
//! candle's message. Work on large tensors runs with the GIL released.

use std::cell::RefCell;

use candle_core::{DType, Device, DeviceLocation, Shape, Tensor, D};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyImportError, PyIndexError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pyclass::CompareOp;
use pyo3::types::{PyFloat, PyInt, PyList, PyModule, PySlice, PyTuple};

use crate::convert;
use crate::error::Error;
use crate::spec::with_numpy_element;

pyo3::create_exception!(
    pyop,
    OpTimeout,
    pyo3::exceptions::PyBaseException,
    "Raised inside a body that ran past its time limit."
);
pyo3::create_exception!(
    pyop,
    RustError,
    pyo3::exceptions::PyException,
    "An error from Rust code called by a body (a nested op, an exposed Rust function)."
);

/// Tensors at least this large are computed with the GIL released.
const RELEASE_GIL_AT: usize = 1 << 15;

thread_local! {
    /// The devices of the op calls running on this thread, innermost last.
    static DEVICES: RefCell<Vec<Device>> = const { RefCell::new(Vec::new()) };
}

/// While alive, `pyop.tensor`, `zeros`, … on this thread make tensors on `device`.
pub(crate) struct DeviceScope(());

impl DeviceScope {
    pub(crate) fn enter(device: &Device) -> Self {
        DEVICES.with(|d| d.borrow_mut().push(device.clone()));
        DeviceScope(())
    }
}

impl Drop for DeviceScope {
    fn drop(&mut self) {
        DEVICES.with(|d| d.borrow_mut().pop());
    }
}

fn current_device() -> Device {
    DEVICES
        .with(|d| d.borrow().last().cloned())
        .unwrap_or(Device::Cpu)
}

/// A candle tensor as Python sees it (`pyop.Tensor`). Holds the tensor itself: same storage,
/// same device, same place in the autograd graph.
#[pyclass(name = "Tensor", module = "pyop", frozen)]
pub struct PyTensor {
    tensor: Tensor,
    /// For the base object of a NumPy view: the address the view starts at.
    view_data: usize,
    /// Whether that view was handed out writable (an `out` buffer).
    writable: bool,
}

impl PyTensor {
    /// Wraps a tensor for Python (e.g. to return it from a Rust function called by a body).
    pub fn new(tensor: Tensor) -> Self {
        Self {
            tensor,
            view_data: 0,
            writable: false,
        }
    }

    /// The base object of a NumPy view of `tensor` starting at address `data`.
    pub(crate) fn view_base(tensor: Tensor, data: usize, writable: bool) -> Self {
        Self {
            tensor,
            view_data: data,
            writable,
        }
    }

    pub(crate) fn writable(&self) -> bool {
        self.writable
    }

    pub(crate) fn view_data(&self) -> Option<usize> {
        (self.view_data != 0).then_some(self.view_data)
    }

    /// The wrapped tensor.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }
}

type CResult<T> = candle_core::Result<T>;

fn value_error(e: candle_core::Error) -> PyErr {
    PyValueError::new_err(candle_message(&e))
}

/// candle's message without the Rust backtrace it carries when `RUST_BACKTRACE` is set: the
/// Python traceback says where the body was.
pub(crate) fn candle_message(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => candle_message(inner),
        e => e.to_string(),
    }
}

/// Runs candle work, with the GIL released when the tensor is large.
fn compute<T: Send>(
    py: Python<'_>,
    elems: usize,
    f: impl FnOnce() -> CResult<T> + Send,
) -> PyResult<T> {
    if elems >= RELEASE_GIL_AT {
        py.detach(f).map_err(value_error)
    } else {
        f().map_err(value_error)
    }
}

fn wrap(t: Tensor) -> PyTensor {
    PyTensor::new(t)
}

/// A dtype named as candle names it (`"f32"`) or as NumPy does (`"float32"`).
fn parse_dtype(v: &Bound<'_, PyAny>) -> PyResult<DType> {
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

fn device_name(d: &Device) -> String {
    match d.location() {
        DeviceLocation::Cpu => "cpu".to_owned(),
        DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// A dimension index, negative counting from the end, for a tensor of `rank` dims.
fn dim(d: isize, rank: usize) -> PyResult<usize> {
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
fn dims_arg(v: Option<&Bound<'_, PyAny>>, rank: usize) -> PyResult<Option<Vec<usize>>> {
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
fn shape_arg(args: &Bound<'_, PyTuple>, elems: Option<usize>) -> PyResult<Vec<usize>> {
    let raw: Vec<isize> = if args.len() == 1 && args.get_item(0)?.extract::<isize>().is_err() {
        args.get_item(0)?.extract()?
    } else {
        args.extract()?
    };
    let known: usize = raw
        .iter()
        .filter(|&&d| d >= 0)
        .map(|&d| d as usize)
        .product();
    let inferred = raw.iter().filter(|&&d| d == -1).count();
    if inferred > 1 || raw.iter().any(|&d| d < -1) {
        return Err(PyValueError::new_err(format!("invalid shape {raw:?}")));
    }
    raw.iter()
        .map(|&d| match (d, elems) {
            (-1, Some(n)) if known > 0 && n % known == 0 => Ok(n / known),
            (-1, _) => Err(PyValueError::new_err(format!(
                "cannot infer -1 in shape {raw:?}"
            ))),
            (d, _) => Ok(d as usize),
        })
        .collect()
}

impl PyTensor {
    fn n(&self) -> usize {
        self.tensor.elem_count()
    }

    /// Runs a unary candle op.
    fn unary(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Tensor) -> CResult<Tensor> + Send,
    ) -> PyResult<PyTensor> {
        let t = &self.tensor;
        compute(py, self.n(), || f(t)).map(wrap)
    }

    /// Runs a float-only candle op (candle's unary kernels have no integer versions).
    fn math(
        &self,
        py: Python<'_>,
        name: &str,
        f: impl FnOnce(&Tensor) -> CResult<Tensor> + Send,
    ) -> PyResult<PyTensor> {
        if !self.tensor.dtype().is_float() {
            return Err(PyTypeError::new_err(format!(
                "{name}() needs a float tensor, got {}; convert with .to_dtype(\"f32\") first",
                self.dtype()
            )));
        }
        self.unary(py, f)
    }

    /// The other operand of a binary op, as a tensor of this tensor's dtype on its device.
    fn operand(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Option<Tensor>> {
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
        match convert::to_tensor(py, other, Some(self.tensor.dtype())) {
            Ok(Some(t)) => Ok(Some(
                t.to_device(self.tensor.device()).map_err(value_error)?,
            )),
            Ok(None) => Ok(None),
            Err(msg) => Err(PyValueError::new_err(msg)),
        }
    }

    fn binary(
        &self,
        py: Python<'_>,
        other: &Bound<'_, PyAny>,
        reflected: bool,
        f: impl FnOnce(&Tensor, &Tensor) -> CResult<Tensor> + Send,
    ) -> PyResult<Option<PyTensor>> {
        let Some(o) = self.operand(py, other)? else {
            return Ok(None);
        };
        let (a, b) = if reflected {
            (&o, &self.tensor)
        } else {
            (&self.tensor, &o)
        };
        let n = self.n().max(o.elem_count());
        compute(py, n, || f(a, b)).map(|t| Some(wrap(t)))
    }

    fn reduce(
        &self,
        py: Python<'_>,
        dim: Option<&Bound<'_, PyAny>>,
        keepdim: bool,
        f: impl Fn(&Tensor, usize) -> CResult<Tensor> + Send + Sync,
    ) -> PyResult<PyTensor> {
        let t = &self.tensor;
        let rank = t.rank();
        let dims = dims_arg(dim, rank)?;
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

    fn one_element(&self, what: &str) -> PyResult<Tensor> {
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
fn item<'py>(py: Python<'py>, t: &Tensor) -> PyResult<Bound<'py, PyAny>> {
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

fn powi(t: &Tensor, e: u64) -> CResult<Tensor> {
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

fn matmul(a: &Tensor, b: &Tensor) -> CResult<Tensor> {
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

fn sigmoid(t: &Tensor) -> CResult<Tensor> {
    (t.neg()?.exp()? + 1.0)?.recip()
}

#[pymethods]
impl PyTensor {
    // --- shape and kind ---

    /// The shape, as a tuple.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.tensor.dims())
    }

    /// The dtype's name, as candle names it (`"f32"`).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.tensor.dtype().as_str()
    }

    /// `"cpu"` or `"cuda:N"`.
    #[getter]
    fn device(&self) -> String {
        device_name(self.tensor.device())
    }

    #[getter]
    fn ndim(&self) -> usize {
        self.tensor.rank()
    }

    /// The number of elements.
    fn numel(&self) -> usize {
        self.n()
    }

    fn __len__(&self) -> PyResult<usize> {
        self.tensor
            .dims()
            .first()
            .copied()
            .ok_or_else(|| PyTypeError::new_err("len() of a 0-d tensor"))
    }

    fn __repr__(&self) -> String {
        format!(
            "pyop.Tensor({}, dtype={}, device={})",
            self.tensor,
            self.dtype(),
            self.device()
        )
    }

    // --- Python numbers and control flow ---

    fn __bool__(&self) -> PyResult<bool> {
        let t = self.one_element("the truth value")?;
        let v = t
            .to_dtype(DType::F64)
            .and_then(|t| t.to_scalar::<f64>())
            .map_err(value_error)?;
        Ok(v != 0.0)
    }

    fn __float__(&self) -> PyResult<f64> {
        let t = self.one_element("float()")?;
        t.to_dtype(DType::F64)
            .and_then(|t| t.to_scalar::<f64>())
            .map_err(value_error)
    }

    fn __int__(&self) -> PyResult<i64> {
        let t = self.one_element("int()")?;
        if t.dtype().is_float() {
            Ok(t.to_dtype(DType::F64)
                .and_then(|t| t.to_scalar::<f64>())
                .map_err(value_error)?
                .trunc() as i64)
        } else {
            t.to_dtype(DType::I64)
                .and_then(|t| t.to_scalar::<i64>())
                .map_err(value_error)
        }
    }

    /// The value of a one-element tensor as a Python number.
    fn item<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let t = self.one_element("item()")?;
        item(py, &t)
    }

    /// The values as (nested) Python lists.
    fn tolist<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let t = self.tensor.to_device(&Device::Cpu).map_err(value_error)?;
        let flat: Vec<Bound<'py, PyAny>> = if t.dtype().is_float() {
            let v = t
                .flatten_all()
                .and_then(|t| t.to_dtype(DType::F64))
                .and_then(|t| t.to_vec1::<f64>())
                .map_err(value_error)?;
            v.into_iter()
                .map(|x| PyFloat::new(py, x).into_any())
                .collect()
        } else {
            let v = t
                .flatten_all()
                .and_then(|t| t.to_dtype(DType::I64))
                .and_then(|t| t.to_vec1::<i64>())
                .map_err(value_error)?;
            v.into_iter()
                .map(|x| PyInt::new(py, x).into_any())
                .collect()
        };
        fn nest<'py>(
            py: Python<'py>,
            dims: &[usize],
            items: &mut std::vec::IntoIter<Bound<'py, PyAny>>,
        ) -> PyResult<Bound<'py, PyAny>> {
            match dims.split_first() {
                None => Ok(items.next().expect("one per element")),
                Some((&n, rest)) => {
                    let list = PyList::empty(py);
                    for _ in 0..n {
                        list.append(nest(py, rest, items)?)?;
                    }
                    Ok(list.into_any())
                }
            }
        }
        nest(py, t.dims(), &mut flat.into_iter())
    }

    // --- arithmetic (NumPy-style broadcasting, Python numbers on either side) ---

    fn __add__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Option<PyTensor>> {
        self.binary(py, o, false, |a, b| a.broadcast_add(b))
    }
    fn __radd__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Option<PyTensor>> {
        self.binary(py, o, true, |a, b| a.broadcast_add(b))
    }
    fn __sub__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Option<PyTensor>> {
        self.binary(py, o, false, |a, b| a.broadcast_sub(b))
    }
    fn __rsub__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Option<PyTensor>> {
        self.binary(py, o, true, |a, b| a.broadcast_sub(b))
    }
    fn __mul__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Option<PyTensor>> {
        self.binary(py, o, false, |a, b| a.broadcast_mul(b))
    }
    fn __rmul__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Option<PyTensor>> {
        self.binary(py, o, true, |a, b| a.broadcast_mul(b))
    }
    fn __truediv__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Option<PyTensor>> {
        self.float_only("/")?;
        self.binary(py, o, false, |a, b| a.broadcast_div(b))
    }
    fn __rtruediv__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Option<PyTensor>> {
        self.float_only("/")?;
        self.binary(py, o, true, |a, b| a.broadcast_div(b))
    }
    fn __matmul__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Option<PyTensor>> {
        self.binary(py, o, false, matmul)
    }
    fn __rmatmul__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Option<PyTensor>> {
        self.binary(py, o, true, matmul)
    }

    fn __pow__(
        &self,
        py: Python<'_>,
        o: &Bound<'_, PyAny>,
        modulo: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<PyTensor>> {
        if modulo.is_some_and(|m| !m.is_none()) {
            return Err(PyTypeError::new_err(
                "pow() with a modulus is not supported for tensors",
            ));
        }
        if o.cast::<PyTensor>().is_err() {
            if let Ok(s) = convert::scalar(o) {
                let e = match s {
                    convert::Scalar::Bool(b) => b as u8 as f64,
                    convert::Scalar::Int(i) => i as f64,
                    convert::Scalar::UInt(u) => u as f64,
                    convert::Scalar::Float(f) => f,
                };
                if self.tensor.dtype().is_float() {
                    return self
                        .unary(py, move |t| if e == 2.0 { t.sqr() } else { t.powf(e) })
                        .map(Some);
                }
                if e >= 0.0 && e.fract() == 0.0 {
                    return self.unary(py, move |t| powi(t, e as u64)).map(Some);
                }
                return Err(PyValueError::new_err(format!(
                    "an integer tensor ({}) can only be raised to a non-negative integer power, not {e}",
                    self.dtype()
                )));
            }
        }
        self.float_only("**")?;
        self.binary(py, o, false, |a, b| a.broadcast_pow(b))
    }

    fn __rpow__(
        &self,
        py: Python<'_>,
        o: &Bound<'_, PyAny>,
        _modulo: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<PyTensor>> {
        self.float_only("**")?;
        self.binary(py, o, true, |a, b| a.broadcast_pow(b))
    }

    fn __neg__(&self, py: Python<'_>) -> PyResult<PyTensor> {
        if self.tensor.dtype().is_float() {
            self.unary(py, |t| t.neg())
        } else {
            self.unary(py, |t| t.zeros_like()?.broadcast_sub(t))
        }
    }

    fn __pos__(&self) -> PyTensor {
        wrap(self.tensor.clone())
    }

    fn __abs__(&self, py: Python<'_>) -> PyResult<PyTensor> {
        if self.tensor.dtype().is_float() {
            self.unary(py, |t| t.abs())
        } else {
            // candle's unary kernels are float-only: |t| = max(t, 0 - t) for integers.
            self.unary(py, |t| t.maximum(&t.zeros_like()?.sub(t)?))
        }
    }

    fn __richcmp__(
        &self,
        py: Python<'_>,
        o: &Bound<'_, PyAny>,
        op: CompareOp,
    ) -> PyResult<Option<PyTensor>> {
        self.binary(py, o, false, move |a, b| match op {
            CompareOp::Lt => a.broadcast_lt(b),
            CompareOp::Le => a.broadcast_le(b),
            CompareOp::Gt => a.broadcast_gt(b),
            CompareOp::Ge => a.broadcast_ge(b),
            CompareOp::Eq => a.broadcast_eq(b),
            CompareOp::Ne => a.broadcast_ne(b),
        })
    }

    // --- math ---

    fn abs(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.__abs__(py)
    }
    fn exp(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.math(py, "exp", |t| t.exp())
    }
    fn log(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.math(py, "log", |t| t.log())
    }
    fn sqrt(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.math(py, "sqrt", |t| t.sqrt())
    }
    fn square(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.unary(py, |t| t * t)
    }
    fn sin(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.math(py, "sin", |t| t.sin())
    }
    fn cos(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.math(py, "cos", |t| t.cos())
    }
    fn tanh(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.math(py, "tanh", |t| t.tanh())
    }
    fn relu(&self, py: Python<'_>) -> PyResult<PyTensor> {
        if self.tensor.dtype().is_float() {
            self.unary(py, |t| t.relu())
        } else {
            self.unary(py, |t| t.maximum(&t.zeros_like()?))
        }
    }
    fn sigmoid(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.math(py, "sigmoid", sigmoid)
    }
    /// Beyond the issue's list: `erf`, `gelu`, `silu`, `floor`, `ceil`, `round`, `sign`, `recip`.
    fn erf(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.math(py, "erf", |t| t.erf())
    }
    fn gelu(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.math(py, "gelu_erf", |t| t.gelu_erf())
    }
    fn silu(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.math(py, "silu", |t| t.silu())
    }
    fn floor(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.math(py, "floor", |t| t.floor())
    }
    fn ceil(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.math(py, "ceil", |t| t.ceil())
    }
    fn round(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.math(py, "round", |t| t.round())
    }
    fn sign(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.math(py, "sign", |t| t.sign())
    }
    fn recip(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.math(py, "recip", |t| t.recip())
    }

    /// Elementwise maximum with a tensor or number (broadcasting).
    fn maximum(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<PyTensor> {
        self.binary(py, o, false, |a, b| a.broadcast_maximum(b))?
            .ok_or_else(|| PyTypeError::new_err("maximum() takes a tensor or a number"))
    }

    /// Elementwise minimum with a tensor or number (broadcasting).
    fn minimum(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<PyTensor> {
        self.binary(py, o, false, |a, b| a.broadcast_minimum(b))?
            .ok_or_else(|| PyTypeError::new_err("minimum() takes a tensor or a number"))
    }

    /// Limits values to `[min, max]`; either bound may be `None`.
    #[pyo3(signature = (min=None, max=None))]
    fn clamp(
        &self,
        py: Python<'_>,
        min: Option<&Bound<'_, PyAny>>,
        max: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyTensor> {
        let mut r = PyTensor::new(self.tensor.clone());
        if let Some(lo) = min.filter(|m| !m.is_none()) {
            r = r.maximum(py, lo)?;
        }
        if let Some(hi) = max.filter(|m| !m.is_none()) {
            r = r.minimum(py, hi)?;
        }
        Ok(r)
    }

    // --- reductions ---

    #[pyo3(signature = (dim=None, keepdim=false))]
    fn sum(
        &self,
        py: Python<'_>,
        dim: Option<&Bound<'_, PyAny>>,
        keepdim: bool,
    ) -> PyResult<PyTensor> {
        self.reduce(py, dim, keepdim, |t, d| t.sum_keepdim(d))
    }
    #[pyo3(signature = (dim=None, keepdim=false))]
    fn mean(
        &self,
        py: Python<'_>,
        dim: Option<&Bound<'_, PyAny>>,
        keepdim: bool,
    ) -> PyResult<PyTensor> {
        self.reduce(py, dim, keepdim, |t, d| t.mean_keepdim(d))
    }
    #[pyo3(signature = (dim=None, keepdim=false))]
    fn max(
        &self,
        py: Python<'_>,
        dim: Option<&Bound<'_, PyAny>>,
        keepdim: bool,
    ) -> PyResult<PyTensor> {
        self.reduce(py, dim, keepdim, |t, d| t.max_keepdim(d))
    }
    #[pyo3(signature = (dim=None, keepdim=false))]
    fn min(
        &self,
        py: Python<'_>,
        dim: Option<&Bound<'_, PyAny>>,
        keepdim: bool,
    ) -> PyResult<PyTensor> {
        self.reduce(py, dim, keepdim, |t, d| t.min_keepdim(d))
    }
    /// Index of the largest value (u32), over all elements or along `dim`.
    #[pyo3(signature = (dim=None, keepdim=false))]
    fn argmax(
        &self,
        py: Python<'_>,
        dim: Option<&Bound<'_, PyAny>>,
        keepdim: bool,
    ) -> PyResult<PyTensor> {
        self.single_dim(dim, "argmax")?;
        self.reduce(py, dim, keepdim, |t, d| t.argmax_keepdim(d))
    }
    /// Index of the smallest value (u32), over all elements or along `dim`.
    #[pyo3(signature = (dim=None, keepdim=false))]
    fn argmin(
        &self,
        py: Python<'_>,
        dim: Option<&Bound<'_, PyAny>>,
        keepdim: bool,
    ) -> PyResult<PyTensor> {
        self.single_dim(dim, "argmin")?;
        self.reduce(py, dim, keepdim, |t, d| t.argmin_keepdim(d))
    }

    // --- shape ---

    #[pyo3(signature = (*shape))]
    fn reshape(&self, py: Python<'_>, shape: &Bound<'_, PyTuple>) -> PyResult<PyTensor> {
        let s = shape_arg(shape, Some(self.n()))?;
        self.unary(py, move |t| t.reshape(s))
    }
    fn transpose(&self, py: Python<'_>, dim0: isize, dim1: isize) -> PyResult<PyTensor> {
        let (a, b) = (
            dim(dim0, self.tensor.rank())?,
            dim(dim1, self.tensor.rank())?,
        );
        self.unary(py, move |t| t.transpose(a, b))
    }
    /// The transpose of the last two dims (a 0-d or 1-d tensor unchanged).
    fn t(&self, py: Python<'_>) -> PyResult<PyTensor> {
        if self.tensor.rank() < 2 {
            return Ok(wrap(self.tensor.clone()));
        }
        self.unary(py, |t| t.t())
    }
    #[getter(T)]
    fn transposed(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.t(py)
    }
    fn unsqueeze(&self, py: Python<'_>, d: isize) -> PyResult<PyTensor> {
        let d = dim(d, self.tensor.rank() + 1)?;
        self.unary(py, move |t| t.unsqueeze(d))
    }
    /// Removes `dim` (which must have size 1), or every size-1 dim.
    #[pyo3(signature = (dim=None))]
    fn squeeze(&self, py: Python<'_>, dim: Option<isize>) -> PyResult<PyTensor> {
        match dim {
            Some(d) => {
                let d = self::dim(d, self.tensor.rank())?;
                self.unary(py, move |t| t.squeeze(d))
            }
            None => {
                let s: Vec<usize> = self
                    .tensor
                    .dims()
                    .iter()
                    .copied()
                    .filter(|&n| n != 1)
                    .collect();
                self.unary(py, move |t| t.reshape(s))
            }
        }
    }
    #[pyo3(signature = (*shape))]
    fn broadcast_to(&self, py: Python<'_>, shape: &Bound<'_, PyTuple>) -> PyResult<PyTensor> {
        let s = shape_arg(shape, None)?;
        self.unary(py, move |t| t.broadcast_as(s))
    }
    fn narrow(&self, py: Python<'_>, d: isize, start: usize, length: usize) -> PyResult<PyTensor> {
        let d = dim(d, self.tensor.rank())?;
        self.unary(py, move |t| t.narrow(d, start, length))
    }
    /// A contiguous copy if the tensor is not contiguous.
    fn contiguous(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.unary(py, |t| t.contiguous())
    }
    /// The tensor flattened to one dimension.
    fn flatten(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.unary(py, |t| t.flatten_all())
    }

    /// `x[i]`, `x[a:b]`, `x[i, a:b, ...]`, and `x[index_tensor]` (along dim 0).
    fn __getitem__(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<PyTensor> {
        if let Ok(idx) = key.cast::<PyTensor>() {
            let idx = idx.get().tensor.clone();
            return self.unary(py, move |t| t.index_select(&idx, 0));
        }
        let keys: Vec<Bound<'_, PyAny>> = match key.cast::<PyTuple>() {
            Ok(t) => t.iter().collect(),
            Err(_) => vec![key.clone()],
        };
        if keys.len() > self.tensor.rank() {
            return Err(PyIndexError::new_err(format!(
                "too many indices for a tensor of {} dimensions",
                self.tensor.rank()
            )));
        }
        let mut t = self.tensor.clone();
        let mut d = 0;
        for k in keys {
            let size = t.dims()[d];
            if let Ok(i) = k.extract::<isize>() {
                let j = if i < 0 { i + size as isize } else { i };
                if j < 0 || j >= size as isize {
                    return Err(PyIndexError::new_err(format!(
                        "index {i} is out of range for a dimension of size {size}"
                    )));
                }
                t = t
                    .narrow(d, j as usize, 1)
                    .and_then(|x| x.squeeze(d))
                    .map_err(value_error)?;
            } else if let Ok(s) = k.cast::<PySlice>() {
                let ind = s.indices(size as isize)?;
                if ind.step != 1 {
                    return Err(PyValueError::new_err(
                        "slices with a step other than 1 are not supported",
                    ));
                }
                let len = (ind.stop - ind.start).max(0) as usize;
                t = t
                    .narrow(d, ind.start.max(0) as usize, len)
                    .map_err(value_error)?;
                d += 1;
            } else {
                return Err(PyTypeError::new_err(format!(
                    "tensor indices must be ints, slices or an index tensor, not {}",
                    convert::describe_value(&k)
                )));
            }
        }
        Ok(wrap(t))
    }

    // --- conversion ---

    fn to_dtype(&self, py: Python<'_>, dtype: &Bound<'_, PyAny>) -> PyResult<PyTensor> {
        let d = parse_dtype(dtype)?;
        self.unary(py, move |t| t.to_dtype(d))
    }
    /// The same values, cut from the autograd graph.
    fn detach(&self) -> PyTensor {
        wrap(self.tensor.detach())
    }
    /// A copy of the values as a NumPy array (needs NumPy).
    fn numpy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_numpy(py, &self.tensor)
    }
    #[pyo3(signature = (dtype=None, copy=None))]
    fn __array__<'py>(
        &self,
        py: Python<'py>,
        dtype: Option<&Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = copy;
        let a = to_numpy(py, &self.tensor)?;
        match dtype.filter(|d| !d.is_none()) {
            Some(d) => a.call_method1("astype", (d,)),
            None => Ok(a),
        }
    }
}

impl PyTensor {
    fn float_only(&self, op: &str) -> PyResult<()> {
        if self.tensor.dtype().is_float() {
            Ok(())
        } else {
            Err(PyTypeError::new_err(format!(
                "`{op}` needs a float tensor, got {}; convert with .to_dtype(\"f32\") first",
                self.dtype()
            )))
        }
    }

    fn single_dim(&self, d: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<()> {
        match dims_arg(d, self.tensor.rank())? {
            Some(ds) if ds.len() > 1 => Err(PyValueError::new_err(format!(
                "{what} takes one dim, not {}",
                ds.len()
            ))),
            _ => Ok(()),
        }
    }
}

fn to_numpy<'py>(py: Python<'py>, t: &Tensor) -> PyResult<Bound<'py, PyAny>> {
    crate::python::ensure_numpy(py, "").map_err(|e| PyImportError::new_err(e.to_string()))?;
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

// --- module functions ---

/// `pyop.tensor(obj, dtype=None)`: a tensor from a number, a (nested) list, a NumPy array or a
/// tensor, on the running op's device.
#[pyfunction]
#[pyo3(signature = (obj, dtype=None))]
fn tensor(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyTensor> {
    let dtype = dtype
        .filter(|d| !d.is_none())
        .map(parse_dtype)
        .transpose()?;
    if let Ok(t) = obj.cast::<PyTensor>() {
        let t = t.get().tensor.clone();
        let t = match dtype {
            Some(d) => t.to_dtype(d).map_err(value_error)?,
            None => t,
        };
        return Ok(wrap(t));
    }
    // NumPy arrays keep their own dtype, then convert (a requested dtype is a conversion here, not
    // a check as for outputs).
    let t = match convert::to_tensor(py, obj, None) {
        Ok(Some(t)) => t,
        Ok(None) => {
            return Err(PyTypeError::new_err(format!(
                "cannot make a tensor from {}",
                convert::describe_value(obj)
            )))
        }
        Err(msg) => return Err(PyValueError::new_err(msg)),
    };
    let t = match dtype {
        Some(d) if d != t.dtype() => {
            if obj.cast::<numpy::PyUntypedArray>().is_ok() {
                t.to_dtype(d).map_err(value_error)?
            } else {
                match convert::to_tensor(py, obj, Some(d)) {
                    Ok(Some(t)) => t,
                    Ok(None) => unreachable!("converted above"),
                    Err(msg) => return Err(PyValueError::new_err(msg)),
                }
            }
        }
        _ => t,
    };
    Ok(wrap(t.to_device(&current_device()).map_err(value_error)?))
}

fn dtype_or(dtype: Option<&Bound<'_, PyAny>>, default: DType) -> PyResult<DType> {
    dtype
        .filter(|d| !d.is_none())
        .map(parse_dtype)
        .transpose()
        .map(|d| d.unwrap_or(default))
}

fn shape_of(shape: &Bound<'_, PyAny>) -> PyResult<Shape> {
    if let Ok(n) = shape.extract::<usize>() {
        return Ok(Shape::from(n));
    }
    Ok(Shape::from(shape.extract::<Vec<usize>>()?))
}

/// `pyop.zeros(shape, dtype="f32")` on the running op's device.
#[pyfunction]
#[pyo3(signature = (shape, dtype=None))]
fn zeros(shape: &Bound<'_, PyAny>, dtype: Option<&Bound<'_, PyAny>>) -> PyResult<PyTensor> {
    Tensor::zeros(
        shape_of(shape)?,
        dtype_or(dtype, DType::F32)?,
        &current_device(),
    )
    .map(wrap)
    .map_err(value_error)
}

/// `pyop.ones(shape, dtype="f32")` on the running op's device.
#[pyfunction]
#[pyo3(signature = (shape, dtype=None))]
fn ones(shape: &Bound<'_, PyAny>, dtype: Option<&Bound<'_, PyAny>>) -> PyResult<PyTensor> {
    Tensor::ones(
        shape_of(shape)?,
        dtype_or(dtype, DType::F32)?,
        &current_device(),
    )
    .map(wrap)
    .map_err(value_error)
}

/// `pyop.full(shape, value, dtype=None)`: dtype from the value (f32, i64 or u8) unless given.
#[pyfunction]
#[pyo3(signature = (shape, value, dtype=None))]
fn full(
    py: Python<'_>,
    shape: &Bound<'_, PyAny>,
    value: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyTensor> {
    let one = tensor(py, value, dtype)?;
    let shape = shape_of(shape)?;
    one.tensor
        .reshape(())
        .and_then(|t| t.broadcast_as(shape))
        .and_then(|t| t.contiguous())
        .map(wrap)
        .map_err(value_error)
}

/// `pyop.zeros_like(x, dtype=None)`.
#[pyfunction]
#[pyo3(signature = (x, dtype=None))]
fn zeros_like(x: &Bound<'_, PyTensor>, dtype: Option<&Bound<'_, PyAny>>) -> PyResult<PyTensor> {
    let t = &x.get().tensor;
    Tensor::zeros(t.shape(), dtype_or(dtype, t.dtype())?, t.device())
        .map(wrap)
        .map_err(value_error)
}

/// `pyop.ones_like(x, dtype=None)`.
#[pyfunction]
#[pyo3(signature = (x, dtype=None))]
fn ones_like(x: &Bound<'_, PyTensor>, dtype: Option<&Bound<'_, PyAny>>) -> PyResult<PyTensor> {
    let t = &x.get().tensor;
    Tensor::ones(t.shape(), dtype_or(dtype, t.dtype())?, t.device())
        .map(wrap)
        .map_err(value_error)
}

/// `pyop.arange(start, end, step=1, dtype=None)` (or `arange(end)`).
#[pyfunction]
#[pyo3(signature = (start, end=None, step=None, dtype=None))]
fn arange(
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
    Tensor::arange_step(lo, hi, step, &current_device())
        .and_then(|t| t.to_dtype(d))
        .map(wrap)
        .map_err(value_error)
}

fn tensors_of(ts: &Bound<'_, PyAny>) -> PyResult<Vec<Tensor>> {
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

/// `pyop.cat(tensors, dim=0)`.
#[pyfunction]
#[pyo3(signature = (tensors, dim=0))]
fn cat(py: Python<'_>, tensors: &Bound<'_, PyAny>, dim: isize) -> PyResult<PyTensor> {
    let ts = tensors_of(tensors)?;
    let rank = ts.first().map_or(1, |t| t.rank());
    let d = self::dim(dim, rank)?;
    let n = ts.iter().map(|t| t.elem_count()).sum();
    compute(py, n, || Tensor::cat(&ts, d)).map(wrap)
}

/// `pyop.stack(tensors, dim=0)`.
#[pyfunction]
#[pyo3(signature = (tensors, dim=0))]
fn stack(py: Python<'_>, tensors: &Bound<'_, PyAny>, dim: isize) -> PyResult<PyTensor> {
    let ts = tensors_of(tensors)?;
    let rank = ts.first().map_or(0, |t| t.rank());
    let d = self::dim(dim, rank + 1)?;
    let n = ts.iter().map(|t| t.elem_count()).sum();
    compute(py, n, || Tensor::stack(&ts, d)).map(wrap)
}

/// `pyop.where(cond, x, y)`: `x` where `cond` is nonzero, else `y`, broadcasting all three;
/// `x` or `y` may be a number.
#[pyfunction(name = "where")]
fn where_(
    py: Python<'_>,
    cond: &Bound<'_, PyTensor>,
    x: &Bound<'_, PyAny>,
    y: &Bound<'_, PyAny>,
) -> PyResult<PyTensor> {
    let c = cond.get().tensor.clone();
    let (x, y) = match (x.cast::<PyTensor>(), y.cast::<PyTensor>()) {
        (Ok(a), _) => {
            let a = a.get();
            let b = a
                .operand(py, y)?
                .ok_or_else(|| PyTypeError::new_err("where() takes tensors or numbers"))?;
            (a.tensor.clone(), b)
        }
        (_, Ok(b)) => {
            let b = b.get();
            let a = b
                .operand(py, x)?
                .ok_or_else(|| PyTypeError::new_err("where() takes tensors or numbers"))?;
            (a, b.tensor.clone())
        }
        _ => {
            return Err(PyTypeError::new_err(
                "where() needs at least one of x and y to be a tensor",
            ))
        }
    };
    let n = c.elem_count().max(x.elem_count()).max(y.elem_count());
    compute(py, n, || {
        let s = c.shape().broadcast_shape_binary_op(x.shape(), "where")?;
        let s = s.broadcast_shape_binary_op(y.shape(), "where")?;
        c.broadcast_as(s.clone())?
            .where_cond(&x.broadcast_as(s.clone())?, &y.broadcast_as(s)?)
    })
    .map(wrap)
}

// --- errors between Rust and Python ---

/// The kind of the pyop error a `pyop.RustError` carries.
#[pyclass(frozen)]
struct ErrorKindBox(crate::error::ErrorKind);

/// A Python exception (`pyop.RustError`) carrying `err`, for Rust code called from a body: an op
/// whose body lets it pass reports it with its kind kept and the body's traceback added.
pub fn error_to_python(err: Error) -> PyErr {
    Python::attach(|py| {
        let e = RustError::new_err(err.to_string());
        if let Ok(b) = Bound::new(py, ErrorKindBox(err.kind())) {
            let _ = e.value(py).setattr("_pyop_kind", b);
        }
        e
    })
}

/// The kind of the pyop error inside a `pyop.RustError`, if `err` is one.
pub(crate) fn rust_error_kind(py: Python<'_>, err: &PyErr) -> Option<crate::error::ErrorKind> {
    if !err.is_instance_of::<RustError>(py) {
        return None;
    }
    let boxed = err.value(py).getattr("_pyop_kind").ok()?;
    Some(boxed.cast::<ErrorKindBox>().ok()?.get().0)
}

pub(crate) fn is_timeout(py: Python<'_>, err: &PyErr) -> bool {
    err.is_instance_of::<OpTimeout>(py)
}

/// What the conversion layer needs of NumPy, looked up once.
pub(crate) struct NumpyRefs {
    /// `numpy.generic`, the type of NumPy scalars.
    pub generic: Py<PyAny>,
    /// `numpy.asarray`.
    pub asarray: Py<PyAny>,
}

static NUMPY_REFS: pyo3::sync::PyOnceLock<NumpyRefs> = pyo3::sync::PyOnceLock::new();

/// NumPy, if something already imported it (tensor mode never imports NumPy itself). Once it
/// is, the answer is cached: this runs on every output conversion.
pub(crate) fn numpy_if_loaded(py: Python<'_>) -> PyResult<Option<&'static NumpyRefs>> {
    if let Some(refs) = NUMPY_REFS.get(py) {
        return Ok(Some(refs));
    }
    let modules = py.import("sys")?.getattr("modules")?;
    let np = modules.call_method1("get", ("numpy",))?;
    if np.is_none() || !np.hasattr("ndarray")? {
        return Ok(None); // absent, or still being imported
    }
    let refs = NumpyRefs {
        generic: np.getattr("generic")?.unbind(),
        asarray: np.getattr("asarray")?.unbind(),
    };
    Ok(Some(NUMPY_REFS.get_or_init(py, || refs)))
}

/// Module-level forms of the methods (`pyop.log(x)` as well as `x.log()`); numbers become tensors.
const MODULE_GLUE: &str = r#"
def _method(name):
    def f(x, *args, **kwargs):
        if not isinstance(x, Tensor):
            x = tensor(x)
        return getattr(x, name)(*args, **kwargs)
    f.__name__ = f.__qualname__ = name
    f.__doc__ = "pyop.%s(x, ...) is x.%s(...)" % (name, name)
    return f

for _name in ("abs", "exp", "log", "sqrt", "square", "sin", "cos", "tanh", "relu", "sigmoid",
              "erf", "gelu", "silu", "floor", "ceil", "round", "sign", "recip", "clamp",
              "sum", "mean", "max", "min", "argmax", "argmin", "reshape", "transpose", "t",
              "unsqueeze", "squeeze", "broadcast_to", "narrow", "to_dtype", "detach", "flatten",
              "contiguous", "numpy", "tolist"):
    globals()[_name] = _method(_name)

def _commutative(name):
    def f(a, b):
        if isinstance(a, Tensor):
            return getattr(a, name)(b)
        if isinstance(b, Tensor):
            return getattr(b, name)(a)
        return getattr(tensor(a), name)(b)
    f.__name__ = f.__qualname__ = name
    return f

maximum = _commutative("maximum")
minimum = _commutative("minimum")

def matmul(a, b):
    return a @ b


import importlib.abc as _abc
import importlib.util as _util
import sys as _sys


class _EmbeddedPackage(_abc.MetaPathFinder, _abc.Loader):
    """Serves a package embedded in the binary (`#[py_op(package = ...)]`) from memory."""

    def __init__(self, name, root, files):
        self.name, self.root, self.files = name, root, dict(files)

    def _locate(self, fullname):
        if fullname == self.name:
            return "__init__.py", True
        if not fullname.startswith(self.name + "."):
            return None
        rel = fullname[len(self.name) + 1:].replace(".", "/")
        if rel + "/__init__.py" in self.files:
            return rel + "/__init__.py", True
        if rel + ".py" in self.files:
            return rel + ".py", False
        return None

    def find_spec(self, fullname, path=None, target=None):
        found = self._locate(fullname)
        if found is None:
            return None
        rel, is_package = found
        spec = _util.spec_from_loader(fullname, self, origin=self.root + "/" + rel, is_package=is_package)
        spec.has_location = True
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        rel, _ = self._locate(module.__name__)
        filename = self.root + "/" + rel
        module.__file__ = filename
        exec(compile(self.files.get(rel, ""), filename, "exec"), module.__dict__)

    def get_source(self, fullname):
        found = self._locate(fullname)
        return None if found is None else self.files.get(found[0], "")


_packages = {}


def _install_package(name, root, files, replace):
    finder = _packages.get(name)
    if finder is None:
        finder = _packages[name] = _EmbeddedPackage(name, root, files)
        _sys.meta_path.insert(0, finder)
    elif replace and finder.files != dict(files):
        finder.files = dict(files)
        for key in [k for k in _sys.modules if k == name or k.startswith(name + ".")]:
            del _sys.modules[key]

del _name
"#;

/// Creates the `pyop` module and puts it in `sys.modules`.
pub(crate) fn register_module(py: Python<'_>) -> PyResult<()> {
    let m = PyModule::new(py, "pyop")?;
    m.add_class::<PyTensor>()?;
    m.add("OpTimeout", py.get_type::<OpTimeout>())?;
    m.add("RustError", py.get_type::<RustError>())?;
    m.add_function(wrap_pyfunction!(tensor, &m)?)?;
    m.add_function(wrap_pyfunction!(zeros, &m)?)?;
    m.add_function(wrap_pyfunction!(ones, &m)?)?;
    m.add_function(wrap_pyfunction!(full, &m)?)?;
    m.add_function(wrap_pyfunction!(zeros_like, &m)?)?;
    m.add_function(wrap_pyfunction!(ones_like, &m)?)?;
    m.add_function(wrap_pyfunction!(arange, &m)?)?;
    m.add_function(wrap_pyfunction!(cat, &m)?)?;
    m.add_function(wrap_pyfunction!(stack, &m)?)?;
    m.add_function(wrap_pyfunction!(where_, &m)?)?;
    // Compiled under the name `<pyop>`, so that tracebacks can leave pyop's own frames out.
    let builtins = py.import("builtins")?;
    let glue =
        builtins
            .getattr("compile")?
            .call1((MODULE_GLUE, crate::python::PYOP_FRAMES, "exec"))?;
    builtins.getattr("exec")?.call1((glue, m.dict()))?;
    let rust = PyModule::new(py, "pyop.rust")?;
    rust.setattr(
        "__doc__",
        "Rust functions exposed to bodies with pyop::expose.",
    )?;
    m.add("rust", &rust)?;
    let modules = py.import("sys")?.getattr("modules")?;
    modules.set_item("pyop.rust", rust)?;
    modules.set_item("pyop", m)?;
    Ok(())
}
