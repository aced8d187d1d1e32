//! The dense linear algebra of the spectral methods (SPEC §4c–§4f), one room below the engine:
//! Gram matrices accumulated from a tall matrix's row blocks ([`gram`]), symmetric
//! eigendecompositions ([`eigen`]), the functions of a Gram matrix the methods are made of — its
//! inverse square root on the numerical rank (the right half of a polar factor: P(X) =
//! X·(XᵀX)^{+1/2}) and its top eigenvectors (a matrix's top right singular vectors) — and the
//! Lanczos process for a few singular triplets ([`truncated_svd`]), and the top K triplets
//! whichever way finds them ([`top_k`]: ResMerge's heads, extracted LoRA adapters).
//!
//! Every method works on the short side: an m × n matrix with m ≥ n is taken as m rows of n
//! (its n × n Gram matrix, summed block by block as the rows stream past), a wide one as its
//! transpose. The host's matrices are faer's, in f64; its products are faer's GEMM, whose bits do
//! not depend on the thread count, and its eigendecompositions split their work the same way
//! whatever the thread count ([`eigen::symmetric_eigen`]), so a merge writes the same bytes with
//! any `--threads`.

pub mod eigen;
pub mod gram;
pub mod top_k;
pub mod truncated_svd;

pub use eigen::{symmetric_eigen, Eigen};
pub use gram::{inverse_sqrt, rows_per_block, GramSum};

/// A matrix of the host's linear algebra.
pub type Mat = faer::Mat<f64>;

/// `values`, rows of `cols` row-major, as a matrix.
pub fn row_major(values: &[f64], cols: usize) -> faer::MatRef<'_, f64> {
    faer::MatRef::from_row_major_slice(values, values.len() / cols.max(1), cols)
}

/// The numerical rank's threshold of a Gram matrix XᵀX of a matrix with `rows` rows, `cols`
/// columns and largest eigenvalue `top` (SPEC §4c–§4f): eigenvalues at or below it are not
/// directions of X. X's values are f32 (task vectors), whose rounding alone makes directions of
/// singular values near 2⁻²⁴·s₁ (a LoRA agent's product θ₀ + s·B·A rounded to f32 has them
/// beside its rank); a singular value up to 2⁻²⁰·s₁ (about 10⁻⁶·s₁) is left out — and, where
/// larger, the f64 sums' own rounding, max(rows, cols)·2⁻⁵²·λ₁.
pub fn rank_floor(top: f64, (rows, cols): (usize, usize)) -> f64 {
    let sums = rows.max(cols) as f64 * f64::EPSILON;
    top.max(0.0) * sums.max(2f64.powi(-40))
}
