//! How `pyop.Tensor`'s methods (`methods`) run candle ops: unary ops, views, binary ops with
//! Python numbers or tensors, arithmetic, reductions and their argument checks, shared by the
//! one `#[pymethods]` block.

use candle_core::{DType, Tensor};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::checked::{
    allocatable, broadcast_count, check_int_range, elem_count, exact_i64, int_overflow,
    matmul_count, result_count,
};
use super::compute::{compute, value_error, wrap, CResult};
use super::kernels::matmul;
use super::parse::{device_name, dims_arg};
use super::PyTensor;
use crate::bridge::numbers::{to_tensor, ConversionError};

impl PyTensor {
    pub(super) fn n(&self) -> usize {
        self.tensor().elem_count()
    }

    /// Runs a unary candle op.
    pub(super) fn unary(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Tensor) -> CResult<Tensor> + Send,
    ) -> PyResult<PyTensor> {
        let t = self.tensor();
        allocatable(Some(self.n()), t.dtype(), "the result")?;
        compute(py, self.n(), || f(t)).map(|r| self.derived(r))
    }

    /// Runs a candle op that makes a view of the tensor (same storage, new layout: `narrow`,
    /// `transpose`, `squeeze`, `unsqueeze`, `broadcast_as`), which allocates nothing, so needs no
    /// allocation check: a huge broadcast tensor can still be cut and turned.
    pub(super) fn view(&self, f: impl FnOnce(&Tensor) -> CResult<Tensor>) -> PyResult<PyTensor> {
        f(self.tensor())
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
        let dtype = self.tensor().dtype();
        if dtype == DType::I64 {
            allocatable(Some(self.n()), DType::I64, "the result")?;
            let values = self
                .tensor()
                .flatten_all()
                .and_then(|t| t.to_vec1::<i64>())
                .map_err(value_error)?;
            if values.iter().any(|&v| exact(v).is_none()) {
                return Err(int_overflow(what, dtype));
            }
        } else if !dtype.is_float() {
            allocatable(Some(self.n()), DType::F64, "the result")?;
            let t = self.tensor();
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
        if !self.tensor().dtype().is_float() {
            return Err(PyTypeError::new_err(format!(
                "{name}() needs a float tensor, got {}; convert with .to_dtype(\"f32\") first",
                self.tensor().dtype().as_str()
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
            let o = o.get().tensor();
            if !o.device().same_device(self.tensor().device()) {
                return Err(PyValueError::new_err(format!(
                    "tensors on different devices: {} and {}",
                    device_name(self.tensor().device()),
                    device_name(o.device())
                )));
            }
            return Ok(Some(o.clone()));
        }
        match to_tensor(py, other, Some(self.tensor().dtype())) {
            Ok(t) => Ok(Some(
                t.to_device(self.tensor().device()).map_err(value_error)?,
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
            (o, self.tensor())
        } else {
            (self.tensor(), o)
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
        allocatable(Some(n), self.tensor().dtype(), "the result")?;
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
        let dtype = self.tensor().dtype();
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
        let t = self.tensor();
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
        self.tensor()
            .flatten_all()
            .and_then(|t| t.get(0))
            .map_err(value_error)
    }
}

impl PyTensor {
    pub(super) fn float_only(&self, op: &str) -> PyResult<()> {
        if self.tensor().dtype().is_float() {
            Ok(())
        } else {
            Err(PyTypeError::new_err(format!(
                "`{op}` needs a float tensor, got {}; convert with .to_dtype(\"f32\") first",
                self.tensor().dtype().as_str()
            )))
        }
    }

    pub(super) fn single_dim(&self, d: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<()> {
        match dims_arg(d, self.tensor().rank())? {
            Some(ds) if ds.len() > 1 => Err(PyValueError::new_err(format!(
                "{what} takes one dim, not {}",
                ds.len()
            ))),
            _ => Ok(()),
        }
    }
}
