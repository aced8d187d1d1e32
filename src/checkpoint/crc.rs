//! CRC-32 of a byte stream whose pieces arrive out of order: tile workers read and write tiles in
//! whatever order they finish, and the merge record still holds each file's CRC without a second read.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// The running CRC-32 of bytes `0..done` of a stream, plus pieces seen beyond `done` that wait for
/// the gap before them to close. Each piece is hashed by its caller, outside the lock, while its
/// bytes are still in cache; folding a piece in costs a CRC combine, not a pass over the bytes.
#[derive(Default)]
pub struct CrcStream {
    done: u64,
    crc: crc32fast::Hasher,
    /// Start → (length, CRC-32) of pieces beyond `done`; `None` while none waits (most of the
    /// time, and always for a one-tile tensor: 8 bytes per stream, not an empty map's 24 and
    /// its root node).
    #[allow(clippy::box_collection)] // the point: 8 bytes inline instead of the map's 24
    pending: Option<Box<BTreeMap<u64, (u64, crc32fast::Hasher)>>>,
}

fn crc_of(bytes: &[u8]) -> crc32fast::Hasher {
    let mut h = crc32fast::Hasher::new();
    h.update(bytes);
    h
}

impl CrcStream {
    /// A stream whose first bytes are already hashed in `crc` (e.g. a file's header).
    pub fn starting_with(crc: crc32fast::Hasher, len: u64) -> CrcStream {
        CrcStream {
            done: len,
            crc,
            pending: None,
        }
    }

    /// Records that `bytes` sit at `start` in the stream. Bytes already covered (a second pass
    /// over the same range) change nothing; a piece that overlaps the covered prefix contributes
    /// its uncovered tail.
    pub fn record(stream: &Mutex<CrcStream>, start: u64, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let end = start + bytes.len() as u64;
        if end <= lock(stream).done {
            return;
        }
        let piece = crc_of(bytes);
        let mut s = lock(stream);
        if start == s.done && s.pending.is_none() {
            // In order: no piece waits. The common case, and the only one of a one-tile tensor.
            s.crc.combine(&piece);
            s.done = end;
            return;
        }
        if start >= s.done {
            s.pending
                .get_or_insert_with(Default::default)
                .entry(start)
                .or_insert((bytes.len() as u64, piece));
        } else if end > s.done {
            // Rare: tiles of another size than the pass before (whole-row tiles). Hash the tail.
            let skip = (s.done - start) as usize;
            let tail = crc_of(&bytes[skip..]);
            let at = s.done;
            s.pending
                .get_or_insert_with(Default::default)
                .insert(at, (bytes.len() as u64 - skip as u64, tail));
        }
        s.drain();
    }

    /// Folds in every pending piece that now continues the covered prefix.
    fn drain(&mut self) {
        let Some(pending) = self.pending.as_mut() else {
            return;
        };
        while let Some(entry) = pending.first_entry() {
            let start = *entry.key();
            if start > self.done {
                break;
            }
            let (len, piece) = entry.remove();
            if start == self.done {
                self.crc.combine(&piece);
                self.done += len;
            }
        }
        if pending.is_empty() {
            self.pending = None;
        }
    }

    /// Bytes `0..done` are hashed.
    pub fn done(&self) -> u64 {
        self.done
    }

    /// The CRC-32 of bytes `0..done`.
    pub fn crc(&self) -> &crc32fast::Hasher {
        &self.crc
    }
}

/// The stream's lock; a worker that panicked mid-update leaves a stream that is still consistent
/// (each update is a whole piece), so a poisoned lock is taken as is.
pub fn lock(stream: &Mutex<CrcStream>) -> std::sync::MutexGuard<'_, CrcStream> {
    stream.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_in_any_order_give_the_crc_of_the_whole() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let whole = crc_of(&bytes).finalize();
        let cuts = [0usize, 700, 1000, 4096, 4097, 9000, 10_000];
        let pieces: Vec<(usize, usize)> = cuts.windows(2).map(|w| (w[0], w[1])).collect();
        for order in [
            vec![0, 1, 2, 3, 4, 5],
            vec![5, 4, 3, 2, 1, 0],
            vec![2, 0, 5, 1, 4, 3],
        ] {
            let s = Mutex::new(CrcStream::default());
            for &p in &order {
                let (a, b) = pieces[p];
                CrcStream::record(&s, a as u64, &bytes[a..b]);
                // A repeated piece (a second pass) changes nothing.
                CrcStream::record(&s, a as u64, &bytes[a..b]);
            }
            let s = s.into_inner().unwrap();
            assert_eq!(s.done(), bytes.len() as u64);
            assert_eq!(s.crc().clone().finalize(), whole, "order {order:?}");
        }
    }

    #[test]
    fn a_piece_overlapping_the_covered_prefix_adds_its_tail() {
        let bytes: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 253) as u8).collect();
        let s = Mutex::new(CrcStream::default());
        CrcStream::record(&s, 0, &bytes[..3000]);
        CrcStream::record(&s, 4000, &bytes[4000..]);
        CrcStream::record(&s, 2048, &bytes[2048..4000]);
        let s = s.into_inner().unwrap();
        assert_eq!(s.done(), 5000);
        assert_eq!(s.crc().clone().finalize(), crc_of(&bytes).finalize());
    }

    #[test]
    fn a_gap_leaves_the_prefix_before_it() {
        let bytes = [1u8; 100];
        let s = Mutex::new(CrcStream::starting_with(crc_of(&bytes[..10]), 10));
        CrcStream::record(&s, 50, &bytes[50..]);
        CrcStream::record(&s, 10, &bytes[10..20]);
        let s = s.into_inner().unwrap();
        assert_eq!(s.done(), 20);
        assert_eq!(s.crc().clone().finalize(), crc_of(&bytes[..20]).finalize());
    }
}
