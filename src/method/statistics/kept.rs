//! DELLA's keep decisions, made once. Its L1 rescale needs each agent's kept elements before the
//! merge, so its statistics scan ranks every row; the merge would rank every row again to make
//! the same decisions. Instead the scan keeps them, one bit per element and agent, and the merge
//! reads them as [`Keep::Flagged`](crate::method::combine::Keep::Flagged) words — the same decisions, so the same bytes, with half the
//! ranking. Bounded: a tensor whose bits would pass [`MAX_BITS`] is ranked twice, as before.

use crate::method::combine::{row_keep_mask, RankKeep};
use crate::simd::multiversion;
use std::sync::atomic::{AtomicU64, Ordering};

/// The most bits kept for one tensor (all its agents): 64 MiB.
pub const MAX_BITS: u64 = 1 << 29;

/// Keep bits of a tensor's ranked agents: bit i of agent t is element i's keep decision.
/// Recorded by the scan's workers at once (runs of rows share words where they meet: atomic).
#[derive(Debug)]
pub struct KeptFlags {
    /// Per present agent: its bits, or `None` for an agent whose keep rule is not ranked.
    agents: Vec<Option<Vec<AtomicU64>>>,
}

impl KeptFlags {
    /// Room for `numel` elements of the agents marked in `ranked`; `None` past [`MAX_BITS`].
    pub(super) fn new(numel: u64, ranked: &[bool]) -> Option<KeptFlags> {
        let count = ranked.iter().filter(|&&r| r).count() as u64;
        if count == 0 || numel.saturating_mul(count) > MAX_BITS {
            return None;
        }
        let words = numel.div_ceil(64) as usize;
        Some(KeptFlags {
            agents: ranked
                .iter()
                .map(|&r| r.then(|| (0..words).map(|_| AtomicU64::new(0)).collect()))
                .collect(),
        })
    }

    /// Records agent `t`'s keep mask (all ones: kept) for elements `first..first + mask.len()`,
    /// each element once in the scan. Up to a word boundary, then a word per 64 lanes: a word
    /// the run covers whole is stored (no other run has an element in it), a partial one, which
    /// the next or the previous run shares, is or-ed in.
    pub(super) fn record(&self, t: usize, first: u64, mask: &[u32]) {
        let Some(bits) = self.agents[t].as_ref() else {
            return;
        };
        let lead = (((64 - first % 64) % 64) as usize).min(mask.len());
        if lead > 0 {
            let word = pack(&mask[..lead]) << (first % 64);
            bits[(first / 64) as usize].fetch_or(word, Ordering::Relaxed);
        }
        let word0 = ((first + lead as u64) / 64) as usize;
        for (w, lanes) in bits[word0..].iter().zip(mask[lead..].chunks(64)) {
            if lanes.len() == 64 {
                w.store(pack(lanes), Ordering::Relaxed);
            } else {
                w.fetch_or(pack(lanes), Ordering::Relaxed);
            }
        }
    }

    /// Agent `t`'s words for elements `start..start + len`, as [`Keep::Flagged`](crate::method::combine::Keep::Flagged) reads them (1:
    /// kept, 0: dropped; all 0 for an agent without bits, whose rule reads none).
    pub fn words(&self, t: usize, start: u64, len: usize, out: &mut Vec<u32>) {
        match &self.agents[t] {
            Some(bits) => {
                // Every lane is written below: no clearing of what `out` held.
                out.truncate(len);
                out.resize(len, 0);
                // Up to a word boundary bit by bit, then 64 words per bit word.
                let lead = (((64 - start % 64) % 64) as usize).min(len);
                for (i, o) in out[..lead].iter_mut().enumerate() {
                    let at = start + i as u64;
                    *o = ((bits[(at / 64) as usize].load(Ordering::Relaxed) >> (at % 64)) & 1)
                        as u32;
                }
                let word0 = ((start + lead as u64) / 64) as usize;
                for (lanes, w) in out[lead..].chunks_mut(64).zip(&bits[word0..]) {
                    unpack(w.load(Ordering::Relaxed), lanes);
                }
            }
            None => {
                out.clear();
                out.resize(len, 0);
            }
        }
    }
}

/// DELLA's keep decisions, as the merge reads them ([`Keep::Flagged`](crate::method::combine::Keep::Flagged) words): kept by its
/// statistics scan, or — past [`MAX_BITS`], or without an L1 scan (`rescale=false`) — made tile by
/// tile from each row's ranks under the agent's rule, by the same [`row_keep_mask`], so the same
/// decisions either way.
#[derive(Debug)]
pub enum Decisions {
    /// One bit per element and ranked agent, from the statistics scan.
    Kept(KeptFlags),
    /// Made tile by tile from the rows' ranks.
    PerTile {
        /// Per present agent, its rule if it is ranked.
        rules: Vec<Option<RankKeep>>,
        /// Elements of a slab of rows ([`row_keep_mask`]).
        slab: u64,
        /// Stride of a row within a slab (1: the slab is one row).
        stride: u64,
    },
}

impl Decisions {
    /// The decisions of the agents ranked under `rules` (per present agent, its rule if it is
    /// ranked), rows of (`slab`, `stride`): `kept` when the scan kept them, else tile by tile;
    /// `None` when no agent is ranked.
    pub(super) fn of(
        rules: Vec<Option<RankKeep>>,
        kept: Option<KeptFlags>,
        (slab, stride): (u64, u64),
    ) -> Option<Decisions> {
        if rules.iter().all(Option::is_none) {
            return None;
        }
        Some(match kept {
            Some(k) => Decisions::Kept(k),
            None => Decisions::PerTile {
                rules,
                slab,
                stride,
            },
        })
    }

    /// Agent `t`'s words for elements `start..start + v.len()` (1 or all ones: kept, 0:
    /// dropped), its τ (θ without a base) being `v` — read only when the decisions are made
    /// here. All 0 for an agent that is not ranked.
    pub fn words(&self, t: usize, start: u64, v: &[f32], out: &mut Vec<u32>) {
        match self {
            Decisions::Kept(k) => k.words(t, start, v.len(), out),
            Decisions::PerTile {
                rules,
                slab,
                stride,
            } => match rules[t] {
                Some(rule) => {
                    let rows = (*slab as usize, *stride as usize);
                    row_keep_mask(v, rows, start as u32, rule, out)
                }
                None => {
                    out.clear();
                    out.resize(v.len(), 0);
                }
            },
        }
    }
}

/// Bit j of the word: lane j's keep mask (up to 64 lanes).
#[inline]
fn pack(lanes: &[u32]) -> u64 {
    match <&[u32; 64]>::try_from(lanes) {
        Ok(whole) => pack64(whole),
        Err(_) => lanes
            .iter()
            .enumerate()
            .fold(0u64, |w, (j, &m)| w | (u64::from(m & 1) << j)),
    }
}

multiversion! {
    /// [`pack`] of a whole word: one vectorized loop.
    fn pack64(lanes: &[u32; 64]) -> u64 {
        let mut w = 0u64;
        for (j, &m) in lanes.iter().enumerate() {
            w |= u64::from(m & 1) << j;
        }
        w
    }
}

/// Lane j = bit j of `word` (1 or 0), for up to 64 lanes.
#[inline]
fn unpack(word: u64, lanes: &mut [u32]) {
    match <&mut [u32; 64]>::try_from(&mut *lanes) {
        Ok(whole) => unpack64(word, whole),
        Err(_) => {
            for (j, o) in lanes.iter_mut().enumerate() {
                *o = ((word >> j) & 1) as u32;
            }
        }
    }
}

multiversion! {
    /// [`unpack`] of a whole word: one vectorized loop.
    fn unpack64(word: u64, lanes: &mut [u32; 64]) {
        for (j, o) in lanes.iter_mut().enumerate() {
            *o = ((word >> j) & 1) as u32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_round_trip_across_word_boundaries() {
        let k = KeptFlags::new(300, &[true, false]).unwrap();
        let mask: Vec<u32> = (0..130)
            .map(|i| if i % 3 == 0 { u32::MAX } else { 0 })
            .collect();
        // Two runs that meet inside a word (180 = 2·64 + 52), as two workers' runs do; the
        // first has a partial lead, a whole word and a partial tail.
        k.record(0, 50, &mask);
        k.record(0, 180, &mask[..100]);
        k.record(1, 50, &mask); // not ranked: ignored

        // The buffer comes from an earlier tile, longer and holding other words.
        let mut w = vec![7; 300];
        k.words(0, 40, 260, &mut w);
        assert_eq!(w.len(), 260);
        for (i, &x) in w.iter().enumerate() {
            let at = 40 + i;
            let want = ((50..180).contains(&at) && (at - 50) % 3 == 0)
                || ((180..280).contains(&at) && (at - 180) % 3 == 0);
            assert_eq!(x, want as u32, "element {at}");
        }
        k.words(1, 0, 10, &mut w);
        assert_eq!(w, [0; 10]);
        // A shorter tile after a longer one: every lane rewritten.
        w.fill(7);
        k.words(0, 50, 3, &mut w);
        assert_eq!(w, [1, 0, 0]);
        // The workers record in any order: the later run first gives the same words (its
        // partial lead word is or-ed, not overwritten, by the earlier run's tail).
        let later_first = KeptFlags::new(300, &[true, false]).unwrap();
        later_first.record(0, 180, &mask[..100]);
        later_first.record(0, 50, &mask);
        let mut v = Vec::new();
        later_first.words(0, 0, 300, &mut v);
        k.words(0, 0, 300, &mut w);
        assert_eq!(v, w);
        assert!(KeptFlags::new(MAX_BITS, &[true, true]).is_none());
        assert!(KeptFlags::new(10, &[false]).is_none());
    }
}
