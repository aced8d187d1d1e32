//! The rank cut of a key computed per element from every agent's values (SCE's variance): the same
//! two-level histogram as [`super::rank_cuts`], over keys that are not one agent's magnitudes.

use super::bin_scan::{record_limit, BinScan};
use super::bins::{locate, Bins16, BINS, BIN_MEMORY};
use super::cut::RankCut;
use crate::scans::{lock, unlock, worker_states, Scans, Values};
use anyhow::Result;
use std::ops::ControlFlow;

/// The rank cut of the k largest of a per-element key computed from every agent's values
/// (`keys`, over a chunk of them), k from the count of non-zero keys: a histogram of the keys'
/// high 16 bits, then of the low 16 bits in the threshold's bin (SCE's variance keys are rarely of
/// one value) — both from chunks in any order on every worker, the workers' records added after —
/// then a third, in-order scan only when the cut splits a tie too large to remember. Zero keys are
/// never kept.
pub fn key_rank_cut(
    scan: &mut dyn Scans,
    numel: u64,
    keys: &(dyn Fn(&Values, &mut Vec<u32>) + Sync),
    k_of_nonzero: impl Fn(u64) -> u64,
) -> Result<RankCut> {
    cut_of_keys(scan, numel, keys, k_of_nonzero, true)
}

/// The k-th largest key of [`key_rank_cut`] alone (u32::MAX for k = 0), for a statistic that
/// needs the order statistic, not which of the elements tied at it are inside (arcee_fusion's
/// quartiles): no third scan.
pub fn key_rank_value(
    scan: &mut dyn Scans,
    numel: u64,
    keys: &(dyn Fn(&Values, &mut Vec<u32>) + Sync),
    k_of_nonzero: impl Fn(u64) -> u64,
) -> Result<u32> {
    Ok(cut_of_keys(scan, numel, keys, k_of_nonzero, false)?.value)
}

/// [`key_rank_cut`]; without `split_ties`, the cut's index among tied elements is left unknown.
fn cut_of_keys(
    scan: &mut dyn Scans,
    numel: u64,
    keys: &(dyn Fn(&Values, &mut Vec<u32>) + Sync),
    k_of_nonzero: impl Fn(u64) -> u64,
    split_ties: bool,
) -> Result<RankCut> {
    let workers = scan.workers();
    // Per worker: its histogram and its buffer of keys.
    let counts = worker_states(workers, 1, |_| (Bins16::new(BINS / 2, numel), Vec::new()));
    scan.chunks_any_order(&|w, chunk| {
        let mut state = lock(&counts[w]);
        let (bins, buf) = &mut *state;
        keys(chunk, buf);
        let mut add = bins.adder();
        for (i, &key) in buf.iter().enumerate().filter(|(_, &k)| k != 0) {
            add.add(key >> 16, i);
        }
    })?;
    let mut high = vec![0u64; BINS / 2];
    for state in counts {
        unlock(state).0.drain_range(0, &mut high);
    }
    let nonzero: u64 = high.iter().sum();
    let k = k_of_nonzero(nonzero).min(nonzero);
    if k == 0 {
        return Ok(RankCut::EMPTY);
    }
    let (bin, above) = locate(&high, k);
    let per_worker = record_limit(BIN_MEMORY, workers);
    let records = worker_states(workers, 1, |_| {
        (BinScan::new(bin as u32, per_worker, numel), Vec::new())
    });
    scan.chunks_any_order(&|w, chunk| {
        let mut state = lock(&records[w]);
        let (b, buf) = &mut *state;
        keys(chunk, buf);
        for (i, &key) in buf.iter().enumerate() {
            if key != 0 && key >> 16 == b.bin {
                b.record(key, chunk.start + i as u64);
            }
        }
        b.end_chunk(chunk.start, 0);
    })?;
    let mut records = records.into_iter().map(|state| unlock(state).0);
    let mut b = records.next().expect("a scan has a worker");
    for other in records {
        b.absorb(other, BIN_MEMORY as usize);
    }
    let b = b.in_index_order();
    // Zero keys are never counted, so the threshold is above zero.
    let (mut cut, search) = b.resolve(k, above, false);
    if let Some(split) = search.filter(|_| split_ties) {
        let (value, need) = (cut.value, split.m);
        let (mut seen, mut buf) = (0u64, Vec::new());
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
