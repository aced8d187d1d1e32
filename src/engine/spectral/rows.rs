//! Where a spectral method reads a matrix: as a tall matrix's blocks of rows, in order, as often
//! as its algorithm needs — streamed from the input files (a matrix with at least as many rows as
//! columns: nothing of it held whole), or from its task vectors gathered in memory and read
//! transposed (a wide matrix, whose short side is its rows).

use super::row_map::Block;
use crate::backend::Tile;
use crate::checkpoint::dtype::{decode, decode_minus};
use crate::engine::scans::TensorScans;
use crate::linalg::rows_per_block;
use anyhow::Result;
use std::ops::ControlFlow;

/// A tall matrix (rows ≥ columns) read block by block.
pub(in crate::engine) trait RowBlocks {
    /// (rows, columns) of the tall matrix read.
    fn shape(&self) -> (usize, usize);
    /// Agents whose task vectors each block carries.
    fn agents(&self) -> usize;
    /// Hands every block to `visit`, in row order: blocks of [`rows_per_block`] rows.
    fn pass(&mut self, visit: &mut dyn FnMut(&Block) -> Result<()>) -> Result<()>;
    /// Whether the rows are the stored matrix's columns (a wide matrix read transposed).
    fn transposed(&self) -> bool;
}

/// SVC's merged update of a tile: the method's own tile rule, its f32 values minus θ₀.
pub(in crate::engine) type MergedOf<'s> = dyn FnMut(&Tile, u64, &mut Vec<f32>) -> Result<()> + 's;

/// A tall matrix's rows as the merge pass reads them: each block one tile of the input files.
pub(in crate::engine) struct FileRows<'s, 'a> {
    pub scans: &'s mut TensorScans<'a>,
    /// (rows, columns), rows ≥ columns.
    pub shape: (usize, usize),
    /// The method, for errors.
    pub method: &'static str,
    /// SVC: the merged update of each tile.
    pub merged: Option<&'s mut MergedOf<'s>>,
}

impl RowBlocks for FileRows<'_, '_> {
    fn shape(&self) -> (usize, usize) {
        self.shape
    }

    fn agents(&self) -> usize {
        self.scans.present.len()
    }

    fn transposed(&self) -> bool {
        false
    }

    fn pass(&mut self, visit: &mut dyn FnMut(&Block) -> Result<()>) -> Result<()> {
        let n = self.shape.1;
        self.scans.pass.tile_elems = rows_per_block(n) * n;
        let method = self.method;
        let agents = self.scans.present.len();
        let mut taus: Vec<Vec<f32>> = vec![Vec::new(); agents];
        let mut base = Vec::new();
        let mut merged = Vec::new();
        let merged_of = &mut self.merged;
        self.scans.each_tile(0, |_, start, tile| {
            base.resize(tile.len, 0.0);
            decode(tile.dtype, tile.base, &mut base);
            for (t, tau) in taus.iter_mut().enumerate() {
                tau.resize(tile.len, 0.0);
                decode_minus(tile.dtype, tile.agents[t], &base, tau);
                refuse_nonfinite(method, t, (start as usize, n), tau)?;
            }
            if let Some(merged_of) = merged_of.as_mut() {
                merged_of(tile, start, &mut merged)?;
            }
            visit(&Block {
                row0: start as usize / n,
                rows: tile.len / n,
                taus: &taus,
                merged: merged_of.is_some().then_some(&merged[..]),
            })?;
            Ok(ControlFlow::Continue(()))
        })
    }
}

/// A wide matrix (m < n) read as its transpose: the agents' task vectors (and SVC's merged
/// update) gathered whole, each block of the transpose's rows copied out of them.
pub(in crate::engine) struct Transposed {
    /// Each agent's τ, m × n row-major.
    pub taus: Vec<Vec<f32>>,
    /// SVC's merged update, m × n.
    pub merged: Option<Vec<f32>>,
    /// (m, n) of the matrix as stored.
    pub stored: (usize, usize),
}

impl Transposed {
    /// Columns `j0..j0 + rows` of the stored matrix `values` (m × n) as rows × m, row-major.
    fn columns(&self, values: &[f32], j0: usize, rows: usize, out: &mut Vec<f32>) {
        let (m, n) = self.stored;
        out.clear();
        out.extend((0..rows).flat_map(|r| (0..m).map(move |i| values[i * n + j0 + r])));
    }
}

impl RowBlocks for Transposed {
    fn shape(&self) -> (usize, usize) {
        (self.stored.1, self.stored.0)
    }

    fn agents(&self) -> usize {
        self.taus.len()
    }

    fn transposed(&self) -> bool {
        true
    }

    fn pass(&mut self, visit: &mut dyn FnMut(&Block) -> Result<()>) -> Result<()> {
        let (rows, cols) = self.shape();
        let step = rows_per_block(cols);
        let mut taus: Vec<Vec<f32>> = vec![Vec::new(); self.taus.len()];
        let mut merged = Vec::new();
        for row0 in (0..rows).step_by(step) {
            crate::cancel::current().check()?;
            let count = step.min(rows - row0);
            for (out, tau) in taus.iter_mut().zip(&self.taus) {
                self.columns(tau, row0, count, out);
            }
            if let Some(m) = &self.merged {
                self.columns(m, row0, count, &mut merged);
            }
            visit(&Block {
                row0,
                rows: count,
                taus: &taus,
                merged: self.merged.as_ref().map(|_| &merged[..]),
            })?;
        }
        Ok(())
    }
}

/// A spectral method cannot decompose a NaN or ±Inf (an SVD of one does not exist): where
/// `--allow-nonfinite` let one through the inputs' gate, agent `t`'s task vector over the
/// elements from `start` (a matrix of `n` columns) is refused here, naming the element — not
/// left to fail inside the decomposition as "did not converge". (The caller's context names
/// the tensor.)
pub(in crate::engine) fn refuse_nonfinite(
    method: &str,
    t: usize,
    (start, n): (usize, usize),
    tau: &[f32],
) -> Result<()> {
    if let Some(e) = tau.iter().position(|x| !x.is_finite()) {
        let at = start + e;
        return Err(crate::error::data(crate::message![
            format!(
                "model {}'s task vector has a non-finite value ({}) at element {at} (row {}, \
                 column {}); {method} decomposes whole matrices and cannot merge NaN or ±Inf (",
                t + 1,
                tau[e],
                at / n.max(1),
                at % n.max(1)
            ),
            crate::error::Arg::switch("allow-nonfinite"),
            " lets them through to the elementwise methods only)",
        ]));
    }
    Ok(())
}
