//! The top K singular triplets of a matrix, never its full SVD: ResMerge's heads (SPEC §4f) and
//! the factors of an extracted LoRA adapter (`crate::extract_lora`). For K up to
//! [`LANCZOS_MAX_K`] the Lanczos process of [`super::truncated_svd`] finds them to a residual of
//! 10⁻¹¹ σ₁; a larger K, or triplets it does not converge on in `max_steps` steps (top values
//! too close together), come from the matrix's Gram matrix on its short side — one
//! eigendecomposition, whatever K. Every step's sums have a fixed order, so the factors are the
//! same whatever the thread count.

use super::truncated_svd::top_triplets;
use super::{rank_floor, row_major, symmetric_eigen};
use anyhow::Result;

/// The most triplets asked of the Lanczos process; more come from the Gram matrix.
pub const LANCZOS_MAX_K: usize = 32;

/// The top triplets of an m × n matrix A as factors: the singular values s_k, the columns
/// s_k·u_k (m) and v_k (n), largest first — A's rank-K part is Σ_k (s_k u_k) v_kᵀ.
#[derive(Debug, Default)]
pub struct TopK {
    pub s: Vec<f64>,
    pub su: Vec<Vec<f64>>,
    pub v: Vec<Vec<f64>>,
}

/// The top `k` triplets of the row-major m × n matrix `a` (fewer where its numerical rank is
/// lower; none where it is 0), the Lanczos process given `max_steps`; `what` names it in errors.
pub fn top_k(
    a: &[f32],
    (m, n): (usize, usize),
    k: usize,
    max_steps: usize,
    what: &str,
) -> Result<TopK> {
    if a.iter().all(|&x| x == 0.0) {
        return Ok(TopK::default());
    }
    if k <= LANCZOS_MAX_K {
        let top = top_triplets(a, (m, n), k, max_steps, what)?;
        if top.converged {
            let mut out = TopK::default();
            for x in top.triplets {
                out.su.push(x.u.iter().map(|u| u * x.s).collect());
                out.s.push(x.s);
                out.v.push(x.v);
            }
            return Ok(out);
        }
    }
    by_gram(a, (m, n), k, what)
}

/// `a`'s top K triplets from its Gram matrix on the short side (AᵀA, or AAᵀ for a wide A), in
/// f64: its top eigenvectors are the singular vectors of that side, λ = s², and the other side's
/// are A v / s (or Aᵀu / s). Directions at or below the numerical rank's floor are left out.
fn by_gram(a: &[f32], (m, n): (usize, usize), k: usize, what: &str) -> Result<TopK> {
    let values: Vec<f64> = a.iter().map(|&x| f64::from(x)).collect();
    let x = row_major(&values, n);
    let wide = m < n;
    let gram = match wide {
        true => x * x.transpose(),
        false => x.transpose() * x,
    };
    let e = symmetric_eigen(
        gram,
        rayon::current_num_threads(),
        &format!("the Gram matrix of {what}"),
    )?;
    let floor = rank_floor(e.values[0], (m, n));
    let kept = e.values.iter().take(k).take_while(|&&l| l > floor).count();
    let mut out = TopK::default();
    for c in 0..kept {
        let side = e.vectors.col(c);
        let other = match wide {
            true => x.transpose() * side,
            false => x * side,
        };
        let s = e.values[c].sqrt();
        let (su, v): (Vec<f64>, Vec<f64>) = match wide {
            true => (
                side.iter().map(|u| u * s).collect(),
                other.iter().map(|y| y / s).collect(),
            ),
            false => (
                other.iter().copied().collect(),
                side.iter().copied().collect(),
            ),
        };
        out.s.push(s);
        out.su.push(su);
        out.v.push(v);
    }
    Ok(out)
}
