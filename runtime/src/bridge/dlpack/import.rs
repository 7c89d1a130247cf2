//! DLPack import: a DLPack producer a body returns (a torch tensor, a CuPy or JAX array, anything
//! with `__dlpack__`) read into a candle tensor with the one copy candle's storage requires.
//! candle's storage owns its memory (a `Vec` on the CPU, a `CudaSlice` of its own allocator on
//! CUDA) and has no way to borrow a foreign buffer with a deleter, so every import copies once:
//!
//! - a CPU producer: into a `Vec` (one pass; a strided producer is gathered in that same pass);
//! - a CUDA producer on the running op's CUDA device: device to device on candle's stream, after
//!   the producer has ordered its pending work before that stream (we pass candle's stream as
//!   `stream=`, as the protocol asks, or the legacy default stream, waited for, when candle's is
//!   CUDA's per-thread default stream); candle's stream is synchronized before the producer's
//!   memory is given back, so its allocator cannot reuse the memory while the copy runs. A
//!   transposed or permuted CUDA tensor is copied as the contiguous block it is and put in
//!   row-major order by candle's copy on the device (a second copy, on the device);
//! - anything else (a CUDA producer for an op on the CPU or another GPU, a stepped, broadcast or
//!   reversed CUDA tensor, another device type) is not read here: the caller copies it through
//!   the host.
//!
//! The unsafe part: reading the managed tensor the producer's capsule points to, and calling its
//! deleter exactly once (`Taken`'s drop), after renaming the capsule to `used_dltensor[_versioned]`
//! so that the capsule's own destructor leaves it to us, as the protocol asks.

use std::ffi::CStr;

use candle_core::{DType, Device, Tensor};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::{
    candle_dtype, DLManagedTensor, DLManagedTensorVersioned, DLTensor, DL_CPU, DL_CUDA, VERSION,
};
use crate::python::describe;
use crate::spec::with_plain_element;

/// Why a producer could not be imported.
#[derive(Debug)]
pub(crate) enum ImportError {
    /// Its dtype is not the one asked for, or one candle lacks: the message says which.
    Dtype(String),
    /// The producer failed, or gave something that is not a valid DLPack tensor.
    Read(String),
}

/// Reads `value`, which has `__dlpack__`, into a tensor of its own dtype (`want`, if given, must
/// be that dtype; a bool producer passes for u8), on the CPU or on the running op's CUDA device.
/// `Ok(None)`: the producer's memory is where this path does not read (see the module's text);
/// the caller copies it through the host.
pub(crate) fn import(
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    want: Option<DType>,
) -> Result<Option<Tensor>, ImportError> {
    // A producer older than `__dlpack_device__` (it came with DLPack's Python protocol in 2021)
    // is asked without a stream, and read only if its tensor is on the CPU.
    let said: Option<(i32, i32)> = if value
        .hasattr(pyo3::intern!(py, "__dlpack_device__"))
        .unwrap_or(false)
    {
        let device = value
            .call_method0(pyo3::intern!(py, "__dlpack_device__"))
            .and_then(|d| d.extract())
            .map_err(|e| {
                ImportError::Read(format!("__dlpack_device__() failed: {}", describe(py, &e)))
            })?;
        Some(device)
    } else {
        None
    };
    let (target, stream) = match said {
        None | Some((DL_CPU, _)) => (Device::Cpu, None),
        Some((DL_CUDA, id)) => match cuda_target(id) {
            Some((device, stream)) => (device, Some(stream)),
            None => return Ok(None),
        },
        Some(_) => return Ok(None),
    };
    let capsule = capsule_of(py, value, stream)?;
    let taken = Taken::from_capsule(py, &capsule)?;
    // SAFETY: the producer keeps the managed tensor valid until its deleter runs, which is when
    // `taken` drops, after the last use of `dl`.
    let dl = unsafe { &*taken.tensor };
    let seen = (dl.device.device_type, dl.device.device_id);
    match said {
        // Unasked, a tensor that is not on the CPU goes through the host (`taken` releases it).
        None if seen.0 != DL_CPU => return Ok(None),
        Some(said) if said != seen => {
            return Err(ImportError::Read(format!(
                "__dlpack_device__() said {said:?} but the tensor is on {seen:?}"
            )))
        }
        _ => {}
    }
    let dtype = candle_dtype(dl.dtype)
        .filter(|&d| want.is_none_or(|w| w == d))
        .ok_or_else(|| {
            let name = super::dl_dtype_name(dl.dtype);
            ImportError::Dtype(match want {
                Some(w) => format!(
                    "expected dtype {}, got a DLPack tensor of dtype {name}",
                    w.as_str()
                ),
                None => format!("a DLPack tensor of dtype {name} (candle has no such dtype)"),
            })
        })?;
    let layout = Layout::of(dl, dtype.size_in_bytes())?;
    if layout.n == 0 {
        return Ok(Some(
            Tensor::zeros(layout.dims, dtype, &target).map_err(read)?,
        ));
    }
    if dl.data.is_null() {
        return Err(ImportError::Read(
            "a DLPack tensor with elements but no data".into(),
        ));
    }
    let base = (dl.data as usize).wrapping_add(dl.byte_offset as usize);
    let tensor = match &target {
        Device::Cpu => {
            // Large copies run without the GIL (the producer's memory stays ours meanwhile).
            crate::python::copy_without_gil(layout.n * dtype.size_in_bytes(), || {
                // SAFETY: the producer's memory holds the elements `layout` describes, readable
                // until `taken` drops (after this).
                unsafe { host_copy(base, dtype, layout) }
            })
        }
        device => {
            // A transposed or permuted block (what `t.t()` and `permute` give) is copied as the
            // block it is, then put in row-major order by candle's own copy on the device; other
            // strides (stepped, broadcast, reversed) go through the host.
            let (block, order) = match &layout.strides {
                None => (layout.dims.clone(), None),
                Some(strides) => match permuted_block(&layout.dims, strides) {
                    Some((block, order)) => (block, Some(order)),
                    None => return Ok(None),
                },
            };
            // Without the GIL: the copy waits for the producer's work ordered before candle's
            // stream, which may itself need the GIL (a host callback).
            py.detach(|| {
                // SAFETY: as above, on the device, after the producer ordered its work before
                // candle's stream; a permuted block is `n` contiguous elements from `base`.
                let t = unsafe { device_copy(device, stream, base, dtype, block)? };
                match order {
                    None => Ok(t),
                    Some(order) => in_row_major(t, &order),
                }
            })
        }
    };
    drop(taken);
    tensor.map(Some).map_err(read)
}

fn read(e: candle_core::Error) -> ImportError {
    ImportError::Read(e.to_string())
}

/// The running op's device, when it is CUDA device `id`, and the stream number a producer is to
/// order its work before: candle's own stream when it is one of its own making, else (candle's
/// default device runs on CUDA's per-thread default stream, `0x2`) the legacy default stream, 1,
/// which every producer accepts (PyTorch refuses 2, "per-thread default stream is not
/// supported"); `device_copy` then waits for the legacy stream before it copies.
fn cuda_target(id: i32) -> Option<(Device, i64)> {
    #[cfg(feature = "cuda")]
    {
        let device = crate::bridge::tensor::device::current_device();
        if let Device::Cuda(cuda) = &device {
            if device.location()
                == (candle_core::DeviceLocation::Cuda {
                    gpu_id: id as usize,
                })
            {
                let stream = cuda.cuda_stream().cu_stream() as usize as i64;
                return Some((
                    device.clone(),
                    if stream <= 2 { LEGACY_STREAM } else { stream },
                ));
            }
        }
    }
    let _ = id;
    None
}

/// DLPack's number for CUDA's legacy default stream.
#[cfg(feature = "cuda")]
const LEGACY_STREAM: i64 = 1;

/// `value.__dlpack__(stream=..., max_version=(1, 1))`, or, once more without `max_version`, for
/// a producer of the protocol before DLPack 1.0 (which raises `TypeError` for it).
fn capsule_of<'py>(
    py: Python<'py>,
    value: &Bound<'py, PyAny>,
    stream: Option<i64>,
) -> Result<Bound<'py, PyAny>, ImportError> {
    let failed = |e: PyErr| ImportError::Read(format!("__dlpack__() failed: {}", describe(py, &e)));
    let kwargs = PyDict::new(py);
    if let Some(s) = stream {
        kwargs
            .set_item(pyo3::intern!(py, "stream"), s)
            .map_err(failed)?;
    }
    kwargs
        .set_item(pyo3::intern!(py, "max_version"), VERSION)
        .map_err(failed)?;
    let method = pyo3::intern!(py, "__dlpack__");
    match value.call_method(method, (), Some(&kwargs)) {
        Ok(capsule) => Ok(capsule),
        Err(first) if first.is_instance_of::<PyTypeError>(py) => {
            kwargs
                .del_item(pyo3::intern!(py, "max_version"))
                .map_err(failed)?;
            value.call_method(method, (), Some(&kwargs)).map_err(|e| {
                ImportError::Read(format!(
                    "__dlpack__() failed: {} (asked for DLPack {}.{} first: {})",
                    describe(py, &e),
                    VERSION.0,
                    VERSION.1,
                    describe(py, &first)
                ))
            })
        }
        Err(e) => Err(failed(e)),
    }
}

/// A producer's managed tensor, taken from its capsule: its deleter runs when this drops.
struct Taken {
    tensor: *const DLTensor,
    managed: Managed,
}

enum Managed {
    Legacy(*mut DLManagedTensor),
    Versioned(*mut DLManagedTensorVersioned),
}

const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";
const USED_LEGACY: &CStr = c"used_dltensor";
const USED_VERSIONED: &CStr = c"used_dltensor_versioned";

impl Taken {
    fn from_capsule(py: Python<'_>, capsule: &Bound<'_, PyAny>) -> Result<Taken, ImportError> {
        let ptr = capsule.as_ptr();
        // SAFETY: `ptr` is a live object and the GIL is held; PyCapsule_IsValid checks the type
        // and name without raising.
        let (name, used) = unsafe {
            if pyo3::ffi::PyCapsule_IsValid(ptr, VERSIONED.as_ptr()) == 1 {
                (VERSIONED, USED_VERSIONED)
            } else if pyo3::ffi::PyCapsule_IsValid(ptr, LEGACY.as_ptr()) == 1 {
                (LEGACY, USED_LEGACY)
            } else {
                return Err(ImportError::Read(format!(
                    "__dlpack__() returned {}, not an unused DLPack capsule",
                    capsule
                        .get_type()
                        .name()
                        .map_or_else(|_| "an object".to_owned(), |n| n.to_string())
                )));
            }
        };
        // SAFETY: a valid capsule of that name (checked above); the name we set is 'static, as
        // PyCapsule_SetName requires. Once renamed, the capsule's destructor leaves the tensor
        // alone and the deleter is ours to call, once.
        unsafe {
            let managed = pyo3::ffi::PyCapsule_GetPointer(ptr, name.as_ptr());
            if managed.is_null() {
                return Err(ImportError::Read(describe(py, &PyErr::fetch(py))));
            }
            if pyo3::ffi::PyCapsule_SetName(ptr, used.as_ptr()) != 0 {
                return Err(ImportError::Read(describe(py, &PyErr::fetch(py))));
            }
            if name == VERSIONED {
                let m = managed.cast::<DLManagedTensorVersioned>();
                let taken = Taken {
                    tensor: &raw const (*m).dl_tensor,
                    managed: Managed::Versioned(m),
                };
                let (major, minor) = ((*m).version.major, (*m).version.minor);
                if major != VERSION.0 {
                    // `taken` drops here: the tensor is released, unread.
                    return Err(ImportError::Read(format!(
                        "the producer gave a DLPack {major}.{minor} tensor; pyop reads 1.x"
                    )));
                }
                Ok(taken)
            } else {
                let m = managed.cast::<DLManagedTensor>();
                Ok(Taken {
                    tensor: &raw const (*m).dl_tensor,
                    managed: Managed::Legacy(m),
                })
            }
        }
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        // SAFETY: the managed tensor is live until its deleter runs, which happens here, once
        // (the capsule was renamed, so its destructor will not); a null deleter means the
        // producer needs no call.
        unsafe {
            match self.managed {
                Managed::Legacy(m) => {
                    if let Some(delete) = (*m).deleter {
                        delete(m);
                    }
                }
                Managed::Versioned(m) => {
                    if let Some(delete) = (*m).deleter {
                        delete(m);
                    }
                }
            }
        }
    }
}

/// A DLPack tensor's shape, its element count, and its strides in elements when it is not
/// compact row-major (`None` when it is: the common case, one contiguous block).
struct Layout {
    dims: Vec<usize>,
    n: usize,
    strides: Option<Vec<isize>>,
}

impl Layout {
    /// The layout of `dl`, whose elements are `size` bytes; refused when its bytes, or the
    /// memory its strides reach, could not be addressed (more than `isize::MAX` bytes).
    fn of(dl: &DLTensor, size: usize) -> Result<Layout, ImportError> {
        let bad = |what: String| ImportError::Read(format!("an invalid DLPack tensor: {what}"));
        let ndim = usize::try_from(dl.ndim).map_err(|_| bad(format!("ndim {}", dl.ndim)))?;
        if ndim > 0 && dl.shape.is_null() {
            return Err(bad("no shape".into()));
        }
        let shape: &[i64] = if ndim == 0 {
            &[]
        } else {
            // SAFETY: `shape` (and `strides`, when not null) hold `ndim` entries, by the
            // protocol.
            unsafe { std::slice::from_raw_parts(dl.shape, ndim) }
        };
        let dims = shape
            .iter()
            .map(|&d| usize::try_from(d).map_err(|_| bad(format!("shape {shape:?}"))))
            .collect::<Result<Vec<usize>, _>>()?;
        let n = dims
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|&n| {
                n.checked_mul(size)
                    .is_some_and(|b| b <= isize::MAX as usize)
            })
            .ok_or_else(|| bad(format!("shape {shape:?} is too large")))?;
        let strides = if dl.strides.is_null() || ndim == 0 || n == 0 {
            None
        } else {
            // SAFETY: as above.
            let strides = unsafe { std::slice::from_raw_parts(dl.strides, ndim) };
            // The farthest element from the first, in bytes, must be addressable, so that no
            // offset `gathered` computes overflows.
            let reach = dims
                .iter()
                .zip(strides)
                .try_fold(0usize, |reach, (&d, &s)| {
                    (s.unsigned_abs() as usize)
                        .checked_mul(d - 1)?
                        .checked_add(reach)
                });
            if reach
                .and_then(|r| r.checked_mul(size))
                .is_none_or(|b| b > isize::MAX as usize)
            {
                return Err(bad(format!("strides {strides:?} reach too far")));
            }
            let strides = strides.iter().map(|&s| s as isize).collect::<Vec<isize>>();
            (!is_row_major(&dims, &strides)).then_some(strides)
        };
        Ok(Layout { dims, n, strides })
    }
}

/// For strides that are a permutation of a compact row-major block (a transpose, a permute; the
/// strides of unit dimensions do not matter): the block's dims in memory order, and for each
/// memory-order dimension the logical dimension it is. `None` for any other strides.
fn permuted_block(dims: &[usize], strides: &[isize]) -> Option<(Vec<usize>, Vec<usize>)> {
    let mut order: Vec<usize> = (0..dims.len()).collect();
    // Largest stride first; unit dimensions last among equals, wherever they land.
    order.sort_by_key(|&i| (std::cmp::Reverse(strides[i]), dims[i] == 1));
    let block: Vec<usize> = order.iter().map(|&i| dims[i]).collect();
    let in_order: Vec<isize> = order.iter().map(|&i| strides[i]).collect();
    is_row_major(&block, &in_order).then_some((block, order))
}

/// A block copied in memory order (`order[k]`: the logical dimension of its dimension `k`) as
/// the row-major tensor of the logical shape.
fn in_row_major(block: Tensor, order: &[usize]) -> candle_core::Result<Tensor> {
    // The logical dimension `i` is the block's dimension where `order` names `i`.
    let mut axes = vec![0usize; order.len()];
    for (k, &i) in order.iter().enumerate() {
        axes[i] = k;
    }
    block.permute(axes)?.contiguous()
}

/// Whether `strides` are compact row-major for `dims`, ignoring the strides of dimensions of
/// size 1 (which NumPy and PyTorch set freely).
fn is_row_major(dims: &[usize], strides: &[isize]) -> bool {
    let mut expected = 1isize;
    for (&d, &s) in dims.iter().zip(strides).rev() {
        if d != 1 && s != expected {
            return false;
        }
        expected = expected.saturating_mul(d as isize);
    }
    true
}

/// A CPU tensor copied from the producer's memory at `base`, in one pass.
///
/// # Safety
/// `base` must be readable at every element `layout` describes, as elements of `dtype`.
unsafe fn host_copy(base: usize, dtype: DType, layout: Layout) -> candle_core::Result<Tensor> {
    let Layout { dims, n, strides } = layout;
    let Some(strides) = strides else {
        // SAFETY: the caller's promise; `n` contiguous elements.
        return unsafe { crate::alloc::tensor_from_bytes(dtype, base as *const u8, dims) };
    };
    with_plain_element!(dtype, T => {
        // SAFETY: the caller's promise.
        let v = unsafe { gathered::<T>(base as *const u8, &dims, &strides, n) }.ok_or_else(|| {
            candle_core::Error::Msg(crate::alloc::no_memory(n, std::mem::size_of::<T>()))
        })?;
        Tensor::from_vec(v, dims, &Device::Cpu)
    }, d => Err(candle_core::Error::Msg(format!("DLPack has no {}", d.as_str()))))
}

/// The `n` elements of a strided layout, in row-major order (any strides: negative, zero for a
/// broadcast dimension, transposed), read unaligned; `None` when the memory cannot be had.
///
/// # Safety
/// Every element the strides reach from `base` must be readable.
unsafe fn gathered<T: crate::alloc::Pod>(
    base: *const u8,
    dims: &[usize],
    strides: &[isize],
    n: usize,
) -> Option<Vec<T>> {
    let mut out: Vec<T> = Vec::new();
    out.try_reserve_exact(n).ok()?;
    let size = std::mem::size_of::<T>() as isize;
    let mut index = vec![0usize; dims.len()];
    let mut offset = 0isize;
    for _ in 0..n {
        // SAFETY: the caller's promise: `offset` is an element the strides reach.
        out.push(unsafe {
            std::ptr::read_unaligned(base.wrapping_offset(offset * size).cast::<T>())
        });
        // The next index in row-major order, and its offset.
        for d in (0..dims.len()).rev() {
            index[d] += 1;
            offset += strides[d];
            if index[d] < dims[d] {
                break;
            }
            offset -= strides[d] * dims[d] as isize;
            index[d] = 0;
        }
    }
    Some(out)
}

/// A tensor on `device` (CUDA) copied from the producer's contiguous device memory at `base`, on
/// candle's stream, which is synchronized before this returns (the producer may free the memory
/// as soon as its deleter runs). `stream`: the stream the producer ordered its writes before; the
/// legacy default stream is waited for first.
///
/// # Safety
/// `base` must be a device address on `device`'s GPU, readable for the tensor's bytes, with the
/// producer's writes ordered before `stream`.
#[cfg(feature = "cuda")]
unsafe fn device_copy(
    device: &Device,
    stream: Option<i64>,
    base: usize,
    dtype: DType,
    dims: Vec<usize>,
) -> candle_core::Result<Tensor> {
    use candle_core::cuda_backend::cudarc::driver::{result, DevicePtrMut};
    use candle_core::cuda_backend::WrapErr;
    let Device::Cuda(cuda) = device else {
        unreachable!("device_copy is called for CUDA devices only")
    };
    let n: usize = dims.iter().product();
    let asked = stream;
    let stream = cuda.cuda_stream();
    stream.context().bind_to_thread().w()?;
    if asked == Some(LEGACY_STREAM) {
        // The producer's writes are ordered before the legacy default stream (the null stream of
        // the driver API); wait for it, whatever candle's stream's relation to it.
        // SAFETY: the null stream is always valid in a bound context.
        unsafe { result::stream::synchronize(std::ptr::null_mut()) }.w()?;
    }
    let storage = with_plain_element!(dtype, T => {
        // SAFETY: every element is written by the copy below before anything reads it.
        let mut slice = unsafe { cuda.alloc::<T>(n)? };
        {
            let (dst, _record) = slice.device_ptr_mut(&stream);
            // SAFETY: `dst` holds `n` elements of `T`; `base` as the caller promises.
            unsafe {
                result::memcpy_dtod_async(
                    dst,
                    base as u64,
                    n * std::mem::size_of::<T>(),
                    stream.cu_stream(),
                )
            }
            .w()?;
        }
        stream.synchronize().w()?;
        candle_core::CudaStorage::wrap_cuda_slice(slice, cuda.clone())
    }, d => return Err(candle_core::Error::Msg(format!("DLPack has no {}", d.as_str()))));
    Ok(Tensor::from_storage(
        candle_core::Storage::Cuda(storage),
        dims,
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

/// Without CUDA, no device but the CPU is ever a target.
#[cfg(not(feature = "cuda"))]
unsafe fn device_copy(
    device: &Device,
    _: Option<i64>,
    _: usize,
    _: DType,
    _: Vec<usize>,
) -> candle_core::Result<Tensor> {
    unreachable!("no CUDA target without the cuda feature ({device:?})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_major_ignores_the_strides_of_unit_dimensions() {
        assert!(is_row_major(&[2, 3], &[3, 1]));
        assert!(is_row_major(&[2, 1, 3], &[3, 99, 1]));
        assert!(is_row_major(&[1, 4], &[0, 1]));
        assert!(!is_row_major(&[2, 3], &[1, 2]));
        assert!(!is_row_major(&[3], &[-1]));
        assert!(!is_row_major(&[3], &[0]));
    }

    #[test]
    fn permuted_blocks_are_put_in_row_major_order_as_a_gather_would() {
        // A 2x3x4 block in memory, seen through permutations of its axes (what `permute` and
        // `t()` give), with a unit dimension of any stride in some.
        let data: Vec<f32> = (0..24).map(|v| v as f32).collect();
        let cases: &[(&[usize], &[isize])] = &[
            (&[4, 3, 2], &[1, 4, 12]),
            (&[3, 2, 4], &[4, 12, 1]),
            (&[2, 4, 3], &[12, 1, 4]),
            (&[4, 1, 6], &[1, -5, 4]),
            (&[6, 4], &[4, 1]),
        ];
        for (dims, strides) in cases {
            let (block, order) = permuted_block(dims, strides).expect("a permuted block");
            let memory = Tensor::from_vec(data.clone(), block, &Device::Cpu).unwrap();
            let got = in_row_major(memory, &order)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            // SAFETY: every offset these strides reach lies inside `data`.
            let want = unsafe { gathered::<f32>(data.as_ptr().cast(), dims, strides, 24).unwrap() };
            assert_eq!(got, want, "{dims:?} {strides:?}");
        }
        // Stepped, broadcast, reversed and overlapping strides are no block.
        assert!(permuted_block(&[3], &[2]).is_none());
        assert!(permuted_block(&[2, 3], &[0, 1]).is_none());
        assert!(permuted_block(&[3], &[-1]).is_none());
        assert!(permuted_block(&[2, 3], &[1, 1]).is_none());
    }

    #[test]
    fn gathered_reads_transposed_reversed_and_broadcast_layouts() {
        let data: Vec<i32> = (0..6).collect();
        let base = data.as_ptr().cast::<u8>();
        // SAFETY: every offset below lies inside `data`.
        unsafe {
            // The transpose of a 2x3 row-major array.
            let t = gathered::<i32>(base, &[3, 2], &[1, 3], 6).unwrap();
            assert_eq!(t, [0, 3, 1, 4, 2, 5]);
            // Reversed: from the last element, stride -1.
            let r = gathered::<i32>(base.add(5 * 4), &[6], &[-1], 6).unwrap();
            assert_eq!(r, [5, 4, 3, 2, 1, 0]);
            // A row broadcast to 2 rows.
            let b = gathered::<i32>(base, &[2, 3], &[0, 1], 6).unwrap();
            assert_eq!(b, [0, 1, 2, 0, 1, 2]);
            // Every other element.
            let s = gathered::<i32>(base, &[3], &[2], 3).unwrap();
            assert_eq!(s, [0, 2, 4]);
        }
    }
}
