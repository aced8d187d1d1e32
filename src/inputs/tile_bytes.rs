//! The bytes a tile read lands in, starting on a cache line. A `pread` from the page cache is a
//! kernel copy whose speed depends on where the destination starts: measured on the development
//! machine (AMD EPYC, 128 KiB reads of cached files), 12.3 GB/s into a 64-byte-aligned buffer,
//! 8.6 GB/s into one 16 bytes past it — where glibc puts a block of 128 KiB or more (its header
//! in front of a fresh mapping), so a plain `Vec<u8>` tile buffer read at two thirds the speed.

use bytemuck::{Pod, Zeroable};

/// One cache line of bytes.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A byte buffer whose first byte is 64-byte aligned, kept from tile to tile: [`Self::resize_exact`]
/// as [`super::resize_exact`] does for a `Vec`.
#[derive(Default)]
pub struct TileBytes {
    lines: Vec<Line>,
    len: usize,
}

impl TileBytes {
    /// Makes the buffer `len` bytes long, for a tile that overwrites all of them (the contents
    /// are not kept): grown to exactly the lines `len` takes, the old allocation freed first.
    /// Lines are initialized once, when first used: a tensor's shorter last tile and the full
    /// one after it only move `len` (zeroing them again on every regrowth was 1 % of a `ties`
    /// merge).
    pub fn resize_exact(&mut self, len: usize) {
        let lines = len.div_ceil(64);
        if lines > self.lines.capacity() {
            self.lines = Vec::new();
            self.lines.reserve_exact(lines);
        }
        if lines > self.lines.len() {
            self.lines.resize(lines, Line([0; 64]));
        }
        self.len = len;
    }

    /// Bytes the buffer holds room for.
    pub fn capacity(&self) -> usize {
        self.lines.capacity() * 64
    }
}

impl std::ops::Deref for TileBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.lines)[..self.len]
    }
}

impl std::ops::DerefMut for TileBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.lines)[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length starts on a cache line and is as long as asked; growing keeps the bytes
    /// before (a `Vec`'s resize) — which no read relies on — and shrinking keeps the allocation.
    #[test]
    fn tile_bytes_start_on_a_cache_line() {
        let mut b = TileBytes::default();
        for len in [0usize, 1, 63, 64, 65, 4096, 131_072, 100, 131_073] {
            b.resize_exact(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % 64, 0, "length {len}");
            b.iter_mut().for_each(|x| *x = 7);
        }
        let room = b.capacity();
        b.resize_exact(10);
        assert_eq!(b.capacity(), room);
        assert!(b.iter().all(|&x| x == 7));
    }
}
