//! The address range a region lives in: one memmap2 mapping (anonymous
//! regions, one-file shared regions), or one reserved range with several
//! files mapped into it back to back (multi-file shared regions), so the
//! data area is contiguous whatever backs it.

use std::io;
use std::os::fd::AsFd;
use std::ptr::NonNull;

use memmap2::{Advice, MmapRaw};
use rustix::mm::{MapFlags, ProtFlags};

/// Alignment of a multi-file region's data area: a transparent huge page,
/// so a tmpfs mounted with `huge=` can map it with 2 MiB pages.
pub(crate) const DATA_ALIGN: usize = 2 << 20;

/// The mapping of a region.
#[derive(Debug)]
pub(crate) enum Mapping {
    /// One memmap2 mapping.
    Raw(MmapRaw),
    /// A reserved range with files mapped into it.
    Pieces(Pieces),
}

impl Mapping {
    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        match self {
            Mapping::Raw(m) => m.as_mut_ptr(),
            Mapping::Pieces(p) => p.base.as_ptr(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Mapping::Raw(m) => m.len(),
            Mapping::Pieces(p) => p.len,
        }
    }

    /// `madvise(MADV_HUGEPAGE)` on `offset..offset+len` of the mapping.
    pub(crate) fn advise_huge(&self, offset: usize, len: usize) -> io::Result<()> {
        match self {
            Mapping::Raw(m) => m.advise_range(Advice::HugePage, offset, len),
            Mapping::Pieces(p) => {
                if offset.checked_add(len).is_none_or(|e| e > p.len) {
                    return Err(io::Error::from(io::ErrorKind::InvalidInput));
                }
                // SAFETY: the range lies inside the reservation this value
                // owns (checked above); MADV_HUGEPAGE only sets a flag on the
                // mappings there and never changes memory contents.
                unsafe {
                    rustix::mm::madvise(p.base.as_ptr().add(offset).cast(), len, rustix::mm::Advice::LinuxHugepage)
                }
                .map_err(io::Error::from)
            }
        }
    }
}

/// A reserved address range (`PROT_NONE`, no memory behind it until files
/// are mapped over it), unmapped as a whole on drop.
#[derive(Debug)]
pub(crate) struct Pieces {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: Pieces owns an address range like memmap2's MmapRaw does (which is
// Send and Sync): it hands out only raw pointers, whose use is the caller's
// contract; unmapping happens once, in Drop, with `&mut self`.
unsafe impl Send for Pieces {}
// SAFETY: see Send; `&Pieces` only reads the base and length.
unsafe impl Sync for Pieces {}

impl Pieces {
    /// Reserves `head + data` bytes such that `base + head` (the data area)
    /// is a multiple of `align` (a power of two, at least the page size:
    /// [`DATA_ALIGN`], or the hugetlbfs page, whose mappings must start on
    /// one); `head` is a multiple of the page size (of `align` on
    /// hugetlbfs, so `base` is aligned too).
    pub(crate) fn reserve_aligned(head: usize, data: usize, align: usize) -> io::Result<Pieces> {
        if !align.is_power_of_two() || align % rustix::param::page_size() != 0 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let len = head.checked_add(data).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        let over = len.checked_add(align).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a fresh private anonymous mapping at an address the kernel
        // picks: it cannot overlap any existing mapping, and PROT_NONE with
        // MAP_NORESERVE commits no memory.
        let raw = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                over,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }?;
        let raw = raw as usize;
        let data_start = (raw + head).next_multiple_of(align);
        let base = data_start - head;
        // Give back the slack before `base` and after `base + len`.
        let tail = base + len;
        // SAFETY: both ranges lie inside the reservation just made (base >=
        // raw and base + len <= raw + over because data_start - (raw + head)
        // < align), are page aligned (raw, head and align are),
        // and nothing refers to them.
        unsafe {
            if base > raw {
                rustix::mm::munmap(raw as *mut _, base - raw)?;
            }
            if raw + over > tail {
                rustix::mm::munmap(tail as *mut _, raw + over - tail)?;
            }
        }
        Ok(Pieces { base: NonNull::new(base as *mut u8).expect("mmap never returns null"), len })
    }

    /// Maps `len` bytes of `file` from its offset 0, shared and writable, at
    /// `offset` of the reservation, replacing what was there.
    pub(crate) fn map_file(&self, offset: usize, len: usize, file: impl AsFd) -> io::Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.len) || len == 0 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        // SAFETY: MAP_FIXED replaces whatever is mapped at the address; the
        // range lies inside this reservation (checked above), which this
        // value owns and which nothing else in the process refers to except
        // through the region built on it (not handed out before every piece
        // is mapped). The file is shared memory of the region.
        let p = unsafe {
            rustix::mm::mmap(
                self.base.as_ptr().add(offset).cast(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::FIXED,
                file,
                0,
            )
        }?;
        debug_assert_eq!(p as usize, self.base.as_ptr() as usize + offset);
        Ok(())
    }
}

impl Drop for Pieces {
    fn drop(&mut self) {
        // SAFETY: the range is this value's reservation (with the files
        // mapped over it); dropping the region that owns it means nothing
        // uses the memory any more (the region's contract for raw pointers).
        if let Err(e) = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) } {
            tracing::warn!(error = %e, "munmap of a region's reservation failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_data_area_lands_on_the_alignment_asked_for() {
        let page = rustix::param::page_size();
        for (head, align) in [(page, DATA_ALIGN), (2 << 20, 2 << 20), (1 << 30, 1 << 30), (3 * page, 64 << 20)] {
            let p = Pieces::reserve_aligned(head, 4 * page, align).unwrap();
            let data = p.base.as_ptr() as usize + head;
            assert_eq!(data % align, 0, "head {head}, align {align}");
            assert_eq!(p.len, head + 4 * page);
        }
        // Not a power of two, or below a page: refused.
        for bad in [3 << 20, page / 2] {
            assert_eq!(Pieces::reserve_aligned(page, page, bad).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        }
    }
}
