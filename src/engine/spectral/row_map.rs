//! How a decomposed matrix's update is made from its rows: each spectral method ends in a small
//! map of the short side (n × n, or the agents' n × kₜ and a c × n core), and the update of a
//! block of rows is the block's task vectors (or, for SVC, the method's merged update) times that
//! map — so a tall matrix's update is made tile by tile in the merge pass, never held whole.

use crate::backend::Backend;
use crate::linalg::{row_major, Mat};
use anyhow::Result;
use faer::{Accum, MatRef, Par};

/// The map from a block of a tall matrix's rows (n columns) to its update's rows (SPEC §4c–§4e).
pub(crate) enum RowMap {
    /// No direction was kept (every τ zero, or TSV-M with fewer columns than agents): Δ = 0.
    Zero,
    /// Iso-C: Δ = (Σₜ τₜ) · W, the sum in f64 in agent order.
    Summed(Split),
    /// TSV-M: Δ = [τ₁A₁, …, τ_T A_T] · K, each Aₜ n × kₜ (in f64), K (Σ kₜ) × n.
    Stacked { a: Vec<Mat>, core: Split },
    /// SVC: Δ = Δ_m · W, Δ_m the method's merged update (its f32 values minus θ₀).
    Merged { w: Map32 },
}

/// A map W = large + left·rightᵀ: `large` well-conditioned (its entries bounded by the largest
/// singular values' share: [`crate::linalg::gram::SMALL_SHARE`]), its product taken in f32 with
/// f32's accuracy; `left`·`right`ᵀ the few directions of small singular values, whose weights
/// are large, taken in f64 as (X·left)·rightᵀ.
pub(crate) struct Split {
    pub large: Map32,
    pub left: Mat,
    pub right: Mat,
}

/// A map's matrix in f32, row-major, for the f32 products on the backend's GEMM; its key names
/// it to the backend (which may keep it on its device while the same key comes back).
pub(crate) struct Map32 {
    values: Vec<f32>,
    rows: usize,
    cols: usize,
    key: u64,
}

/// Keys of the maps made so far: each map its own.
static NEXT_KEY: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Map32 {
    /// `m` rounded to f32.
    #[cfg(test)]
    pub(crate) fn of(m: &Mat) -> Map32 {
        Map32::from_fn(m.nrows(), m.ncols(), |i, j| m[(i, j)] as f32)
    }

    /// `m` as it is.
    pub(crate) fn of32(m: &faer::Mat<f32>) -> Map32 {
        Map32::from_fn(m.nrows(), m.ncols(), |i, j| m[(i, j)])
    }

    fn from_fn(rows: usize, cols: usize, f: impl Fn(usize, usize) -> f32) -> Map32 {
        Map32 {
            values: (0..rows)
                .flat_map(|i| (0..cols).map(move |j| (i, j)))
                .map(|(i, j)| f(i, j))
                .collect(),
            rows,
            cols,
            key: NEXT_KEY.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// x (rows of `self.rows`, row-major f32) · self on `backend`, into `out`.
    fn times(&self, x: &[f32], backend: &dyn Backend, out: &mut [f32]) -> Result<()> {
        let rows = x.len() / self.rows.max(1);
        backend.matmul(
            x,
            (&self.values, self.key),
            (rows, self.rows, self.cols),
            out,
        )
    }
}

/// One block of a tall matrix's rows: each agent's τ (rows × n, row-major f32, agent order) and,
/// for SVC, the method's merged update over the same elements.
pub(crate) struct Block<'a> {
    /// Index of the block's first row.
    pub row0: usize,
    /// Rows in the block.
    pub rows: usize,
    /// Each agent's τ over the block.
    pub taus: &'a [Vec<f32>],
    /// The method's merged update over the block (SVC), when the source makes it.
    pub merged: Option<&'a [f32]>,
}

impl RowMap {
    /// The update of `block` (rows × n, row-major), rounded once to f32, into `out`: the f32
    /// products on `backend`'s GEMM, the f64 ones (and the stacking of TSV-M's rows) on `par`.
    pub(crate) fn apply(
        &self,
        block: &Block,
        n: usize,
        (backend, par): (&dyn Backend, Par),
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let rows = block.rows;
        out.clear();
        out.resize(rows * n, 0.0);
        match self {
            RowMap::Zero => Ok(()),
            RowMap::Summed(split) => {
                let mut sum = vec![0.0f64; rows * n];
                for tau in block.taus {
                    sum.iter_mut()
                        .zip(tau)
                        .for_each(|(s, &t)| *s += f64::from(t));
                }
                split.times(row_major(&sum, n), (backend, par), out)
            }
            RowMap::Merged { w } => {
                let merged = block.merged.expect("SVC's blocks carry the merged update");
                w.times(merged, backend, out)
            }
            RowMap::Stacked { a, core } => {
                core.times(stacked(block, a, n, par).as_ref(), (backend, par), out)
            }
        }
    }
}

impl Split {
    /// x · W into `out` (row-major): x rounded to f32 times `large` on the backend, plus
    /// (x·left)·rightᵀ in f64, the sum rounded to f32.
    fn times(
        &self,
        x: MatRef<f64>,
        (backend, par): (&dyn Backend, Par),
        out: &mut [f32],
    ) -> Result<()> {
        let x32: Vec<f32> = (0..x.nrows())
            .flat_map(|i| (0..x.ncols()).map(move |j| (i, j)))
            .map(|(i, j)| x[(i, j)] as f32)
            .collect();
        self.large.times(&x32, backend, out)?;
        if self.left.ncols() > 0 {
            let through = times(x, self.left.as_ref(), par);
            let low = times(through.as_ref(), self.right.transpose(), par);
            let cols = low.ncols();
            for (e, o) in out.iter_mut().enumerate() {
                *o = (f64::from(*o) + low[(e / cols, e % cols)]) as f32;
            }
        }
        Ok(())
    }
}

/// TSV-M's [τ₁A₁, …, τ_T A_T] over `block` (rows of `n`): each agent's rows times its Aₜ,
/// side by side (rows × Σ kₜ), in f64.
pub(crate) fn stacked(block: &Block, a: &[Mat], n: usize, par: Par) -> Mat {
    let width = a.iter().map(Mat::ncols).sum();
    let mut out = Mat::zeros(block.rows, width);
    let mut col = 0;
    let mut values = Vec::new();
    for (tau, a) in block.taus.iter().zip(a) {
        values.clear();
        values.extend(tau.iter().map(|&x| f64::from(x)));
        let dst = out.as_mut().subcols_mut(col, a.ncols());
        faer::linalg::matmul::matmul(
            dst,
            Accum::Replace,
            row_major(&values, n),
            a.as_ref(),
            1.0,
            par,
        );
        col += a.ncols();
    }
    out
}

/// x · w on `par`.
fn times(x: MatRef<f64>, w: MatRef<f64>, par: Par) -> Mat {
    let mut out = Mat::zeros(x.nrows(), w.ncols());
    faer::linalg::matmul::matmul(out.as_mut(), Accum::Replace, x, w, 1.0, par);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_map_is_its_product() {
        let (rows, n) = (3, 2);
        let taus = vec![vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], vec![0.5f32; 6]];
        let w = Mat::from_fn(2, 2, |i, j| (i * 2 + j) as f64 + 1.0);
        let block = Block {
            row0: 0,
            rows,
            taus: &taus,
            merged: Some(&taus[0]),
        };
        let mut out = Vec::new();
        let cpu = crate::backend::cpu::CpuBackend::new(1).unwrap();
        // W = large + left·rightᵀ, its parts in f32 and f64: [[1, 2], [3, 4]] both ways.
        let split = |large: &Mat, left: Mat, right: Mat| Split {
            large: Map32::of(large),
            left,
            right,
        };
        let e0 = Mat::from_fn(2, 1, |i, _| f64::from(u8::from(i == 0)));
        let e1 = Mat::from_fn(2, 1, |i, _| f64::from(u8::from(i == 1)));
        let zero = Mat::zeros(2, 2);
        for summed in [
            split(&w, Mat::zeros(2, 0), Mat::zeros(2, 0)),
            split(&zero, Mat::identity(2, 2), w.transpose().to_owned()),
        ] {
            // Row 0: (1.5, 2.5) · [[1, 2], [3, 4]] = (9, 13).
            RowMap::Summed(summed)
                .apply(&block, n, (&cpu, Par::Seq), &mut out)
                .unwrap();
            assert_eq!(&out[..2], &[9.0, 13.0]);
        }
        RowMap::Merged { w: Map32::of(&w) }
            .apply(&block, n, (&cpu, Par::Seq), &mut out)
            .unwrap();
        assert_eq!(&out[..2], &[7.0, 10.0]);
        // [τ₁·a₁, τ₂·a₂] · K with a₁ = e₁ (n × 1), a₂ = e₂, K = w: (1, 0.5) · w = (2.5, 4).
        let core = split(&w, Mat::zeros(2, 0), Mat::zeros(2, 0));
        RowMap::Stacked {
            a: vec![e0, e1],
            core,
        }
        .apply(&block, n, (&cpu, Par::Seq), &mut out)
        .unwrap();
        assert_eq!(&out[..2], &[2.5, 4.0]);
        RowMap::Zero
            .apply(&block, n, (&cpu, Par::Seq), &mut out)
            .unwrap();
        assert_eq!(out, vec![0.0; 6]);
    }
}
