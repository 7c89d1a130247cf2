//! [`Value`]: what passes between a body and an exposed Rust function, both ways.

use candle_core::Tensor;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyList, PyString, PyTuple};

use super::numbers::{to_tensor, ConversionError};
use super::tensor::PyTensor;
use crate::error::{Error, ErrorKind, Result};

/// A value passed between a body and an exposed Rust function ([`expose`](crate::expose)).
///
/// ```
/// use pyop::Value;
///
/// // What a body's `pyop.rust.scale([1, 2], 0.5, name="x")`-style arguments look like in Rust:
/// let args = vec![Value::List(vec![Value::I64(1), Value::I64(2)]), Value::F64(0.5)];
/// assert_eq!(args[1].f64()?, 0.5);
/// assert_eq!(Value::I64(3).f64()?, 3.0); // ints widen to f64
/// let err = args[0].tensor().unwrap_err(); // the wrong kind of value is an error, not a panic
/// assert_eq!(err.kind(), pyop::ErrorKind::InvalidArgument);
/// # Ok::<(), pyop::Error>(())
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Value {
    /// Python `None`.
    None,
    /// A `bool`.
    Bool(bool),
    /// An `int` that fits in i64.
    I64(i64),
    /// A `float`.
    F64(f64),
    /// A `str`.
    Str(String),
    /// A `pyop.Tensor`, or a NumPy array (an input's own view is the input itself; any other
    /// array is copied).
    Tensor(Tensor),
    /// A Python list or tuple.
    List(Vec<Value>),
}

impl Value {
    /// The tensor, or an error naming what was passed instead.
    pub fn tensor(&self) -> Result<&Tensor> {
        match self {
            Value::Tensor(t) => Ok(t),
            other => Err(wrong("a tensor", other)),
        }
    }

    /// The number as f64 (ints and bools convert).
    pub fn f64(&self) -> Result<f64> {
        match self {
            Value::F64(v) => Ok(*v),
            Value::I64(v) => Ok(*v as f64),
            Value::Bool(v) => Ok(*v as u8 as f64),
            other => Err(wrong("a number", other)),
        }
    }

    /// The integer.
    pub fn i64(&self) -> Result<i64> {
        match self {
            Value::I64(v) => Ok(*v),
            Value::Bool(v) => Ok(*v as i64),
            other => Err(wrong("an int", other)),
        }
    }

    /// The string.
    pub fn str(&self) -> Result<&str> {
        match self {
            Value::Str(s) => Ok(s),
            other => Err(wrong("a str", other)),
        }
    }
}

impl From<Tensor> for Value {
    fn from(t: Tensor) -> Self {
        Value::Tensor(t)
    }
}

fn wrong(what: &str, got: &Value) -> Error {
    Error::op_failure(
        "",
        ErrorKind::InvalidArgument,
        format!("expected {what}, got {got:?}"),
    )
}

/// How deeply lists may nest in an argument of a Rust function (Python's own recursion limit is
/// about 1000 frames; the conversion recurses once per level).
const MAX_NESTING: usize = 256;

pub(crate) fn from_python(py: Python<'_>, v: &Bound<'_, PyAny>) -> PyResult<Value> {
    // A list can hold one item many times (`[v, v]`), so a few bytes of Python can name more
    // values than memory holds: they are counted first (each list once, so that costs what the
    // Python objects do), and their memory checked as every allocation a body controls is.
    let values = count_values(v, 0, &mut std::collections::HashMap::new());
    let bytes = values.and_then(|n| n.checked_mul(std::mem::size_of::<Value>()));
    crate::alloc::check(bytes, candle_core::DType::U8)
        .map_err(crate::bridge::numbers::ConversionError::from)?;
    // No more values are made than were counted (a leaf's conversion runs Python code, which
    // could put longer lists where counted ones were).
    from_python_at(py, v, 0, &mut values.unwrap_or(0))
}

/// The items of a list or tuple, read at C level; `None` for anything else.
fn items<'py>(v: &Bound<'py, PyAny>) -> Option<Vec<Bound<'py, PyAny>>> {
    if let Ok(list) = v.cast::<PyList>() {
        Some(list.iter().collect())
    } else if let Ok(tuple) = v.cast::<PyTuple>() {
        Some(tuple.iter().collect())
    } else {
        None
    }
}

/// How many values `v` becomes (`None`: more than a `usize` counts), each list and tuple counted
/// once however often it is held (`seen`, by address: they are alive while `v` is).
fn count_values(
    v: &Bound<'_, PyAny>,
    depth: usize,
    seen: &mut std::collections::HashMap<usize, Option<usize>>,
) -> Option<usize> {
    let Some(items) = items(v) else {
        return Some(1);
    };
    // Deeper than the walk goes: it refuses it, whatever the count.
    if depth >= MAX_NESTING {
        return Some(1);
    }
    let at = v.as_ptr() as usize;
    if let Some(&n) = seen.get(&at) {
        return n;
    }
    let n = items.iter().try_fold(1usize, |n, item| {
        n.checked_add(count_values(item, depth + 1, seen)?)
    });
    seen.insert(at, n);
    n
}

fn from_python_at(
    py: Python<'_>,
    v: &Bound<'_, PyAny>,
    depth: usize,
    left: &mut usize,
) -> PyResult<Value> {
    let Some(rest) = left.checked_sub(1) else {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "the lists passed to Rust changed while they were read",
        ));
    };
    *left = rest;
    if v.is_none() {
        return Ok(Value::None);
    }
    if let Ok(t) = v.cast::<PyTensor>() {
        return Ok(Value::Tensor(t.get().tensor().clone()));
    }
    if v.is_instance_of::<PyBool>() {
        return Ok(Value::Bool(v.extract()?));
    }
    if v.is_exact_instance_of::<PyInt>() {
        return Ok(Value::I64(v.extract()?));
    }
    if v.is_exact_instance_of::<PyFloat>() {
        return Ok(Value::F64(v.extract()?));
    }
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(Value::Str(s.to_string()));
    }
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        if depth >= MAX_NESTING {
            return Err(pyo3::exceptions::PyRecursionError::new_err(format!(
                "lists nested more than {MAX_NESTING} levels deep cannot be passed to Rust"
            )));
        }
        // The items as counted (at C level: a subclass's `__iter__` is not asked, or it could
        // name more values than were counted).
        return items(v)
            .unwrap_or_default()
            .iter()
            .map(|x| from_python_at(py, x, depth + 1, left))
            .collect::<PyResult<_>>()
            .map(Value::List);
    }
    match to_tensor(py, v, None) {
        Ok(t) => Ok(Value::Tensor(t)),
        Err(ConversionError::NotTensorLike(what)) => {
            Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "a Rust function takes tensors, arrays, numbers, str, None and lists of them, not \
                 {what}"
            )))
        }
        Err(e) => Err(e.into()),
    }
}

pub(crate) fn to_python(py: Python<'_>, v: Value) -> PyResult<Bound<'_, PyAny>> {
    Ok(match v {
        Value::None => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, b).to_owned().into_any(),
        Value::I64(i) => PyInt::new(py, i).into_any(),
        Value::F64(f) => PyFloat::new(py, f).into_any(),
        Value::Str(s) => PyString::new(py, &s).into_any(),
        Value::Tensor(t) => Bound::new(py, PyTensor::new(t))?.into_any(),
        Value::List(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_python(py, item)?)?;
            }
            list.into_any()
        }
    })
}
