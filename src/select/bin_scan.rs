//! PassOptions 2 of a rank cut: the elements of one high bin, remembered while they fit, else counted by
//! their low 16 bits; and where a cut splits the elements tied at its threshold.

use super::bins::{locate, Bins16, BINS};
use super::cut::RankCut;
use super::key_window::{for_each_key, nonzero_count};
use crate::scans::{lock, unlock, worker_states, Scans};
use anyhow::Result;

/// Where a cut splits the elements tied at its threshold, when the bin's record cannot tell: the
/// `m`-th of them in index order, `before` of them lying before element `from`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Split {
    pub(super) m: u64,
    pub(super) from: u64,
    pub(super) before: u64,
}

/// One high bin's elements as a scan records them: the (low 16 bits, index) of each while they
/// fit in `memory`, else a histogram of their low 16 bits; and how many fell in each chunk, so a
/// split in a bin of one key can be found by reading a single chunk again.
pub(super) struct BinScan {
    pub(super) bin: u32,
    /// Remembered members (in index order once [`Self::in_index_order`] ran), while `low` and
    /// `one_key` are None.
    pub(super) members: Vec<(u16, u32)>,
    pub(super) low: Option<Bins16>,
    /// Instead of either: the bin holds this many elements, all with the key `bin << 16`.
    pub(super) one_key: Option<u64>,
    /// Zero keys (bin 0 only), counted by difference; never members, never split.
    pub(super) zeros: u64,
    /// (chunk start, non-zero elements of the bin in it), for chunks that had some.
    pub(super) chunks: Vec<(u64, u32)>,
    pub(super) in_chunk: u32,
    /// Members one record may hold before it turns to a histogram.
    pub(super) memory: usize,
    pub(super) numel: u64,
}

impl BinScan {
    pub(super) fn new(bin: u32, memory: usize, numel: u64) -> BinScan {
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
    pub(super) fn of_one_key(
        bin: u32,
        count: u64,
        chunks: Option<Vec<(u64, u32)>>,
        numel: u64,
    ) -> BinScan {
        let mut scan = BinScan::new(bin, 0, numel);
        scan.one_key = Some(count);
        scan.chunks = chunks.unwrap_or_default();
        scan
    }

    /// Records the non-zero element at tensor index `index` with key `key` (in this bin).
    #[inline(always)]
    pub(super) fn record(&mut self, key: u32, index: u64) {
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
    pub(super) fn end_chunk(&mut self, start: u64, zeros: u64) {
        if self.in_chunk > 0 {
            self.chunks.push((start, self.in_chunk));
            self.in_chunk = 0;
        }
        if self.bin == 0 {
            self.zeros += zeros;
        }
    }

    /// One chunk's elements of this bin, found by their own mask.
    pub(super) fn scan_chunk(&mut self, v: &[f32], start: u64) {
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

    pub(super) fn turn_to_histogram(&mut self) {
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
    pub(super) fn absorb(&mut self, mut other: BinScan, limit: usize) {
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
    pub(super) fn in_index_order(mut self) -> BinScan {
        self.members.sort_unstable_by_key(|&(_, index)| index);
        self.chunks.sort_unstable_by_key(|&(start, _)| start);
        self
    }

    /// `(fine, gt, equal)` for rank `r` ≥ 1 within the bin: the low bits holding it, elements of
    /// the bin above them, elements equal to them.
    pub(super) fn locate_low(&self, r: u64) -> (u32, u64, u64) {
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
    pub(super) fn resolve(&self, k: u64, above: u64, high_first: bool) -> (RankCut, Option<Split>) {
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

/// PassOptions 2: a [`BinScan`] of each bin in `bins[t]`, each found by its own mask, together
/// remembering at most `bin_memory` members.
pub(super) fn bin_scans(
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

/// Members the records of one scan may remember in all (8 bytes each).
pub(super) fn record_limit(bin_memory: u64, records: usize) -> usize {
    bin_memory as usize / records.max(1)
}
