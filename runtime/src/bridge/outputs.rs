//! The one output check: a body's (or gradient's) return value against `tout`, by one rule table
//! for every mode, turned into tensors on the op's device.

use candle_core::{Device, Tensor};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::arg::Arg;
use crate::error::{Error, ErrorKind, Result};
use crate::spec::OutSpec;
use candle_core::DType;

use super::numbers::{describe_value, to_tensor, ConversionError};
use super::tensor::PyTensor;

/// A call's output tensors, held inline for the usual one or two (`PyOp::call` hands out a `Vec`;
/// the functions `#[py_op]` writes take them from here without one).
pub type Outputs = smallvec::SmallVec<[Tensor; 2]>;

/// What a checked value is: one of a body's outputs, or one of a gradient function's results.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Output,
    Gradient,
}

impl Role {
    /// The kind of a mismatch of this role.
    pub(crate) fn kind(self) -> ErrorKind {
        match self {
            Role::Output => ErrorKind::OutputMismatch,
            Role::Gradient => ErrorKind::GradientMismatch,
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Output => "output",
            Role::Gradient => "gradient",
        })
    }
}

/// What [`outputs_from_python`] checks against: the op's name and `tout`, and where outputs go.
pub(crate) struct OutputCheck<'a> {
    pub op: &'a str,
    pub tout: &'a [OutSpec],
    pub device: &'a Device,
    /// Whether these are a body's outputs or a gradient function's results.
    pub role: Role,
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
    pub(crate) fn error(&self, index: Option<usize>, msg: String) -> Error {
        Error::mismatch(self.op, self.role.kind(), index, msg)
    }
}

/// Applies the rule table to a body's return value: one output takes a value or a 1-tuple; M ≥ 2
/// outputs take a tuple or list of exactly M values; `()` takes `None`.
///
/// It takes the body's result by value and lets go of the tuple or list before converting the
/// items, so an array only the result referenced has no other reference and can be adopted
/// without a copy (see `numbers::to_tensor`).
#[inline(always)]
pub(crate) fn outputs_from_python(
    py: Python<'_>,
    check: &OutputCheck<'_>,
    result: Bound<'_, PyAny>,
) -> Result<Outputs> {
    let m = check.tout.len();
    if m == 0 {
        if result.is_none() {
            return Ok(Outputs::new());
        }
        return Err(check.error(
            None,
            format!(
                "`tout = ()` expects the body to return None, got {}",
                describe_value(&result)
            ),
        ));
    }
    if m == 1 && !result.is_instance_of::<PyTuple>() {
        // The usual case, one value for one output: converted as it is.
        let one = value_to_tensor(py, check, 0, &check.tout[0], &result)?;
        return Ok(smallvec::smallvec![one]);
    }
    let items: Vec<Bound<'_, PyAny>> = if let Ok(t) = result.cast::<PyTuple>() {
        if m == 1 && t.len() != 1 {
            return Err(check.error(
                None,
                format!(
                    "expected 1 {}, got a tuple of {} values",
                    check.role,
                    t.len()
                ),
            ));
        }
        t.iter().collect()
    } else {
        match result.cast::<PyList>() {
            Ok(l) => l.iter().collect(),
            Err(_) => {
                return Err(check.error(
                    None,
                    format!(
                        "expected a tuple of {m} {}s, got {}",
                        check.role,
                        describe_value(&result)
                    ),
                ))
            }
        }
    };
    drop(result); // the items are now referenced by `items` (and whatever the body kept)
    if items.len() != m {
        return Err(check.error(
            None,
            format!("expected {m} {}s, got {}", check.role, items.len()),
        ));
    }
    items
        .iter()
        .zip(check.tout)
        .enumerate()
        .map(|(i, (value, spec))| value_to_tensor(py, check, i, spec, value))
        .collect()
}

/// A returned value that is a tensor already, of dtype `want`: a `pyop.Tensor` (a final
/// class), or a tensor's own view handed back unchanged (an input's, `view::unchanged_view`,
/// asked only once NumPy is known loaded and its type objects looked up, so that this never
/// loads NumPy's C API where `to_tensor` would not). What `to_tensor` gives for these, without
/// its layers (~100 instructions of a scalar call in tensor mode, ~250 in numpy mode); `None`
/// for anything else, which `to_tensor` converts or refuses.
#[inline]
fn own_tensor(py: Python<'_>, value: &Bound<'_, PyAny>, want: DType) -> Option<Tensor> {
    let t = match value.cast_exact::<PyTensor>() {
        Ok(t) => t.get().tensor().clone(),
        Err(_) if crate::python::numpy::known_loaded(py) && super::ndarray::types_known(py) => {
            return super::view::unchanged_view(py, value, Some(want));
        }
        Err(_) => return None,
    };
    (t.dtype() == want).then_some(t)
}

/// Converts one returned value to a tensor of `spec`'s dtype and shape on the op's device.
pub(crate) fn value_to_tensor(
    py: Python<'_>,
    check: &OutputCheck<'_>,
    index: usize,
    spec: &OutSpec,
    value: &Bound<'_, PyAny>,
) -> Result<Tensor> {
    let what = check.role;
    let converted = match own_tensor(py, value, spec.dtype) {
        Some(t) => Ok(t),
        None => to_tensor(py, value, Some(spec.dtype)),
    };
    let tensor = match converted {
        Ok(t) => t,
        Err(ConversionError::NotTensorLike(got)) => {
            return Err(check.error(
                Some(index),
                format!(
                    "{what} {index}: expected {spec} (a pyop.Tensor, NumPy array, number or list), got {got}"
                ),
            ))
        }
        Err(ConversionError::Invalid(msg)) => {
            return Err(check.error(Some(index), format!("{what} {index}: {msg}")))
        }
        Err(ConversionError::NoMemory(msg)) => {
            return Err(Error::mismatch(
                check.op,
                ErrorKind::ResourceExhausted,
                Some(index),
                format!("{what} {index}: MemoryError: {msg}"),
            ))
        }
        Err(e @ ConversionError::Overdue) => {
            return Err(Error::mismatch(
                check.op,
                ErrorKind::Timeout,
                Some(index),
                format!("{what} {index}: {e}"),
            ))
        }
    };
    placed(check, index, spec, tensor)
}

/// The output check's shape and device rule for a value converted to `tensor`: its shape as
/// `spec` says, moved to the op's device (a worker's array, read without Python, comes here too).
#[inline(always)]
pub(crate) fn placed(
    check: &OutputCheck<'_>,
    index: usize,
    spec: &OutSpec,
    tensor: Tensor,
) -> Result<Tensor> {
    let what = check.role;
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
    if tensor.device().same_device(check.device) {
        return Ok(tensor);
    }
    Ok(tensor.to_device(check.device)?)
}
