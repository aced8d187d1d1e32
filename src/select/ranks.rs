//! DELLA's keep decisions by rank: each element's 1-based rank by |v| ascending within its rank
//! group, ties by index (a stable sort) — a matrix's rows, or for a tensor [a, b, c, …] the b
//! elements that share every other index, as mergekit's DELLA ranks along dimension 1 — found
//! without a comparison sort: zeros (most of an RL task vector) rank first and are never kept,
//! the other magnitude keys go through a stable radix sort, and each is decided in sorted order;
//! slab by slab in parallel. Same ranks as sorting by (|v| key, index).

use super::cut::magnitude_key;
use crate::hash::element_hash;
use crate::simd::multiversion;
use rayon::prelude::*;
use std::cell::RefCell;

/// Elements of a run from which its slabs are ranked in parallel.
const PARALLEL_ELEMS: usize = 1 << 16;

/// DELLA's keep rule on ranks: an element of 1-based rank r is kept when its hash under `key`
/// is below [`rank_threshold`]`(p0, step, r)`.
#[derive(Clone, Copy, Debug)]
pub struct RankKeep {
    /// Keep probability of the lowest rank.
    pub p0: f32,
    /// Added to the probability per rank.
    pub step: f32,
    /// The mask's hash key (seed, tensor and agent).
    pub key: [u32; 2],
}

impl RankKeep {
    /// Whether the element of tensor index `index` and 1-based `rank` is kept under this rule.
    #[inline(always)]
    fn keeps(self, index: u32, rank: u32) -> bool {
        element_hash(self.key, index) < rank_threshold(self.p0, self.step, rank)
    }
}

/// DELLA's keep threshold for an element of 1-based `rank`: ⌊p · 2³²⌋ with
/// p = p0 + (rank − 1)·step in f32 (the shaders compute the same).
#[inline]
pub fn rank_threshold(p0: f32, step: f32, rank: u32) -> u32 {
    let p = p0 + (rank - 1) as f32 * step;
    saturating_u32(p * 4_294_967_296.0f32)
}

/// `x as u32` (truncation; saturating, NaN → 0), written so a loop of them vectorizes to one
/// unsigned conversion per vector (Rust's saturating `as` compiles to a scalar one per lane).
#[inline(always)]
fn saturating_u32(x: f32) -> u32 {
    // The largest f32 below 2^32 is 2^32 − 256: every x < 2^32 is at most it.
    let inside = if x >= 0.0 {
        x.min(4_294_967_040.0)
    } else {
        0.0
    };
    // SAFETY: `inside` is finite and in [0, 2^32 − 256], where the conversion is exact truncation.
    let t = unsafe { inside.to_int_unchecked::<u32>() };
    if x >= 4_294_967_296.0 {
        u32::MAX
    } else {
        t
    }
}

/// DELLA's keep mask, made where the ranks are found: `out[i]` = all ones where the element of
/// tensor index `first + i` is kept under `rule` with its rank, else 0. A zero is
/// never kept: whether it is changes no output (a kept zero adds ±0 to sums that are never −0,
/// agrees with no consensus sign and adds nothing to an L1 norm; SPEC §4), so zeros are counted,
/// not ranked. Rank groups: in each slab of `slab` elements, elements k, k + `stride`, k +
/// 2·`stride`, … form group k (stride 1: the slab is one row). Each group's ranks are found
/// first, then the slab's decisions in index order: in one vectorized loop over the slab, or over
/// a sparse row's nonzero elements (`SPARSE`).
pub fn row_keep_mask(
    v: &[f32],
    (slab, stride): (usize, usize),
    first: u32,
    rule: RankKeep,
    out: &mut Vec<u32>,
) {
    // Every lane is written below: no clearing of what `out` held.
    out.truncate(v.len());
    out.resize(v.len(), 0);
    let slab = slab.max(1);
    let stride = stride.max(1);
    let keep_slab = |(j, (values, mask)): (usize, (&[f32], &mut [u32]))| {
        let at = first.wrapping_add((j * slab) as u32);
        SCRATCH.with_borrow_mut(|scratch| {
            scratch.reserve(values.len());
            let mut nonzero = 0;
            for k in 0..stride.min(values.len()) {
                nonzero = rank_group(values, k, stride, scratch);
            }
            if stride == 1 && nonzero * SPARSE < values.len() {
                decide_sparse(nonzero, at, rule, scratch, mask);
            } else {
                decide(values, &scratch.ranks[..values.len()], at, rule, mask);
            }
        })
    };
    if v.len() >= PARALLEL_ELEMS && v.len() > slab {
        v.par_chunks(slab)
            .zip(out.par_chunks_mut(slab))
            .enumerate()
            .for_each(keep_slab);
    } else {
        v.chunks(slab)
            .zip(out.chunks_mut(slab))
            .enumerate()
            .for_each(keep_slab);
    }
}

/// A row with fewer than one nonzero element in this many is decided element by nonzero
/// element ([`decide_sparse`]), else in one pass over the whole row ([`decide`]): RL task vectors
/// are often mostly zeros, and then hashing every element costs more than placing the few
/// decisions.
const SPARSE: usize = 4;

multiversion! {
    /// The 1-based ranks of group `k` of a slab (elements k, k + stride, …) into `s.ranks`, by
    /// slab index: the nonzero keys sorted by key, stably, after the group's zeros (whose entries
    /// are left as they were: the decisions never read them). Returns how many are nonzero, their
    /// (key, slab index) pairs left in `s.keys` in index order.
    fn rank_group(values: &[f32], k: usize, stride: usize, s: &mut Scratch) -> usize {
        let group = (values.len() - k).div_ceil(stride);
        let keys = &mut s.keys[..=group];
        let nonzero = if stride == 1 {
            row_pairs(values, keys)
        } else {
            let group = (k..values.len()).step_by(stride).map(|i| (i, values[i]));
            push_pairs(group, 0, keys)
        };
        let zeros = (group - nonzero) as u32;
        let buffers = (&mut s.spare[..nonzero], &mut s.third[..nonzero]);
        rank_sorted(&s.keys[..nonzero], buffers, zeros + 1, &mut s.ranks);
        nonzero
    }
}

/// A (magnitude key, slab index) pair as the ranks sort them: laid out key first, so the vector
/// path of [`row_pairs`] writes one as the 64-bit word key | index << 32.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
struct Pair(u32, u32);

/// The nonzero magnitude keys of a row (`values`, slab indices 0, 1, …) as pairs packed to the
/// front of `pairs` (at least one longer than the row), in index order; returns how many. With
/// AVX-512 sixteen at a time by compressing stores; else one at a time, branch-free.
fn row_pairs(values: &[f32], pairs: &mut [Pair]) -> usize {
    assert!(
        pairs.len() > values.len(),
        "room for the row and a spare pair"
    );
    // (elements done, pairs packed) by the vector path.
    #[cfg(target_arch = "x86_64")]
    let (done, nonzero) = match crate::simd::level() {
        crate::simd::Level::Avx512 => {
            let whole = values.len() / 16 * 16;
            // SAFETY: the CPU supports AVX-512 F/BW/VL, detected by `level`; the row's first
            // `whole` elements are whole groups of sixteen and `pairs` is longer than the row.
            (whole, unsafe { row_pairs_avx512(&values[..whole], pairs) })
        }
        _ => (0, 0),
    };
    #[cfg(not(target_arch = "x86_64"))]
    let (done, nonzero) = (0, 0);
    push_pairs(
        values.iter().copied().enumerate().skip(done),
        nonzero,
        pairs,
    )
}

/// The nonzero magnitude keys of `elements` ((slab index, value), in index order) as pairs
/// packed into `pairs` after the `nonzero` there; returns how many there are then. Branch-free
/// (zeros fall at random in a task vector): every key is written as the next pair, and only a
/// nonzero one moves the count on.
#[inline(always)]
fn push_pairs(
    elements: impl Iterator<Item = (usize, f32)>,
    mut nonzero: usize,
    pairs: &mut [Pair],
) -> usize {
    for (i, x) in elements {
        let key = magnitude_key(x);
        pairs[nonzero] = Pair(key, i as u32);
        nonzero += usize::from(key != 0);
    }
    nonzero
}

/// [`row_pairs`] of whole groups of sixteen elements: per group, the keys and indices widened to
/// 64-bit pairs, eight at a time, compressed to the nonzero ones and stored unaligned at the end
/// of those packed so far (each store stays within the row's length: at most as many pairs
/// are packed as elements were read).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,bmi1,bmi2,lzcnt,popcnt")]
fn row_pairs_avx512(values: &[f32], pairs: &mut [Pair]) -> usize {
    use std::arch::x86_64::*;
    assert!(values.len().is_multiple_of(16) && pairs.len() >= values.len());
    // magnitude_key's mask, sixteen lanes at a time.
    let magnitude = _mm512_set1_epi32(0x7fff_ffff);
    let sixteen = _mm512_set1_epi32(16);
    let mut index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let out = pairs.as_mut_ptr().cast::<u64>();
    let mut n = 0usize;
    for group in values.chunks_exact(16) {
        // SAFETY: `group` holds sixteen f32 (64 bytes); unaligned loads are allowed.
        let key = _mm512_and_si512(
            unsafe { _mm512_loadu_si512(group.as_ptr().cast()) },
            magnitude,
        );
        let nonzero = _mm512_test_epi32_mask(key, key);
        for half in 0..2 {
            let (k, i) = if half == 0 {
                (_mm512_castsi512_si256(key), _mm512_castsi512_si256(index))
            } else {
                (
                    _mm512_extracti64x4_epi64::<1>(key),
                    _mm512_extracti64x4_epi64::<1>(index),
                )
            };
            let pair = _mm512_or_si512(
                _mm512_cvtepu32_epi64(k),
                _mm512_slli_epi64::<32>(_mm512_cvtepu32_epi64(i)),
            );
            let lanes = (nonzero >> (8 * half)) as u8;
            // SAFETY: n ≤ the elements read before this half, so the eight pairs stored end
            // within the first `values.len()` pairs; `Pair` is repr(C), key then index, so the
            // little-endian word key | index << 32 is one pair.
            unsafe {
                _mm512_storeu_si512(out.add(n).cast(), _mm512_maskz_compress_epi64(lanes, pair))
            };
            n += lanes.count_ones() as usize;
        }
        index = _mm512_add_epi32(index, sixteen);
    }
    n
}

multiversion! {
    /// `mask[i]` = all ones when slab element `i` (tensor index `first` + i) is nonzero and kept
    /// at its rank `ranks[i]`, else 0: the hashes and thresholds of a slab in one vectorized
    /// loop (a zero's rank entry is stale, and read as 1).
    fn decide(values: &[f32], ranks: &[u32], first: u32, rule: RankKeep, mask: &mut [u32]) {
        for (i, ((&x, &r), m)) in values.iter().zip(ranks).zip(mask.iter_mut()).enumerate() {
            let nonzero = magnitude_key(x) != 0;
            let rank = if nonzero { r } else { 1 };
            let keep = nonzero & rule.keeps(first.wrapping_add(i as u32), rank);
            *m = u32::from(keep).wrapping_neg();
        }
    }
}

/// [`decide`] of a sparse row from its `nonzero` elements' (key, slab index) pairs in `s.keys`,
/// in index order, and their ranks in `s.ranks`: `mask` cleared, then each nonzero element's
/// decision placed (the hashes and thresholds in one vectorized loop over them).
fn decide_sparse(nonzero: usize, first: u32, rule: RankKeep, s: &mut Scratch, mask: &mut [u32]) {
    let pairs = &s.keys[..nonzero];
    let decisions = &mut s.decisions[..nonzero];
    for (r, &Pair(_, i)) in decisions.iter_mut().zip(pairs) {
        *r = s.ranks[i as usize];
    }
    decide_ranked(pairs, first, rule, decisions);
    mask.fill(0);
    for (&Pair(_, i), &d) in pairs.iter().zip(&*decisions) {
        mask[i as usize] = d;
    }
}

multiversion! {
    /// `ranks[j]` (the rank of the element of `pairs[j]`, slab index `pairs[j].1`, tensor index
    /// `first` + it) replaced by its decision: all ones when kept, else 0.
    fn decide_ranked(pairs: &[Pair], first: u32, rule: RankKeep, ranks: &mut [u32]) {
        for (&Pair(_, i), r) in pairs.iter().zip(ranks.iter_mut()) {
            *r = u32::from(rule.keeps(first.wrapping_add(i), *r)).wrapping_neg();
        }
    }
}

/// A thread's buffers: (key, index) pairs, the radix sort's buffers, a slab's ranks and a sparse
/// row's decisions, kept from row to row and tile to tile (fresh ones per slab cost a page fault per page, and as
/// much time again in the kernel as the sort).
#[derive(Default)]
struct Scratch {
    /// A group's nonzero (key, slab index) pairs in index order, left so by the sort.
    keys: Vec<Pair>,
    /// The radix sort's buffers.
    spare: Vec<Pair>,
    third: Vec<Pair>,
    /// Each slab element's 1-based rank in its group, by slab index.
    ranks: Vec<u32>,
    /// A sparse row's ranks, then decisions, of its nonzero elements in index order.
    decisions: Vec<u32>,
}

impl Scratch {
    /// Room for a slab of `len` elements and a sentinel pair: buffers only grow, and what they
    /// held is overwritten before it is read (no clearing per row).
    fn reserve(&mut self, len: usize) {
        if self.keys.len() <= len {
            self.keys.resize(len + 1, Pair(0, 0));
            self.spare.resize(len + 1, Pair(0, 0));
            self.third.resize(len + 1, Pair(0, 0));
            self.ranks.resize(len + 1, 0);
            self.decisions.resize(len + 1, 0);
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// Ranks (key, slab index) pairs by key, stably — they arrive in index order, so equal keys
/// keep it: `ranks[index]` = `base` + the pair's position in that order. A radix sort, up to 8
/// bits at a time from the lowest bit that differs between keys to the highest (the keys of a
/// task vector of 16-bit weights differ in few bits: its low mantissa bits are all 0, its
/// exponents span a few binades — often one pass, not four), whose last pass writes the ranks
/// instead of moving the pairs; the passes before move them between the two `buffers` (as long
/// as `a`), so `a` is left in index order. Short runs by a stable comparison sort. Inlined into
/// [`rank_group`]'s builds.
#[inline(always)]
fn rank_sorted(a: &[Pair], (b, c): (&mut [Pair], &mut [Pair]), base: u32, ranks: &mut [u32]) {
    if a.len() <= SHORT_RUN {
        b.copy_from_slice(a);
        b.sort_by_key(|p| p.0);
        for (pos, &Pair(_, i)) in b.iter().enumerate() {
            ranks[i as usize] = base + pos as u32;
        }
        return;
    }
    let (any, all) = a
        .iter()
        .fold((0u32, u32::MAX), |(o, n), p| (o | p.0, n & p.0));
    let varying = any ^ all;
    // Digits over the bits that vary, from the lowest: as few passes of at most 8 bits as
    // cover them, of equal width, each counting into 2^width buckets only (a row of a few dozen
    // keys of a handful of exponents counts into 16, not 256). Keys all equal: one pass of one
    // bucket, in index order.
    let (low, high) = (varying.trailing_zeros() % 32, 32 - varying.leading_zeros());
    let passes = (high - low).div_ceil(8).max(1);
    let width = (high - low).div_ceil(passes);
    // The pairs the next pass reads: `a` first, then whichever buffer the last pass wrote (`x`).
    let (mut x, mut y) = (b, c);
    let mut in_a = true;
    for pass in 0..passes {
        let digits = Digits {
            shift: low + pass * width,
            buckets: 1 << width,
        };
        let last = pass + 1 == passes;
        match (in_a, last) {
            (true, true) => radix_pass(a, digits, base, |p, at| ranks[p.1 as usize] = at),
            (false, true) => radix_pass(x, digits, base, |p, at| ranks[p.1 as usize] = at),
            (true, false) => {
                radix_pass(a, digits, 0, |p, at| x[at as usize] = p);
                in_a = false;
            }
            (false, false) => {
                radix_pass(x, digits, 0, |p, at| y[at as usize] = p);
                std::mem::swap(&mut x, &mut y);
            }
        }
    }
}

/// Runs of at most this many pairs are ranked by a comparison sort: below it, the radix passes'
/// fixed work (the key bits, clearing and summing the counters) costs more than the compares.
const SHORT_RUN: usize = 16;

/// A radix pass's digit: `buckets` (a power of two, at most 256) values from bit `shift` of a key.
#[derive(Clone, Copy)]
struct Digits {
    shift: u32,
    buckets: usize,
}

/// One stable counting pass over `a` by `digits`: `place(pair, position)` for each pair, its
/// position in `a` sorted by that digit.
///
/// It counts and places the four quarters of the run in one interleaved loop, each quarter
/// with its own counters (quarter j's entries of a digit go after quarter j − 1's, so the pass
/// stays stable): the keys of a task vector repeat, and one counter per digit would make every
/// entry wait for the previous store to the same counter.
#[inline(always)]
fn radix_pass(
    a: &[Pair],
    Digits { shift, buckets }: Digits,
    origin: u32,
    mut place: impl FnMut(Pair, u32),
) {
    // Masked to 8 bits as well, so the counters' indexing needs no bounds check.
    let digit = |p: Pair| (p.0 >> shift) as usize & (buckets - 1) & 0xff;
    let q = a.len() / 4;
    // Quarter j is a[j·q .. (j + 1)·q], the last one also holding the n % 4 entries after 4q.
    let (q0, rest) = a.split_at(q);
    let (q1, rest) = rest.split_at(q);
    let (q2, q3) = rest.split_at(q);
    let (q3, tail) = q3.split_at(q);
    let quarters = || q0.iter().zip(q1).zip(q2).zip(q3);
    let mut count = [[0u32; 256]; 4];
    for (((&p0, &p1), &p2), &p3) in quarters() {
        count[0][digit(p0)] += 1;
        count[1][digit(p1)] += 1;
        count[2][digit(p2)] += 1;
        count[3][digit(p3)] += 1;
    }
    for &p in tail {
        count[3][digit(p)] += 1;
    }
    // Where each digit's entries start (one chain of adds, from `origin`), then each quarter's
    // start within them (digit-wise, vectorized).
    let mut starts = [0u32; 256];
    for (d, s) in starts[..buckets].iter_mut().enumerate() {
        *s = count[0][d] + count[1][d] + count[2][d] + count[3][d];
    }
    let mut at = origin;
    for s in starts[..buckets].iter_mut() {
        (*s, at) = (at, at + *s);
    }
    for (d, &s) in starts[..buckets].iter().enumerate() {
        let [c0, c1, c2, _] = [count[0][d], count[1][d], count[2][d], count[3][d]];
        [count[0][d], count[1][d], count[2][d], count[3][d]] =
            [s, s + c0, s + c0 + c1, s + c0 + c1 + c2];
    }
    let [c0, c1, c2, c3] = &mut count;
    for (((&p0, &p1), &p2), &p3) in quarters() {
        for (p, c) in [
            (p0, &mut *c0),
            (p1, &mut *c1),
            (p2, &mut *c2),
            (p3, &mut *c3),
        ] {
            let d = digit(p);
            place(p, c[d]);
            c[d] += 1;
        }
    }
    for &p in tail {
        let d = digit(p);
        place(p, c3[d]);
        c3[d] += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::SplitMix64;

    /// The reference ranks the tests check against, by hand: rows, strided groups (a [3, 2]
    /// slab's columns), ties by index, −0 a zero.
    #[test]
    fn reference_ranks_by_hand() {
        let v = [3.0, -1.0, 2.0, 5.0, 4.0, 0.5];
        assert_eq!(sorted_ranks(&v, 3, 1), [3, 1, 2, 3, 2, 1]);
        assert_eq!(sorted_ranks(&v, 6, 2), [2, 2, 1, 3, 3, 1]);
        assert_eq!(
            sorted_ranks(&[1.0, 1.0, -1.0, -0.0, 0.0], 5, 1),
            [3, 4, 5, 1, 2]
        );
    }

    /// Rows of every kind the ranks meet: sparse and dense, ties, zeros of both signs, NaN and
    /// infinities (`Mixed`), or the few magnitudes of a task vector of 16-bit weights (k·2^e for
    /// small k: few bits differ, so one radix pass), at `zeros` density.
    fn random_rows(rng: &mut SplitMix64, len: usize, zeros: f64, bf16_like: bool) -> Vec<f32> {
        (0..len)
            .map(|_| {
                let u = rng.next_u64();
                let sign = if u.is_multiple_of(2) { 1.0 } else { -1.0 };
                match u % 100 {
                    _ if (u >> 32) as f64 / 4294967296.0 < zeros => 0.0 * sign,
                    _ if bf16_like => {
                        let k = 1 + (u >> 8) % 4;
                        k as f32 * f32::powi(2.0, -12 - ((u >> 12) % 9) as i32) * sign
                    }
                    0 => f32::NAN,
                    1 => f32::INFINITY,
                    2..=30 => ((u >> 40) % 8) as f32 * 0.25 - 1.0,
                    _ => f32::from_bits((u >> 16) as u32 & 0x3fff_ffff) * sign,
                }
            })
            .collect()
    }

    /// (len, slab, stride, zero density, 16-bit-like magnitudes) of the rows the tests rank.
    const CASES: [(usize, usize, usize, f64, bool); 8] = [
        (1000, 100, 1, 0.0, false),
        (4096, 4096, 1, 0.9, false),
        (3 << 16, 3000, 1, 0.6, false),
        (6000, 600, 3, 0.5, false),
        (1 << 17, 1 << 12, 4, 0.97, false),
        (3 << 16, 2816, 1, 0.5, true),
        (20_000, 1000, 1, 0.0, true),
        (7000, 700, 7, 0.3, true),
    ];

    /// The ranks of a stable sort by (magnitude key, index): each group's ranks by a comparison
    /// sort.
    fn sorted_ranks(v: &[f32], slab: usize, stride: usize) -> Vec<u32> {
        let mut want = vec![0u32; v.len()];
        for (s0, chunk) in (0..v.len()).step_by(slab).zip(v.chunks(slab)) {
            for k in 0..stride.min(chunk.len()) {
                let mut order: Vec<usize> = (k..chunk.len()).step_by(stride).collect();
                order.sort_by_key(|&i| (magnitude_key(chunk[i]), i));
                for (pos, i) in order.into_iter().enumerate() {
                    want[s0 + i] = pos as u32 + 1;
                }
            }
        }
        want
    }

    /// The radix ranks are a stable sort's positions by key: on the (key, index) pairs of
    /// sparse and dense rows with ties, NaN and infinities, 16-bit-like keys (one pass), keys of
    /// every bit (four), all equal keys, runs just past [`SHORT_RUN`] and short runs (the
    /// comparison sort).
    #[test]
    fn radix_ranks_are_a_stable_sorts_positions() {
        let mut rng = SplitMix64::new(7);
        let equal = vec![0.5f32; 300];
        for (len, _, _, zeros, bf16_like) in CASES {
            let v = random_rows(&mut rng, len, zeros, bf16_like);
            for run in [&v[..], &v[..40], &v[..12], &v[..len.min(3000)], &equal[..]] {
                let pairs: Vec<Pair> = run
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| Pair(magnitude_key(x), i as u32))
                    .collect();
                let mut sorted = pairs.clone();
                sorted.sort_by_key(|p| p.0);
                let mut want = vec![0u32; run.len()];
                for (pos, p) in sorted.iter().enumerate() {
                    want[p.1 as usize] = 5 + pos as u32;
                }
                let (mut spare, mut third) = (pairs.clone(), pairs.clone());
                let mut got = vec![0u32; run.len()];
                rank_sorted(&pairs, (&mut spare, &mut third), 5, &mut got);
                assert_eq!(got, want, "len {}, zeros {zeros}", run.len());
            }
        }
    }

    /// The vectorizable conversion is Rust's saturating `as u32`: around 0, 1, 2^24, 2^32 and
    /// every binade's ends, negative, infinite and NaN values.
    #[test]
    fn saturating_conversion_is_as_u32() {
        let mut xs = vec![
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            0.0,
        ];
        for e in -30..=40 {
            let b = f32::powi(2.0, e);
            for x in [b, -b, b * 0.75, b * 1.5] {
                xs.extend([
                    x,
                    f32::from_bits(x.to_bits() + 1),
                    f32::from_bits(x.to_bits() - 1),
                ]);
            }
        }
        let mut rng = SplitMix64::new(3);
        xs.extend((0..100_000).map(|_| f32::from_bits(rng.next_u64() as u32)));
        for x in xs {
            assert_eq!(saturating_u32(x), x as u32, "{x:e} ({:#x})", x.to_bits());
        }
    }

    /// A row's pairs are the same whichever path packs them (sixteen at a time with AVX-512,
    /// else one at a time): rows of every length around the groups of sixteen, dense, sparse
    /// and all zero, −0 a zero.
    #[test]
    fn row_pairs_match_the_scalar_packing() {
        let mut rng = SplitMix64::new(5);
        for len in (0..70).chain([255, 256, 257, 1000, 4096]) {
            for zeros in [0.0, 0.5, 0.97, 1.0] {
                let v = random_rows(&mut rng, len, zeros, false);
                let mut want = vec![Pair(0, 0); len + 1];
                let n = push_pairs(v.iter().copied().enumerate(), 0, &mut want);
                let mut got = vec![Pair(7, 7); len + 1];
                assert_eq!(row_pairs(&v, &mut got), n, "len {len}, zeros {zeros}");
                assert_eq!(got[..n], want[..n], "len {len}, zeros {zeros}");
            }
        }
    }

    /// DELLA's keep mask is the rule applied to the sorted ranks: every nonzero element kept
    /// exactly when its hash is below its rank's threshold, every zero dropped — for rules with
    /// rising, falling and flat probabilities, tensors that start anywhere (`first`), rows
    /// decided whole and sparse rows decided by their nonzero elements.
    #[test]
    fn keep_masks_apply_the_rule_to_the_ranks() {
        let mut rng = SplitMix64::new(11);
        // Probabilities rise (or fall) by 0.2 (0.4) over a slab.
        let rules = [(0.4, 0.2), (0.7, -0.4), (0.5, 0.0)];
        for (c, (len, slab, stride, zeros, bf16_like)) in CASES.into_iter().enumerate() {
            let v = random_rows(&mut rng, len, zeros, bf16_like);
            let ranks = sorted_ranks(&v, slab, stride);
            let (p0, rise) = rules[c % rules.len()];
            let step = rise / slab as f32;
            let rule = RankKeep {
                p0,
                step,
                key: [rng.next_u64() as u32, rng.next_u64() as u32],
            };
            let first = (rng.next_u64() as u32) / slab as u32 * slab as u32;
            // A buffer from an earlier, longer tile, holding other decisions: every lane must
            // be written (sparse rows and dense ones).
            let mut got = vec![u32::MAX; len + 5];
            row_keep_mask(&v, (slab, stride), first, rule, &mut got);
            assert_eq!(got.len(), len);
            let mut kept = 0;
            for (i, (&x, &r)) in v.iter().zip(&ranks).enumerate() {
                let idx = first.wrapping_add(i as u32);
                let keep = magnitude_key(x) != 0
                    && element_hash(rule.key, idx) < rank_threshold(p0, step, r);
                kept += usize::from(keep);
                assert_eq!(
                    got[i],
                    u32::from(keep).wrapping_neg(),
                    "case {c}, element {i}"
                );
            }
            assert!(kept > 0, "case {c}: nothing kept, the test would not tell");
        }
    }
}
