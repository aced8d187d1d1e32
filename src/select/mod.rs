//! Exact rank selection without sorting: the thresholds ("rank cuts") that keep the k largest
//! magnitudes of a tensor's task vectors, ties broken by index, found by histograms of the keys'
//! bits over a few scans of the tensor (SPEC.md §4).

mod bin_scan;
mod bins;
mod cut;
mod histogram;
mod key_cut;
mod key_window;
mod ranks;
#[cfg(test)]
mod tests;

use crate::scans::{lock, states, unlock, Scans};
use anyhow::{Context, Result};
use bin_scan::{bin_scans, BinScan, Split};
use bins::BIN_MEMORY;
pub use cut::{magnitude_key, RankCut};
use histogram::{histogram_pass, Histogram, Lane};
pub use key_cut::{key_rank_cut, key_rank_value};
use key_window::KeyWindow;
pub use ranks::{rank_threshold, row_keep_mask, RankKeep};
use std::ops::ControlFlow;

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

/// Below this many elements a tensor's rank cuts skip the sample (it would read too much of it).
const SAMPLE_MIN_ELEMS: u64 = 1 << 20;

/// One chunk in this many is sampled to guess each cut's bin.
const SAMPLE_EVERY: usize = 16;

/// How far, in standard deviations of an independent sample of the same size, a guessed window
/// reaches around the sample's rank where keys are spread finely ([`Histogram::likely_bins`]).
/// The sample takes whole chunks, whose elements (a row's) are alike, so its ranks stray much
/// further than independent elements' would: on the f32 task vectors of a LoRA agent beside a
/// full one (`benches/lora_memory.sh`, 512 MiB), the nearest bins alone missed 79 of 112 large
/// tensors' cuts, 16 deviations 1 or 2, 24 none.
const SAMPLE_MARGIN: f64 = 24.0;

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
pub fn rank_cuts(
    scan: &mut dyn Scans,
    delta: bool,
    (agents, numel): (usize, u64),
    wanted: &[Wanted],
) -> Result<Vec<RankCut>> {
    let sizes = (agents, numel, SAMPLE_MIN_ELEMS);
    rank_cuts_remembering(scan, delta, sizes, wanted, BIN_MEMORY)
}

/// One wanted cut: (agent, k, high_first).
type Wanted = (usize, u64, bool);

/// [`rank_cuts`], remembering at most `bin_memory` elements of the bins it records, and sampling
/// to guess them on tensors of at least `sample_min` elements.
fn rank_cuts_remembering(
    scan: &mut dyn Scans,
    delta: bool,
    (agents, numel, sample_min): (usize, u64, u64),
    wanted: &[Wanted],
    bin_memory: u64,
) -> Result<Vec<RankCut>> {
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let size = (agents, numel);
    let guessed = if numel >= sample_min {
        guess_lanes(scan, delta, size, wanted)?
    } else {
        wanted
            .iter()
            .map(|&(agent, _, _)| Lane {
                agent,
                window: KeyWindow::ALL,
                follow: Vec::new(),
            })
            .collect()
    };
    let (lanes, lane_of) = distinct_lanes(guessed);
    let pass1 = first_pass(scan, delta, size, wanted, lanes, &lane_of)?;
    // Cut c's histogram.
    let hist = |c: usize| &pass1[lane_of[c]];
    let coarse: Vec<(u32, u64)> = wanted
        .iter()
        .enumerate()
        .map(|(c, &(t, k, _))| {
            hist(c).locate(k).with_context(|| {
                format!("internal: rank {k} of agent {t} lies in no bin of the first pass")
            })
        })
        .collect::<Result<_>>()?;
    // A cut in a bin of one key (no low bits set anywhere in it; in bin 0: zeros only) is
    // resolved now; pass 2 records the bins of the others.
    let single = |c: usize| !hist(c).mixed(coarse[c].0);
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
            let chunks = hist(c)
                .chunks
                .iter()
                .find(|(b, _)| *b == bin)
                .map(|(_, chunks)| chunks.clone());
            Ok(BinScan::of_one_key(bin, hist(c).count(bin), chunks, numel)
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
    let mut ties = Vec::new();
    for (c, &(t, k, high_first)) in wanted.iter().enumerate() {
        let (cut, split) = resolve(c, k, high_first)?;
        if let Some(split) = split {
            ties.push((c, t, cut.value, split));
        }
        cuts.push(cut);
    }
    split_ties(scan, delta, agents, &ties, &mut cuts)?;
    Ok(cuts)
}

/// The lanes of `lanes` without repeats, and for each of the cuts they were made for (one each,
/// in order) the index of its lane: two cuts guessed in the same window share one histogram.
fn distinct_lanes(lanes: Vec<Lane>) -> (Vec<Lane>, Vec<usize>) {
    let mut distinct: Vec<Lane> = Vec::new();
    let lane_of = lanes
        .into_iter()
        .map(|lane| match distinct.iter().position(|d| *d == lane) {
            Some(i) => i,
            None => {
                distinct.push(lane);
                distinct.len() - 1
            }
        })
        .collect();
    (distinct, lane_of)
}

/// Guesses of each cut's bin, from a sample of one chunk in [`SAMPLE_EVERY`]: pass 1 then counts
/// only a window around them bin by bin — one lane per cut, so an agent's cuts far apart (the
/// top 1 % and the top 90 %) leave the keys between them only counted — and those bins per
/// chunk, so that a cut in one of them, splitting a tie, finds the split by reading one chunk
/// again. One lane per wanted cut, in order.
fn guess_lanes(
    scan: &mut dyn Scans,
    delta: bool,
    (agents, numel): (usize, u64),
    wanted: &[Wanted],
) -> Result<Vec<Lane>> {
    let mut cut_agents: Vec<usize> = wanted.iter().map(|w| w.0).collect();
    cut_agents.sort_unstable();
    cut_agents.dedup();
    let whole: Vec<Lane> = cut_agents
        .iter()
        .map(|&agent| Lane {
            agent,
            window: KeyWindow::ALL,
            follow: Vec::new(),
        })
        .collect();
    let sample = histogram_pass(scan, delta, (agents, numel), SAMPLE_EVERY, &whole)?;
    Ok(wanted
        .iter()
        .map(|&(t, k, _)| {
            let sample = &sample[cut_agents.binary_search(&t).expect("a cut agent")];
            let seen = sample.seen;
            if seen == 0 {
                return Lane {
                    agent: t,
                    window: KeyWindow::ALL,
                    follow: Vec::new(),
                };
            }
            let k = ((k as f64 * seen as f64 / numel as f64).ceil() as u64).clamp(1, seen);
            let mut bins = sample.likely_bins(k, SAMPLE_MARGIN);
            // A cut deep among the zeros (bin 0; most of an RL task vector is zeros): bin 0
            // alone, so every nonzero key is only counted. A sample that misleads here costs a
            // retry over every bin, not a wrong cut.
            let nonzero = seen - sample.count(0);
            if bins[0] == 0 && k > nonzero + nonzero / 16 + 64 {
                bins = vec![0];
            }
            bins.sort_unstable();
            bins.dedup();
            Lane {
                agent: t,
                window: KeyWindow::around(&bins),
                follow: bins,
            }
        })
        .collect())
}

/// Pass 1: each lane's histogram of the high 16 bits of its agent's magnitude keys in its
/// window; again over every bin for a lane whose cut (`lane_of`: each cut's lane) the window
/// missed.
fn first_pass(
    scan: &mut dyn Scans,
    delta: bool,
    size: (usize, u64),
    wanted: &[Wanted],
    lanes: Vec<Lane>,
    lane_of: &[usize],
) -> Result<Vec<Histogram>> {
    let mut pass1 = histogram_pass(scan, delta, size, 1, &lanes)?;
    let missed: Vec<usize> = (0..lanes.len())
        .filter(|&l| {
            wanted
                .iter()
                .zip(lane_of)
                .any(|(&(_, k, _), &of)| of == l && pass1[l].locate(k).is_none())
        })
        .collect();
    if !missed.is_empty() {
        let again: Vec<Lane> = missed
            .iter()
            .map(|&l| Lane {
                window: KeyWindow::ALL,
                ..lanes[l].clone()
            })
            .collect();
        let histograms = histogram_pass(scan, delta, size, 1, &again)?;
        for (&l, h) in missed.iter().zip(histograms) {
            pass1[l] = h;
        }
    }
    Ok(pass1)
}

/// A cut whose index lies just past the m-th element tied at its key: (cut, agent, key, split).
type Tie = (usize, usize, u32, Split);

/// PassOptions 3: where a cut splits a tie no record could place, the index of the split, searched in
/// index order: from the chunk that holds it when that is known (a read of one chunk each), else
/// from the start, all such searches in one scan.
fn split_ties(
    scan: &mut dyn Scans,
    delta: bool,
    agents: usize,
    ties: &[Tie],
    cuts: &mut [RankCut],
) -> Result<()> {
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
                s.search(chunk.start, chunk.values(delta));
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
    Ok(())
}

impl TieSearch {
    /// Counts the tied elements of the chunk starting at tensor index `start`, noting the split
    /// when it is among them: [`SEARCH_BLOCK`] elements at a time by a count that vectorizes,
    /// element by element only in the block that holds the split.
    fn search(&mut self, start: u64, v: &[f32]) {
        let skip = self.from.saturating_sub(start).min(v.len() as u64) as usize;
        let key = self.key;
        for (b, block) in v[skip..].chunks(SEARCH_BLOCK).enumerate() {
            let tied: u32 = block
                .iter()
                .map(|&x| u32::from(magnitude_key(x) == key))
                .sum();
            if self.seen + u64::from(tied) < self.m {
                self.seen += u64::from(tied);
                continue;
            }
            for (j, &x) in block.iter().enumerate() {
                if magnitude_key(x) == key {
                    self.seen += 1;
                    if self.seen == self.m {
                        let at = skip + b * SEARCH_BLOCK + j;
                        self.found = Some((start + at as u64 + 1) as u32);
                        return;
                    }
                }
            }
        }
    }
}

/// Elements a tie search counts at once ([`TieSearch::search`]).
const SEARCH_BLOCK: usize = 256;

/// The cut holding ranks `< k` of `n` elements.
pub fn cut_of(k: u64, n: u64, found: &mut impl Iterator<Item = RankCut>) -> RankCut {
    if k == 0 {
        RankCut::EMPTY
    } else if k >= n {
        RankCut::FULL
    } else {
        found.next().expect("one cut was searched per rank")
    }
}
