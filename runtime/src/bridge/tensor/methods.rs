//! The one `#[pymethods]` block of `pyop.Tensor`, as pyo3 recommends (no `multiple-pymethods`).

use candle_core::{DType, Device};
use pyo3::exceptions::{PyIndexError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pyclass::CompareOp;
use pyo3::types::{PyFloat, PyInt, PyList, PySlice, PyTuple};

use super::checked::*;
use super::compute::*;
use super::kernels::*;
use super::parse::*;
use super::values::*;
use super::PyTensor;

#[pymethods]
impl PyTensor {
    // --- shape and kind ---

    /// The shape, as a tuple.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.tensor().dims())
    }

    /// The dtype's name, as candle names it (`"f32"`).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.tensor().dtype().as_str()
    }

    /// `"cpu"` or `"cuda:N"`.
    #[getter]
    fn device(&self) -> String {
        device_name(self.tensor().device())
    }

    #[getter]
    fn ndim(&self) -> usize {
        self.tensor().rank()
    }

    /// The number of elements.
    fn numel(&self) -> usize {
        self.n()
    }

    fn __len__(&self) -> PyResult<usize> {
        self.tensor()
            .dims()
            .first()
            .copied()
            .ok_or_else(|| PyTypeError::new_err("len() of a 0-d tensor"))
    }

    fn __repr__(&self) -> String {
        format!(
            "pyop.Tensor({}, dtype={}, device={})",
            self.tensor(),
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

    /// As Python's `int()`: a float's exact integer part, `ValueError` for NaN and
    /// `OverflowError` for infinities (never a saturated i64).
    fn __int__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let t = self.one_element("int()")?;
        if t.dtype().is_float() {
            let v = t
                .to_dtype(DType::F64)
                .and_then(|t| t.to_scalar::<f64>())
                .map_err(value_error)?;
            pyo3::types::PyFloat::new(py, v).call_method0("__int__")
        } else {
            Ok(t.to_dtype(DType::I64)
                .and_then(|t| t.to_scalar::<i64>())
                .map_err(value_error)?
                .into_pyobject(py)?
                .into_any())
        }
    }

    /// The value of a one-element tensor as a Python number.
    fn item<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let t = self.one_element("item()")?;
        item(py, &t)
    }

    /// The values as (nested) Python lists.
    fn tolist<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        // The values in 64 bits, and a list entry for each.
        allocatable(self.n().checked_mul(2), DType::F64, "the list")?;
        let t = self.tensor().to_device(&Device::Cpu).map_err(value_error)?;
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

    fn __add__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        self.arith(py, o, false, "+", |a, b| a.broadcast_add(b))
    }
    fn __radd__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        self.arith(py, o, true, "+", |a, b| a.broadcast_add(b))
    }
    fn __sub__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        self.arith(py, o, false, "-", |a, b| a.broadcast_sub(b))
    }
    fn __rsub__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        self.arith(py, o, true, "-", |a, b| a.broadcast_sub(b))
    }
    fn __mul__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        self.arith(py, o, false, "*", |a, b| a.broadcast_mul(b))
    }
    fn __rmul__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        self.arith(py, o, true, "*", |a, b| a.broadcast_mul(b))
    }
    fn __truediv__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        self.float_only("/")?;
        self.binary(py, o, false, |a, b| a.broadcast_div(b))
    }
    fn __rtruediv__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        self.float_only("/")?;
        self.binary(py, o, true, |a, b| a.broadcast_div(b))
    }
    fn __matmul__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        self.matmul_with(py, o, false)
    }
    fn __rmatmul__(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        self.matmul_with(py, o, true)
    }

    fn __pow__(
        &self,
        py: Python<'_>,
        o: &Bound<'_, PyAny>,
        modulo: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        if modulo.is_some_and(|m| !m.is_none()) {
            return Err(PyTypeError::new_err(
                "pow() with a modulus is not supported for tensors",
            ));
        }
        if o.cast::<PyTensor>().is_err() {
            if let Ok(s) = crate::bridge::numbers::scalar(o) {
                let e = match s {
                    crate::bridge::numbers::Scalar::Bool(b) => b as u8 as f64,
                    crate::bridge::numbers::Scalar::Int(i) => i as f64,
                    crate::bridge::numbers::Scalar::UInt(u) => u as f64,
                    crate::bridge::numbers::Scalar::Float(f) => f,
                };
                if self.tensor().dtype().is_float() {
                    let r = self.unary(py, move |t| if e == 2.0 { t.sqr() } else { t.powf(e) })?;
                    return Ok(Bound::new(py, r)?.into_any().unbind());
                }
                if e >= 0.0 && e.fract() == 0.0 {
                    let exp = u32::try_from(e as u64).ok();
                    let r = self.int_checked(
                        py,
                        "**",
                        move |t| {
                            if t.dtype().is_float() {
                                t.powf(e)
                            } else {
                                powi(t, e as u64)
                            }
                        },
                        move |v| exp.and_then(|e| v.checked_pow(e)),
                    )?;
                    return Ok(Bound::new(py, r)?.into_any().unbind());
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
    ) -> PyResult<Py<PyAny>> {
        self.float_only("**")?;
        self.binary(py, o, true, |a, b| a.broadcast_pow(b))
    }

    fn __neg__(&self, py: Python<'_>) -> PyResult<PyTensor> {
        if self.tensor().dtype().is_float() {
            self.unary(py, |t| t.neg())
        } else {
            self.int_checked(
                py,
                "negation",
                |t| t.zeros_like()?.broadcast_sub(t),
                i64::checked_neg,
            )
        }
    }

    fn __pos__(&self) -> PyTensor {
        wrap(self.tensor().clone())
    }

    fn __abs__(&self, py: Python<'_>) -> PyResult<PyTensor> {
        match self.tensor().dtype() {
            d if d.is_float() => self.unary(py, |t| t.abs()),
            // Unsigned values are their own absolute values.
            DType::U8 | DType::U32 => Ok(wrap(self.tensor().clone())),
            // candle's unary kernels are float-only: |t| = max(t, 0 - t) for signed integers,
            // checked (|i64::MIN| does not fit).
            _ => self.int_checked(
                py,
                "abs()",
                |t| {
                    if t.dtype().is_float() {
                        t.abs()
                    } else {
                        t.maximum(&t.zeros_like()?.sub(t)?)
                    }
                },
                i64::checked_abs,
            ),
        }
    }

    fn __richcmp__(
        &self,
        py: Python<'_>,
        o: &Bound<'_, PyAny>,
        op: CompareOp,
    ) -> PyResult<Py<PyAny>> {
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
        if self.tensor().dtype().is_float() {
            self.unary(py, |t| t.relu())
        } else {
            self.unary(py, |t| t.maximum(&t.zeros_like()?))
        }
    }
    fn sigmoid(&self, py: Python<'_>) -> PyResult<PyTensor> {
        self.math(py, "sigmoid", sigmoid)
    }
    /// The error function.
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
        self.binary_op(py, o, false, |a, b| a.broadcast_maximum(b))?
            .ok_or_else(|| PyTypeError::new_err("maximum() takes a tensor or a number"))
    }

    /// Elementwise minimum with a tensor or number (broadcasting).
    fn minimum(&self, py: Python<'_>, o: &Bound<'_, PyAny>) -> PyResult<PyTensor> {
        self.binary_op(py, o, false, |a, b| a.broadcast_minimum(b))?
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
        let mut r = PyTensor::new(self.tensor().clone());
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
        let dtype = self.tensor().dtype();
        if dtype.is_float() {
            return self.reduce(py, dim, keepdim, |t, d| t.sum_keepdim(d));
        }
        // Integers: summed in i64 (no partial sum overflows a narrower dtype), range-checked
        // in f64 first, then given back in the tensor's own dtype.
        let wide = self.reduce(py, dim, keepdim, |t, d| {
            t.to_dtype(DType::F64)?.sum_keepdim(d)
        })?;
        check_int_range(wide.tensor(), dtype, "sum()")?;
        let sum = self.reduce(py, dim, keepdim, |t, d| {
            t.to_dtype(DType::I64)?.sum_keepdim(d)
        })?;
        sum.tensor().to_dtype(dtype).map(wrap).map_err(value_error)
    }
    #[pyo3(signature = (dim=None, keepdim=false))]
    fn mean(
        &self,
        py: Python<'_>,
        dim: Option<&Bound<'_, PyAny>>,
        keepdim: bool,
    ) -> PyResult<PyTensor> {
        // candle's integer mean truncates (1/n is 0 in an integer dtype): float-only, like the
        // other float math.
        self.float_only("mean()")?;
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
    fn transpose(&self, dim0: isize, dim1: isize) -> PyResult<PyTensor> {
        let (a, b) = (
            dim(dim0, self.tensor().rank())?,
            dim(dim1, self.tensor().rank())?,
        );
        self.view(move |t| t.transpose(a, b))
    }
    /// The transpose of the last two dims (a 0-d or 1-d tensor unchanged).
    fn t(&self) -> PyResult<PyTensor> {
        if self.tensor().rank() < 2 {
            return Ok(wrap(self.tensor().clone()));
        }
        self.view(|t| t.t())
    }
    #[getter(T)]
    fn transposed(&self) -> PyResult<PyTensor> {
        self.t()
    }
    fn unsqueeze(&self, d: isize) -> PyResult<PyTensor> {
        // A new dim may go at any of rank + 1 places; the message counts the tensor's own dims.
        let rank = self.tensor().rank();
        let d = dim(d, rank + 1).map_err(|_| {
            PyIndexError::new_err(format!(
                "unsqueeze({d}) is out of range for a tensor of {rank} dimensions (a new \
                 dimension goes at -{} … {rank})",
                rank + 1
            ))
        })?;
        self.view(move |t| t.unsqueeze(d))
    }
    /// Removes `dim` (which must have size 1), or every size-1 dim.
    #[pyo3(signature = (dim=None))]
    fn squeeze(&self, py: Python<'_>, dim: Option<isize>) -> PyResult<PyTensor> {
        match dim {
            Some(d) => {
                let d = self::dim(d, self.tensor().rank())?;
                self.view(move |t| t.squeeze(d))
            }
            None => {
                let s: Vec<usize> = self
                    .tensor()
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
    fn broadcast_to(&self, shape: &Bound<'_, PyTuple>) -> PyResult<PyTensor> {
        let s = shape_arg(shape, None)?;
        self.view(move |t| t.broadcast_as(s))
    }
    fn narrow(&self, d: isize, start: usize, length: usize) -> PyResult<PyTensor> {
        let d = dim(d, self.tensor().rank())?;
        self.view(move |t| t.narrow(d, start, length))
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
            let idx = idx.get().tensor().clone();
            let t = self.tensor();
            // The result has a row of `t` for every index.
            let row = t.dims().iter().skip(1).product::<usize>();
            let n = idx.elem_count().checked_mul(row);
            allocatable(n, t.dtype(), "the result")?;
            return compute(py, n.unwrap_or(0), || t.index_select(&idx, 0)).map(wrap);
        }
        let keys: Vec<Bound<'_, PyAny>> = match key.cast::<PyTuple>() {
            Ok(t) => t.iter().collect(),
            Err(_) => vec![key.clone()],
        };
        if keys.len() > self.tensor().rank() {
            return Err(PyIndexError::new_err(format!(
                "too many indices for a tensor of {} dimensions",
                self.tensor().rank()
            )));
        }
        let mut t = self.tensor().clone();
        let mut d = 0;
        for k in keys {
            let size = t.dims()[d];
            // An int too large for isize is out of range, as in Python (`IndexError`).
            if k.is_instance_of::<pyo3::types::PyInt>() && k.extract::<isize>().is_err() {
                return Err(PyIndexError::new_err(format!(
                    "index {k} is out of range for a dimension of size {size}"
                )));
            }
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
                    crate::bridge::numbers::describe_value(&k)
                )));
            }
        }
        Ok(self.derived(t))
    }

    // --- conversion ---

    fn to_dtype(&self, py: Python<'_>, dtype: &Bound<'_, PyAny>) -> PyResult<PyTensor> {
        let d = parse_dtype(dtype)?;
        // The result is of the new dtype, which may be wider than the tensor's.
        allocatable(Some(self.n()), d, "the result")?;
        self.unary(py, move |t| t.to_dtype(d))
    }
    /// The same values, cut from the autograd graph.
    fn detach(&self) -> PyTensor {
        self.derived(self.tensor().detach())
    }
    /// A DLPack capsule of the tensor, without a copy (`copy=True` exports a copy): what
    /// `np.from_dlpack(x)`, `torch.from_dlpack(x)` and `cupy.from_dlpack(x)` call. Read-only for
    /// consumers that ask for DLPack 1.x (NumPy's arrays of it are read-only).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Some(device) = dl_device {
            if device != crate::bridge::dlpack::device_of(self.tensor()) {
                return Err(pyo3::exceptions::PyBufferError::new_err(
                    "a pyop.Tensor exports only to its own device",
                ));
            }
        }
        // A consumer reads the memory without candle's storage lock for as long as it keeps
        // the capsule's array. A tensor autograd tracks may be a `Var` or a view of one, whose
        // storage `Var::set` on another thread overwrites in place: it is exported as a snapshot
        // (taken under the storage's read lock, so all old or all new values), as numpy mode
        // snapshots such inputs. Untracked tensors are exported without a copy.
        let t = if copy == Some(true) || self.may_be_written() {
            // Only the view's own elements, copied under the storage's read lock.
            let t = self.tensor();
            compute(py, t.elem_count(), || t.force_contiguous())?
        } else {
            self.tensor().clone()
        };
        // Work candle queued on the tensor's stream is done before a consumer's stream reads it.
        crate::bridge::dlpack::export::order_for(&t, stream).map_err(value_error)?;
        crate::bridge::dlpack::export::export(
            py,
            &t,
            max_version.is_some_and(|(major, _)| major >= 1),
        )
    }
    /// `(device type, device id)` as DLPack numbers them: `(1, 0)` for the CPU, `(2, n)` for
    /// CUDA device `n`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        crate::bridge::dlpack::device_of(self.tensor())
    }
    /// A copy of the values as a NumPy array (needs NumPy).
    fn numpy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_numpy(py, self.tensor())
    }
    #[pyo3(signature = (dtype=None, copy=None))]
    fn __array__<'py>(
        &self,
        py: Python<'py>,
        dtype: Option<&Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // NumPy 2's contract: `copy=False` asks for no copy, and this always copies.
        if copy == Some(false) {
            return Err(PyValueError::new_err(
                "a pyop.Tensor cannot become a NumPy array without a copy; call np.asarray(x) or \
                 x.numpy(), which copy",
            ));
        }
        let a = to_numpy(py, self.tensor())?;
        match dtype.filter(|d| !d.is_none()) {
            Some(d) => a.call_method1("astype", (d,)),
            None => Ok(a),
        }
    }
}
