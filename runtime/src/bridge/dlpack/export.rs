//! DLPack export of `pyop.Tensor`: `__dlpack__` hands a body's tensor to NumPy, PyTorch, CuPy or
//! JAX (`np.from_dlpack(x)`, `torch.from_dlpack(x)`) without a copy.
//!
//! The unsafe part is one allocation per export and two C callbacks:
//! - the managed tensor, its shape and strides, and a clone of the candle tensor (which keeps the
//!   storage alive for as long as the consumer holds the memory) live in one `Box<Export>`,
//!   whose address is the capsule's pointer and the managed tensor's `manager_ctx`;
//! - the consumer calls `deleter` when it is done, which drops that box;
//! - the capsule's destructor calls the deleter only if no consumer took the tensor (a consumer
//!   renames the capsule to `used_dltensor[_versioned]`), as the protocol asks.
//!
//! Versioned exports (a consumer that passes `max_version >= (1, 0)`, as NumPy 2.1+ does) carry
//! the read-only flag, so NumPy's arrays of them are read-only, as every other NumPy view of
//! candle memory pyop hands out. A consumer of the legacy protocol, or one that ignores the flag,
//! can write to the tensor's memory; the README says not to.

use std::ffi::{c_void, CStr};

use candle_core::{Storage, Tensor};
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;

use super::{
    device_of, dl_dtype, DLDevice, DLManagedTensor, DLManagedTensorVersioned, DLPackVersion,
    DLTensor, READ_ONLY, VERSION,
};

/// One export: the managed tensor (first, so that its address is the export's) and what it
/// points into.
#[repr(C)]
struct Export<M> {
    managed: M,
    shape: Vec<i64>,
    strides: Vec<i64>,
    _tensor: Tensor,
}

/// The device address of a CUDA storage's first element. The storage's own stream is the one
/// candle's work on it runs on; `export`'s caller orders the consumer after it.
#[cfg(feature = "cuda")]
fn cuda_base(cuda: &candle_core::CudaStorage, dtype: candle_core::DType) -> Option<*mut c_void> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    let stream = cuda.device.cuda_stream();
    crate::spec::with_plain_element!(dtype, T => {
        let slice = cuda.as_cuda_slice::<T>().ok()?;
        let (ptr, _recorded) = slice.device_ptr(&stream);
        Some(ptr as usize as *mut c_void)
    }, _ => None)
}

/// Makes the tensor's pending CUDA work visible to a consumer on `stream` (DLPack's contract: the
/// producer orders the consumer's stream after its own). candle's stream is synchronized, which
/// holds for every consumer stream; `-1` says the consumer needs no ordering. A CPU tensor needs
/// none.
pub(crate) fn order_for(t: &Tensor, stream: Option<i64>) -> candle_core::Result<()> {
    if t.device().is_cpu() || stream == Some(-1) {
        return Ok(());
    }
    t.device().synchronize()
}

/// A DLPack capsule of `t` (versioned, read-only flagged, if `versioned`).
pub(crate) fn export<'py>(
    py: Python<'py>,
    t: &Tensor,
    versioned: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let Some(dtype) = dl_dtype(t.dtype()) else {
        return Err(PyBufferError::new_err(format!(
            "DLPack has no dtype for {}",
            t.dtype().as_str()
        )));
    };
    let (device_type, device_id) = device_of(t);
    let (data, start) = {
        let (storage, layout) = t.storage_and_layout();
        let base = match &*storage {
            Storage::Cpu(cpu) => Some(crate::bridge::prepare::element_ptr(cpu, 0) as *mut c_void)
                .filter(|p| !p.is_null()),
            #[cfg(feature = "cuda")]
            Storage::Cuda(cuda) => cuda_base(cuda, t.dtype()),
            _ => None,
        };
        let Some(base) = base else {
            return Err(PyBufferError::new_err(format!(
                "DLPack export of a {} tensor on {:?} is not supported",
                t.dtype().as_str(),
                t.device().location()
            )));
        };
        (base, layout.start_offset())
    };
    let layout = t.layout();
    let shape: Vec<i64> = t.dims().iter().map(|&d| d as i64).collect();
    let strides: Vec<i64> = layout.stride().iter().map(|&s| s as i64).collect();
    let tensor = DLTensor {
        data,
        device: DLDevice {
            device_type,
            device_id,
        },
        ndim: shape.len() as i32,
        dtype,
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: (start * t.dtype().size_in_bytes()) as u64,
    };
    if versioned {
        export_as::<DLManagedTensorVersioned>(py, tensor, shape, strides, t)
    } else {
        export_as::<DLManagedTensor>(py, tensor, shape, strides, t)
    }
}

/// The two managed-tensor structs of the protocol: what differs between their exports.
trait Managed: Sized {
    /// The capsule's name.
    const NAME: &'static CStr;
    /// The struct around `tensor`, with `delete::<Self>` as its deleter and no context yet.
    fn new(tensor: DLTensor) -> Self;
    fn parts(&mut self) -> (&mut DLTensor, &mut *mut c_void);
}

impl Managed for DLManagedTensor {
    const NAME: &'static CStr = c"dltensor";
    fn new(dl_tensor: DLTensor) -> Self {
        DLManagedTensor {
            dl_tensor,
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete::<Self>),
        }
    }
    fn parts(&mut self) -> (&mut DLTensor, &mut *mut c_void) {
        (&mut self.dl_tensor, &mut self.manager_ctx)
    }
}

impl Managed for DLManagedTensorVersioned {
    const NAME: &'static CStr = c"dltensor_versioned";
    fn new(dl_tensor: DLTensor) -> Self {
        DLManagedTensorVersioned {
            version: DLPackVersion {
                major: VERSION.0,
                minor: VERSION.1,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete::<Self>),
            flags: READ_ONLY,
            dl_tensor,
        }
    }
    fn parts(&mut self) -> (&mut DLTensor, &mut *mut c_void) {
        (&mut self.dl_tensor, &mut self.manager_ctx)
    }
}

/// One export as a capsule: the box is made, the tensor pointed at the box's own shape and
/// strides, the context at the box, and the box handed to the capsule.
fn export_as<'py, M: Managed>(
    py: Python<'py>,
    tensor: DLTensor,
    shape: Vec<i64>,
    strides: Vec<i64>,
    t: &Tensor,
) -> PyResult<Bound<'py, PyAny>> {
    let mut export = Box::new(Export {
        managed: M::new(tensor),
        shape,
        strides,
        _tensor: t.clone(),
    });
    let (shape, strides) = (export.shape.as_mut_ptr(), export.strides.as_mut_ptr());
    let (dl, _) = export.managed.parts();
    dl.shape = shape;
    dl.strides = strides;
    let raw = Box::into_raw(export);
    // SAFETY: `raw` is a live box; its first field is the managed tensor (repr(C)).
    unsafe { *(*raw).managed.parts().1 = raw.cast() };
    // SAFETY: `raw` is a live export of `M`; `M::NAME` is 'static (the capsule keeps the pointer).
    let capsule =
        unsafe { pyo3::ffi::PyCapsule_New(raw.cast(), M::NAME.as_ptr(), Some(destroy::<M>)) };
    if capsule.is_null() {
        // No capsule: nobody else has the export; free it.
        // SAFETY: `raw` came from Box::into_raw of an `Export<M>`.
        unsafe { delete::<M>(raw.cast()) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference, owned from here.
    Ok(unsafe { Bound::from_owned_ptr(py, capsule) })
}

/// The deleter: frees the box (the tensor clone, shape, strides).
unsafe extern "C" fn delete<M: Managed>(managed: *mut M) {
    if !managed.is_null() {
        // SAFETY: the protocol calls this once, with the pointer `export_as` made by
        // Box::into_raw (the managed tensor is the export's first field).
        drop(unsafe { Box::from_raw(managed.cast::<Export<M>>()) });
    }
}

/// The capsule's destructor: frees the export only if no consumer took it (a consumer renames
/// the capsule and calls the deleter itself when done).
unsafe extern "C" fn destroy<M: Managed>(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by Python with the capsule, the GIL held; PyCapsule_IsValid checks the
    // name without raising.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, M::NAME.as_ptr()) == 1 {
            let ptr = pyo3::ffi::PyCapsule_GetPointer(capsule, M::NAME.as_ptr());
            delete::<M>(ptr.cast());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_managed_tensor_is_first_in_its_export() {
        assert_eq!(std::mem::offset_of!(Export<DLManagedTensor>, managed), 0);
        assert_eq!(
            std::mem::offset_of!(Export<DLManagedTensorVersioned>, managed),
            0
        );
    }
}
