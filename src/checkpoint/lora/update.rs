//! The update s·B·A of one module, added to a tile's values run by run (SPEC §5): column block
//! by column block, each block's terms decoded once for every row that crosses it.

use super::LoraAdapter;
use crate::checkpoint::dtype::{decode, decode_one};
use crate::simd::multiversion;
use anyhow::Result;

impl LoraAdapter {
    /// Adds update `name` to `values`, elements `start..start + values.len()` of the base tensor
    /// of `shape` ([m, n]) in f32: for element (i, j), s·Σ_k B[i,k]·A[k,j] (transposed:
    /// s·Σ_k B[j,k]·A[k,i]), k ascending from 0, no fused multiply-add.
    pub fn add_update(
        &self,
        name: &str,
        shape: &[usize],
        start: u64,
        values: &mut [f32],
    ) -> Result<()> {
        self.each_update(name, shape, start, values.len(), |at, update, s| {
            for (v, &x) in values[at..at + update.len()].iter_mut().zip(update) {
                *v += x * s;
            }
        })
    }

    /// [`Self::add_update`] into f32 values stored as little-endian bytes (a widened tile).
    pub fn add_update_bytes(
        &self,
        name: &str,
        shape: &[usize],
        start: u64,
        bytes: &mut [u8],
    ) -> Result<()> {
        self.each_update(name, shape, start, bytes.len() / 4, |at, update, s| {
            let out = bytes[at * 4..(at + update.len()) * 4].chunks_exact_mut(4);
            for (b, &x) in out.zip(update) {
                let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]) + x * s;
                b.copy_from_slice(&v.to_le_bytes());
            }
        })
    }

    /// Hands `add` each run of update `name` over elements `start..start + len`: its offset from
    /// `start`, Σ_k B·A over the run, and s. Column block by column block: a block's terms (A's
    /// rows over it; transposed, B's rows over it, turned) are decoded once for every row that
    /// crosses it, each row's coefficients (B's row; transposed, A's column) once per block.
    fn each_update(
        &self,
        name: &str,
        shape: &[usize],
        start: u64,
        len: usize,
        mut add: impl FnMut(usize, &[f32], f32),
    ) -> Result<()> {
        if let Some(bias) = self.biases.get(name) {
            return self.each_bias(bias, start, len, add);
        }
        let u = &self.updates[name];
        let p = self.pair(u)?;
        let (r, m, n) = (u.rank, shape[0], shape[1]);
        let (ta, tb) = (u.a.dtype, u.b.dtype);
        let (sa, sb) = (ta.size(), tb.size());
        debug_assert!(r >= 1);
        if len == 0 {
            return Ok(());
        }
        // Columns per block: the block's r rows of terms take BLOCK_TERMS values (one column
        // at least), beside a row's r coefficients; sized for the call, not for the largest rank.
        let cols = (BLOCK_TERMS / r).clamp(1, BLOCK_COLS);
        let mut scratch = vec![0.0f32; r + r * cols];
        let (coef, terms) = scratch.split_at_mut(r);
        let mut acc = [0.0f32; BLOCK_COLS];
        let (first, end) = (start as usize, start as usize + len);
        let (row_lo, row_hi) = (first / n, (end - 1) / n);
        for c0 in (0..n).step_by(cols) {
            let c1 = (c0 + cols).min(n);
            let w = c1 - c0;
            // Rows whose part in the block is in the run (all but the first and last rows).
            let mut rows = (row_lo..=row_hi)
                .filter(|&i| i * n + c0 < end && i * n + c1 > first)
                .peekable();
            if rows.peek().is_none() {
                continue;
            }
            if u.transposed {
                // terms[k][j] = B[c0 + j, k]: B's rows over the block, turned.
                for j in 0..w {
                    let from = (c0 + j) * r * sb;
                    decode(tb, &p.b()[from..from + r * sb], coef);
                    for (k, &x) in coef.iter().enumerate() {
                        terms[k * w + j] = x;
                    }
                }
            } else {
                // terms[k][j] = A[k, c0 + j].
                for k in 0..r {
                    let from = (k * n + c0) * sa;
                    decode(
                        ta,
                        &p.a()[from..from + w * sa],
                        &mut terms[k * w..(k + 1) * w],
                    );
                }
            }
            for i in rows {
                if u.transposed {
                    for (k, c) in coef.iter_mut().enumerate() {
                        *c = decode_one(ta, p.a(), k * m + i);
                    }
                } else {
                    let from = i * r * sb;
                    decode(tb, &p.b()[from..from + r * sb], coef);
                }
                let lo = (i * n + c0).max(first);
                let hi = (i * n + c1).min(end);
                let acc = &mut acc[..hi - lo];
                rank_sums(coef, &terms[lo - (i * n + c0)..], w, acc);
                add(lo - first, acc, u.scale);
            }
        }
        Ok(())
    }
}

/// Values of a column block's terms in [`LoraAdapter::add_update`] (rank × columns), 16 KiB:
/// they stay in L1 while every row of a tile crosses the block.
const BLOCK_TERMS: usize = 4096;

/// Columns per block of [`LoraAdapter::add_update`] at most (rank ≤ 16 reaches it).
const BLOCK_COLS: usize = 256;

multiversion! {
    /// `acc[j] = Σ_k coef[k] · terms[k·stride + j]`, k ascending from 0, no fused multiply-add:
    /// one row's update over a run of a column block (compiled for the baseline, AVX2 and
    /// AVX-512; every build gives the same bits).
    fn rank_sums(coef: &[f32], terms: &[f32], stride: usize, acc: &mut [f32]) {
        // LANES columns at a time, their sums kept in registers over the whole rank.
        const LANES: usize = 64;
        let done = acc.len() - acc.len() % LANES;
        let mut lanes = acc.chunks_exact_mut(LANES);
        for (b, out) in lanes.by_ref().enumerate() {
            let mut sums = [0.0f32; LANES];
            for (k, &c) in coef.iter().enumerate() {
                let t = &terms[k * stride + b * LANES..][..LANES];
                for (x, &y) in sums.iter_mut().zip(t) {
                    *x += c * y;
                }
            }
            out.copy_from_slice(&sums);
        }
        for (j, out) in acc.iter_mut().enumerate().skip(done) {
            let mut x = 0.0f32;
            for (k, &c) in coef.iter().enumerate() {
                x += c * terms[k * stride + j];
            }
            *out = x;
        }
    }
}

impl LoraAdapter {
    /// Whether update `name` is DoRA's: its rows are rescaled to the magnitudes m.
    pub fn is_dora(&self, name: &str) -> bool {
        self.updates
            .get(name)
            .is_some_and(|u| u.magnitude.is_some())
    }

    /// DoRA's magnitudes m_i of update `name` for rows `rows`, as f32, into `out`.
    pub fn magnitudes(
        &self,
        name: &str,
        rows: std::ops::Range<usize>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let u = &self.updates[name];
        let e = u
            .magnitude
            .as_ref()
            .expect("a DoRA update has a magnitude vector");
        let p = self.pair(u)?;
        let size = e.dtype.size();
        out.clear();
        out.resize(rows.len(), 0.0);
        decode(e.dtype, &p.m()[rows.start * size..rows.end * size], out);
        Ok(())
    }
}
