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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn one_tensor_keeps_its_shape() {
        let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu).unwrap();
        let p = pack([&x].into_iter(), DType::F32).unwrap();
        assert_eq!(p.dims(), [2, 2]);
        let p64 = pack([&x].into_iter(), DType::F64).unwrap();
        assert_eq!(p64.dtype(), DType::F64);
        // Unpacked like `x`: same shape and dtype, same values.
        let back = unpack(&p64.flatten_all().unwrap(), 0, &x).unwrap();
        assert_eq!(back.dtype(), DType::F32);
        assert_eq!(back.to_vec2::<f32>().unwrap(), [[1., 2.], [3., 4.]]);
    }

    #[test]
    fn several_tensors_are_flattened_and_concatenated() {
        let a = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu).unwrap();
        let b = Tensor::new(&[5f64, 6., 7.], &Device::Cpu).unwrap();
        let p = pack([&a, &b].into_iter(), DType::F64).unwrap();
        assert_eq!(p.to_vec1::<f64>().unwrap(), [1., 2., 3., 4., 5., 6., 7.]);
        let a2 = unpack(&p, 0, &a).unwrap();
        let b2 = unpack(&p, 4, &b).unwrap();
        assert_eq!(a2.to_vec2::<f32>().unwrap(), [[1., 2.], [3., 4.]]);
        assert_eq!(b2.to_vec1::<f64>().unwrap(), [5., 6., 7.]);
    }
}
