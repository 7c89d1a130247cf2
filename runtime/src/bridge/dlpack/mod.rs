//! DLPack, both ways: `export` hands a `pyop.Tensor`'s memory to NumPy, PyTorch, CuPy or JAX
//! without a copy (`pyop.Tensor.__dlpack__`); `import` reads any DLPack producer a body returns
//! (a torch tensor, a CuPy or JAX array) into a candle tensor with the one copy candle's storage
//! requires, device to device on CUDA.
//!
//! The protocol's structs are C structs (dmlc/dlpack `dlpack.h`, v1.1), declared here
//! `#[repr(C)]` with layout tests. No maintained crate fits: dlpark 0.10 supports candle 0.11 and
//! pyo3 0.30 but needs Rust 1.88 and edition 2024, and pyop supports 1.85.

pub(crate) mod export;
pub(crate) mod import;

use std::ffi::c_void;

use candle_core::{DType, Tensor};

/// `DLDeviceType::kDLCPU` and `kDLCUDA`.
pub(crate) const DL_CPU: i32 = 1;
pub(crate) const DL_CUDA: i32 = 2;

/// `DLPACK_FLAG_BITMASK_READ_ONLY`.
const READ_ONLY: u64 = 1;

/// The newest protocol version pyop speaks, as a consumer asks for it (`max_version`) and as a
/// producer stamps it.
const VERSION: (u32, u32) = (1, 1);

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// `DLDataTypeCode`s: `kDLInt`, `kDLUInt`, `kDLFloat`, `kDLBfloat`, `kDLBool`.
const INT: u8 = 0;
const UINT: u8 = 1;
const FLOAT: u8 = 2;
const BFLOAT: u8 = 4;
const BOOL: u8 = 6;

/// Each candle dtype DLPack has, with its DLPack code and bits: all of candle's but fp8.
const DTYPES: [(DType, u8, u8); 9] = [
    (DType::U8, UINT, 8),
    (DType::U32, UINT, 32),
    (DType::I16, INT, 16),
    (DType::I32, INT, 32),
    (DType::I64, INT, 64),
    (DType::F16, FLOAT, 16),
    (DType::F32, FLOAT, 32),
    (DType::F64, FLOAT, 64),
    (DType::BF16, BFLOAT, 16),
];

/// DLPack's dtype for a candle dtype.
fn dl_dtype(dtype: DType) -> Option<DLDataType> {
    DTYPES
        .iter()
        .find(|(d, ..)| *d == dtype)
        .map(|&(_, code, bits)| DLDataType {
            code,
            bits,
            lanes: 1,
        })
}

/// Whether DLPack can carry `dtype` (all of candle's dtypes but fp8).
pub(crate) fn can_carry(dtype: DType) -> bool {
    dl_dtype(dtype).is_some()
}

/// The candle dtype of a DLPack dtype: bool is u8 (one byte, 0 or 1), as a NumPy bool array is
/// for pyop; `None` for what candle lacks (`uint16`, `complex64`, vector lanes, …).
fn candle_dtype(dl: DLDataType) -> Option<DType> {
    if dl.lanes != 1 {
        return None;
    }
    if (dl.code, dl.bits) == (BOOL, 8) {
        return Some(DType::U8);
    }
    DTYPES
        .iter()
        .find(|(_, code, bits)| (*code, *bits) == (dl.code, dl.bits))
        .map(|&(d, ..)| d)
}

/// A DLPack dtype as NumPy and the array API name it (`float32`, `uint16`, `bool`), for messages.
fn dl_dtype_name(dl: DLDataType) -> String {
    let base = match dl.code {
        INT => format!("int{}", dl.bits),
        UINT => format!("uint{}", dl.bits),
        FLOAT => format!("float{}", dl.bits),
        BFLOAT => format!("bfloat{}", dl.bits),
        BOOL => "bool".to_owned(),
        5 => format!("complex{}", dl.bits),
        code => format!("DLPack type code {code} of {} bits", dl.bits),
    };
    if dl.lanes == 1 {
        base
    } else {
        format!("{base}x{}", dl.lanes)
    }
}

/// `(device_type, device_id)` of `__dlpack_device__`.
pub(crate) fn device_of(t: &Tensor) -> (i32, i32) {
    match t.device().location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => (DL_CUDA, gpu_id as i32),
        _ => (DL_CPU, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_candle_dtype_but_fp8_has_a_dlpack_dtype_and_back() {
        for d in [
            DType::U8,
            DType::U32,
            DType::I16,
            DType::I32,
            DType::I64,
            DType::BF16,
            DType::F16,
            DType::F32,
            DType::F64,
        ] {
            let dl = dl_dtype(d).unwrap();
            assert_eq!(usize::from(dl.bits) / 8, d.size_in_bytes(), "{d:?}");
            assert_eq!(candle_dtype(dl), Some(d));
        }
        assert!(!can_carry(DType::F8E4M3));
    }

    #[test]
    fn dlpack_dtypes_candle_lacks_are_named() {
        let dl = |code, bits, lanes| DLDataType { code, bits, lanes };
        assert_eq!(candle_dtype(dl(BOOL, 8, 1)), Some(DType::U8));
        for (lacking, name) in [
            (dl(UINT, 16, 1), "uint16"),
            (dl(INT, 8, 1), "int8"),
            (dl(5, 64, 1), "complex64"),
            (dl(FLOAT, 32, 4), "float32x4"),
        ] {
            assert_eq!(candle_dtype(lacking), None, "{name}");
            assert_eq!(dl_dtype_name(lacking), name);
        }
    }

    #[test]
    fn the_structs_have_dlpack_h_layout() {
        // dlpack.h's layout on 64-bit targets.
        assert_eq!(std::mem::size_of::<DLTensor>(), 48);
        assert_eq!(std::mem::size_of::<DLManagedTensor>(), 64);
        assert_eq!(std::mem::size_of::<DLManagedTensorVersioned>(), 80);
        assert_eq!(
            std::mem::offset_of!(DLManagedTensorVersioned, dl_tensor),
            32
        );
        assert_eq!(std::mem::offset_of!(DLTensor, byte_offset), 40);
    }
}
