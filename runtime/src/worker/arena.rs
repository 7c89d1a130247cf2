//! Shared memory: an anonymous memfd, mapped here and (sent over the socket) in a worker.
//!
//! A memfd has no name anywhere: nothing appears in `/dev/shm`, and the memory is freed when the
//! last descriptor and mapping go, whichever process ends first and however it ends (a killed
//! program leaves nothing behind).

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};

/// Arenas start at 1 MiB and grow by powers of two.
const MIN_SIZE: usize = 1 << 20;

/// One memfd and this process's mapping of it (shared, read-write).
pub(crate) struct Arena {
    fd: OwnedFd,
    map: Arc<MmapRaw>,
}

impl Arena {
    /// A fresh arena of at least `needed` bytes.
    pub(crate) fn with_room_for(needed: usize) -> std::io::Result<Arena> {
        let size = needed
            .max(MIN_SIZE)
            .checked_next_power_of_two()
            .filter(|&s| isize::try_from(s).is_ok())
            .ok_or_else(|| std::io::Error::other(format!("an arena of {needed} bytes")))?;
        let fd = rustix::fs::memfd_create("pyop-worker-arena", rustix::fs::MemfdFlags::CLOEXEC)?;
        rustix::fs::ftruncate(&fd, size as u64)?;
        let file = File::from(fd.try_clone()?);
        let map = MmapOptions::new().len(size).map_raw(&file)?;
        Ok(Arena {
            fd,
            map: Arc::new(map),
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The mapping, kept alive by whoever holds a clone (a reply, a Python view of it).
    pub(crate) fn map(&self) -> &Arc<MmapRaw> {
        &self.map
    }

    /// Copies `src` to `offset`.
    ///
    /// # Safety
    /// No other thread or process may read or write `offset..offset + src.len()` meanwhile (the
    /// worker is between calls: it reads inputs only while it runs one).
    pub(crate) unsafe fn write(&self, offset: usize, src: &[u8]) {
        assert!(
            offset + src.len() <= self.len(),
            "arena write out of bounds"
        );
        // SAFETY: in bounds (asserted); the caller guarantees nothing else touches the range.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.map.as_mut_ptr().add(offset),
                src.len(),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arenas_round_up_and_are_shared() {
        let a = Arena::with_room_for(10).unwrap();
        assert_eq!(a.len(), MIN_SIZE);
        let b = Arena::with_room_for(MIN_SIZE + 1).unwrap();
        assert_eq!(b.len(), 2 * MIN_SIZE);
        assert!(Arena::with_room_for(usize::MAX).is_err());
        assert!(Arena::with_room_for(1 << 63).is_err());
        // SAFETY: nothing else has the arena.
        unsafe { a.write(5, b"hello") };
        // A second mapping of the same memfd sees the bytes (as the worker's does).
        let file = File::from(a.fd().try_clone_to_owned().unwrap());
        let other = MmapOptions::new().len(a.len()).map_raw(&file).unwrap();
        // SAFETY: in bounds of the mapping, and nothing writes meanwhile.
        let seen = unsafe { std::slice::from_raw_parts(other.as_ptr().add(5), 5) };
        assert_eq!(seen, b"hello");
    }
}
