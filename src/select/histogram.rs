//! PassOptions 1 of a rank cut: each agent's histogram of the high 16 bits of its magnitude keys inside
//! a window of bins, with which bins hold several keys and, for followed bins, counts per chunk.

use super::bins::{Bins16, BINS};
use super::cut::magnitude_key;
use super::key_window::{window_bits, KeyWindow, WindowTally};
use crate::scans::{lock, unlock, worker_states, Scans, SCAN_CHUNK};
use crate::simd::multiversion;
use anyhow::Result;

/// (chunk start, elements of a bin in the chunk), for chunks that had some.
pub(super) type ChunkCounts = Vec<(u64, u32)>;

/// What one worker's pass 1 keeps for one agent.
pub(super) struct AgentPass {
    /// Histogram of the window's keys' high 16 bits (non-zero keys).
    pub(super) high: Bins16,
    /// Keys above and in the window.
    pub(super) tally: WindowTally,
    /// The lowest and highest bin the window's keys reached (`u32::MAX`, 0 while none did): only
    /// those counters are summed and cleared after.
    pub(super) reached: (u32, u32),
    /// Elements seen.
    pub(super) seen: u64,
    /// Per high bin of the window, a bit: whether a key in it had low bits set.
    pub(super) mixed: Vec<u64>,
    /// Followed bins: (bin, count so far, its chunk counts).
    pub(super) follow: Vec<(u32, u64, ChunkCounts)>,
}

/// What pass 1 found for one agent: every key is above the window, in one of its bins, or else
/// (zero or below the window).
pub(super) struct Histogram {
    /// Keys above the window.
    pub(super) above: u64,
    /// Keys neither above nor in the window: zeros (then bin 0 holds them) when `rest_are_zeros`,
    /// the window starting at bin 0.
    pub(super) rest: u64,
    pub(super) rest_are_zeros: bool,
    /// Non-zero keys per high bin, from bin `lo` on (the window's bins that have any).
    pub(super) lo: u32,
    pub(super) counts: Vec<u64>,
    pub(super) seen: u64,
    /// Per high bin, a bit: whether a key of the window in it had low bits set. A bin without
    /// holds one key, `bin << 16`.
    pub(super) mixed: Vec<u64>,
    /// Each followed bin's chunk counts, in index order.
    pub(super) chunks: Vec<(u32, Vec<(u64, u32)>)>,
}

impl Histogram {
    /// Elements in high bin `bin`, zeros in bin 0 (bins of the window, and bin 0).
    pub(super) fn count(&self, bin: u32) -> u64 {
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

    pub(super) fn mixed(&self, bin: u32) -> bool {
        self.mixed[bin as usize / 64] >> (bin % 64) & 1 == 1
    }

    /// The high bin holding rank k − 1 (0 < k ≤ elements) and the elements above it; None when
    /// that rank lies outside the window, among keys only counted.
    pub(super) fn locate(&self, k: u64) -> Option<(u32, u64)> {
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
        // them), if the window starts there.
        self.rest_are_zeros.then_some((0, above))
    }

    /// The guessed bins of a cut at rank `k` of this (sampled, whole) histogram, the bin holding
    /// it first: that bin and the nearest non-empty bins above and below. Where that bin holds
    /// several keys (f32 weights, a LoRA agent's products: magnitudes spread finely, few ranks
    /// per bin), also the bins of ranks k ± `margin` standard deviations of an independent
    /// sample's rank (`seen` elements): a window that misses the cut costs a second pass over
    /// every bin (a read of every input).
    pub(super) fn likely_bins(&self, k: u64, margin: f64) -> Vec<u32> {
        let (g, _) = self
            .locate(k)
            .expect("a histogram of every bin holds every rank");
        let end = self.lo + self.counts.len() as u32;
        let below = (0..g).rev().find(|&b| self.count(b) > 0);
        let above = (g + 1..end).find(|&b| self.count(b) > 0);
        let mut bins: Vec<u32> = [Some(g), below, above].into_iter().flatten().collect();
        if self.mixed(g) {
            let q = k as f64 / self.seen as f64;
            let m = (margin * (k as f64 * (1.0 - q)).sqrt()).ceil() as u64;
            for r in [k.saturating_sub(m).max(1), (k + m).min(self.seen)] {
                bins.extend(self.locate(r).map(|(bin, _)| bin));
            }
        }
        bins
    }
}

/// One histogram a pass counts: agent `agent`'s keys in `window`, the bins in `follow` also
/// counted per chunk. An agent with several cuts far apart (breadcrumbs' two) has a lane around
/// each, so the keys between them are only counted, not put in bins one by one.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Lane {
    pub(super) agent: usize,
    pub(super) window: KeyWindow,
    pub(super) follow: Vec<u32>,
}

/// One any-order pass over a sample of one chunk in `every` (1: all): for each lane, the
/// histogram of the high 16 bits of its agent's magnitude keys in its window (keys above only
/// counted, with vector compares, and zeros not even that; RL task vectors are mostly zero),
/// which bins of the window hold keys with low bits set, and for each bin it follows its count
/// per chunk (from the histogram's growth, so free per element). Each worker counts in its own
/// state, and only the bins its keys reached are summed after. One histogram per lane.
pub(super) fn histogram_pass(
    scan: &mut dyn Scans,
    delta: bool,
    (agents, numel): (usize, u64),
    every: usize,
    lanes: &[Lane],
) -> Result<Vec<Histogram>> {
    let workers = scan.workers();
    let count = lanes.len();
    let of_agent: Vec<Vec<usize>> = (0..agents)
        .map(|t| (0..count).filter(|&l| lanes[l].agent == t).collect())
        .collect();
    let fresh = |l: usize| AgentPass {
        // The magnitude key's top bit is clear: 2^15 high bins.
        high: Bins16::new(BINS / 2, numel / every as u64),
        tally: WindowTally::NONE,
        reached: (u32::MAX, 0),
        seen: 0,
        mixed: vec![0; BINS / 2 / 64],
        follow: lanes[l]
            .follow
            .iter()
            .map(|&b| (b, 0, Vec::new()))
            .collect(),
    };
    let states = worker_states(workers, count, |_| None::<AgentPass>);
    scan.any_order(every, delta, &|w, t, start, v| {
        for &l in &of_agent[t] {
            let mut guard = lock(&states[w * count + l]);
            count_lane(
                guard.get_or_insert_with(|| fresh(l)),
                lanes[l].window,
                start,
                v,
            );
        }
    })?;
    let mut parts: Vec<Option<AgentPass>> = states.into_iter().map(unlock).collect();
    Ok(lanes
        .iter()
        .enumerate()
        .map(|(l, lane)| {
            let mine: Vec<AgentPass> = (0..workers)
                .filter_map(|w| parts[w * count + l].take())
                .collect();
            merged_histogram(mine, lane.window, &lane.follow)
        })
        .collect())
}

multiversion! {
    /// Adds the chunk of values `v` (from element `start`) to one lane's pass (the walk over the
    /// window's keys compiled per level: its `trailing_zeros` and shifts are one instruction each
    /// with BMI).
    fn count_lane(pass: &mut AgentPass, window: KeyWindow, start: u64, v: &[f32]) {
        let AgentPass {
            high,
            tally,
            reached,
            seen,
            mixed,
            follow,
        } = pass;
        *seen += v.len() as u64;
        let (mut inside, mut low) = ([0u64; SCAN_CHUNK / 64], [0u64; SCAN_CHUNK / 64]);
        let words = v.len().div_ceil(64);
        tally.add(window_bits(
            v,
            window,
            &mut inside[..words],
            &mut low[..words],
        ));
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
    }
}

/// One lane's [`Histogram`] from its workers' parts of [`histogram_pass`] (`window`: the lane's
/// key window; `follow`: the bins whose chunks are counted).
fn merged_histogram(mine: Vec<AgentPass>, window: KeyWindow, follow: &[u32]) -> Histogram {
    let mut tally = WindowTally::NONE;
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
        rest_are_zeros: window.lo == 0,
        lo,
        counts: vec![0; bins as usize],
        seen: 0,
        mixed: vec![0; BINS / 2 / 64],
        chunks: follow.iter().map(|&b| (b, Vec::new())).collect(),
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
}
