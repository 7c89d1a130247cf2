//! Packing any number of tracked inputs into the one tensor a candle custom op takes, and
//! narrowing outputs back out; all of it differentiable.

use std::sync::Mutex;

use candle_core::{CpuStorage, DType, Tensor};

use crate::error::Result;

/// Tensors as one, in dtype `f` (differentiably): a single tensor keeps its shape (no reshape
/// nodes in the common one-input, one-output case); several are flattened and concatenated.
pub(super) fn pack<'a>(ts: impl ExactSizeIterator<Item = &'a Tensor>, f: DType) -> Result<Tensor> {
    if ts.len() == 1 {
        let t = ts.into_iter().next().expect("one");
        return Ok(if t.dtype() == f {
            t.clone()
        } else {
            t.to_dtype(f)?
        });
    }
    let flat: Vec<Tensor> = ts.map(|t| flat(t, f)).collect::<candle_core::Result<_>>()?;
    Ok(Tensor::cat(&flat, 0)?)
}

/// `t` flattened, in dtype `f`; no new tensor where it already is (the common one-input case).
pub(super) fn flat(t: &Tensor, f: DType) -> candle_core::Result<Tensor> {
    let t = if t.rank() == 1 {
        t.clone()
    } else {
        t.flatten_all()?
    };
    if t.dtype() == f {
        Ok(t)
    } else {
        t.to_dtype(f)
    }
}

/// The part of the flat `packed` at `offset` with `like`'s size, shaped and typed like it.
pub(super) fn unpack(packed: &Tensor, offset: usize, like: &Tensor) -> candle_core::Result<Tensor> {
    let n = like.elem_count();
    let t = if offset == 0 && n == packed.elem_count() {
        packed.clone()
    } else {
        packed.narrow(0, offset, n)?
    };
    let t = if t.dims() == like.dims() {
        t
    } else {
        t.reshape(like.shape())?
    };
    if t.dtype() == like.dtype() {
        Ok(t)
    } else {
        t.to_dtype(like.dtype())
    }
}

pub(super) fn cpu_storage(t: &Tensor) -> Result<CpuStorage> {
    Ok(match t.dtype() {
        DType::F64 => CpuStorage::F64(t.to_vec1::<f64>()?),
        _ => CpuStorage::F32(t.to_vec1::<f32>()?),
    })
}

/// The outputs the node's forward hands candle: taken once from the CPU, or a device tensor.
pub(super) enum Slot {
    Cpu(Mutex<Option<CpuStorage>>),
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Device(Tensor),
}
