//! The rank cut of a key computed per element from whole tiles (SCE's variance): the same
//! two-level histogram as [`super::rank_cuts`], over keys that are not one agent's magnitudes.

use super::bin_scan::BinScan;
use super::bins::{locate, Bins16, BINS, BIN_MEMORY};
use super::cut::RankCut;
use crate::scans::{Scans, Values};
use anyhow::Result;
use std::ops::ControlFlow;

/// The rank cut of the k largest of a per-element key computed from whole tiles (`keys`), k from
/// the count of non-zero keys: a histogram of the keys' high 16 bits, then of the low 16 bits in
/// the threshold's bin (SCE's variance keys are rarely of one value), then a third scan only when
/// the cut splits a tie too large to remember. Zero keys are never kept.
pub fn key_rank_cut(
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
    let mut b = BinScan::new(bin as u32, BIN_MEMORY as usize, numel);
    scan.tiles(&mut |tile| {
        keys(tile, &mut buf);
        for (i, &key) in buf.iter().enumerate() {
            if key != 0 && key >> 16 == b.bin {
                b.record(key, tile.start + i as u64);
            }
        }
        b.end_chunk(tile.start, 0);
        Ok(ControlFlow::Continue(()))
    })?;
    let b = b.in_index_order();
    // Zero keys are never counted, so the threshold is above zero.
    let (mut cut, search) = b.resolve(k, above, false);
    if let Some(split) = search {
        let (value, need) = (cut.value, split.m);
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
