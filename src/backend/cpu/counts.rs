//! SPEC §1 on the CPU: each element's agent mask (bit t: agent t changed it, |τ| > ε) and the
//! histogram of who changed what with how many others, from the probe or from the merge's own
//! masks (a counted merge).

use super::{chunk_bytes, Stored, CHUNK};
use crate::backend::{Tile, TileCounts};
use crate::checkpoint::dtype::decode;
use crate::simd::multiversion;

/// Per-worker buffers for one chunk of the probe.
pub(super) struct ProbeScratch {
    base: Vec<f32>,
    agent: Vec<f32>,
    /// Agent masks of up to 32 agents (half the bytes to clear and count of `masks`).
    narrow: Vec<u32>,
    masks: Vec<u64>,
    patterns: Vec<u32>,
}

impl ProbeScratch {
    pub(super) fn new() -> ProbeScratch {
        ProbeScratch {
            base: vec![0.0; CHUNK],
            agent: vec![0.0; CHUNK],
            narrow: vec![0; CHUNK],
            masks: vec![0; CHUNK],
            patterns: vec![0; PATTERN_SLOTS],
        }
    }
}

/// Up to this many agents the probe counts mask patterns in a table of 2^n entries.
const PATTERN_TABLE_AGENTS: usize = 8;

/// Adds `hits` elements changed by exactly the agents in `mask` to the histogram.
fn add_mask(counts: &mut TileCounts, mask: u64, hits: u64) {
    let n = counts.agents;
    let others = mask.count_ones() as usize - 1;
    let mut bits = mask;
    while bits != 0 {
        counts.hist[bits.trailing_zeros() as usize * n + others] += hits;
        bits &= bits - 1;
    }
}

multiversion! {
    /// SPEC §1 over elements `start..start + len`: one agent bit per element, then the histogram.
    pub(super) fn probe_chunk(
        tile: &Tile,
        epsilon: f32,
        start: usize,
        len: usize,
        s: &mut ProbeScratch,
    ) -> TileCounts {
        let n = tile.agents.len();
        let (base, agent) = (&mut s.base[..len], &mut s.agent[..len]);
        let mut counts = TileCounts::zeros(n);
        if n <= 32 {
            let masks = &mut s.narrow[..len];
            agent_masks(tile, epsilon, start, (base, agent), masks);
            count_masks(masks, &mut s.patterns, &mut counts);
        } else {
            let masks = &mut s.masks[..len];
            agent_masks(tile, epsilon, start, (base, agent), masks);
            count_masks(masks, &mut s.patterns, &mut counts);
        }
        counts
    }
}

multiversion! {
    /// SPEC §1's agent masks of elements `start..start + masks.len()` of `tile` (bit t: agent t
    /// changed the element, |τ_t| > ε), the base decoded into `base` on the way and `agent` a
    /// row to decode through: the probe's own predicate, for counts the host makes (the
    /// boost-rounding tally, `crate::engine`). Up to 32 agents.
    pub(crate) fn changed_masks(
        tile: &Tile,
        epsilon: f32,
        start: usize,
        base: &mut [f32],
        agent: &mut [f32],
        masks: &mut [u32],
    ) {
        agent_masks(tile, epsilon, start, (base, agent), masks)
    }
}

/// [`changed_masks`] of more than 32 agents.
pub(crate) fn changed_masks_wide(
    tile: &Tile,
    epsilon: f32,
    start: usize,
    base: &mut [f32],
    agent: &mut [f32],
    masks: &mut [u64],
) {
    agent_masks(tile, epsilon, start, (base, agent), masks)
}

/// Each element's agent mask over elements `start..start + masks.len()` (bit t: |τ_t| > ε),
/// decoding through the `base` and `agent` rows.
#[inline(always)]
fn agent_masks<M: Masks + From<bool> + std::ops::Shl<usize, Output = M> + std::ops::BitOrAssign>(
    tile: &Tile,
    epsilon: f32,
    start: usize,
    (base, agent): (&mut [f32], &mut [f32]),
    masks: &mut [M],
) {
    let (len, size) = (masks.len(), tile.dtype.size());
    decode(tile.dtype, chunk_bytes(tile.base, start, len, size), base);
    masks.fill(M::from(false));
    for (t, bytes) in tile.agents.iter().enumerate() {
        let changed = |a: f32, b: f32| M::from((a - b).abs() > epsilon) << t;
        // bf16 and f32 values are read in place and widened as compared, not decoded into a row
        // first.
        if let Some(bits) = u16::view(tile.dtype, bytes, (start, len)) {
            or_changed(masks, bits, base, changed);
        } else if let Some(values) = f32::view(tile.dtype, bytes, (start, len)) {
            or_changed(masks, values, base, changed);
        } else {
            decode(tile.dtype, chunk_bytes(bytes, start, len, size), agent);
            or_changed(masks, agent, base, changed);
        }
    }
}

/// `masks[i] |= changed(values[i], base[i])`, each value widened as it is read.
#[inline(always)]
fn or_changed<M: std::ops::BitOrAssign, T: Stored>(
    masks: &mut [M],
    values: &[T],
    base: &[f32],
    changed: impl Fn(f32, f32) -> M,
) {
    for ((m, &a), &b) in masks.iter_mut().zip(values).zip(base) {
        *m |= changed(a.widen(), b);
    }
}

/// Adds each element's agent mask (bit t: agent t changed it) to the histogram: few agents count
/// each mask pattern once — up to [`LANE_COUNT_AGENTS`] by vector compares
/// ([`count_patterns`]), else in four interleaved tables of 2^n entries (`patterns` holds
/// [`PATTERN_SLOTS`]) so the increments of a run of equal masks, mostly 0, do not wait for each
/// other — then spread the patterns; many agents add mask by mask.
pub(super) fn count_masks<M: Masks>(masks: &[M], patterns: &mut [u32], counts: &mut TileCounts) {
    let n = counts.agents;
    if n <= LANE_COUNT_AGENTS {
        let mut hits = [0u32; 1 << LANE_COUNT_AGENTS];
        M::count_patterns(masks, n, &mut hits);
        for (m, &h) in hits.iter().enumerate().skip(1) {
            if h != 0 {
                add_mask(counts, m as u64, h as u64);
            }
        }
    } else if n <= PATTERN_TABLE_AGENTS {
        let size = 1 << n;
        let patterns = &mut patterns[..4 * size];
        patterns.fill(0);
        let (t0, rest) = patterns.split_at_mut(size);
        let (t1, rest) = rest.split_at_mut(size);
        let (t2, t3) = rest.split_at_mut(size);
        let mut quads = masks.chunks_exact(4);
        for q in &mut quads {
            t0[q[0].into() as usize] += 1;
            t1[q[1].into() as usize] += 1;
            t2[q[2].into() as usize] += 1;
            t3[q[3].into() as usize] += 1;
        }
        for &m in quads.remainder() {
            t0[m.into() as usize] += 1;
        }
        for m in 1..size {
            let hits = t0[m] + t1[m] + t2[m] + t3[m];
            if hits != 0 {
                add_mask(counts, m as u64, hits as u64);
            }
        }
    } else {
        for m in masks.iter().map(|&m| m.into()).filter(|&m| m != 0) {
            add_mask(counts, m, 1);
        }
    }
}

/// Up to this many agents, [`count_masks`] counts each pattern by vector compares.
const LANE_COUNT_AGENTS: usize = 4;

/// The agent masks [`count_masks`] counts: u32 (the merge's, and the probe's of up to 32 agents) and
/// u64 (the probe's of more).
pub(super) trait Masks: Copy + Into<u64> {
    /// The mask's low 32 bits (all of it, with ≤ [`LANE_COUNT_AGENTS`] agents).
    fn low(self) -> u32;
    /// `hits[m]` = how many of `masks` equal m, for m < 2^`n` (n ≤ [`LANE_COUNT_AGENTS`]).
    fn count_patterns(masks: &[Self], n: usize, hits: &mut [u32; 1 << LANE_COUNT_AGENTS]);
}

impl Masks for u32 {
    fn low(self) -> u32 {
        self
    }
    fn count_patterns(masks: &[u32], n: usize, hits: &mut [u32; 1 << LANE_COUNT_AGENTS]) {
        count_patterns_u32(masks, n, hits)
    }
}

impl Masks for u64 {
    fn low(self) -> u32 {
        self as u32
    }
    fn count_patterns(masks: &[u64], n: usize, hits: &mut [u32; 1 << LANE_COUNT_AGENTS]) {
        count_patterns_u64(masks, n, hits)
    }
}

multiversion! {
    /// [`Masks::count_patterns`] of the merge's masks and the probe's of up to 32 agents.
    fn count_patterns_u32(masks: &[u32], n: usize, hits: &mut [u32; 1 << LANE_COUNT_AGENTS]) {
        patterns_of_agents(masks, n, hits)
    }
}

multiversion! {
    /// [`Masks::count_patterns`] of the probe's masks of more than 32 agents.
    fn count_patterns_u64(masks: &[u64], n: usize, hits: &mut [u32; 1 << LANE_COUNT_AGENTS]) {
        patterns_of_agents(masks, n, hits)
    }
}

/// [`count_patterns`] over the 2^`n` patterns of `n` agents.
#[inline(always)]
fn patterns_of_agents<M: Masks>(masks: &[M], n: usize, hits: &mut [u32; 16]) {
    match n {
        0..=3 => count_patterns_in_bytes(masks, hits),
        _ => count_patterns::<M, 16>(masks, hits),
    }
}

/// `hits[m]` = how many of `masks` equal m, for m in 1..8 (up to three agents): each mask adds 1
/// to byte m of a 64-bit word — a shift and an add per mask, where a pass of compares per pattern
/// took seven — and the word's bytes are added to `hits` every 255 masks, before one can overflow.
#[inline(always)]
fn count_patterns_in_bytes<M: Masks>(masks: &[M], hits: &mut [u32; 16]) {
    for block in masks.chunks(255) {
        let bytes = block
            .iter()
            .fold(0u64, |acc, &m| acc + (1u64 << (8 * (m.low() & 7))));
        for (p, h) in hits.iter_mut().enumerate().take(8).skip(1) {
            *h += (bytes >> (8 * p)) as u32 & 0xff;
        }
    }
}

/// `hits[m]` = how many of `masks` equal m, for m in 1..`P`: a pass of vector compares per
/// pattern over the masks (in L1), no stores.
#[inline(always)]
fn count_patterns<M: Masks, const P: usize>(masks: &[M], hits: &mut [u32; 16]) {
    for (m, h) in hits.iter_mut().enumerate().take(P).skip(1) {
        *h = masks.iter().map(|&x| u32::from(x.low() == m as u32)).sum();
    }
}

/// Entries of a scratch's pattern tables: four of 2^[`PATTERN_TABLE_AGENTS`].
pub(super) const PATTERN_SLOTS: usize = 4 << PATTERN_TABLE_AGENTS;

#[cfg(test)]
mod tests {
    use super::*;

    /// Every way of counting patterns (bytes of a word up to 3 agents, compares at 4, tables up
    /// to [`PATTERN_TABLE_AGENTS`], mask by mask beyond) gives the naive histogram, on masks with
    /// runs of one pattern far longer than the 255 a word's byte holds, zeros most of all.
    #[test]
    fn mask_patterns_are_counted_as_the_naive_histogram() {
        for n in [1usize, 2, 3, 4, 5, 12, 20] {
            let mut masks = Vec::new();
            let mut x = 0x9e37_79b9u32;
            for run in 0..64 {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let m = if run % 3 == 0 {
                    0
                } else {
                    x & ((1u64 << n) - 1) as u32
                };
                let len = [1, 7, 255, 256, 700, 2000][run % 6];
                masks.extend(std::iter::repeat_n(m, len));
            }
            let mut naive = TileCounts::zeros(n);
            for &m in &masks {
                if m != 0 {
                    add_mask(&mut naive, m as u64, 1);
                }
            }
            let mut got = TileCounts::zeros(n);
            let mut patterns = vec![0u32; PATTERN_SLOTS];
            count_masks(&masks, &mut patterns, &mut got);
            assert_eq!(got.hist, naive.hist, "{n} agents");
        }
    }
}
