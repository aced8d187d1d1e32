//! Counting histograms of 16-bit bins of magnitude keys, and the walk that finds a rank in one.

use crate::scans::lock;
use std::sync::Mutex;

pub(super) const BINS: usize = 1 << 16;

/// Up to this many elements in a threshold's histogram bin are remembered in the second pass
/// (low bits and index, 8 bytes each: 2 MiB per cut), so ties at the threshold resolve without a
/// third pass. A bin with more reads again the one chunk its counts point to, which costs less
/// than remembering millions. `ties` on a 7B-shaped pair of models (2 cores): bf16 agent at
/// 1 << 22 (32 MiB per cut), 85–105 MB and 3.7–4.1 s; at 1 << 18, 21–24 MB and 1.9–2.0 s, the
/// same bytes; f32 agent 12 MB at both. At 1 << 16 the f32 agent's cuts fall back to a scan of
/// larger tiles (19 MB).
pub(super) const BIN_MEMORY: u64 = 1 << 18;

/// A histogram of 16-bit bins kept as four interleaved u32 counters per bin, element i counting
/// in counter i mod 4: task-vector magnitudes cluster in a few bins, and runs of increments to
/// one counter would each wait for the last one's store. u32 suffices: the methods that rank
/// elements index them with 32 bits.
pub(super) struct Bins16 {
    pub(super) counts: Vec<u32>,
    /// Counters per bin − 1.
    pub(super) ways: usize,
}

impl Bins16 {
    /// For a tensor of `numel` elements: small ones (norms, biases — a third of a model's
    /// tensors) get one counter per bin, as clearing and summing four would cost more than
    /// counting.
    pub(super) fn new(bins: usize, numel: u64) -> Bins16 {
        let ways = if numel >= 1 << 20 { 4 } else { 1 };
        let len = bins * ways;
        let reused = COUNTER_POOL.take(len);
        Bins16 {
            counts: reused.unwrap_or_else(|| vec![0; len]),
            ways: ways - 1,
        }
    }

    /// Adds the counts of bins `lo..lo + total.len()` into `total`, clearing those counters (the
    /// only ones counted in), and keeps the counters for the next histogram of the same size: a
    /// tensor's pass allocates, clears and sums several of these, and fresh ones cost page faults
    /// and a memset each.
    pub(super) fn drain_range(mut self, lo: usize, total: &mut [u64]) {
        let w = self.ways + 1;
        let counters = &mut self.counts[lo * w..(lo + total.len()) * w];
        for (t, c) in total.iter_mut().zip(counters.chunks_exact_mut(w)) {
            *t += c.iter().map(|&c| c as u64).sum::<u64>();
            c.fill(0);
        }
        COUNTER_POOL.give(std::mem::take(&mut self.counts));
    }

    /// Counts element `index` in `bin`.
    #[inline(always)]
    pub(super) fn add(&mut self, bin: u32, index: usize) {
        self.adder().add(bin, index)
    }

    /// The counters as a plain slice, for hot loops: a field of a struct behind `&mut` would be
    /// reloaded after every increment, as the compiler cannot tell the two apart.
    pub(super) fn adder(&mut self) -> BinsAdder<'_> {
        BinsAdder {
            counts: &mut self.counts,
            ways: self.ways,
            // Counters per bin are 1 or 4: a shift, not a multiply.
            shift: (self.ways + 1).trailing_zeros(),
        }
    }

    /// The count of one bin.
    pub(super) fn count(&self, bin: u32) -> u64 {
        let w = self.ways + 1;
        self.counts[bin as usize * w..(bin as usize + 1) * w]
            .iter()
            .map(|&c| c as u64)
            .sum()
    }

    /// The count of every bin.
    pub(super) fn totals(&self) -> Vec<u64> {
        self.counts
            .chunks_exact(self.ways + 1)
            .map(|w| w.iter().map(|&c| c as u64).sum())
            .collect()
    }
}

/// A free list of zeroed counter arrays: an allocation cache, like an allocator's, shared by the
/// histograms of every tensor. It hands over memory, never counts: only arrays whose every counter
/// is zero enter it ([`Bins16::drain_range`] clears what it counted; debug builds check the whole
/// array on the way out), so no tensor's histogram can start from another's state.
struct CounterPool(Mutex<Vec<Vec<u32>>>);

impl CounterPool {
    /// Arrays kept at most (a tensor's pass uses a few per worker and agent).
    const KEEP: usize = 16;

    /// A zeroed array of `len` counters, if one is free.
    fn take(&self, len: usize) -> Option<Vec<u32>> {
        let mut pool = lock(&self.0);
        let found = pool.iter().position(|c| c.len() == len)?;
        let counts = pool.swap_remove(found);
        debug_assert!(
            counts.iter().all(|&c| c == 0),
            "a pooled array was not cleared"
        );
        Some(counts)
    }

    /// Returns a zeroed array for later histograms (dropped when the pool is full).
    fn give(&self, counts: Vec<u32>) {
        let mut pool = lock(&self.0);
        if pool.len() < Self::KEEP {
            pool.push(counts);
        }
    }
}

static COUNTER_POOL: CounterPool = CounterPool(Mutex::new(Vec::new()));

/// [`Bins16::adder`].
pub(super) struct BinsAdder<'a> {
    pub(super) counts: &'a mut [u32],
    pub(super) ways: usize,
    pub(super) shift: u32,
}

impl BinsAdder<'_> {
    #[inline(always)]
    pub(super) fn add(&mut self, bin: u32, index: usize) {
        self.counts[((bin as usize) << self.shift) | (index & self.ways)] += 1;
    }
}

/// Walks down from the largest bin to the one holding rank k − 1: (bin, elements above it).
pub(super) fn locate(h: &[u64], k: u64) -> (usize, u64) {
    let mut above = 0u64;
    for bin in (0..h.len()).rev() {
        if above + h[bin] >= k {
            return (bin, above);
        }
        above += h[bin];
    }
    unreachable!("k is at most the element count")
}
