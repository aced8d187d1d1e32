//! Per-tensor statistics of the mergekit-family methods, gathered by scans over the tensor's
//! tiles before its merge pass: exact rank cuts by magnitude (histograms, never a sort), L1 norms
//! for rescaling, Gram sums for Model Stock and row moments for slerp. Sums are f64 in element
//! order, so every backend merges with the same coefficients.

use super::combine::{
    hash_key, magnitude_key, random_threshold, row_ranks, variance_key, CombineSpec, Keep,
    Normalize, RankCut, VarianceCut,
};
use super::plan::{BaseTerm, Sparsify, TensorRecipe};
use crate::simd::multiversion;
use anyhow::{Context, Result};
use rayon::prelude::*;
use std::ops::ControlFlow;
use std::sync::Mutex;

/// One tile's values: `base` = θ₀, `x[t]` = θ_t, `tau[t]` = θ_t − θ₀ in f32; `start` = tensor
/// index of element 0.
pub struct Values<'a> {
    pub start: u64,
    pub base: &'a [f32],
    pub x: &'a [Vec<f32>],
    pub tau: &'a [Vec<f32>],
}

/// What a whole-tile scan does with each tile: `Break` ends the scan early.
pub type Visit<'v> = dyn FnMut(&Values) -> Result<ControlFlow<()>> + 'v;

/// One agent's values over a short run of elements (cache-sized).
pub struct AgentChunk<'a> {
    /// Tensor index of element 0.
    pub start: u64,
    pub base: &'a [f32],
    pub x: &'a [f32],
    pub tau: &'a [f32],
}

impl AgentChunk<'_> {
    fn v(&self, delta: bool) -> &[f32] {
        if delta {
            self.tau
        } else {
            self.x
        }
    }
}

/// What a per-agent scan does with agent `t`'s next chunk: `Break` when that agent is done.
pub type AgentVisit<'v> = dyn Fn(usize, &AgentChunk) -> ControlFlow<()> + Sync + 'v;

/// What an any-order scan does with a chunk: `(worker, agent, tensor index of the chunk's first
/// element, the agent's values there)`.
pub type AnyOrderVisit<'v> = dyn Fn(usize, usize, u64, &[f32]) + Sync + 'v;

/// The ways to scan a tensor's tiles.
pub trait Scans {
    /// Whole tiles in order, every agent at once (for statistics across agents).
    fn tiles(&mut self, visit: &mut Visit) -> Result<()>;
    /// Each agent's values in element order, chunk by chunk, agents in parallel; ends when every
    /// agent is done or the tensor is.
    /// Starting at the chunk holding element `from` (0: the whole tensor); from elsewhere, read in
    /// small tiles, as such a scan is meant to stop soon.
    fn per_agent(&mut self, from: u64, visit: &AgentVisit) -> Result<()>;
    /// Threads an any-order scan runs on: `visit`'s worker argument is below this.
    fn workers(&self) -> usize;
    /// Every agent's values in chunks of [`SCAN_CHUNK`] elements that start at multiples of
    /// [`SCAN_CHUNK`] (the last may be shorter), in any order, on [`Self::workers`] threads at
    /// once — for statistics that do not depend on order (counts), or that keep a result per
    /// chunk and combine them in order. The fastest scan: every core busy, each tile read once.
    /// With `every` > 1, a sample: about one chunk in `every`, spread over the tensor. The values
    /// are task vectors τ with `delta`, else the agents' θ.
    fn any_order(&mut self, every: usize, delta: bool, visit: &AnyOrderVisit) -> Result<()>;
}

/// Per-(worker, agent) states of an any-order scan, at `worker * agents + agent`: each is only
/// touched by its worker.
fn worker_states<S>(workers: usize, agents: usize, init: impl Fn(usize) -> S) -> Vec<Mutex<S>> {
    (0..workers * agents)
        .map(|i| Mutex::new(init(i % agents)))
        .collect()
}

/// Per-agent state of a per-agent scan: each agent's state is only touched by the thread running
/// that agent, so its lock is never contended.
fn states<S>(items: impl IntoIterator<Item = S>) -> Vec<Mutex<S>> {
    items.into_iter().map(Mutex::new).collect()
}

fn unlock<S>(m: Mutex<S>) -> S {
    m.into_inner().unwrap_or_else(|p| p.into_inner())
}

fn lock<S>(m: &Mutex<S>) -> std::sync::MutexGuard<'_, S> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

const BINS: usize = 1 << 16;

/// Up to this many elements in a threshold's histogram bin are remembered in the second pass
/// (low bits and index, 8 bytes each), so ties at the threshold resolve without a third pass.
const BIN_MEMORY: u64 = 1 << 22;

/// A histogram of 16-bit bins kept as four interleaved u32 counters per bin, element i counting
/// in counter i mod 4: task-vector magnitudes cluster in a few bins, and runs of increments to
/// one counter would each wait for the last one's store. u32 suffices: the methods that rank
/// elements index them with 32 bits.
struct Bins16 {
    counts: Vec<u32>,
    /// Counters per bin − 1.
    ways: usize,
}

impl Bins16 {
    /// For a tensor of `numel` elements: small ones (norms, biases — a third of a model's
    /// tensors) get one counter per bin, as clearing and summing four would cost more than
    /// counting.
    fn new(bins: usize, numel: u64) -> Bins16 {
        let ways = if numel >= 1 << 20 { 4 } else { 1 };
        let len = bins * ways;
        let reused = {
            let mut pool = lock(&CLEAR_COUNTERS);
            let found = pool.iter().position(|c| c.len() == len);
            found.map(|i| pool.swap_remove(i))
        };
        Bins16 {
            counts: reused.unwrap_or_else(|| vec![0; len]),
            ways: ways - 1,
        }
    }

    /// Adds the counts of bins `lo..lo + total.len()` into `total`, clearing those counters (the
    /// only ones counted in), and keeps the counters for the next histogram of the same size: a
    /// tensor's pass allocates, clears and sums several of these, and fresh ones cost page faults
    /// and a memset each.
    fn drain_range(mut self, lo: usize, total: &mut [u64]) {
        let w = self.ways + 1;
        let counters = &mut self.counts[lo * w..(lo + total.len()) * w];
        for (t, c) in total.iter_mut().zip(counters.chunks_exact_mut(w)) {
            *t += c.iter().map(|&c| c as u64).sum::<u64>();
            c.fill(0);
        }
        let mut pool = lock(&CLEAR_COUNTERS);
        if pool.len() < 16 {
            pool.push(std::mem::take(&mut self.counts));
        }
    }

    /// Counts element `index` in `bin`.
    #[inline(always)]
    fn add(&mut self, bin: u32, index: usize) {
        self.adder().add(bin, index)
    }

    /// The counters as a plain slice, for hot loops: a field of a struct behind `&mut` would be
    /// reloaded after every increment, as the compiler cannot tell the two apart.
    fn adder(&mut self) -> BinsAdder<'_> {
        BinsAdder {
            counts: &mut self.counts,
            ways: self.ways,
            // Counters per bin are 1 or 4: a shift, not a multiply.
            shift: (self.ways + 1).trailing_zeros(),
        }
    }

    /// The count of one bin.
    fn count(&self, bin: u32) -> u64 {
        let w = self.ways + 1;
        self.counts[bin as usize * w..(bin as usize + 1) * w]
            .iter()
            .map(|&c| c as u64)
            .sum()
    }

    /// The count of every bin.
    fn totals(&self) -> Vec<u64> {
        self.counts
            .chunks_exact(self.ways + 1)
            .map(|w| w.iter().map(|&c| c as u64).sum())
            .collect()
    }
}

/// Zeroed counter arrays of drained histograms, for the next ones ([`Bins16::drain_range`]).
static CLEAR_COUNTERS: Mutex<Vec<Vec<u32>>> = Mutex::new(Vec::new());

/// [`Bins16::adder`].
struct BinsAdder<'a> {
    counts: &'a mut [u32],
    ways: usize,
    shift: u32,
}

impl BinsAdder<'_> {
    #[inline(always)]
    fn add(&mut self, bin: u32, index: usize) {
        self.counts[((bin as usize) << self.shift) | (index & self.ways)] += 1;
    }
}

/// Walks down from the largest bin to the one holding rank k − 1: (bin, elements above it).
fn locate(h: &[u64], k: u64) -> (usize, u64) {
    let mut above = 0u64;
    for bin in (0..h.len()).rev() {
        if above + h[bin] >= k {
            return (bin, above);
        }
        above += h[bin];
    }
    unreachable!("k is at most the element count")
}

/// A run of high bins `lo..=hi` (the top 16 bits of magnitude keys) that a histogram pass
/// counts bin by bin; keys above and below it are only counted.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Band {
    lo: u32,
    hi: u32,
}

impl Band {
    /// Every bin: a full histogram.
    const ALL: Band = Band {
        lo: 0,
        hi: (BINS / 2 - 1) as u32,
    };

    /// The band around some bins (at least one).
    fn around(bins: &[u32]) -> Band {
        Band {
            lo: *bins.iter().min().expect("a bin"),
            hi: *bins.iter().max().expect("a bin"),
        }
    }

    /// The smallest and the largest key in the band.
    fn keys(self) -> (u32, u32) {
        (self.lo << 16, (self.hi << 16) | 0xffff)
    }
}

/// What [`band_bits`] counts besides its bits.
#[derive(Clone, Copy, Debug, PartialEq)]
struct BandTally {
    /// Keys above the band.
    above: u64,
    /// Keys in the band (non-zero).
    inside: u64,
}

impl BandTally {
    const NONE: BandTally = BandTally {
        above: 0,
        inside: 0,
    };

    fn add(&mut self, o: BandTally) {
        self.above += o.above;
        self.inside += o.inside;
    }
}

/// Bit `i % 64` of `inside[i / 64]`: whether element i's magnitude key is non-zero and in
/// `band`; of `low[i / 64]`: whether it is also not a multiple of 2^16 (its bin holds more than
/// one key). Keys above the band are only counted; zeros and keys below it, neither (the rest).
/// With AVX2, eight elements per compare and `movemask`; with AVX-512, sixteen per compare into
/// mask registers (compilers do not find either for bit packing); the same result every way.
fn band_bits(v: &[f32], band: Band, inside: &mut [u64], low: &mut [u64]) -> BandTally {
    let whole = v.len() / 64;
    let (blocks, rest) = v.split_at(whole * 64);
    #[cfg(target_arch = "x86_64")]
    let mut tally = {
        use crate::simd::{level, Level};
        match level() {
            // SAFETY: the CPU supports AVX-512 F/BW/VL, detected by `level`; every block read
            // is 64 elements.
            Level::Avx512 => unsafe { band_bits_avx512(blocks, band, inside, low) },
            // SAFETY: the CPU supports AVX2, detected by `level`; blocks of 64 elements.
            Level::Avx2 => unsafe { band_bits_avx2(blocks, band, inside, low) },
            Level::Baseline => band_bits_scalar(blocks, band, inside, low),
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let mut tally = band_bits_scalar(blocks, band, inside, low);
    tally.add(band_bits_scalar(
        rest,
        band,
        &mut inside[whole..],
        &mut low[whole..],
    ));
    tally
}

fn band_bits_scalar(v: &[f32], band: Band, inside: &mut [u64], low: &mut [u64]) -> BandTally {
    let (first, last) = band.keys();
    let (mut above, mut count) = (0, 0);
    for ((x, n), l) in v.chunks(64).zip(inside.iter_mut()).zip(low.iter_mut()) {
        let (mut wn, mut wl) = (0u64, 0u64);
        for (i, &e) in x.iter().enumerate() {
            let key = magnitude_key(e);
            above += (key > last) as u64;
            let is_in = (key != 0) & (key <= last) & (key >= first);
            wn |= (is_in as u64) << i;
            wl |= ((is_in & (key & 0xffff != 0)) as u64) << i;
        }
        count += wn.count_ones() as u64;
        *n = wn;
        *l = wl;
    }
    BandTally {
        above,
        inside: count,
    }
}

/// [`band_bits`] over whole blocks of 64 elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn band_bits_avx2(v: &[f32], band: Band, inside: &mut [u64], low: &mut [u64]) -> BandTally {
    use std::arch::x86_64::*;
    let (first, last_key) = band.keys();
    // Keys are below 2^31: signed compares order them. From bin 0 on, a key is in the band
    // unless zero; from a later bin, unless below its first key (then it is not zero either).
    let from_zero = first == 0;
    let below_first = _mm256_set1_epi32(first as i32 - 1);
    let last = _mm256_set1_epi32(last_key as i32);
    let magnitude = _mm256_set1_epi32(0x7fff_ffff);
    let low_bits = _mm256_set1_epi32(0xffff);
    let zero = _mm256_setzero_si256();
    // Per-lane counts (a true compare is −1), reduced at the end.
    let mut above = zero;
    let mut count = 0u64;
    for ((x, n), l) in v
        .chunks_exact(64)
        .zip(inside.iter_mut())
        .zip(low.iter_mut())
    {
        let (mut wn, mut wl) = (0u64, 0u64);
        for (g, group) in x.chunks_exact(8).enumerate() {
            // SAFETY: `group` holds eight f32 (32 bytes); unaligned loads are allowed.
            let bits = unsafe { _mm256_loadu_si256(group.as_ptr().cast()) };
            let key = _mm256_and_si256(bits, magnitude);
            let is_above = _mm256_cmpgt_epi32(key, last);
            let is_in = if from_zero {
                _mm256_andnot_si256(
                    _mm256_or_si256(_mm256_cmpeq_epi32(key, zero), is_above),
                    _mm256_set1_epi32(-1),
                )
            } else {
                _mm256_andnot_si256(is_above, _mm256_cmpgt_epi32(key, below_first))
            };
            let low_zero = _mm256_cmpeq_epi32(_mm256_and_si256(key, low_bits), zero);
            let is_low = _mm256_andnot_si256(low_zero, is_in);
            above = _mm256_sub_epi32(above, is_above);
            let mi = _mm256_movemask_ps(_mm256_castsi256_ps(is_in)) as u64;
            let ml = _mm256_movemask_ps(_mm256_castsi256_ps(is_low)) as u64;
            wn |= mi << (8 * g);
            wl |= ml << (8 * g);
        }
        count += wn.count_ones() as u64;
        *n = wn;
        *l = wl;
    }
    let lanes = |v: __m256i| -> [i32; 8] {
        let mut out = [0i32; 8];
        // SAFETY: `out` holds eight i32 (32 bytes).
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), v) };
        out
    };
    BandTally {
        above: lanes(above).iter().map(|&c| c as u64).sum(),
        inside: count,
    }
}

/// [`band_bits_avx2`] with AVX-512: sixteen elements per compare, straight into bit masks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn band_bits_avx512(v: &[f32], band: Band, inside: &mut [u64], low: &mut [u64]) -> BandTally {
    use std::arch::x86_64::*;
    let (first, last_key) = band.keys();
    // As in `band_bits_avx2`: keys are below 2^31, so signed compares order them.
    let from_zero = first == 0;
    let below_first = _mm512_set1_epi32(first as i32 - 1);
    let last = _mm512_set1_epi32(last_key as i32);
    let magnitude = _mm512_set1_epi32(0x7fff_ffff);
    let low_bits = _mm512_set1_epi32(0xffff);
    let zero = _mm512_setzero_si512();
    let (mut above, mut count) = (0u64, 0u64);
    for ((x, n), l) in v
        .chunks_exact(64)
        .zip(inside.iter_mut())
        .zip(low.iter_mut())
    {
        let (mut wn, mut wl, mut wa) = (0u64, 0u64, 0u64);
        for (g, group) in x.chunks_exact(16).enumerate() {
            // SAFETY: `group` holds sixteen f32 (64 bytes); unaligned loads are allowed.
            let bits = unsafe { _mm512_loadu_si512(group.as_ptr().cast()) };
            let key = _mm512_and_si512(bits, magnitude);
            let is_above = _mm512_cmpgt_epi32_mask(key, last);
            let is_in = if from_zero {
                !(_mm512_cmpeq_epi32_mask(key, zero) | is_above)
            } else {
                _mm512_cmpgt_epi32_mask(key, below_first) & !is_above
            };
            let is_low = _mm512_mask_test_epi32_mask(is_in, key, low_bits);
            wn |= (is_in as u64) << (16 * g);
            wl |= (is_low as u64) << (16 * g);
            wa |= (is_above as u64) << (16 * g);
        }
        count += wn.count_ones() as u64;
        above += wa.count_ones() as u64;
        *n = wn;
        *l = wl;
    }
    BandTally {
        above,
        inside: count,
    }
}

multiversion! {
    /// Bit `i % 64` of `bits[i / 64]`: whether element i's magnitude key is non-zero and, when
    /// `in_bin` is given, has those high 16 bits.
    fn key_bits(v: &[f32], in_bin: Option<u32>, bits: &mut [u64]) {
        let (bin, any) = (in_bin.unwrap_or(0), in_bin.is_none());
        for (x, word) in v.chunks(64).zip(bits.iter_mut()) {
            let mut w = 0u64;
            for (i, &e) in x.iter().enumerate() {
                let key = magnitude_key(e);
                let pass = (key != 0) & ((key >> 16 == bin) | any);
                w |= (pass as u64) << i;
            }
            *word = w;
        }
    }
}

/// Calls `f(index, key)` for each element with a non-zero magnitude key in high bin `in_bin`
/// (any bin: `None`): a bit mask first (vectorized), then only the set bits — cheap on sparse
/// task vectors and on a single bin.
#[inline(always)]
fn for_each_key(v: &[f32], in_bin: Option<u32>, mut f: impl FnMut(usize, u32)) {
    let mut bits = [0u64; 64];
    for (chunk, x) in v.chunks(64 * 64).enumerate() {
        let words = x.len().div_ceil(64);
        key_bits(x, in_bin, &mut bits[..words]);
        for (w, &word) in bits[..words].iter().enumerate() {
            let mut word = word;
            while word != 0 {
                let i = (chunk * 64 + w) * 64 + word.trailing_zeros() as usize;
                f(i, magnitude_key(v[i]));
                word &= word - 1;
            }
        }
    }
}

fn nonzero_count(v: &[f32]) -> u64 {
    v.iter().map(|&e| (magnitude_key(e) != 0) as u64).sum()
}

/// The third pass's search for where cut `cut` splits the elements tied at key `key`: the index
/// just past the `m`-th of them, counting from element `from`, `seen` of them being before it.
struct TieSearch {
    cut: usize,
    key: u32,
    m: u64,
    from: u64,
    seen: u64,
    found: Option<u32>,
}

/// Where a cut splits the elements tied at its threshold, when the bin's record cannot tell: the
/// `m`-th of them in index order, `before` of them lying before element `from`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Split {
    m: u64,
    from: u64,
    before: u64,
}

/// One high bin's elements as a scan records them: the (low 16 bits, index) of each while they
/// fit in `memory`, else a histogram of their low 16 bits; and how many fell in each chunk, so a
/// split in a bin of one key can be found by reading a single chunk again.
struct BinScan {
    bin: u32,
    /// Remembered members (in index order once [`Self::in_index_order`] ran), while `low` and
    /// `one_key` are None.
    members: Vec<(u16, u32)>,
    low: Option<Bins16>,
    /// Instead of either: the bin holds this many elements, all with the key `bin << 16`.
    one_key: Option<u64>,
    /// Zero keys (bin 0 only), counted by difference; never members, never split.
    zeros: u64,
    /// (chunk start, non-zero elements of the bin in it), for chunks that had some.
    chunks: Vec<(u64, u32)>,
    in_chunk: u32,
    /// Members one record may hold before it turns to a histogram.
    memory: usize,
    numel: u64,
}

impl BinScan {
    fn new(bin: u32, memory: usize, numel: u64) -> BinScan {
        BinScan {
            bin,
            members: Vec::new(),
            low: None,
            one_key: None,
            zeros: 0,
            chunks: Vec::new(),
            in_chunk: 0,
            memory,
            numel,
        }
    }

    /// The record of a bin whose `count` non-zero elements all have the key `bin << 16`, with
    /// their counts per chunk when pass 1 followed the bin.
    fn of_one_key(bin: u32, count: u64, chunks: Option<Vec<(u64, u32)>>, numel: u64) -> BinScan {
        let mut scan = BinScan::new(bin, 0, numel);
        scan.one_key = Some(count);
        scan.chunks = chunks.unwrap_or_default();
        scan
    }

    /// Records the non-zero element at tensor index `index` with key `key` (in this bin).
    #[inline(always)]
    fn record(&mut self, key: u32, index: u64) {
        self.in_chunk += 1;
        match &mut self.low {
            Some(h) => h.add(key & 0xffff, index as usize),
            None => {
                self.members.push((key as u16, index as u32));
                if self.members.len() > self.memory {
                    self.turn_to_histogram();
                }
            }
        }
    }

    /// Closes the chunk starting at `start`, which held `zeros` zero keys.
    fn end_chunk(&mut self, start: u64, zeros: u64) {
        if self.in_chunk > 0 {
            self.chunks.push((start, self.in_chunk));
            self.in_chunk = 0;
        }
        if self.bin == 0 {
            self.zeros += zeros;
        }
    }

    /// One chunk's elements of this bin, found by their own mask.
    fn scan_chunk(&mut self, v: &[f32], start: u64) {
        for_each_key(v, Some(self.bin), |j, key| {
            self.record(key, start + j as u64)
        });
        let zeros = if self.bin == 0 {
            v.len() as u64 - nonzero_count(v)
        } else {
            0
        };
        self.end_chunk(start, zeros);
    }

    fn turn_to_histogram(&mut self) {
        if self.low.is_none() {
            let mut h = Bins16::new(BINS, self.numel);
            for &(low, index) in &self.members {
                h.add(low as u32, index as usize);
            }
            self.members = Vec::new();
            self.low = Some(h);
        }
    }

    /// Adds another worker's record of the same bin; members stay while both kept theirs and
    /// together they fit in `limit`.
    fn absorb(&mut self, mut other: BinScan, limit: usize) {
        self.zeros += other.zeros;
        self.chunks.append(&mut other.chunks);
        let both_listed = self.low.is_none() && other.low.is_none();
        if both_listed && self.members.len() + other.members.len() <= limit {
            self.members.append(&mut other.members);
            return;
        }
        self.turn_to_histogram();
        other.turn_to_histogram();
        let (Some(a), Some(b)) = (&mut self.low, &other.low) else {
            unreachable!("both are histograms now")
        };
        for (x, y) in a.counts.iter_mut().zip(&b.counts) {
            *x += y;
        }
    }

    /// Members and chunks sorted by index (workers saw their tiles in any order).
    fn in_index_order(mut self) -> BinScan {
        self.members.sort_unstable_by_key(|&(_, index)| index);
        self.chunks.sort_unstable_by_key(|&(start, _)| start);
        self
    }

    /// `(fine, gt, equal)` for rank `r` ≥ 1 within the bin: the low bits holding it, elements of
    /// the bin above them, elements equal to them.
    fn locate_low(&self, r: u64) -> (u32, u64, u64) {
        if let Some(count) = self.one_key {
            return (0, 0, count);
        }
        match &self.low {
            Some(h) => {
                let mut low = h.totals();
                low[0] += self.zeros;
                let (fine, gt) = locate(&low, r);
                (fine as u32, gt, low[fine])
            }
            None => {
                let mut lows: Vec<u16> = self.members.iter().map(|m| m.0).collect();
                lows.sort_unstable_by(|a, b| b.cmp(a));
                let i = (r - 1) as usize;
                if i >= lows.len() {
                    // Below every member of bin 0: the zeros.
                    return (0, lows.len() as u64, self.zeros);
                }
                let fine = lows[i];
                let gt = lows.partition_point(|&x| x > fine);
                let equal = lows[gt..].partition_point(|&x| x == fine);
                (fine as u32, gt as u64, equal as u64)
            }
        }
    }

    /// The cut keeping the `k` largest keys, `above` of which lie above this bin. When the cut
    /// splits the elements tied at its threshold, the split index comes from the remembered
    /// members; else the returned [`Split`] says which tied element to search for — from the
    /// chunk that holds it when every element of the bin has the one key. A threshold of exactly
    /// zero needs no split: which zeros count as kept changes nothing (a kept zero adds ±0, never
    /// agrees in a consensus, and no sum starts at −0).
    fn resolve(&self, k: u64, above: u64, high_first: bool) -> (RankCut, Option<Split>) {
        let (fine, gt, equal) = self.locate_low(k - above);
        let value = (self.bin << 16) | fine;
        let need = k - above - gt;
        // Lower first: the first `need` tied elements are inside. Higher first: all but the first
        // `equal − need`.
        let m = if high_first { equal - need } else { need };
        let mut cut = RankCut {
            value,
            index: if high_first { 0 } else { u32::MAX },
            high_first,
        };
        if m == 0 || m >= equal || value == 0 {
            return (cut, None);
        }
        if self.low.is_none() && self.one_key.is_none() {
            let split = self
                .members
                .iter()
                .filter(|&&(low, _)| low as u32 == fine)
                .nth(m as usize - 1)
                .expect("the bin holds `equal` tied elements");
            cut.index = split.1 + 1;
            return (cut, None);
        }
        let listed: u64 = self.chunks.iter().map(|&(_, c)| c as u64).sum();
        let split = if listed == equal {
            // One key in the bin: the chunk counts count the tied elements.
            let (mut from, mut before) = (0, 0u64);
            for &(start, c) in &self.chunks {
                if before + c as u64 >= m {
                    from = start;
                    break;
                }
                before += c as u64;
            }
            Split { m, from, before }
        } else {
            Split {
                m,
                from: 0,
                before: 0,
            }
        };
        (cut, Some(split))
    }
}

/// Below this many elements a tensor's rank cuts skip the sample (it would read too much of it).
const SAMPLE_MIN_ELEMS: u64 = 1 << 20;

/// One chunk in this many is sampled to guess each cut's bin.
const SAMPLE_EVERY: usize = 16;

/// Members the records of one scan may remember in all (8 bytes each).
fn record_limit(bin_memory: u64, records: usize) -> usize {
    bin_memory as usize / records.max(1)
}

/// Resolves rank cuts (`(agent, k, high_first)`, 0 < k < n: the k largest, ties at the threshold
/// to the lower index first unless `high_first`) to exact thresholds, without sorting:
///
/// 1. A histogram of the keys' high 16 bits finds each cut's bin. It also notes which bins hold
///    keys with low bits set and, for bins a 1/16 sample guessed, the count in every chunk.
/// 2. Only a cut whose bin holds several keys needs a second scan: a histogram of the low 16
///    bits within the bin, remembering its members while they fit.
/// 3. A cut that splits elements tied at its threshold needs the index of the split: from the
///    remembered members, else by reading again the one chunk the counts point to, else by a
///    search from the start that stops at the split.
///
/// Task vectors of 16-bit weights hold few exact magnitudes, so most tensors take step 1, a
/// sample and a chunk or two: about one scan.
fn rank_cuts(
    scan: &mut dyn Scans,
    delta: bool,
    (agents, numel): (usize, u64),
    wanted: &[(usize, u64, bool)],
) -> Result<Vec<RankCut>> {
    let sizes = (agents, numel, SAMPLE_MIN_ELEMS);
    rank_cuts_remembering(scan, delta, sizes, wanted, BIN_MEMORY)
}

/// [`rank_cuts`], remembering at most `bin_memory` elements of the bins it records, and sampling
/// to guess them on tensors of at least `sample_min` elements.
fn rank_cuts_remembering(
    scan: &mut dyn Scans,
    delta: bool,
    (agents, numel, sample_min): (usize, u64, u64),
    wanted: &[(usize, u64, bool)],
    bin_memory: u64,
) -> Result<Vec<RankCut>> {
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let size = (agents, numel);
    let cut_agent: Vec<Option<Band>> = (0..agents)
        .map(|t| wanted.iter().any(|w| w.0 == t).then_some(Band::ALL))
        .collect();
    // Guesses of each cut's bin, from a sample: pass 1 counts only the band around them bin by
    // bin, and those bins per chunk, so that a cut in one of them, splitting a tie, finds the
    // split by reading one chunk again.
    let mut guesses: Vec<Vec<u32>> = vec![Vec::new(); agents];
    let mut bands = cut_agent.clone();
    if numel >= sample_min {
        let sample = histogram_pass(scan, delta, size, SAMPLE_EVERY, &cut_agent, &guesses)?;
        for &(t, k, _) in wanted {
            let seen = sample[t].seen;
            if seen > 0 {
                let k = ((k as f64 * seen as f64 / numel as f64).ceil() as u64).clamp(1, seen);
                guesses[t].extend(sample[t].likely_bins(k));
            }
        }
        for (g, band) in guesses.iter_mut().zip(&mut bands) {
            g.sort_unstable();
            g.dedup();
            if !g.is_empty() {
                *band = Some(Band::around(g));
            }
        }
    }
    // Pass 1: each cut agent's histogram of the high 16 bits of its magnitude keys, in the
    // guessed band; again over every bin for an agent whose cut the band missed.
    let mut pass1 = histogram_pass(scan, delta, size, 1, &bands, &guesses)?;
    let missed: Vec<Option<Band>> = (0..agents)
        .map(|t| {
            let miss = wanted
                .iter()
                .any(|&(a, k, _)| a == t && pass1[t].locate(k).is_none());
            miss.then_some(Band::ALL)
        })
        .collect();
    if missed.iter().any(Option::is_some) {
        let again = histogram_pass(scan, delta, size, 1, &missed, &guesses)?;
        for (t, h) in again.into_iter().enumerate() {
            if missed[t].is_some() {
                pass1[t] = h;
            }
        }
    }
    let coarse: Vec<(u32, u64)> = wanted
        .iter()
        .map(|&(t, k, _)| {
            pass1[t].locate(k).with_context(|| {
                format!("internal: rank {k} of agent {t} lies in no bin of the first pass")
            })
        })
        .collect::<Result<_>>()?;
    // A cut in a bin of one key (no low bits set anywhere in it; in bin 0: zeros only) is
    // resolved now; pass 2 records the bins of the others.
    let single = |c: usize| !pass1[wanted[c].0].mixed(coarse[c].0);
    let mut missing: Vec<Vec<u32>> = vec![Vec::new(); agents];
    for (c, &(t, _, _)) in wanted.iter().enumerate() {
        let bin = coarse[c].0;
        if !single(c) && !missing[t].contains(&bin) {
            missing[t].push(bin);
        }
    }
    let records = if missing.iter().any(|m| !m.is_empty()) {
        bin_scans(scan, delta, size, &missing, bin_memory)?
    } else {
        Vec::new()
    };
    // Each cut from its bin's record: pass 2's, or one made of pass 1's count and chunk counts.
    let resolve = |c: usize, k: u64, high_first: bool| {
        let (t, (bin, above)) = (wanted[c].0, coarse[c]);
        if single(c) {
            let chunks = pass1[t]
                .chunks
                .iter()
                .find(|(b, _)| *b == bin)
                .map(|(_, chunks)| chunks.clone());
            Ok(BinScan::of_one_key(bin, pass1[t].count(bin), chunks, numel)
                .resolve(k, above, high_first))
        } else {
            let i = missing[t]
                .iter()
                .position(|&b| b == bin)
                .with_context(|| format!("internal: bin {bin} of agent {t} was not recorded"))?;
            Ok::<_, anyhow::Error>(records[t][i].resolve(k, above, high_first))
        }
    };
    let mut cuts = Vec::with_capacity(wanted.len());
    // (cut, agent, key, m): the cut's index goes just past the m-th tied element in index order.
    let mut ties = Vec::new();
    for (c, &(t, k, high_first)) in wanted.iter().enumerate() {
        let (cut, split) = resolve(c, k, high_first)?;
        if let Some(split) = split {
            ties.push((c, t, cut.value, split));
        }
        cuts.push(cut);
    }
    if ties.is_empty() {
        return Ok(cuts);
    }
    // Pass 3: where a cut splits a tie no record could place, the index of the split, searched in
    // index order: from the chunk that holds it when that is known (a read of one chunk each),
    // else from the start, all such searches in one scan.
    type Tie = (usize, usize, u32, Split);
    let (known, from_start): (Vec<&Tie>, Vec<&Tie>) = ties.iter().partition(|tie| tie.3.from > 0);
    let mut groups: Vec<(u64, Vec<Tie>)> =
        known.into_iter().map(|t| (t.3.from, vec![*t])).collect();
    if !from_start.is_empty() {
        groups.push((0, from_start.into_iter().copied().collect()));
    }
    for (from, group) in groups {
        let mut searches: Vec<Vec<TieSearch>> = (0..agents).map(|_| Vec::new()).collect();
        for &(cut, t, key, split) in &group {
            searches[t].push(TieSearch {
                cut,
                key,
                m: split.m,
                from: split.from,
                seen: split.before,
                found: None,
            });
        }
        let searches = states(searches);
        scan.per_agent(from, &|t, chunk| {
            let mut open = lock(&searches[t]);
            for s in open.iter_mut().filter(|s| s.found.is_none()) {
                let skip = s.from.saturating_sub(chunk.start) as usize;
                for (j, &x) in chunk.v(delta).iter().enumerate().skip(skip) {
                    if magnitude_key(x) == s.key {
                        s.seen += 1;
                        if s.seen == s.m {
                            s.found = Some((chunk.start + j as u64 + 1) as u32);
                            break;
                        }
                    }
                }
            }
            if open.iter().all(|s| s.found.is_some()) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })?;
        for s in searches.into_iter().flat_map(unlock) {
            cuts[s.cut].index = s.found.with_context(|| {
                format!(
                    "internal: the tie split of cut {} lies outside the tensor",
                    s.cut
                )
            })?;
        }
    }
    Ok(cuts)
}

/// (chunk start, elements of a bin in the chunk), for chunks that had some.
type ChunkCounts = Vec<(u64, u32)>;

/// What one worker's pass 1 keeps for one agent.
struct AgentPass {
    /// Histogram of the band's keys' high 16 bits (non-zero keys).
    high: Bins16,
    /// Keys above and in the band.
    tally: BandTally,
    /// The lowest and highest bin the band's keys reached (`u32::MAX`, 0 while none did): only
    /// those counters are summed and cleared after.
    reached: (u32, u32),
    /// Elements seen.
    seen: u64,
    /// Per high bin of the band, a bit: whether a key in it had low bits set.
    mixed: Vec<u64>,
    /// Followed bins: (bin, count so far, its chunk counts).
    follow: Vec<(u32, u64, ChunkCounts)>,
}

/// What pass 1 found for one agent: every key is above the band, in one of its bins, or else
/// (zero or below the band).
struct Histogram {
    /// Keys above the band.
    above: u64,
    /// Keys neither above nor in the band: zeros (then bin 0 holds them) when `rest_are_zeros`,
    /// the band starting at bin 0.
    rest: u64,
    rest_are_zeros: bool,
    /// Non-zero keys per high bin, from bin `lo` on (the band's bins that have any).
    lo: u32,
    counts: Vec<u64>,
    seen: u64,
    /// Per high bin, a bit: whether a key of the band in it had low bits set. A bin without
    /// holds one key, `bin << 16`.
    mixed: Vec<u64>,
    /// Each followed bin's chunk counts, in index order.
    chunks: Vec<(u32, Vec<(u64, u32)>)>,
}

impl Histogram {
    /// Elements in high bin `bin`, zeros in bin 0 (bins of the band, and bin 0).
    fn count(&self, bin: u32) -> u64 {
        let counted = bin
            .checked_sub(self.lo)
            .and_then(|i| self.counts.get(i as usize));
        let zeros = if bin == 0 && self.rest_are_zeros {
            self.rest
        } else {
            0
        };
        counted.copied().unwrap_or(0) + zeros
    }

    fn mixed(&self, bin: u32) -> bool {
        self.mixed[bin as usize / 64] >> (bin % 64) & 1 == 1
    }

    /// The high bin holding rank k − 1 (0 < k ≤ elements) and the elements above it; None when
    /// that rank lies outside the band, among keys only counted.
    fn locate(&self, k: u64) -> Option<(u32, u64)> {
        let mut above = self.above;
        if above >= k {
            return None;
        }
        for bin in (self.lo..self.lo + self.counts.len() as u32).rev() {
            let c = self.count(bin);
            if above + c >= k {
                return Some((bin, above));
            }
            above += c;
        }
        // Only zeros can be left, in bin 0 (not among the counted bins, or it would have held
        // them), if the band starts there.
        self.rest_are_zeros.then_some((0, above))
    }

    /// The guessed bins of a cut at rank `k` of this (sampled, whole) histogram: the bin holding
    /// it and the nearest non-empty bins above and below.
    fn likely_bins(&self, k: u64) -> Vec<u32> {
        let (g, _) = self
            .locate(k)
            .expect("a histogram of every bin holds every rank");
        let end = self.lo + self.counts.len() as u32;
        let below = (0..g).rev().find(|&b| self.count(b) > 0);
        let above = (g + 1..end).find(|&b| self.count(b) > 0);
        [Some(g), below, above].into_iter().flatten().collect()
    }
}

/// One any-order pass over a sample of one chunk in `every` (1: all): for each agent with a band
/// `bands[t]`, the histogram of the high 16 bits of its magnitude keys in the band (keys above
/// only counted, with vector compares, and zeros not even that; RL task vectors are mostly
/// zero), which bins of
/// the band hold keys with low bits set, and for each bin in `follow[t]` its count per chunk
/// (from the histogram's growth, so free per element). Each worker counts in its own state, and
/// only the bins its keys reached are summed after.
fn histogram_pass(
    scan: &mut dyn Scans,
    delta: bool,
    (agents, numel): (usize, u64),
    every: usize,
    bands: &[Option<Band>],
    follow: &[Vec<u32>],
) -> Result<Vec<Histogram>> {
    let workers = scan.workers();
    let fresh = |t: usize| AgentPass {
        // The magnitude key's top bit is clear: 2^15 high bins.
        high: Bins16::new(BINS / 2, numel / every as u64),
        tally: BandTally::NONE,
        reached: (u32::MAX, 0),
        seen: 0,
        mixed: vec![0; BINS / 2 / 64],
        follow: follow[t].iter().map(|&b| (b, 0, Vec::new())).collect(),
    };
    let states = worker_states(workers, agents, |_| None::<AgentPass>);
    scan.any_order(every, delta, &|w, t, start, v| {
        let Some(band) = bands[t] else {
            return;
        };
        let mut guard = lock(&states[w * agents + t]);
        let AgentPass {
            high,
            tally,
            reached,
            seen,
            mixed,
            follow,
        } = guard.get_or_insert_with(|| fresh(t));
        *seen += v.len() as u64;
        let (mut inside, mut low) = ([0u64; SCAN_CHUNK / 64], [0u64; SCAN_CHUNK / 64]);
        let words = v.len().div_ceil(64);
        tally.add(band_bits(v, band, &mut inside[..words], &mut low[..words]));
        let mut adder = high.adder();
        let (mut lowest, mut highest) = *reached;
        for (w, (&n, &l)) in inside[..words].iter().zip(&low[..words]).enumerate() {
            let mut n = n;
            while n != 0 {
                let i = w * 64 + n.trailing_zeros() as usize;
                let bin = magnitude_key(v[i]) >> 16;
                adder.add(bin, i);
                (lowest, highest) = (lowest.min(bin), highest.max(bin));
                n &= n - 1;
            }
            // Low bits set: rare where task vectors come from 16-bit weights.
            let mut l = l;
            while l != 0 {
                let bin = magnitude_key(v[w * 64 + l.trailing_zeros() as usize]) >> 16;
                mixed[bin as usize / 64] |= 1 << (bin % 64);
                l &= l - 1;
            }
        }
        *reached = (lowest, highest);
        for (bin, before, chunks) in follow.iter_mut() {
            let now = high.count(*bin);
            if now > *before {
                chunks.push((start, (now - *before) as u32));
                *before = now;
            }
        }
    })?;
    let mut parts: Vec<Option<AgentPass>> = states.into_iter().map(unlock).collect();
    Ok((0..agents)
        .map(|t| {
            let mine: Vec<AgentPass> = (0..workers)
                .filter_map(|w| parts[w * agents + t].take())
                .collect();
            let mut tally = BandTally::NONE;
            mine.iter().for_each(|p| tally.add(p.tally));
            let lowest = mine.iter().map(|p| p.reached.0).min().unwrap_or(u32::MAX);
            let highest = mine.iter().map(|p| p.reached.1).max().unwrap_or(0);
            let (lo, bins) = if lowest > highest {
                (0, 0)
            } else {
                (lowest, highest - lowest + 1)
            };
            let mut h = Histogram {
                above: tally.above,
                rest: 0,
                rest_are_zeros: bands[t].is_some_and(|b| b.lo == 0),
                lo,
                counts: vec![0; bins as usize],
                seen: 0,
                mixed: vec![0; BINS / 2 / 64],
                chunks: follow[t].iter().map(|&b| (b, Vec::new())).collect(),
            };
            for part in mine {
                h.seen += part.seen;
                part.high.drain_range(lo as usize, &mut h.counts);
                h.mixed
                    .iter_mut()
                    .zip(&part.mixed)
                    .for_each(|(a, &b)| *a |= b);
                for ((_, all), (_, _, mine)) in h.chunks.iter_mut().zip(part.follow) {
                    all.extend(mine);
                }
            }
            for (_, chunks) in &mut h.chunks {
                chunks.sort_unstable_by_key(|&(start, _)| start);
            }
            h.rest = h.seen - h.above - tally.inside;
            debug_assert_eq!(tally.inside, h.counts.iter().sum::<u64>());
            h
        })
        .collect())
}

/// Pass 2: a [`BinScan`] of each bin in `bins[t]`, each found by its own mask, together
/// remembering at most `bin_memory` members.
fn bin_scans(
    scan: &mut dyn Scans,
    delta: bool,
    (agents, numel): (usize, u64),
    bins: &[Vec<u32>],
    bin_memory: u64,
) -> Result<Vec<Vec<BinScan>>> {
    let workers = scan.workers();
    let count: usize = bins.iter().map(Vec::len).sum();
    let limit = record_limit(bin_memory, count);
    let per_worker = record_limit(bin_memory, count * workers);
    let fresh = |t: usize, memory: usize| -> Vec<BinScan> {
        bins[t]
            .iter()
            .map(|&b| BinScan::new(b, memory, numel))
            .collect()
    };
    let states = worker_states(workers, agents, |_| None::<Vec<BinScan>>);
    scan.any_order(1, delta, &|w, t, start, v| {
        if bins[t].is_empty() {
            return;
        }
        let mut guard = lock(&states[w * agents + t]);
        let records = guard.get_or_insert_with(|| fresh(t, per_worker));
        for r in records.iter_mut() {
            r.scan_chunk(v, start);
        }
    })?;
    let mut parts: Vec<Option<Vec<BinScan>>> = states.into_iter().map(unlock).collect();
    Ok((0..agents)
        .map(|t| {
            let mut sum: Option<Vec<BinScan>> = None;
            for w in 0..workers {
                let Some(part) = parts[w * agents + t].take() else {
                    continue;
                };
                sum = Some(match sum {
                    None => part,
                    Some(mut sum) => {
                        for (a, b) in sum.iter_mut().zip(part) {
                            a.absorb(b, limit);
                        }
                        sum
                    }
                });
            }
            sum.unwrap_or_else(|| fresh(t, limit))
                .into_iter()
                .map(BinScan::in_index_order)
                .collect()
        })
        .collect())
}

/// The cut holding ranks `< k` of `n` elements.
fn cut_of(k: u64, n: u64, found: &mut impl Iterator<Item = RankCut>) -> RankCut {
    if k == 0 {
        RankCut::EMPTY
    } else if k >= n {
        RankCut::FULL
    } else {
        found.next().expect("one cut was searched per rank")
    }
}

/// Gathers the statistics `recipe` needs from scans of the tensor and builds its combine rule.
/// `numel` ≤ u32::MAX; `seed` and `name` key the random masks.
pub fn build_spec(
    recipe: &TensorRecipe,
    numel: u64,
    shape: &[usize],
    seed: u64,
    name: &str,
    present: &[usize],
    scan: &mut dyn Scans,
) -> Result<CombineSpec> {
    let n = recipe.weights.len();
    let delta = recipe.delta;
    let rank_rows = rank_rows(recipe, numel, shape)?;
    // Rank cuts first: the masks must be known before any kept-element statistic.
    let mut wanted = Vec::new();
    for (t, s) in recipe.sparsify.iter().enumerate() {
        if let Sparsify::Ranks { lo, hi, high_first } = *s {
            for k in [lo, hi] {
                if k > 0 && k < numel {
                    wanted.push((t, k, high_first));
                }
            }
        }
    }
    let found = rank_cuts(scan, delta, (n, numel), &wanted)?;
    let mut found = found.into_iter();
    let keep: Vec<Keep> = recipe
        .sparsify
        .iter()
        .enumerate()
        .map(|(t, s)| match *s {
            Sparsify::All => Keep::All,
            Sparsify::Ranks { lo, hi, .. } => {
                let lo = cut_of(lo, numel, &mut found);
                let hi = cut_of(hi, numel, &mut found);
                Keep::Band { lo, hi }
            }
            Sparsify::Random { density } => Keep::Random {
                threshold: random_threshold(density),
                key: hash_key(seed, name, present[t]),
            },
            Sparsify::RowRank { density, epsilon } => Keep::RowRank {
                p0: (density - epsilon) as f32,
                step: if rank_rows > 1 {
                    (2.0 * epsilon / (rank_rows - 1) as f64) as f32
                } else {
                    0.0
                },
                key: hash_key(seed, name, present[t]),
            },
        })
        .collect();
    let ranked: Vec<bool> = keep
        .iter()
        .map(|k| matches!(k, Keep::RowRank { .. }))
        .collect();

    // One pass of moments when anything needs them.
    let rescale: Vec<bool> = recipe
        .sparsify
        .iter()
        .map(|s| recipe.rescale && *s != Sparsify::All)
        .collect();
    let row_len = match recipe.base {
        BaseTerm::Fisher => 1,
        BaseTerm::Slerp { .. } => {
            (numel / shape.first().copied().unwrap_or(1).max(1) as u64).max(1)
        }
        _ => 0,
    };
    let rows = numel.checked_div(row_len).map_or(1, |r| r as usize);
    let want_l1 = rescale.iter().any(|&r| r);
    let gram_of_tau = recipe.base.gram_of(delta);
    let want_gram = gram_of_tau.is_some();
    let want_rows = matches!(recipe.base, BaseTerm::Slerp { .. });
    let mut l1 = vec![(0.0f64, 0.0f64); n];
    let mut gram = vec![0.0f64; n * n];
    let pairs: Vec<(usize, usize)> = (0..n).flat_map(|a| (a..n).map(move |b| (a, b))).collect();
    let mut row_moments = vec![[0.0f64; 3]; if want_rows { rows } else { 0 }];
    if want_l1 && !want_rows {
        // L1 norms alone: any order, each chunk's sums kept by chunk index and added in order
        // after, so the f64 totals are those of an in-order scan.
        let l1_agent = |t: usize| rescale[t] && !ranked[t];
        let workers = scan.workers();
        let parts = worker_states(workers, n, |_| Vec::<(u64, f64, f64)>::new());
        // Each worker's mask row, made once.
        let masks = worker_states(workers, 1, |_| vec![0u32; SCAN_CHUNK]);
        scan.any_order(1, delta, &|w, t, start, v| {
            if !l1_agent(t) {
                return;
            }
            let mut mask = lock(&masks[w]);
            let mask = &mut mask[..v.len()];
            keep[t].mask_into(v, start as u32, &[], mask);
            let (all, kept) = abs_sums(v, mask);
            lock(&parts[w * n + t]).push((start, all, kept));
        })?;
        let mut parts: Vec<Vec<(u64, f64, f64)>> = parts.into_iter().map(unlock).collect();
        for (t, l) in l1.iter_mut().enumerate() {
            let mut chunks: Vec<(u64, f64, f64)> = (0..workers)
                .flat_map(|w| std::mem::take(&mut parts[w * n + t]))
                .collect();
            chunks.sort_unstable_by_key(|c| c.0);
            for (_, all, kept) in chunks {
                l.0 += all;
                l.1 += kept;
            }
        }
    } else if want_l1 || want_rows {
        let l1_state = states(l1.iter().copied());
        let rows_state = Mutex::new(std::mem::take(&mut row_moments));
        scan.per_agent(0, &|t, c| {
            if rescale[t] && !ranked[t] {
                let v = c.v(delta);
                let mut mask = [0u32; SCAN_CHUNK];
                let mask = &mut mask[..v.len()];
                keep[t].mask_into(v, c.start as u32, &[], mask);
                let (all, kept) = abs_sums(v, mask);
                let mut l = lock(&l1_state[t]);
                l.0 += all;
                l.1 += kept;
            }
            if want_rows && t == 0 {
                let mut rows = lock(&rows_state);
                for (j, (&b, &x)) in c.base.iter().zip(c.x).enumerate() {
                    let m = &mut rows[((c.start + j as u64) / row_len) as usize];
                    m[0] += b as f64 * b as f64;
                    m[1] += x as f64 * x as f64;
                    m[2] += b as f64 * x as f64;
                }
            }
            if (rescale[t] && !ranked[t]) || (want_rows && t == 0) {
                ControlFlow::Continue(())
            } else {
                ControlFlow::Break(())
            }
        })?;
        l1 = l1_state.into_iter().map(unlock).collect();
        row_moments = unlock(rows_state);
    }
    // DELLA's masks need each row's ranks: whole-row tiles.
    if (0..n).any(|t| rescale[t] && ranked[t]) {
        let mut ranks = Vec::new();
        let mut mask = Vec::new();
        scan.tiles(&mut |tile| {
            for t in (0..n).filter(|&t| rescale[t] && ranked[t]) {
                let v = if delta { &tile.tau[t] } else { &tile.x[t] };
                row_ranks(v, rank_rows as usize, &mut ranks);
                mask.resize(v.len(), 0);
                keep[t].mask_into(v, tile.start as u32, &ranks, &mut mask);
                let (all, kept) = abs_sums(v, &mask);
                l1[t].0 += all;
                l1[t].1 += kept;
            }
            Ok(ControlFlow::Continue(()))
        })?;
    }
    if want_gram {
        scan.tiles(&mut |tile| {
            let dots: Vec<f64> = pairs
                .par_iter()
                .map(|&(a, b)| {
                    let v = if gram_of_tau == Some(true) {
                        tile.tau
                    } else {
                        tile.x
                    };
                    v[a].iter()
                        .zip(&v[b])
                        .map(|(&x, &y)| x as f64 * y as f64)
                        .sum()
                })
                .collect();
            for (&(a, b), dot) in pairs.iter().zip(dots) {
                gram[a * n + b] += dot;
                if a != b {
                    gram[b * n + a] += dot;
                }
            }
            Ok(ControlFlow::Continue(()))
        })?;
    }

    let factor = |t: usize| -> f64 {
        let (all, kept) = l1[t];
        // Skipped below 1e-7 (SPEC §4), and where an infinite input makes a norm infinite (with
        // --allow-nonfinite): the infinite element then propagates alone, by IEEE rules, instead
        // of ∞/∞ = NaN scaling every finite element of the tensor.
        if rescale[t] && all >= 1e-7 && kept >= 1e-7 && all.is_finite() && kept.is_finite() {
            all / kept
        } else {
            1.0
        }
    };
    // SCE: the variance cut, then each agent's weight from its mean square on the kept elements.
    let (element_keep, sce_weights) = match recipe.base {
        BaseTerm::Sce { density } => sce_statistics(scan, n, numel, density)?,
        _ => (None, Vec::new()),
    };
    let weights_f32: Vec<f32> = if sce_weights.is_empty() {
        recipe.weights.iter().map(|&w| w as f32).collect()
    } else {
        sce_weights.iter().map(|&w| w as f32).collect()
    };
    let mut coefs = Vec::new();
    match recipe.base {
        BaseTerm::Add | BaseTerm::None => {
            coefs.push(if recipe.base == BaseTerm::Add {
                1.0
            } else {
                0.0
            });
            coefs.extend((0..n).map(|t| (recipe.weights[t] * factor(t)) as f32));
        }
        BaseTerm::ModelStock => {
            let t = model_stock_t(&gram, n);
            coefs.push((1.0 - t) as f32);
            coefs.extend((0..n).map(|_| (t / n as f64) as f32));
        }
        BaseTerm::Slerp { t } => {
            for m in &row_moments {
                let (a, b) = slerp_coefs(t, m);
                coefs.push(a as f32);
                coefs.push(b as f32);
            }
        }
        BaseTerm::Nuslerp { t } => {
            coefs.push(if delta { 1.0 } else { 0.0 });
            let (a, b) = nuslerp_coefs(t, &gram);
            coefs.extend([a as f32, b as f32]);
        }
        BaseTerm::Multislerp { ref weights } => {
            coefs.push(if delta { 1.0 } else { 0.0 });
            coefs.extend(
                multislerp_coefs(weights, &gram)?
                    .into_iter()
                    .map(|c| c as f32),
            );
        }
        BaseTerm::Nearswap { .. } => coefs.extend([1.0, 1.0]),
        // The per-element rows come with each tile; this row keeps λ for them.
        BaseTerm::Fisher => {
            coefs.push(0.0);
            coefs.extend(recipe.weights.iter().map(|&w| w as f32));
        }
        BaseTerm::Sce { .. } => {
            coefs.push(1.0);
            coefs.extend(sce_weights.iter().map(|&w| w as f32));
        }
        BaseTerm::Karcher { max_iter, tol } => {
            coefs.push(0.0);
            coefs.extend(
                karcher_coefs(&gram, n, max_iter, tol)
                    .into_iter()
                    .map(|c| c as f32),
            );
        }
    }
    let normalize = if !recipe.normalize {
        Normalize::None
    } else if recipe.consensus {
        // SCE divides by max(Σ w, 1e-6); TIES by Σ w, or 1 where it is 0.
        let floor = if element_keep.is_some() || !sce_weights.is_empty() {
            1e-6
        } else {
            0.0
        };
        Normalize::PerElement(weights_f32, floor)
    } else {
        let sum: f32 = weights_f32.iter().sum();
        Normalize::Fixed(if sum.abs() < 1e-8 { 1.0 } else { 1.0 / sum })
    };
    Ok(CombineSpec {
        delta,
        keep,
        consensus: recipe.consensus,
        normalize,
        lambda: recipe.lambda as f32,
        row_len,
        coefs,
        sign_of_values: matches!(recipe.base, BaseTerm::Sce { .. }),
        rank_rows,
        tile_coefs: recipe.base == BaseTerm::Fisher,
        element_keep,
        nearswap: match recipe.base {
            BaseTerm::Nearswap { t } => Some(t as f32),
            _ => None,
        },
    })
}

/// Elements per chunk of a per-agent scan: a few arrays of it stay in L1.
pub const SCAN_CHUNK: usize = 4096;

multiversion! {
    /// Σ|x| (of the kept x when `mask` is given) over a chunk: eight f32 lanes over eight elements
    /// each, then f64 — a fixed order, so every run and thread count gives the same sum. Lane j
    /// adds elements j, j + 8, … of each block of 64 in turn: eight-wide vector adds.
    fn abs_sum(values: &[f32], mask: Option<&[u32]>) -> f64 {
        let mut total = 0.0f64;
        for (block, x) in values.chunks(64).enumerate() {
            let mut lanes = [0.0f32; 8];
            // Whole groups of eight, then the rest (a partial group would become a masked
            // store, microcoded on AMD).
            let m = mask.map(|m| &m[block * 64..block * 64 + x.len()]);
            let whole = x.len() / 8 * 8;
            let add = |lanes: &mut [f32], x: &[f32], m: Option<&[u32]>| match m {
                None => {
                    for (l, &v) in lanes.iter_mut().zip(x) {
                        *l += v.abs();
                    }
                }
                Some(m) => {
                    for ((l, &v), &m) in lanes.iter_mut().zip(x).zip(m) {
                        *l += f32::from_bits(v.to_bits() & m & 0x7fff_ffff);
                    }
                }
            };
            for g in (0..whole).step_by(8) {
                add(&mut lanes, &x[g..g + 8], m.map(|m| &m[g..g + 8]));
            }
            add(&mut lanes[..x.len() - whole], &x[whole..], m.map(|m| &m[whole..]));
            total += lanes.iter().map(|&l| l as f64).sum::<f64>();
        }
        total
    }
}

/// (Σ|x|, Σ|x| of the kept x) over a chunk, `mask` all ones where x is kept ([`abs_sum`] twice:
/// LLVM vectorizes the two sums in one loop poorly).
fn abs_sums(values: &[f32], mask: &[u32]) -> (f64, f64) {
    (abs_sum(values, None), abs_sum(values, Some(mask)))
}

/// The row length of DELLA's ranks for a tensor of `shape` (0 when no keep rule ranks rows):
/// the last dimension of a matrix, the whole of a vector (mergekit ranks along dimension 1 after
/// making vectors one row).
pub fn rank_rows(recipe: &TensorRecipe, numel: u64, shape: &[usize]) -> Result<u64> {
    if !recipe
        .sparsify
        .iter()
        .any(|s| matches!(s, Sparsify::RowRank { .. }))
    {
        return Ok(0);
    }
    match shape {
        [_] | [] => Ok(numel.max(1)),
        [_, cols] => Ok((*cols as u64).max(1)),
        _ => anyhow::bail!(
            "della on a tensor of {} dimensions is not supported yet",
            shape.len()
        ),
    }
}

/// SCE's statistics: the cut keeping the ⌊density · (elements of non-zero variance)⌋ elements
/// of highest variance over the agents' task vectors (none when density ≥ 1), and each agent's
/// weight, its mean square on the kept elements over the sum of them (1/n if that sum < 1e-6).
fn sce_statistics(
    scan: &mut dyn Scans,
    n: usize,
    numel: u64,
    density: f64,
) -> Result<(Option<VarianceCut>, Vec<f64>)> {
    let inv_n = 1.0f32 / n as f32;
    let keys = |tile: &Values, out: &mut Vec<u32>| {
        out.clear();
        let mut v = vec![0.0f32; tile.tau.len()];
        out.extend((0..tile.base.len()).map(|i| {
            for (t, v) in v.iter_mut().enumerate() {
                *v = tile.tau[t][i];
            }
            variance_key(&v, inv_n)
        }));
    };
    let element_keep = if density >= 1.0 {
        None
    } else {
        Some((
            key_rank_cut(scan, numel, &keys, |nonzero| {
                (density.max(0.0) * nonzero as f64) as u64
            })?,
            inv_n,
        ))
    };
    let mut squares = vec![0.0f64; n];
    let mut buf = Vec::new();
    scan.tiles(&mut |tile| {
        keys(tile, &mut buf);
        for (t, sq) in squares.iter_mut().enumerate() {
            for (i, &x) in tile.tau[t].iter().enumerate() {
                let kept = element_keep
                    .is_none_or(|(cut, _)| cut.inside(buf[i], (tile.start + i as u64) as u32));
                if kept {
                    *sq += x as f64 * x as f64;
                }
            }
        }
        Ok(ControlFlow::Continue(()))
    })?;
    let means: Vec<f64> = squares.iter().map(|s| s / numel.max(1) as f64).collect();
    let total: f64 = means.iter().sum();
    let weights = if total.abs() < 1e-6 {
        vec![1.0 / n as f64; n]
    } else {
        means.iter().map(|m| m / total).collect()
    };
    Ok((element_keep, weights))
}

/// The rank cut of the k largest of a per-element key computed from whole tiles (`keys`), k from
/// the count of non-zero keys: a histogram of the keys' high 16 bits, then of the low 16 bits in
/// the threshold's bin (SCE's variance keys are rarely of one value), then a third scan only when
/// the cut splits a tie too large to remember. Zero keys are never kept.
fn key_rank_cut(
    scan: &mut dyn Scans,
    numel: u64,
    keys: &dyn Fn(&Values, &mut Vec<u32>),
    k_of_nonzero: impl Fn(u64) -> u64,
) -> Result<RankCut> {
    let mut bins = Bins16::new(BINS / 2, numel);
    let mut buf = Vec::new();
    scan.tiles(&mut |tile| {
        keys(tile, &mut buf);
        for (i, &key) in buf.iter().enumerate().filter(|(_, &k)| k != 0) {
            bins.add(key >> 16, i);
        }
        Ok(ControlFlow::Continue(()))
    })?;
    let high = bins.totals();
    let nonzero: u64 = high.iter().sum();
    let k = k_of_nonzero(nonzero).min(nonzero);
    if k == 0 {
        return Ok(RankCut::EMPTY);
    }
    let (bin, above) = locate(&high, k);
    let mut b = BinScan::new(bin as u32, BIN_MEMORY as usize, numel);
    scan.tiles(&mut |tile| {
        keys(tile, &mut buf);
        for (i, &key) in buf.iter().enumerate() {
            if key != 0 && key >> 16 == b.bin {
                b.record(key, tile.start + i as u64);
            }
        }
        b.end_chunk(tile.start, 0);
        Ok(ControlFlow::Continue(()))
    })?;
    let b = b.in_index_order();
    // Zero keys are never counted, so the threshold is above zero.
    let (mut cut, search) = b.resolve(k, above, false);
    if let Some(split) = search {
        let (value, need) = (cut.value, split.m);
        let mut seen = 0u64;
        scan.tiles(&mut |tile| {
            keys(tile, &mut buf);
            for (i, &key) in buf.iter().enumerate() {
                if key == value {
                    seen += 1;
                    if seen == need {
                        cut.index = (tile.start + i as u64 + 1) as u32;
                        return Ok(ControlFlow::Break(()));
                    }
                }
            }
            Ok(ControlFlow::Continue(()))
        })?;
    }
    Ok(cut)
}

/// nuslerp's coefficients of (v₀, v₁) from their 2×2 Gram matrix: the slerp of the directions,
/// applied to the unnormalized vectors; lerp when the vectors are collinear.
pub fn nuslerp_coefs(t: f64, gram: &[f64]) -> (f64, f64) {
    let n0 = gram[0].sqrt().max(1e-7);
    let n1 = gram[3].sqrt().max(1e-7);
    let cos = (gram[1] / (n0 * n1)).clamp(-1.0, 1.0);
    if 1.0 - cos * cos <= 1e-16 {
        return (1.0 - t, t);
    }
    let theta = cos.acos();
    let s = theta.sin();
    (((1.0 - t) * theta).sin() / s, (t * theta).sin() / s)
}

/// multislerp's coefficients from the Gram matrix: the weighted mean of the unit vectors,
/// normalized and scaled by the weighted mean norm. (mergekit's tangent-space step sums to zero
/// exactly — Σ w_i (u_i − ⟨u_i, m̂⟩ m̂) = m − ‖m‖ m̂ — so it moves nothing but rounding.)
pub fn multislerp_coefs(weights: &[f64], gram: &[f64]) -> Result<Vec<f64>> {
    const EPS: f64 = 1e-8;
    let n = weights.len();
    let norm: Vec<f64> = (0..n).map(|i| gram[i * n + i].sqrt()).collect();
    let unit = |i: usize, j: usize| gram[i * n + j] / ((norm[i] + EPS) * (norm[j] + EPS));
    let mut mean_sq = 0.0;
    for i in 0..n {
        for j in 0..n {
            mean_sq += weights[i] * weights[j] * unit(i, j);
        }
    }
    let mean_norm = mean_sq.max(0.0).sqrt();
    // Every vector zero (a tensor no agent changed): the sum is zero too, whatever the weights.
    if norm.iter().all(|&x| x == 0.0) {
        return Ok(vec![0.0; n]);
    }
    if mean_norm < EPS {
        if n == 2 {
            return Ok(weights.to_vec());
        }
        anyhow::bail!(
            "multislerp: the weighted sum of the unit vectors is zero (antipodal inputs with balancing weights); use other weights"
        );
    }
    let avg_norm: f64 = weights.iter().zip(&norm).map(|(w, n)| w * n).sum();
    Ok((0..n)
        .map(|i| weights[i] / ((norm[i] + EPS) * mean_norm) * avg_norm)
        .collect())
}

/// karcher's coefficients from the Gram matrix of the models: the weighted Karcher mean of the
/// unit vectors (equal weights), iterated in the span of the inputs, scaled by the mean norm.
/// Angles and norms below `tol` — or zero, so `tol = 0` stays finite — end the step or the loop.
pub fn karcher_coefs(gram: &[f64], n: usize, max_iter: usize, tol: f64) -> Vec<f64> {
    let norm: Vec<f64> = (0..n).map(|i| gram[i * n + i].sqrt()).collect();
    // Below tol, or zero: with tol = 0 a zero angle or norm must not be divided by.
    let small = |x: f64| x < tol || x <= 0.0;
    let valid: Vec<usize> = (0..n).filter(|&i| norm[i] > tol).collect();
    if valid.is_empty() {
        return vec![0.0; n];
    }
    // Inner products of unit vectors, and of coefficient vectors over them.
    let u = |i: usize, j: usize| gram[i * n + j] / (norm[i] * norm[j]);
    // Zero coefficients skip u(i, j): an invalid input's norm may be 0.
    let dot = |a: &[f64], b: &[f64]| -> f64 {
        let mut s = 0.0;
        for (i, &ai) in a.iter().enumerate().filter(|(_, &x)| x != 0.0) {
            for (j, &bj) in b.iter().enumerate().filter(|(_, &x)| x != 0.0) {
                s += ai * bj * u(i, j);
            }
        }
        s
    };
    let alpha = 1.0 / valid.len() as f64;
    let mut mean = vec![0.0; n];
    for &i in &valid {
        mean[i] = alpha;
    }
    let mean_norm = dot(&mean, &mean).max(0.0).sqrt();
    if small(mean_norm) {
        mean = vec![0.0; n];
        mean[valid[0]] = 1.0;
    } else {
        mean.iter_mut().for_each(|a| *a /= mean_norm);
    }
    for _ in 0..max_iter {
        let mut tangent = vec![0.0; n];
        for &j in &valid {
            let mut e = vec![0.0; n];
            e[j] = 1.0;
            let d = dot(&mean, &e).clamp(-1.0, 1.0);
            let theta = d.acos();
            if small(theta) {
                continue;
            }
            let beta = alpha * theta / theta.sin();
            for i in 0..n {
                tangent[i] += beta * (e[i] - d * mean[i]);
            }
        }
        let tn = dot(&tangent, &tangent).max(0.0).sqrt();
        if small(tn) {
            break;
        }
        for i in 0..n {
            mean[i] = tn.cos() * mean[i] + tn.sin() * tangent[i] / tn;
        }
        let un = dot(&mean, &mean).max(0.0).sqrt();
        if !small(un) {
            mean.iter_mut().for_each(|a| *a /= un);
        }
    }
    // scale = Σ α_i ‖v_i‖ over every input (mergekit's α = 1/N for all of them).
    let scale: f64 = norm.iter().sum::<f64>() / n as f64;
    (0..n)
        .map(|i| {
            if norm[i] > 0.0 {
                scale * mean[i] / norm[i]
            } else {
                0.0
            }
        })
        .collect()
}

/// Model Stock's interpolation t from the Gram sums of the task vectors (upper triangle):
/// cos = mean over pairs of dot / max(‖a‖‖b‖, 1e-6) clamped to [−1, 1]; t = N·cos / (1 + (N−1)·cos),
/// 0 where the denominator vanishes.
pub fn model_stock_t(gram: &[f64], n: usize) -> f64 {
    let norm = |a: usize| gram[a * n + a].sqrt();
    let mut sum = 0.0;
    let mut pairs = 0usize;
    for a in 0..n {
        for b in a + 1..n {
            sum += (gram[a * n + b] / (norm(a) * norm(b)).max(1e-6)).clamp(-1.0, 1.0);
            pairs += 1;
        }
    }
    let cos = sum / pairs.max(1) as f64;
    let den = 1.0 + (n as f64 - 1.0) * cos;
    if den.abs() < 1e-6 {
        0.0
    } else {
        n as f64 * cos / den
    }
}

/// Slerp's coefficients of (θ₀, θ₁) for one row from Σa², Σb², Σab: linear when the normalized
/// dot exceeds 0.9995 in magnitude, else sin((1−t)θ)/sin θ and sin(tθ)/sin θ.
pub fn slerp_coefs(t: f64, m: &[f64; 3]) -> (f64, f64) {
    let guard = |x: f64| if x > 1e-8 { x } else { 1.0 };
    let (na, nb) = (guard(m[0].sqrt()), guard(m[1].sqrt()));
    let dot = (m[2] / (na * nb)).clamp(-1.0, 1.0);
    if dot.abs() > 0.9995 {
        return (1.0 - t, t);
    }
    let theta = dot.acos();
    let s = theta.sin();
    (((1.0 - t) * theta).sin() / s, (t * theta).sin() / s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In-memory task vectors (base 0) cut into tiles of `tile` elements.
    struct Memory {
        v: Vec<Vec<f32>>,
        tile: usize,
        zeros: Vec<f32>,
    }

    impl Memory {
        fn chunk(&self, t: usize, start: usize, end: usize) -> AgentChunk<'_> {
            AgentChunk {
                start: start as u64,
                base: &self.zeros[start..end],
                x: &self.v[t][start..end],
                tau: &self.v[t][start..end],
            }
        }
    }

    impl Scans for Memory {
        fn tiles(&mut self, visit: &mut Visit) -> Result<()> {
            let len = self.v[0].len();
            for start in (0..len).step_by(self.tile) {
                let end = (start + self.tile).min(len);
                let part: Vec<Vec<f32>> = self.v.iter().map(|a| a[start..end].to_vec()).collect();
                let values = Values {
                    start: start as u64,
                    base: &self.zeros[start..end],
                    x: &part,
                    tau: &part,
                };
                if visit(&values)?.is_break() {
                    break;
                }
            }
            Ok(())
        }

        fn per_agent(&mut self, from: u64, visit: &AgentVisit) -> Result<()> {
            let len = self.v[0].len();
            for t in 0..self.v.len() {
                let first = from as usize / self.tile * self.tile;
                for start in (first..len).step_by(self.tile) {
                    let end = (start + self.tile).min(len);
                    if visit(t, &self.chunk(t, start, end)).is_break() {
                        break;
                    }
                }
            }
            Ok(())
        }

        fn workers(&self) -> usize {
            2
        }

        /// Last chunk first, the two workers taking turns.
        fn any_order(&mut self, every: usize, delta: bool, visit: &AnyOrderVisit) -> Result<()> {
            let len = self.v[0].len();
            let starts: Vec<usize> = (0..len).step_by(SCAN_CHUNK * every).collect();
            for (i, &start) in starts.iter().rev().enumerate() {
                let end = (start + SCAN_CHUNK).min(len);
                for t in 0..self.v.len() {
                    let c = self.chunk(t, start, end);
                    visit(i % 2, t, start as u64, c.v(delta));
                }
            }
            Ok(())
        }
    }

    fn scan_of(v: Vec<Vec<f32>>, tile: usize) -> Memory {
        let zeros = vec![0.0; v[0].len()];
        Memory { v, tile, zeros }
    }

    /// Exact top-k with ties at the threshold going to lower indices, for any tiling.
    #[test]
    fn rank_cuts_are_exact_with_ties() {
        let v = vec![vec![0.5f32, -2.0, 1.0, 2.0, -1.0, 1.0, 0.0, 1.0]];
        for (tile, memory) in [(1, 0), (3, 0), (8, 0), (1, 100), (3, 100), (8, 100)] {
            let cuts_of = |want| {
                rank_cuts_remembering(
                    &mut scan_of(v.clone(), tile),
                    true,
                    (1, v.len() as u64, 0),
                    &[want],
                    memory,
                )
                .unwrap()
            };
            // k = 4: 2, 2 (indices 1, 3) then two of the three 1.0s: indices 2 and 4.
            let cuts = cuts_of((0, 4, false));
            assert_eq!(cuts[0].value, magnitude_key(1.0));
            assert_eq!(cuts[0].index, 5, "tile {tile}");
            let kept: Vec<usize> = (0..8)
                .filter(|&i| cuts[0].inside(magnitude_key(v[0][i]), i as u32))
                .collect();
            assert_eq!(kept, [1, 2, 3, 4]);
            // Higher index first: the 1.0s at indices 7 and 5.
            let cuts = cuts_of((0, 4, true));
            let kept: Vec<usize> = (0..8)
                .filter(|&i| cuts[0].inside(magnitude_key(v[0][i]), i as u32))
                .collect();
            assert_eq!(kept, [1, 3, 5, 7], "tile {tile}");
        }
    }

    /// Several chunks, several agents, heavy ties: every cut keeps exactly the sort's top k (ties
    /// by index), whether the threshold's bin is remembered or searched, though the any-order
    /// passes see the chunks last first on two workers.
    #[test]
    fn rank_cuts_match_a_sort_over_many_chunks() {
        let len = 40 * SCAN_CHUNK + 17;
        let mut rng = crate::demo::SplitMix64::new(7);
        // Few distinct magnitudes, zeros, both signs: many ties at any threshold. Agent 2 also
        // has magnitudes that share a high bin with different low bits.
        let v: Vec<Vec<f32>> = (0..3)
            .map(|t| {
                (0..len)
                    .map(|_| {
                        let r = rng.next_f64();
                        if r < 0.3 + 0.2 * t as f64 {
                            return 0.0;
                        }
                        let mut m = [0.25f32, 0.5, 0.75, 1.0, 3.0][(r * 1000.0) as usize % 5];
                        if t == 2 && r > 0.9 {
                            m = f32::from_bits(m.to_bits() + 1 + (r * 1e4) as u32 % 3);
                        }
                        if r < 0.8 {
                            m
                        } else {
                            -m
                        }
                    })
                    .collect()
            })
            .collect();
        let cases = [
            (0, 1, false),
            (1, 7777, false),
            (2, 50_000, true),
            (2, 20_000, false),
            (0, 90_000, true),
        ];
        for (memory, sample_min) in [(0, 0), (1 << 20, 0), (0, u64::MAX), (1 << 20, u64::MAX)] {
            for (t, k, high_first) in cases {
                let cut = rank_cuts_remembering(
                    &mut scan_of(v.clone(), 1000),
                    true,
                    (3, len as u64, sample_min),
                    &[(t, k, high_first)],
                    memory,
                )
                .unwrap()[0];
                let got: Vec<usize> = (0..len)
                    .filter(|&i| cut.inside(magnitude_key(v[t][i]), i as u32) && v[t][i] != 0.0)
                    .collect();
                assert_eq!(
                    got,
                    sorted_top(&v[t], k as usize, high_first),
                    "agent {t}, k {k}, high first {high_first}, memory {memory}, sample {sample_min}"
                );
            }
        }
    }

    /// The top k of `v[t]` by magnitude, ties to the lower index (`high_first`: the higher), as a
    /// sort finds them, zeros left out (which zeros a zero threshold keeps changes nothing).
    fn sorted_top(v: &[f32], k: usize, high_first: bool) -> Vec<usize> {
        let mut order: Vec<usize> = (0..v.len()).collect();
        order.sort_by(|&a, &b| {
            let (ka, kb) = (magnitude_key(v[a]), magnitude_key(v[b]));
            kb.cmp(&ka)
                .then(if high_first { b.cmp(&a) } else { a.cmp(&b) })
        });
        let mut top: Vec<usize> = order[..k]
            .iter()
            .copied()
            .filter(|&i| v[i] != 0.0)
            .collect();
        top.sort();
        top
    }

    /// A sample that sees only the large values guesses a band that misses the cut: pass 1
    /// counts again over every bin, and the cut is still exact.
    #[test]
    fn rank_cuts_survive_a_misleading_sample() {
        let len = 40 * SCAN_CHUNK;
        let mut rng = crate::demo::SplitMix64::new(11);
        // The sampled chunks (every 16th) hold large magnitudes, the others small ones and zeros.
        let v: Vec<f32> = (0..len)
            .map(|i| {
                let r = rng.next_f64();
                let m = if (i / SCAN_CHUNK).is_multiple_of(SAMPLE_EVERY) {
                    [8.0f32, 16.0][(r * 2.0) as usize]
                } else if r < 0.3 {
                    0.0
                } else {
                    [0.25f32, 0.5, 0.75][(r * 3.0) as usize]
                };
                if r < 0.5 {
                    m
                } else {
                    -m
                }
            })
            .collect();
        for (k, high_first) in [(5_000, false), (30_000, false), (100_000, true)] {
            for memory in [0, 1 << 20] {
                let cut = rank_cuts_remembering(
                    &mut scan_of(vec![v.clone()], 1000),
                    true,
                    (1, len as u64, 0),
                    &[(0, k as u64, high_first)],
                    memory,
                )
                .unwrap()[0];
                let got: Vec<usize> = (0..len)
                    .filter(|&i| cut.inside(magnitude_key(v[i]), i as u32) && v[i] != 0.0)
                    .collect();
                assert_eq!(got, sorted_top(&v, k, high_first), "k {k}, memory {memory}");
            }
        }
    }

    /// The vector and the scalar band scans agree on bits, counts and extremes, for bands from
    /// bin 0, in the middle and at the top, with zeros, denormals and a NaN's key among the values.
    #[test]
    fn band_bits_vector_and_scalar_agree() {
        let mut rng = crate::demo::SplitMix64::new(5);
        let v: Vec<f32> = (0..1000)
            .map(|i| match i % 50 {
                0 => 0.0,
                1 => -0.0,
                2 => f32::from_bits(3),
                3 => f32::from_bits(u32::MAX),
                _ => ((rng.next_f64() - 0.5) * 4.0) as f32,
            })
            .collect();
        let key_bin = |x: f32| magnitude_key(x) >> 16;
        let bands = [
            Band::ALL,
            Band { lo: 0, hi: 0 },
            Band::around(&[key_bin(0.3), key_bin(1.5)]),
            Band::around(&[key_bin(1.0)]),
            Band::around(&[Band::ALL.hi]),
        ];
        for band in bands {
            for len in [0usize, 63, 64, 1000] {
                let words = len.div_ceil(64);
                let (mut a, mut b) = (
                    (vec![0; words], vec![0; words]),
                    (vec![0; words], vec![0; words]),
                );
                let fast = band_bits(&v[..len], band, &mut a.0, &mut a.1);
                let slow = band_bits_scalar(&v[..len], band, &mut b.0, &mut b.1);
                assert_eq!((fast, &a), (slow, &b), "band {band:?}, {len} values");
                // Each vector build the CPU runs, over the whole blocks.
                #[cfg(target_arch = "x86_64")]
                {
                    use crate::simd::{detected, Level};
                    let blocks = &v[..len / 64 * 64];
                    let whole = blocks.len() / 64;
                    let mut want = (vec![0; whole], vec![0; whole]);
                    let want_tally = band_bits_scalar(blocks, band, &mut want.0, &mut want.1);
                    let mut got = (vec![0; whole], vec![0; whole]);
                    if detected() >= Level::Avx2 {
                        // SAFETY: the CPU has AVX2; blocks of 64 elements.
                        let t = unsafe { band_bits_avx2(blocks, band, &mut got.0, &mut got.1) };
                        assert_eq!((t, &got), (want_tally, &want), "AVX2, band {band:?}");
                    }
                    if detected() >= Level::Avx512 {
                        // SAFETY: the CPU has AVX-512 F/BW/VL; blocks of 64 elements.
                        let t = unsafe { band_bits_avx512(blocks, band, &mut got.0, &mut got.1) };
                        assert_eq!((t, &got), (want_tally, &want), "AVX-512, band {band:?}");
                    }
                }
                let (first, last) = band.keys();
                let keys = v[..len].iter().map(|&x| magnitude_key(x));
                let inside = keys.clone().filter(|&k| k != 0 && k >= first && k <= last);
                let bits = (0..len).filter(|&i| a.0[i / 64] >> (i % 64) & 1 == 1);
                assert_eq!(slow.inside, bits.count() as u64);
                assert_eq!(slow.inside, inside.count() as u64);
                assert_eq!(slow.above, keys.filter(|&k| k > last).count() as u64);
            }
        }
    }

    #[test]
    fn model_stock_t_by_hand() {
        // Two orthogonal task vectors: cos 0 → t 0 (keep the base). Two equal ones: cos 1 → t 1.
        assert_eq!(model_stock_t(&[1.0, 0.0, 0.0, 1.0], 2), 0.0);
        assert!((model_stock_t(&[4.0, 4.0, 0.0, 4.0], 2) - 1.0).abs() < 1e-12);
        // cos 0.5, N = 2 → 2·0.5 / 1.5 = 2/3.
        assert!((model_stock_t(&[1.0, 0.5, 0.0, 1.0], 2) - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn slerp_coefs_by_hand() {
        // Orthogonal unit rows, t = 0.5: θ = π/2, both coefficients sin(π/4).
        let (a, b) = slerp_coefs(0.5, &[1.0, 1.0, 0.0]);
        assert!((a - 0.5f64.sqrt()).abs() < 1e-12 && (b - a).abs() < 1e-12);
        // Parallel rows fall back to lerp.
        assert_eq!(slerp_coefs(0.25, &[1.0, 4.0, 2.0]), (0.75, 0.25));
    }
}
