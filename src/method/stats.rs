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
use anyhow::Result;
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

/// What an any-order scan does with a chunk: `(worker, agent, chunk)`.
pub type AnyOrderVisit<'v> = dyn Fn(usize, usize, &AgentChunk) + Sync + 'v;

/// The ways to scan a tensor's tiles.
pub trait Scans {
    /// Whole tiles in order, every agent at once (for statistics across agents).
    fn tiles(&mut self, visit: &mut Visit) -> Result<()>;
    /// Each agent's values in element order, chunk by chunk, agents in parallel; ends when every
    /// agent is done or the tensor is.
    fn per_agent(&mut self, visit: &AgentVisit) -> Result<()>;
    /// Threads an any-order scan runs on: `visit`'s worker argument is below this.
    fn workers(&self) -> usize;
    /// Every agent's values in chunks of [`SCAN_CHUNK`] elements that start at multiples of
    /// [`SCAN_CHUNK`] (the last may be shorter), in any order, on [`Self::workers`] threads at
    /// once — for statistics that do not depend on order (counts), or that keep a result per
    /// chunk and combine them in order. The fastest scan: every core busy, each tile read once.
    fn any_order(&mut self, visit: &AnyOrderVisit) -> Result<()>;
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
        Bins16 {
            counts: vec![0; bins * ways],
            ways: ways - 1,
        }
    }

    /// Adds every bin's count into `total`.
    fn add_totals(&self, total: &mut [u64]) {
        for (t, w) in total
            .iter_mut()
            .zip(self.counts.chunks_exact(self.ways + 1))
        {
            *t += w.iter().map(|&c| c as u64).sum::<u64>();
        }
    }

    /// Counts element `index` in `bin`.
    #[inline(always)]
    fn add(&mut self, bin: u32, index: usize) {
        self.counts[bin as usize * (self.ways + 1) + (index & self.ways)] += 1;
    }

    /// The count of every bin.
    fn totals(&self) -> Vec<u64> {
        self.counts
            .chunks_exact(self.ways + 1)
            .map(|w| w.iter().map(|&c| c as u64).sum())
            .collect()
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
/// just past the `m`-th of them.
struct TieSearch {
    cut: usize,
    key: u32,
    m: u64,
    seen: u64,
    found: Option<u32>,
}

/// The second pass's record of one cut's bin.
struct BinScan {
    bin: u32,
    /// Histogram of the low 16 bits of the keys in the bin.
    low: Bins16,
    /// (low 16 bits, index) of every element in the bin, in index order, when it has few enough.
    members: Option<Vec<(u16, u32)>>,
}

impl BinScan {
    /// Adds another worker's record of the same bin.
    fn absorb(&mut self, other: BinScan) {
        for (a, b) in self.low.counts.iter_mut().zip(&other.low.counts) {
            *a += b;
        }
        match (&mut self.members, other.members) {
            (Some(m), Some(o)) => m.extend(o),
            _ => self.members = None,
        }
    }

    /// Members sorted by index (workers saw their tiles in any order).
    fn in_index_order(mut self) -> BinScan {
        if let Some(m) = &mut self.members {
            m.sort_unstable_by_key(|&(_, index)| index);
        }
        self
    }

    /// The cut keeping the `k` largest keys, `above` of which lie above this bin. When the cut
    /// splits the elements tied at its threshold, the split index comes from the remembered
    /// members, or — when the bin was too full to remember — the returned `m` says to search for
    /// the m-th tied element in index order. A threshold of exactly zero needs no split: which
    /// zeros count as kept changes nothing (a kept zero adds ±0, never agrees in a consensus, and
    /// no sum starts at −0).
    fn resolve(&self, k: u64, above: u64, high_first: bool) -> (RankCut, Option<u64>) {
        let low = self.low.totals();
        let (fine, gt) = locate(&low, k - above);
        let value = (self.bin << 16) | fine as u32;
        let need = k - above - gt;
        let equal = low[fine];
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
        match &self.members {
            Some(members) => {
                let split = members
                    .iter()
                    .filter(|&&(low, _)| low as usize == fine)
                    .nth(m as usize - 1)
                    .expect("the bin holds `equal` tied elements");
                cut.index = split.1 + 1;
                (cut, None)
            }
            None => (cut, Some(m)),
        }
    }
}

/// Resolves rank cuts (`(agent, k, high_first)`, 0 < k < n: the k largest, ties at the threshold
/// to the lower index first unless `high_first`) to exact thresholds: a histogram of the keys'
/// high 16 bits, then of the low 16 bits within the threshold's bin — two scans, and a third
/// (stopping early) only when a cut splits a tie in a bin too full to remember.
fn rank_cuts(
    scan: &mut dyn Scans,
    delta: bool,
    (agents, numel): (usize, u64),
    wanted: &[(usize, u64, bool)],
) -> Result<Vec<RankCut>> {
    rank_cuts_remembering(scan, delta, (agents, numel), wanted, BIN_MEMORY)
}

/// [`rank_cuts`], remembering bins of at most `bin_memory` elements.
fn rank_cuts_remembering(
    scan: &mut dyn Scans,
    delta: bool,
    (agents, numel): (usize, u64),
    wanted: &[(usize, u64, bool)],
    bin_memory: u64,
) -> Result<Vec<RankCut>> {
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    // Pass 1: histogram of the high 16 bits of each wanted agent's magnitude keys, per worker.
    let cut_agent = |t: usize| wanted.iter().any(|w| w.0 == t);
    let workers = scan.workers();
    // Zeros are counted by difference: RL task vectors are mostly zero, and counting them one by
    // one would serialize on a single counter.
    let high = worker_states(workers, agents, |_| (None::<Bins16>, 0u64));
    scan.any_order(&|w, t, c| {
        if !cut_agent(t) {
            return;
        }
        let mut guard = lock(&high[w * agents + t]);
        let (h, seen) = &mut *guard;
        // The magnitude key's top bit is clear: 2^15 high bins.
        let h = h.get_or_insert_with(|| Bins16::new(BINS / 2, numel));
        let v = c.v(delta);
        *seen += v.len() as u64;
        for_each_key(v, None, |j, key| h.add(key >> 16, j));
    })?;
    let high: Vec<(Option<Bins16>, u64)> = high.into_iter().map(unlock).collect();
    let high: Vec<Vec<u64>> = (0..agents)
        .map(|t| {
            if !cut_agent(t) {
                return Vec::new();
            }
            let mut total = vec![0u64; BINS / 2];
            let mut seen = 0;
            for (h, s) in (0..workers).map(|w| &high[w * agents + t]) {
                h.iter().for_each(|h| h.add_totals(&mut total));
                seen += s;
            }
            let counted: u64 = total.iter().sum();
            total[0] += seen - counted;
            total
        })
        .collect();
    let hist_of = |t: usize| &high[t];
    let coarse: Vec<(usize, u64)> = wanted
        .iter()
        .map(|&(t, k, _)| locate(hist_of(t), k))
        .collect();
    // Pass 2: within each cut's bin, a histogram of the low 16 bits (and the members), per
    // worker; each agent's cuts in the order of `wanted`.
    let cuts_of: Vec<Vec<usize>> = (0..agents)
        .map(|t| (0..wanted.len()).filter(|&c| wanted[c].0 == t).collect())
        .collect();
    let new_bins = |t: usize| -> Vec<BinScan> {
        cuts_of[t]
            .iter()
            .map(|&c| {
                let bin = coarse[c].0;
                BinScan {
                    bin: bin as u32,
                    low: Bins16::new(BINS, hist_of(t)[bin]),
                    members: (hist_of(t)[bin] <= bin_memory).then(Vec::new),
                }
            })
            .collect()
    };
    let scans = worker_states(workers, agents, |_| None::<Vec<BinScan>>);
    scan.any_order(&|w, t, c| {
        if cuts_of[t].is_empty() {
            return;
        }
        let mut guard = lock(&scans[w * agents + t]);
        let bins = guard.get_or_insert_with(|| new_bins(t));
        let v = c.v(delta);
        for b in bins.iter_mut() {
            // Zeros (in bin 0) are counted by difference, and never needed as members (below).
            let bin = b.bin;
            for_each_key(v, Some(bin), |j, key| {
                b.low.add(key & 0xffff, j);
                if let Some(m) = &mut b.members {
                    m.push((key as u16, (c.start + j as u64) as u32));
                }
            });
            if bin == 0 {
                let zeros = v.len() as u64 - nonzero_count(v);
                b.low.counts[0] += zeros as u32;
            }
        }
    })?;
    // Each cut's workers' records, summed: counts added, members in index order.
    let mut scans: Vec<Option<Vec<BinScan>>> = scans.into_iter().map(unlock).collect();
    let mut bins: Vec<Option<BinScan>> = (0..wanted.len()).map(|_| None).collect();
    for (i, part) in scans.iter_mut().enumerate() {
        let t = i % agents;
        for (&c, b) in cuts_of[t].iter().zip(part.take().unwrap_or_default()) {
            match &mut bins[c] {
                Some(sum) => sum.absorb(b),
                slot => *slot = Some(b),
            }
        }
    }
    let bins: Vec<BinScan> = bins
        .into_iter()
        .enumerate()
        .map(|(c, b)| {
            b.map(BinScan::in_index_order)
                .unwrap_or_else(|| new_bins(wanted[c].0).swap_remove(0))
        })
        .collect();
    let mut cuts = Vec::with_capacity(wanted.len());
    // (cut, agent, key, m): the cut's index goes just past the m-th tied element in index order.
    let mut ties = Vec::new();
    for (c, &(t, k, high_first)) in wanted.iter().enumerate() {
        let (cut, search) = bins[c].resolve(k, coarse[c].1, high_first);
        if let Some(m) = search {
            ties.push((c, t, cut.value, m));
        }
        cuts.push(cut);
    }
    if ties.is_empty() {
        return Ok(cuts);
    }
    // Pass 3: where a cut splits a tie the second pass could not remember, the index of the split.
    let mut searches: Vec<Vec<TieSearch>> = (0..agents).map(|_| Vec::new()).collect();
    for &(cut, t, key, m) in &ties {
        searches[t].push(TieSearch {
            cut,
            key,
            m,
            seen: 0,
            found: None,
        });
    }
    let searches = states(searches);
    scan.per_agent(&|t, chunk| {
        let mut open = lock(&searches[t]);
        for s in open.iter_mut().filter(|s| s.found.is_none()) {
            for (j, &x) in chunk.v(delta).iter().enumerate() {
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
        cuts[s.cut].index = s.found.expect("the split lies within the tensor");
    }
    Ok(cuts)
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
        scan.any_order(&|w, t, c| {
            if !l1_agent(t) {
                return;
            }
            let v = c.v(delta);
            let mut mask = [0u32; SCAN_CHUNK];
            let mask = &mut mask[..v.len()];
            keep[t].mask_into(v, c.start as u32, &[], mask);
            let sums = (abs_sum(v, None), abs_sum(v, Some(mask)));
            lock(&parts[w * n + t]).push((c.start, sums.0, sums.1));
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
        scan.per_agent(&|t, c| {
            if rescale[t] && !ranked[t] {
                let v = c.v(delta);
                let mut mask = [0u32; SCAN_CHUNK];
                let mask = &mut mask[..v.len()];
                keep[t].mask_into(v, c.start as u32, &[], mask);
                let mut l = lock(&l1_state[t]);
                l.0 += abs_sum(v, None);
                l.1 += abs_sum(v, Some(mask));
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
                l1[t].0 += abs_sum(v, None);
                l1[t].1 += abs_sum(v, Some(&mask));
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
        if rescale[t] && all >= 1e-7 && kept >= 1e-7 {
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
            match mask {
                None => {
                    for c in x.chunks(8) {
                        for (l, &v) in lanes.iter_mut().zip(c) {
                            *l += v.abs();
                        }
                    }
                }
                Some(m) => {
                    for (c, mc) in x.chunks(8).zip(m[block * 64..].chunks(8)) {
                        for ((l, &v), &m) in lanes.iter_mut().zip(c).zip(mc) {
                            *l += f32::from_bits(v.to_bits() & m & 0x7fff_ffff);
                        }
                    }
                }
            }
            total += lanes.iter().map(|&l| l as f64).sum::<f64>();
        }
        total
    }
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
/// the count of non-zero keys: the same two histogram scans as [`rank_cuts`], then a third only
/// when the cut splits a tie too large to remember. Zero keys are never kept.
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
    let mut b = BinScan {
        bin: bin as u32,
        low: Bins16::new(BINS, high[bin]),
        members: (high[bin] <= BIN_MEMORY).then(Vec::new),
    };
    scan.tiles(&mut |tile| {
        keys(tile, &mut buf);
        for (i, &key) in buf.iter().enumerate() {
            if key != 0 && key >> 16 == b.bin {
                b.low.add(key & 0xffff, i);
                if let Some(m) = &mut b.members {
                    m.push((key as u16, (tile.start + i as u64) as u32));
                }
            }
        }
        Ok(ControlFlow::Continue(()))
    })?;
    // Zero keys are never counted, so the threshold is above zero.
    let (mut cut, search) = b.resolve(k, above, false);
    if let Some(need) = search {
        let value = cut.value;
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
pub fn karcher_coefs(gram: &[f64], n: usize, max_iter: usize, tol: f64) -> Vec<f64> {
    let norm: Vec<f64> = (0..n).map(|i| gram[i * n + i].sqrt()).collect();
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
    if mean_norm < tol {
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
            if theta < tol {
                continue;
            }
            let beta = alpha * theta / theta.sin();
            for i in 0..n {
                tangent[i] += beta * (e[i] - d * mean[i]);
            }
        }
        let tn = dot(&tangent, &tangent).max(0.0).sqrt();
        if tn < tol {
            break;
        }
        for i in 0..n {
            mean[i] = tn.cos() * mean[i] + tn.sin() * tangent[i] / tn;
        }
        let un = dot(&mean, &mean).max(0.0).sqrt();
        if un > tol {
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

        fn per_agent(&mut self, visit: &AgentVisit) -> Result<()> {
            let len = self.v[0].len();
            for t in 0..self.v.len() {
                for start in (0..len).step_by(self.tile) {
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
        fn any_order(&mut self, visit: &AnyOrderVisit) -> Result<()> {
            let len = self.v[0].len();
            let starts: Vec<usize> = (0..len).step_by(SCAN_CHUNK).collect();
            for (i, &start) in starts.iter().rev().enumerate() {
                let end = (start + SCAN_CHUNK).min(len);
                for t in 0..self.v.len() {
                    visit(i % 2, t, &self.chunk(t, start, end));
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
                    (1, v.len() as u64),
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
        let len = 3 * SCAN_CHUNK + 17;
        let mut rng = crate::demo::SplitMix64::new(7);
        // Few distinct magnitudes, zeros, both signs: many ties at any threshold.
        let v: Vec<Vec<f32>> = (0..3)
            .map(|t| {
                (0..len)
                    .map(|_| {
                        let r = rng.next_f64();
                        if r < 0.3 + 0.2 * t as f64 {
                            0.0
                        } else {
                            let m = [0.25f32, 0.5, 0.75, 1.0, 3.0][(r * 1000.0) as usize % 5];
                            if r < 0.8 {
                                m
                            } else {
                                -m
                            }
                        }
                    })
                    .collect()
            })
            .collect();
        for memory in [0, 1 << 20] {
            for (t, k, high_first) in [
                (0, 1, false),
                (1, 777, false),
                (2, 5000, true),
                (0, 9000, true),
            ] {
                let cut = rank_cuts_remembering(
                    &mut scan_of(v.clone(), 1000),
                    true,
                    (3, len as u64),
                    &[(t, k, high_first)],
                    memory,
                )
                .unwrap()[0];
                let mut order: Vec<usize> = (0..len).collect();
                order.sort_by(|&a, &b| {
                    let (ka, kb) = (magnitude_key(v[t][a]), magnitude_key(v[t][b]));
                    kb.cmp(&ka)
                        .then(if high_first { b.cmp(&a) } else { a.cmp(&b) })
                });
                // Which zeros a zero threshold keeps changes nothing (see `BinScan::resolve`).
                let nonzero = |i: &usize| v[t][*i] != 0.0;
                let mut want: Vec<usize> = order[..k as usize]
                    .iter()
                    .copied()
                    .filter(nonzero)
                    .collect();
                want.sort();
                let got: Vec<usize> = (0..len)
                    .filter(|&i| cut.inside(magnitude_key(v[t][i]), i as u32))
                    .filter(nonzero)
                    .collect();
                assert_eq!(
                    got, want,
                    "agent {t}, k {k}, high first {high_first}, memory {memory}"
                );
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
