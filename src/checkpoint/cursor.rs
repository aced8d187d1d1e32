//! Little-endian fields read in order from a byte slice, each read checked against its length:
//! the zip directory's records ([`super::zip`]) and a pickle's opcodes ([`super::pickle`]).

use anyhow::{Context, Result};

/// A position in a byte slice.
pub struct Cursor<'a> {
    bytes: &'a [u8],
    /// The next byte's index.
    pub at: usize,
    /// What running out of bytes means, for the error (`a zip record ends before its fields`).
    short: &'static str,
}

impl<'a> Cursor<'a> {
    /// A cursor at the start of `bytes`; `short` says what reading past their end means.
    pub fn new(bytes: &'a [u8], short: &'static str) -> Self {
        Cursor {
            bytes,
            at: 0,
            short,
        }
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.with_context(|| format!("{} (byte {})", self.short, self.at))?;
        let part = &self.bytes[self.at..end];
        self.at = end;
        Ok(part)
    }

    /// The bytes not read yet.
    pub fn rest(&self) -> &'a [u8] {
        &self.bytes[self.at..]
    }

    /// The next u8, little-endian.
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    /// The next u16, little-endian.
    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    /// The next u32, little-endian.
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    /// The next u64, little-endian.
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// The next `N` bytes as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }
}
