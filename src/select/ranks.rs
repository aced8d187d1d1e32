//! DELLA's ranks: each element's 1-based rank by |v| ascending within its rank group, ties by
//! index (a stable sort), computed without a comparison sort — zeros (most of an RL task vector)
//! rank first in index order as they are met, the other magnitude keys go through a stable radix
//! sort — and slab by slab in parallel. Same ranks as sorting by (|v| key, index).

use super::cut::magnitude_key;
use rayon::prelude::*;
use std::cell::RefCell;

/// Elements of a run from which its slabs are ranked in parallel.
const PARALLEL_ELEMS: usize = 1 << 16;

/// 1-based ranks of |v| ascending within each rank group (ties: lower index first, as a stable
/// sort), for a run of whole slabs of `slab` elements: in each slab, elements k, k + `stride`,
/// k + 2·`stride`, … form group k (stride 1: the slab is one group, a row). That is a ranking
/// along dimension 1, as mergekit's DELLA ranks: a matrix's rows, or for a tensor [a, b, c, …]
/// the b elements that share every other index (slab b·c·…, stride c·…).
pub fn row_ranks(v: &[f32], slab: usize, stride: usize, out: &mut Vec<u32>) {
    // Every rank is written below: no need to clear what a reused buffer held.
    out.resize(v.len(), 0);
    let slab = slab.max(1);
    let stride = stride.max(1);
    let rank_slab = |(values, ranks): (&[f32], &mut [u32])| {
        SCRATCH.with_borrow_mut(|scratch| {
            for k in 0..stride.min(values.len()) {
                rank_group(values, ranks, (k, stride), scratch);
            }
        })
    };
    if v.len() >= PARALLEL_ELEMS && v.len() > slab {
        v.par_chunks(slab)
            .zip(out.par_chunks_mut(slab))
            .for_each(rank_slab);
    } else {
        v.chunks(slab).zip(out.chunks_mut(slab)).for_each(rank_slab);
    }
}

/// A thread's buffers: (key, index) pairs and the radix sort's second buffer, kept from row to
/// row and tile to tile (fresh ones per slab cost a page fault per page, and as much time again
/// in the kernel as the sort).
#[derive(Default)]
struct Scratch {
    keys: Vec<(u32, u32)>,
    spare: Vec<(u32, u32)>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// Ranks group `k` of a slab (elements k, k + stride, …): zeros first, in index order, then the
/// nonzero keys in (key, index) order.
fn rank_group(values: &[f32], ranks: &mut [u32], (k, stride): (usize, usize), s: &mut Scratch) {
    // Branch-free (zeros fall at random in a task vector): every element is written as a
    // candidate zero rank and as the next nonzero pair, and only the count that applies moves on.
    let group = (values.len() - k).div_ceil(stride);
    // Entries up to the last nonzero one are written below, the rest truncated.
    s.keys.resize(group + 1, (0, 0));
    let (mut zeros, mut nonzero) = (0u32, 0usize);
    for i in (k..values.len()).step_by(stride) {
        let key = magnitude_key(values[i]);
        let is_zero = u32::from(key == 0);
        zeros += is_zero;
        ranks[i] = zeros;
        s.keys[nonzero] = (key, i as u32);
        nonzero += 1 - is_zero as usize;
    }
    s.keys.truncate(nonzero);
    radix_sort(&mut s.keys, &mut s.spare);
    for (pos, &(_, i)) in s.keys.iter().enumerate() {
        ranks[i as usize] = zeros + pos as u32 + 1;
    }
}

/// Sorts (key, index) pairs by key, stably — they arrive in index order, so equal keys stay in
/// it — a byte at a time from the lowest (a byte every key shares is skipped); short runs by a
/// stable comparison sort. The four bytes' counts come from one read of the keys (a count does
/// not depend on the order the earlier passes left).
fn radix_sort(a: &mut Vec<(u32, u32)>, b: &mut Vec<(u32, u32)>) {
    if a.len() <= 64 {
        a.sort_by_key(|p| p.0);
        return;
    }
    // Every entry is written by the first pass that runs: no need to clear it.
    b.resize(a.len(), (0, 0));
    let mut counts = [[0usize; 256]; 4];
    for &(key, _) in a.iter() {
        let [b0, b1, b2, b3] = key.to_le_bytes();
        counts[0][b0 as usize] += 1;
        counts[1][b1 as usize] += 1;
        counts[2][b2 as usize] += 1;
        counts[3][b3 as usize] += 1;
    }
    for (count, shift) in counts.iter_mut().zip([0, 8, 16, 24]) {
        if count.contains(&a.len()) {
            continue;
        }
        let mut at = 0;
        for c in count.iter_mut() {
            (*c, at) = (at, at + *c);
        }
        for &p in a.iter() {
            let digit = (p.0 >> shift) as usize & 255;
            b[count[digit]] = p;
            count[digit] += 1;
        }
        std::mem::swap(a, b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::SplitMix64;

    #[test]
    fn row_ranks_by_hand() {
        let mut r = Vec::new();
        row_ranks(&[3.0, -1.0, 2.0, 5.0, 4.0, 0.5], 3, 1, &mut r);
        assert_eq!(r, [3, 1, 2, 3, 2, 1]);
        // Slab [[3, −1], [2, 5], [4, 0.5]] of shape [3, 2], stride 2: columns ranked.
        row_ranks(&[3.0, -1.0, 2.0, 5.0, 4.0, 0.5], 6, 2, &mut r);
        assert_eq!(r, [2, 2, 1, 3, 3, 1]);
        // Ties by index; −0 is a zero.
        row_ranks(&[1.0, 1.0, -1.0, -0.0, 0.0], 5, 1, &mut r);
        assert_eq!(r, [3, 4, 5, 1, 2]);
    }

    /// The ranks of a stable sort by (magnitude key, index), on sparse and dense runs with ties,
    /// zeros of both signs, NaN and infinities, every stride, runs long enough to go parallel.
    #[test]
    fn ranks_are_a_stable_sorts() {
        let mut rng = SplitMix64::new(7);
        for (len, slab, stride, zeros) in [
            (1000, 100, 1, 0.0),
            (4096, 4096, 1, 0.9),
            (3 << 16, 3000, 1, 0.6),
            (6000, 600, 3, 0.5),
            (1 << 17, 1 << 12, 4, 0.97),
        ] {
            let v: Vec<f32> = (0..len)
                .map(|_| {
                    let u = rng.next_u64();
                    match u % 100 {
                        _ if (u >> 32) as f64 / 4294967296.0 < zeros => {
                            if u.is_multiple_of(2) {
                                0.0
                            } else {
                                -0.0
                            }
                        }
                        0 => f32::NAN,
                        1 => f32::INFINITY,
                        2..=30 => ((u >> 40) % 8) as f32 * 0.25 - 1.0,
                        _ => {
                            f32::from_bits((u >> 16) as u32 & 0x3fff_ffff)
                                * if u.is_multiple_of(2) { 1.0 } else { -1.0 }
                        }
                    }
                })
                .collect();
            let mut got = Vec::new();
            row_ranks(&v, slab, stride, &mut got);
            let mut want = vec![0u32; len];
            for (s0, chunk) in (0..len).step_by(slab).zip(v.chunks(slab)) {
                for k in 0..stride.min(chunk.len()) {
                    let mut order: Vec<usize> = (k..chunk.len()).step_by(stride).collect();
                    order.sort_by_key(|&i| (magnitude_key(chunk[i]), i));
                    for (pos, i) in order.into_iter().enumerate() {
                        want[s0 + i] = pos as u32 + 1;
                    }
                }
            }
            assert_eq!(got, want, "len {len}, slab {slab}, stride {stride}");
        }
    }
}
