//! arcee_fusion's statistics (mergekit semantics): each row's KL divergence between the softmax
//! of the model's row and of the base's, then the Tukey fence Q2 + 1.5·(Q3 − Q1) of the
//! importances |τ|·KL over the whole tensor, from exact order statistics (mergekit samples a
//! million elements at random on larger tensors; rlmerge ranks them all).

use crate::method::combine::Fusion;
use crate::scans::{Scans, Values};
use crate::select::key_rank_value;
use anyhow::Result;
use rayon::prelude::*;
use std::ops::ControlFlow;

/// The probability floor mergekit adds to both softmaxes.
const FLOOR: f64 = 1e-8;

/// KL(p ‖ q) with p = softmax(`x`) + 1e-8 and q = softmax(`base`) + 1e-8, in f64 in element
/// order, rounded once to a non-negative f32.
pub fn row_kl(x: &[f32], base: &[f32]) -> f32 {
    // Each element's exp(v − max), computed once for the sum and the terms.
    let softmax = |v: &[f32]| -> (Vec<f64>, f64) {
        let max = v.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a)) as f64;
        let e: Vec<f64> = v.iter().map(|&a| (a as f64 - max).exp()).collect();
        let sum = e.iter().sum();
        (e, sum)
    };
    let ((ex, sx), (eb, sb)) = (softmax(x), softmax(base));
    let mut kl = 0.0f64;
    for (&a, &b) in ex.iter().zip(&eb) {
        let p = a / sx + FLOOR;
        let q = b / sb + FLOOR;
        kl += p * (p / q).ln();
    }
    // Gibbs: never below 0 but for rounding (so importances are too; NaN from non-finite
    // inputs counts as 0).
    if kl > 0.0 {
        kl as f32
    } else {
        0.0
    }
}

/// A non-negative f32 (an importance) as a u32 ordered like the numbers, never 0 and below 2³¹
/// (what [`key_rank_value`] ranks).
fn ordered_key(x: f32) -> u32 {
    x.to_bits() + 1
}

fn from_ordered_key(k: u32) -> f32 {
    f32::from_bits(k - 1)
}

/// arcee_fusion's [`Fusion`] of a tensor of `numel` elements in rows of `row_len`, from scans
/// whose tiles hold whole rows (agent 0 is the model).
pub(super) fn fusion_statistics(scan: &mut dyn Scans, numel: u64, row_len: u64) -> Result<Fusion> {
    let row_len = row_len.max(1);
    let mut kl = vec![0.0f32; numel.div_ceil(row_len) as usize];
    // A tile holds whole rows; its rows' KLs are independent, computed on every worker.
    scan.tiles(&mut |tile| {
        let first = (tile.start / row_len) as usize;
        let rows = tile.x[0]
            .par_chunks(row_len as usize)
            .zip(tile.base.par_chunks(row_len as usize));
        let count = tile.base.len().div_ceil(row_len as usize);
        kl[first..first + count]
            .par_iter_mut()
            .zip(rows)
            .for_each(|(kl, (x, b))| *kl = row_kl(x, b));
        Ok(ControlFlow::Continue(()))
    })?;
    let mut fusion = Fusion {
        row_len,
        kl,
        threshold: 0.0,
    };
    let keys = |tile: &Values, out: &mut Vec<u32>| {
        out.clear();
        out.extend(
            tile.tau[0]
                .iter()
                .enumerate()
                .map(|(i, &t)| ordered_key(fusion.importance(tile.start + i as u64, t))),
        );
    };
    // mergekit's sorted[⌊q·(n − 1)⌋] (q and n − 1 multiplied in f32), the k-th largest for
    // k = n − that index.
    let mut quantile = |q: f32| -> Result<f32> {
        let at = (q * (numel.saturating_sub(1)) as f32) as u64;
        let value = key_rank_value(scan, numel, &keys, |_| numel - at)?;
        Ok(from_ordered_key(value))
    };
    let (q1, q2, q3) = (quantile(0.25)?, quantile(0.5)?, quantile(0.75)?);
    fusion.threshold = q2 + 1.5 * (q3 - q1);
    Ok(fusion)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_order_like_the_numbers() {
        let xs = [0.0, 1e-45, 1e-30, 1.5, f32::INFINITY];
        for w in xs.windows(2) {
            assert!(ordered_key(w[0]) < ordered_key(w[1]), "{w:?}");
        }
        for x in xs {
            assert_eq!(from_ordered_key(ordered_key(x)), x);
            assert!(ordered_key(x) != 0 && ordered_key(x) < 1 << 31);
        }
    }

    #[test]
    fn kl_by_hand() {
        // Equal rows: 0. Rows (ln 3, 0) against (0, 0): p = (3/4, 1/4), q = (1/2, 1/2).
        assert_eq!(row_kl(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        let want = 0.75 * (1.5f64).ln() + 0.25 * (0.5f64).ln();
        let got = row_kl(&[3f32.ln(), 0.0], &[0.0, 0.0]) as f64;
        assert!((got - want).abs() < 1e-7, "{got} vs {want}");
    }
}
