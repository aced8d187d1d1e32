//! SCE's statistics: the variance cut over the agents' task vectors and each agent's weight.

use crate::method::combine::{variance_key, VarianceCut};
use crate::scans::{lock, unlock, worker_states, Scans, Values};
use crate::select::key_rank_cut;
use anyhow::Result;

/// SCE's statistics: the cut keeping the ⌊density · (elements of non-zero variance)⌋ elements
/// of highest variance over the agents' task vectors (none when density ≥ 1), and each agent's
/// weight, its mean square on the kept elements over the sum of them (1/n if that sum < 1e-6).
pub(super) fn sce_statistics(
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
    // Per worker: (chunk start, each agent's Σv² over its kept elements) of each chunk it read,
    // added in chunk order after, and its buffer of keys.
    let parts = worker_states(scan.workers(), 1, |_| (Vec::new(), Vec::new()));
    scan.chunks_any_order(&|w, chunk| {
        let mut state = lock(&parts[w]);
        let (sums, buf) = &mut *state;
        if element_keep.is_some() {
            keys(chunk, buf);
        }
        let kept = |i: usize| {
            element_keep.is_none_or(|(cut, _)| cut.inside(buf[i], (chunk.start + i as u64) as u32))
        };
        let chunk_sums: Vec<f64> = (0..n)
            .map(|t| {
                let values = chunk.tau[t].iter().enumerate();
                values
                    .filter(|&(i, _)| kept(i))
                    .map(|(_, &x)| x as f64 * x as f64)
                    .fold(0.0, |sum, sq| sum + sq)
            })
            .collect();
        sums.push((chunk.start, chunk_sums));
    })?;
    let mut squares = vec![0.0f64; n];
    for sums in super::in_order(parts.into_iter().map(|p| unlock(p).0)) {
        for (sq, s) in squares.iter_mut().zip(sums) {
            *sq += s;
        }
    }
    let means: Vec<f64> = squares.iter().map(|s| s / numel.max(1) as f64).collect();
    let total: f64 = means.iter().sum();
    let weights = if total.abs() < 1e-6 {
        vec![1.0 / n as f64; n]
    } else {
        means.iter().map(|m| m / total).collect()
    };
    Ok((element_keep, weights))
}
