//! The Python positional arguments of a call.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyList, PyString, PyTuple};

use super::prepare::{Passing, Prepared};
use super::view::numpy_view;
use crate::arg::Arg;
use crate::bridge::tensor::PyTensor;

/// How `&[Tensor]` arguments reach Python: a list for the body, a tuple for a gradient.
#[derive(Clone, Copy)]
pub(crate) enum Lists {
    AsLists,
    AsTuples,
}

/// The Python positional arguments of a call: every argument in declaration order.
pub(crate) fn python_args<'py>(
    py: Python<'py>,
    passing: Passing,
    args: &[Arg<'_>],
    prepared: &[Prepared],
    lists: Lists,
) -> PyResult<Bound<'py, PyTuple>> {
    let mut next = prepared.iter();
    let mut tensor = |py: Python<'py>| -> PyResult<Bound<'py, PyAny>> {
        let p = next.next().expect("one prepared input per tensor");
        match passing {
            Passing::Views => numpy_view(py, p),
            Passing::Tensors | Passing::Dlpack => {
                Ok(Bound::new(py, PyTensor::new(p.tensor.clone()))?.into_any())
            }
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
            Arg::U64(v) => v.into_pyobject(py)?.into_any(),
            Arg::Usizes(v) => PyList::new(py, v.iter())?.into_any(),
            Arg::F32s(v) => PyList::new(py, v.iter().map(|&f| f64::from(f)))?.into_any(),
            Arg::None => py.None().into_bound(py),
        });
    }
    PyTuple::new(py, items)
}
