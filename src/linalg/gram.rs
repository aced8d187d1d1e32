//! Sums of XᵀY over a tall matrix's row blocks — Gram matrices (Y = X) and cross products —
//! in f64, block by block as the rows stream past; and the inverse square root of a Gram matrix
//! on its numerical rank, the right half of a polar factor ([`inverse_sqrt`]).

use super::{Eigen, Mat};
use faer::linalg::matmul::triangular::{matmul as triangular_matmul, BlockStructure};
use faer::{Accum, MatRef, Par};

/// Elements per row block, about: 2^22 (32 MiB of f64).
const BLOCK_ELEMS: usize = 1 << 22;

/// Rows per block of a matrix of `cols` columns: a function of the shape alone, so the blocks —
/// and the order their products are summed in — do not depend on tile sizes or thread counts.
pub fn rows_per_block(cols: usize) -> usize {
    (BLOCK_ELEMS / cols.max(1)).clamp(16, 1 << 16)
}

/// A running Σ XᵀY over row blocks (n × n, f64), blocks added in row order.
pub struct GramSum {
    sum: Mat,
    /// Only the lower triangle is summed (a Gram matrix XᵀX, for its eigendecomposition).
    lower: bool,
    /// A block's product in f32 ([`GramSum::add_f32`]).
    block: faer::Mat<f32>,
}

impl GramSum {
    /// Σ XᵀX of n columns: its lower triangle.
    pub fn gram(n: usize) -> GramSum {
        GramSum {
            sum: Mat::zeros(n, n),
            lower: true,
            block: faer::Mat::zeros(0, 0),
        }
    }

    /// Σ XᵀY of n columns each, whole.
    pub fn cross(n: usize) -> GramSum {
        GramSum {
            sum: Mat::zeros(n, n),
            lower: false,
            block: faer::Mat::zeros(0, 0),
        }
    }

    /// Adds XᵀY for block `x` (rows × n) and `y` (the same block of Y; `x` again for a Gram
    /// matrix), on `par`.
    pub fn add(&mut self, x: MatRef<'_, f64>, y: MatRef<'_, f64>, par: Par) {
        debug_assert_eq!((x.ncols(), y.ncols()), (self.sum.ncols(), self.sum.ncols()));
        debug_assert_eq!(x.nrows(), y.nrows());
        let structure = match self.lower {
            true => BlockStructure::TriangularLower,
            false => BlockStructure::Rectangular,
        };
        triangular_matmul(
            self.sum.as_mut(),
            structure,
            Accum::Add,
            x.transpose(),
            BlockStructure::Rectangular,
            y,
            BlockStructure::Rectangular,
            1.0,
            par,
        );
    }

    /// Adds XᵀY of a cross product's block in f32 (half the time; each product's sums carry f32's
    /// rounding, for the sums that need no more: SVC's responses), the block's product added to
    /// the f64 sum.
    pub fn add_f32(&mut self, x: MatRef<'_, f32>, y: MatRef<'_, f32>, par: Par) {
        debug_assert!(!self.lower);
        let n = self.sum.ncols();
        if self.block.nrows() != n {
            self.block = faer::Mat::zeros(n, n);
        }
        faer::linalg::matmul::matmul(
            self.block.as_mut(),
            Accum::Replace,
            x.transpose(),
            y,
            1.0,
            par,
        );
        for j in 0..n {
            for i in 0..n {
                self.sum[(i, j)] += f64::from(self.block[(i, j)]);
            }
        }
    }

    /// The sum (of a Gram matrix: its lower triangle; the upper one is zero).
    pub fn into_sum(self) -> Mat {
        self.sum
    }

    /// The sum whole: a Gram matrix's upper triangle filled from its lower one.
    pub fn into_symmetric(self) -> Mat {
        let mut sum = self.sum;
        if self.lower {
            for j in 1..sum.ncols() {
                for i in 0..j {
                    sum[(i, j)] = sum[(j, i)];
                }
            }
        }
        sum
    }
}

/// The share of the largest eigenvalue below which [`inverse_sqrt`] keeps a direction out of the
/// part applied in f32: 2⁻⁷ (singular values below s₁/11, whose weights 1/s are large).
pub const SMALL_SHARE: f64 = 1.0 / 128.0;

/// H^{+1/2} = Q diag(λ^{−1/2}) Qᵀ over the eigenvalues above the numerical rank's floor, in two
/// parts: `large`, the directions of λ ≥ [`SMALL_SHARE`]·λ₁ (entries at most 11/s₁ each way:
/// a product with it in f32 keeps f32's accuracy), and `small` = Q_s diag(λ_s^{−1/4}) for the
/// rest, so small·smallᵀ is their part (applied in f64: X·small·smallᵀ). With X a matrix whose
/// Gram matrix is H, X·H^{+1/2} is its polar factor — U Vᵀ of its thin SVD on the numerical
/// rank, a partial isometry, unique even where X has dependent columns.
pub struct InverseSqrt {
    pub large: faer::Mat<f32>,
    pub small: Mat,
    /// The numerical rank: eigenvalues above the floor.
    pub kept: usize,
}

/// [`InverseSqrt`] of H = Q diag(λ) Qᵀ (`e`), over the eigenvalues above `floor`.
pub fn inverse_sqrt(e: &Eigen, floor: f64) -> InverseSqrt {
    let n = e.vectors.nrows();
    let kept = e.values.iter().take_while(|&&l| l > floor).count();
    let top = e.values.first().copied().unwrap_or(0.0);
    let large = e.values[..kept]
        .iter()
        .take_while(|&&l| l >= top * SMALL_SHARE)
        .count();
    // Made in f32, as it is applied: its entries are bounded, and f32's product costs half.
    let scaled = faer::Mat::<f32>::from_fn(n, large, |i, c| {
        (e.vectors[(i, c)] / e.values[c].sqrt()) as f32
    });
    let q = faer::Mat::<f32>::from_fn(n, large, |i, c| e.vectors[(i, c)] as f32);
    InverseSqrt {
        large: &scaled * q.transpose(),
        small: Mat::from_fn(n, kept - large, |i, c| {
            e.vectors[(i, large + c)] / e.values[large + c].sqrt().sqrt()
        }),
        kept,
    }
}

impl InverseSqrt {
    /// The whole H^{+1/2} (large + small·smallᵀ).
    pub fn whole(&self) -> Mat {
        let large = Mat::from_fn(self.large.nrows(), self.large.ncols(), |i, j| {
            f64::from(self.large[(i, j)])
        });
        large + &self.small * self.small.transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sums_are_the_whole_products() {
        let (rows, n) = (37, 5);
        let x: Vec<f64> = (0..rows * n).map(|i| ((i * 13) % 7) as f64 - 3.0).collect();
        let y: Vec<f64> = (0..rows * n).map(|i| ((i * 5) % 9) as f64 - 4.0).collect();
        let mut gram = GramSum::gram(n);
        let mut cross = GramSum::cross(n);
        for (xb, yb) in x.chunks(10 * n).zip(y.chunks(10 * n)) {
            let (xb, yb) = (
                super::super::row_major(xb, n),
                super::super::row_major(yb, n),
            );
            gram.add(xb, xb, Par::Seq);
            cross.add(xb, yb, Par::Seq);
        }
        let (g, c) = (gram.into_sum(), cross.into_sum());
        for i in 0..n {
            for j in 0..n {
                let xx: f64 = (0..rows).map(|r| x[r * n + i] * x[r * n + j]).sum();
                let xy: f64 = (0..rows).map(|r| x[r * n + i] * y[r * n + j]).sum();
                assert_eq!(c[(i, j)], xy);
                assert_eq!(g[(i, j)], if j <= i { xx } else { 0.0 });
            }
        }
    }

    /// X with two equal columns: its Gram matrix has rank 1, and X·H^{+1/2} is the partial
    /// isometry [u/√2, u/√2] — not an arbitrary completion of the null space.
    #[test]
    fn the_polar_factor_of_dependent_columns_is_unique() {
        let x = Mat::from_fn(3, 2, |i, _| [3.0, 0.0, 4.0][i]);
        let h = x.transpose() * &x;
        let e = super::super::symmetric_eigen(h, 1, "h").unwrap();
        let floor = super::super::rank_floor(e.values[0], (3, 2));
        let w = inverse_sqrt(&e, floor);
        assert_eq!(w.kept, 1);
        let p = &x * w.whole();
        let want = [0.6, 0.0, 0.8].map(|u| u / 2f64.sqrt());
        for i in 0..3 {
            for j in 0..2 {
                // Its one direction is a large one, made in f32.
                assert!((p[(i, j)] - want[i]).abs() < 1e-6, "{i} {j}: {}", p[(i, j)]);
            }
        }
    }
}
