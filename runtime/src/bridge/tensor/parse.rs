//! Arguments from Python: dtypes (candle's names or NumPy's), dims, shapes, device names and
//! sequences of tensors.

use candle_core::{DType, Device, DeviceLocation, Shape, Tensor};
use pyo3::exceptions::{PyIndexError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::checked::{checked_shape, elem_count};
use super::PyTensor;

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
                .tensor()
                .clone(),
        );
    }
    Ok(out)
}
