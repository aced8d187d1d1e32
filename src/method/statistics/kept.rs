//! DELLA's keep decisions, made once. Its L1 rescale needs each agent's kept elements before the
//! merge, so its statistics scan ranks every row; the merge would rank every row again to make
//! the same decisions. Instead the scan keeps them, one bit per element and agent, and the merge
//! reads them as [`Keep::Flagged`] words — the same decisions, so the same bytes, with half the
//! ranking. Bounded: a tensor whose bits would pass [`MAX_BITS`] is ranked twice, as before.

use crate::method::combine::Keep;

/// The most bits kept for one tensor (all its agents): 64 MiB.
pub const MAX_BITS: u64 = 1 << 29;

/// Keep bits of a tensor's ranked agents: bit i of agent t is element i's keep decision.
#[derive(Debug)]
pub struct KeptFlags {
    /// Per present agent: its bits, or `None` for an agent whose keep rule is not ranked.
    agents: Vec<Option<Vec<u64>>>,
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
                .map(|&r| r.then(|| vec![0u64; words]))
                .collect(),
        })
    }

    /// Records agent `t`'s keep mask (all ones: kept) for elements `first..first + mask.len()`.
    pub(super) fn record(&mut self, t: usize, first: u64, mask: &[u32]) {
        let Some(bits) = self.agents[t].as_mut() else {
            return;
        };
        // Up to a word boundary bit by bit, then a word per 64 lanes.
        let lead = (((64 - first % 64) % 64) as usize).min(mask.len());
        for (i, &m) in mask[..lead].iter().enumerate() {
            let at = first + i as u64;
            bits[(at / 64) as usize] |= u64::from(m & 1) << (at % 64);
        }
        let word0 = ((first + lead as u64) / 64) as usize;
        let lanes = mask[lead..].chunks(64);
        for (word, lanes) in bits[word0..].iter_mut().zip(lanes) {
            *word |= lanes
                .iter()
                .enumerate()
                .fold(0u64, |w, (j, &m)| w | (u64::from(m & 1) << j));
        }
    }

    /// The rule each agent's keep becomes once its decisions are kept: [`Keep::Flagged`].
    pub(super) fn flag(&self, keep: &mut [Keep]) {
        for (k, bits) in keep.iter_mut().zip(&self.agents) {
            if bits.is_some() {
                *k = Keep::Flagged;
            }
        }
    }

    /// Agent `t`'s words for elements `start..start + len`, as [`Keep::Flagged`] reads them (1:
    /// kept, 0: dropped; all 0 for an agent without bits, whose rule reads none).
    pub fn words(&self, t: usize, start: u64, len: usize, out: &mut Vec<u32>) {
        out.clear();
        match &self.agents[t] {
            Some(bits) => {
                out.resize(len, 0);
                // Up to a word boundary bit by bit, then 64 words per bit word.
                let lead = (((64 - start % 64) % 64) as usize).min(len);
                for (i, o) in out[..lead].iter_mut().enumerate() {
                    let at = start + i as u64;
                    *o = ((bits[(at / 64) as usize] >> (at % 64)) & 1) as u32;
                }
                let word0 = ((start + lead as u64) / 64) as usize;
                for (lanes, &w) in out[lead..].chunks_mut(64).zip(&bits[word0..]) {
                    for (j, o) in lanes.iter_mut().enumerate() {
                        *o = ((w >> j) & 1) as u32;
                    }
                }
            }
            None => out.resize(len, 0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_round_trip_across_word_boundaries() {
        let mut k = KeptFlags::new(200, &[true, false]).unwrap();
        let mask: Vec<u32> = (0..130)
            .map(|i| if i % 3 == 0 { u32::MAX } else { 0 })
            .collect();
        k.record(0, 50, &mask);
        k.record(1, 50, &mask); // not ranked: ignored
        let mut w = Vec::new();
        k.words(0, 40, 150, &mut w);
        for (i, &x) in w.iter().enumerate() {
            let at = 40 + i;
            let want = (50..180).contains(&at) && (at - 50) % 3 == 0;
            assert_eq!(x, want as u32, "element {at}");
        }
        k.words(1, 0, 10, &mut w);
        assert_eq!(w, [0; 10]);
        assert!(KeptFlags::new(MAX_BITS, &[true, true]).is_none());
        assert!(KeptFlags::new(10, &[false]).is_none());
    }
}
