//! Buffers for outputs that pyop allocates itself: zeroed without touching the memory, and on
//! Linux advised to use transparent huge pages, as NumPy does for its own large arrays. A fresh
//! 64 MiB buffer then costs 32 page faults on first write instead of 16,384 — the difference
//! between a NumPy body writing into candle memory at NumPy's speed or at half of it.

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

/// Why a buffer could not be made: the message of a `MemoryError`.
pub(crate) fn no_memory(n: usize, size: usize) -> String {
    format!(
        "Unable to allocate {:.2} GiB for {n} elements",
        (n as f64) * (size as f64) / (1u64 << 30) as f64
    )
}

/// `n` zeros, allocated with the layout `Vec<T>` frees with; `None` when the memory cannot be
/// had (never an abort).
pub(crate) fn zeroed<T: Pod>(n: usize) -> Option<Vec<T>> {
    let layout = Layout::array::<T>(n).ok()?;
    if layout.size() == 0 {
        return Some(Vec::new());
    }
    // SAFETY: the layout has a non-zero size; all-zero bytes are a valid `T` (`Pod`); the
    // pointer comes from the global allocator with exactly the layout `Vec<T>` with capacity `n`
    // deallocates with, and holds `n` initialised elements.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout);
        if ptr.is_null() {
            return None;
        }
        advise_huge_pages(ptr, layout.size());
        Some(Vec::from_raw_parts(ptr.cast::<T>(), n, n))
    }
}

/// A `Vec` of `n` elements copied from `n * size_of::<T>()` bytes at `src`, which need not be
/// aligned, or `None` when the memory cannot be had. The buffer gets the same huge-page advice as
/// [`zeroed`] and is written once.
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
fn advise_huge_pages(ptr: *mut u8, len: usize) {
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
fn advise_huge_pages(_: *mut u8, _: usize) {}
