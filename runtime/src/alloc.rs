//! Buffers for outputs that pyop allocates itself, from the global allocator (the one candle frees
//! into, so a mid-size buffer is usually the previous call's, already mapped), written once, and
//! on Linux advised to use transparent huge pages from 4 MiB, as NumPy does for its own large
//! arrays. A fresh 64 MiB buffer then costs about 32 page faults on first write instead of 16,384
//! — the difference between a NumPy body writing into candle memory at NumPy's speed or at half
//! of it. Nothing here writes a buffer twice: a zeroed buffer that a body then overwrites costs a
//! second pass over the memory (30 µs at 4 MiB, a third of `x + 1`'s time there).

use std::alloc::Layout;

/// Plain numbers: all-zero bytes, and any bytes at all, are a valid value (what `bytemuck::Pod`
/// promises).
///
/// # Safety
/// Implement it only for types without padding, invalid bit patterns or drop glue.
pub(crate) unsafe trait Pod: Copy {}

// SAFETY: primitive integers and IEEE floats (half's are `repr(transparent)` over u16) accept
// every bit pattern and have no padding.
unsafe impl Pod for u8 {}
// SAFETY: as above.
unsafe impl Pod for u32 {}
// SAFETY: as above.
unsafe impl Pod for i16 {}
// SAFETY: as above.
unsafe impl Pod for i32 {}
// SAFETY: as above.
unsafe impl Pod for i64 {}
// SAFETY: as above.
unsafe impl Pod for half::f16 {}
// SAFETY: as above.
unsafe impl Pod for half::bf16 {}
// SAFETY: as above.
unsafe impl Pod for f32 {}
// SAFETY: as above.
unsafe impl Pod for f64 {}

/// Why a tensor of some size may not be made: the one check of every size a body controls, made
/// before candle, NumPy or pyop allocates (a failed allocation aborts the process).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// More bytes than any allocation can have (the element count or the byte count overflows,
    /// or passes `isize::MAX`): a `ValueError`.
    TooLarge,
    /// More memory than the system will give now: a `MemoryError`, with NumPy's wording.
    NoMemory(String),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::TooLarge => f.write_str("too many elements for any tensor"),
            Refusal::NoMemory(msg) => f.write_str(msg),
        }
    }
}

/// Below this, an allocation is not checked first (it cannot abort for size alone).
const CHECK_FROM: usize = 64 << 20;

/// Whether `elems` elements (`None`: a count that overflowed) of `dtype` can be allocated now.
pub(crate) fn check(elems: Option<usize>, dtype: candle_core::DType) -> Result<(), Refusal> {
    let bytes = elems.and_then(|n| n.checked_mul(dtype.size_in_bytes()));
    let Some(bytes) = bytes.filter(|&b| b <= isize::MAX as usize) else {
        return Err(Refusal::TooLarge);
    };
    // More than the machine's memory can never be filled, even where the kernel promises any
    // size (`vm.overcommit_memory=1`, common on GPU hosts: the reservation below succeeds there,
    // and the copy into it would end in the OOM killer).
    if bytes >= CHECK_FROM
        && (bytes as u64 > machine_memory() || Vec::<u8>::new().try_reserve_exact(bytes).is_err())
    {
        return Err(Refusal::NoMemory(format!(
            "Unable to allocate {:.2} GiB",
            bytes as f64 / (1u64 << 30) as f64
        )));
    }
    Ok(())
}

/// The machine's memory in bytes (at most 2^62: an arena's size is the next power of two, which
/// must fit `isize`), read once: `_SC_PHYS_PAGES` is a system call (`sysinfo`).
#[cfg(unix)]
pub(crate) fn machine_memory() -> u64 {
    static MEMORY: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *MEMORY.get_or_init(|| {
        // SAFETY: sysconf takes and returns plain integers.
        let (pages, page) = unsafe {
            (
                libc::sysconf(libc::_SC_PHYS_PAGES),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        let total = u64::try_from(pages)
            .ok()
            .zip(u64::try_from(page).ok())
            .and_then(|(n, p)| n.checked_mul(p))
            .unwrap_or(1 << 40);
        total.min(1 << 62)
    })
}

/// Without `sysconf`: 1 TiB.
#[cfg(not(unix))]
pub(crate) fn machine_memory() -> u64 {
    1 << 40
}

/// Why a buffer could not be made: the message of a `MemoryError`.
pub(crate) fn no_memory(n: usize, size: usize) -> String {
    format!(
        "Unable to allocate {:.2} GiB for {n} elements",
        (n as f64) * (size as f64) / (1u64 << 30) as f64
    )
}

/// `n` elements for foreign code to write: a numpy-mode body's `out` array, which NumPy fills
/// (like `np.empty`'s, its contents are unspecified until the body writes them). `None` when the
/// memory cannot be had (never an abort).
///
/// # Safety
/// The returned `Vec` must reach candle, or any Rust read, only after its data pointer has been
/// handed to foreign code that may write it (the body): what Rust then reads is whatever bytes
/// that code, or the allocator's earlier tenant of the memory, left there. Every `T` is `Pod`, so
/// any such bytes are a valid value; the compiler cannot assume the memory unwritten once the
/// pointer has escaped to foreign code.
pub(crate) unsafe fn for_foreign_writes<T: Pod>(n: usize) -> Option<Vec<T>> {
    let layout = Layout::array::<T>(n).ok()?;
    if layout.size() == 0 {
        return Some(Vec::new());
    }
    // SAFETY: a non-zero layout; the pointer comes from the global allocator with exactly the
    // layout `Vec<T>` with capacity `n` deallocates with; initialisation is the caller's promise
    // (above).
    unsafe {
        let ptr = std::alloc::alloc(layout);
        if ptr.is_null() {
            return None;
        }
        advise_huge_pages(ptr, layout.size());
        Some(Vec::from_raw_parts(ptr.cast::<T>(), n, n))
    }
}

/// A `Vec` of `n` elements copied from `n * size_of::<T>()` bytes at `src`, which need not be
/// aligned, or `None` when the memory cannot be had. The buffer gets the same huge-page advice as
/// [`for_foreign_writes`] and is written once.
///
/// # Safety
/// `src` must be readable for `n * size_of::<T>()` bytes.
pub(crate) unsafe fn copied_from_bytes<T: Pod>(src: *const u8, n: usize) -> Option<Vec<T>> {
    let layout = Layout::array::<T>(n).ok()?;
    if layout.size() == 0 {
        return Some(Vec::new());
    }
    // SAFETY: a non-zero layout; the copy initialises all `n` elements (any bytes are a valid
    // plain number) before `from_raw_parts` claims them, with the layout `Vec<T>` frees with.
    unsafe {
        let ptr = std::alloc::alloc(layout);
        if ptr.is_null() {
            return None;
        }
        advise_huge_pages(ptr, layout.size());
        std::ptr::copy_nonoverlapping(src, ptr, layout.size());
        Some(Vec::from_raw_parts(ptr.cast::<T>(), n, n))
    }
}

/// Below this, huge pages do not pay.
const HUGE_FROM: usize = 4 << 20;

#[cfg(target_os = "linux")]
pub(crate) fn advise_huge_pages(ptr: *mut u8, len: usize) {
    if len < HUGE_FROM {
        return;
    }
    const PAGE: usize = 4096;
    let start = (ptr as usize).div_ceil(PAGE) * PAGE;
    let end = (ptr as usize + len) / PAGE * PAGE;
    if end > start {
        // SAFETY: the range lies inside the allocation just made; madvise only gives a hint.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn advise_huge_pages(_: *mut u8, _: usize) {}

/// A CPU tensor for foreign code to write, in a buffer from [`for_foreign_writes`] (reused
/// memory, huge pages for large ones; unspecified contents, as `np.empty`'s).
///
/// # Safety
/// As [`for_foreign_writes`]: no Rust code may read the tensor's memory before its data pointer
/// has been handed to foreign code that may write it.
pub(crate) unsafe fn unwritten_tensor(
    dtype: candle_core::DType,
    dims: Vec<usize>,
) -> candle_core::Result<candle_core::Tensor> {
    let n = dims.iter().product();
    crate::spec::with_numpy_element!(
        dtype,
        // SAFETY: the caller's promise (above).
        T => match unsafe { for_foreign_writes::<T>(n) } {
            Some(v) => candle_core::Tensor::from_vec(v, dims, &candle_core::Device::Cpu),
            None => Err(candle_core::Error::Msg(no_memory(n, std::mem::size_of::<T>()))),
        },
        d => candle_core::Tensor::zeros(dims, d, &candle_core::Device::Cpu)
    )
}

/// A CPU tensor of `dtype` and `dims` holding a copy of the bytes at `src`, which need not be
/// aligned (one pass, into memory got as [`copied_from_bytes`] gets it): the one copy of foreign
/// bytes into candle (a NumPy array, a DLPack producer, a worker's result).
///
/// # Safety
/// `src` must be readable for the tensor's size in bytes.
pub(crate) unsafe fn tensor_from_bytes(
    dtype: candle_core::DType,
    src: *const u8,
    dims: Vec<usize>,
) -> candle_core::Result<candle_core::Tensor> {
    let n = dims.iter().product();
    crate::spec::with_plain_element!(
        dtype,
        // SAFETY: the caller's promise (above).
        T => match unsafe { copied_from_bytes::<T>(src, n) } {
            Some(v) => candle_core::Tensor::from_vec(v, dims, &candle_core::Device::Cpu),
            None => Err(candle_core::Error::Msg(no_memory(n, std::mem::size_of::<T>()))),
        },
        d => match d {
            // fp8 (from ml_dtypes' float8_e4m3fn): candle copies its bytes.
            candle_core::DType::F8E4M3 => {
                let bytes: &[u8] = if n == 0 {
                    &[]
                } else {
                    // SAFETY: the caller's promise (above): `n` one-byte elements.
                    unsafe { std::slice::from_raw_parts(src, n) }
                };
                candle_core::Tensor::from_raw_buffer(bytes, d, &dims, &candle_core::Device::Cpu)
            }
            d => Err(candle_core::Error::Msg(format!("{} has no plain element type", d.as_str()))),
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    #[test]
    fn sizes_past_the_machines_memory_are_refused_whatever_the_kernel_promises() {
        let memory = machine_memory() as usize;
        assert!(memory >= CHECK_FROM, "{memory}");
        // One byte past it: refused as NumPy words it, even where a reservation of that size
        // would succeed (`vm.overcommit_memory=1`).
        let past = check(Some(memory + 1), DType::U8).unwrap_err();
        let gib = (memory + 1) as f64 / (1u64 << 30) as f64;
        assert_eq!(
            past,
            Refusal::NoMemory(format!("Unable to allocate {gib:.2} GiB"))
        );
        // What overflows, or passes isize::MAX, is too large for any tensor.
        assert_eq!(check(None, DType::F32), Err(Refusal::TooLarge));
        assert_eq!(
            check(Some(usize::MAX / 2), DType::F32),
            Err(Refusal::TooLarge)
        );
        // Small sizes are not checked at all.
        assert_eq!(check(Some(1000), DType::F64), Ok(()));
    }
}
