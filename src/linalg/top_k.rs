//! The top K singular triplets of a matrix, never its full SVD: ResMerge's heads (SPEC §4f) and
//! the factors of an extracted LoRA adapter (`crate::extract_lora`). Where [`gram_is_cheaper`]
//! says no, the Lanczos process of [`super::truncated_svd`] finds them to a residual of
//! 10⁻¹¹ σ₁; a larger K, a long thin matrix, or triplets the process does not converge on in
//! `max_steps` steps (top values too close together), come from the matrix's Gram matrix on its
//! short side — one eigendecomposition, whatever K. Every step's sums have a fixed order, so the
//! factors are the same whatever the thread count.

use super::truncated_svd::top_triplets;
use super::{rank_floor, row_major, rows_per_block, symmetric_eigen, GramSum, Mat};
use anyhow::Result;
use faer::linalg::matmul::matmul;
use faer::{Accum, Par};

/// The most triplets asked of the Lanczos process; more come from the Gram matrix.
pub const LANCZOS_MAX_K: usize = 32;

/// Whether the top `k` triplets of an m × n matrix come from its Gram matrix rather than the
/// Lanczos process: for a `k` over [`LANCZOS_MAX_K`], and from 8 triplets on for a matrix whose
/// long side is at least 4 times its short side. The Lanczos process passes over the matrix once
/// a step, and an agent's update (a flat spectrum) takes many steps, more for a larger `k`; the
/// Gram path costs the short side cubed (its eigendecomposition) and the long side times the short
/// side squared, whatever `k`. Measured on RL-like updates (2 cores, one matrix, Lanczos against
/// Gram): 18944 × 3584 at k = 8, 16, 32: 11.3, 13.2, 24 s against 10.1 s; 11008 × 4096 at
/// 8, 16, 32: 5.1, 7.0, 12.8 s against 9.8–10.6 s; 4096 × 4096 at 32: 4.8 s against 7.9 s;
/// 152064 × 3584 at 32: 254 s against 40 s (docs/lora.md).
pub fn gram_is_cheaper((m, n): (usize, usize), k: usize) -> bool {
    k > LANCZOS_MAX_K || (k >= 8 && m.max(n) >= 4 * m.min(n))
}

/// The top triplets of an m × n matrix A as factors: the singular values s_k, the columns
/// s_k·u_k (m) and v_k (n), largest first — A's rank-K part is Σ_k (s_k u_k) v_kᵀ.
#[derive(Debug, Default)]
pub struct TopK {
    pub s: Vec<f64>,
    pub su: Vec<Vec<f64>>,
    pub v: Vec<Vec<f64>>,
}

/// The top `k` triplets of the row-major m × n matrix `a` (fewer where its numerical rank is
/// lower; none where it is 0), the Lanczos process (where [`gram_is_cheaper`] says no) given
/// `max_steps`; `what` names it in errors.
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
    if !gram_is_cheaper((m, n), k) {
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

/// `a`'s top K triplets from its Gram matrix on the short side ([`top_k_by_gram`]), its elements
/// read from `a`.
fn by_gram(a: &[f32], (m, n): (usize, usize), k: usize, what: &str) -> Result<TopK> {
    top_k_by_gram((m, n), k, what, |start, len, out| {
        out.clear();
        out.extend_from_slice(&a[start..start + len]);
        Ok(())
    })
}

/// The top `k` triplets of an m × n matrix A from its Gram matrix on the short side (AᵀA, or AAᵀ
/// for a wide A), in f64: its top eigenvectors are the singular vectors of that side, λ = s²,
/// and the other side's are A v / s (or Aᵀu / s). Directions at or below the numerical rank's
/// floor are left out. The short side is the columns of a tall T (A, or Aᵀ for a wide A), whose
/// rows stream past in blocks of a fixed size ([`rows_per_block`]) twice — summed into the Gram
/// matrix, then multiplied by the kept eigenvectors. `read(start, len, out)` puts elements
/// `start..start + len` of the row-major A into `out`: a tall A's blocks are runs of its rows, a
/// wide A's are gathered from each row's run of columns, never a copy of Aᵀ. So A need not be
/// held at all — `read` may take it from files (an extracted adapter's updates) — and besides the
/// Gram matrix only a block and the k factors are.
pub fn top_k_by_gram(
    (m, n): (usize, usize),
    k: usize,
    what: &str,
    mut read: impl FnMut(usize, usize, &mut Vec<f32>) -> Result<()>,
) -> Result<TopK> {
    let wide = m < n;
    let (rows_of_t, cols) = match wide {
        true => (n, m),
        false => (m, n),
    };
    let mut span = Vec::new();
    // Rows `first..first + count` of T into `block`, row-major, in f64.
    let mut rows = |first: usize, count: usize, block: &mut Vec<f64>| -> Result<()> {
        block.clear();
        match wide {
            false => {
                read(first * n, count * n, &mut span)?;
                block.extend(span.iter().map(|&x| f64::from(x)));
            }
            true => {
                block.resize(count * m, 0.0);
                for i in 0..m {
                    read(i * n + first, count, &mut span)?;
                    for (j, &x) in span.iter().enumerate() {
                        block[j * m + i] = f64::from(x);
                    }
                }
            }
        }
        Ok(())
    };
    let threads = rayon::current_num_threads();
    let par = Par::rayon(threads);
    let per_block = rows_per_block(cols);
    let starts = || (0..rows_of_t).step_by(per_block);
    let mut block: Vec<f64> = Vec::new();
    let mut gram = GramSum::gram(cols);
    for first in starts() {
        crate::cancel::current().check()?;
        rows(first, per_block.min(rows_of_t - first), &mut block)?;
        let x = row_major(&block, cols);
        gram.add(x, x, par);
    }
    let e = symmetric_eigen(
        gram.into_sum(),
        threads,
        &format!("the Gram matrix of {what}"),
    )?;
    let floor = rank_floor(e.values[0], (m, n));
    let kept = e.values.iter().take(k).take_while(|&&l| l > floor).count();
    // T·V_k, block by block: rows × kept.
    let sides = e.vectors.subcols(0, kept);
    let mut others = vec![vec![0.0f64; rows_of_t]; kept];
    let mut product = Mat::zeros(0, 0);
    for first in starts() {
        crate::cancel::current().check()?;
        rows(first, per_block.min(rows_of_t - first), &mut block)?;
        let x = row_major(&block, cols);
        product.resize_with(x.nrows(), kept, |_, _| 0.0);
        matmul(product.as_mut(), Accum::Replace, x, sides, 1.0, par);
        for (c, other) in others.iter_mut().enumerate() {
            for i in 0..x.nrows() {
                other[first + i] = product[(i, c)];
            }
        }
    }
    let mut out = TopK::default();
    for (c, other) in others.into_iter().enumerate() {
        let side = e.vectors.col(c);
        let s = e.values[c].sqrt();
        // A tall A: side = v, T·v = A·v = s·u. A wide one: side = u, T·u = Aᵀu = s·v.
        let (su, v): (Vec<f64>, Vec<f64>) = match wide {
            true => (
                side.iter().map(|u| u * s).collect(),
                other.iter().map(|y| y / s).collect(),
            ),
            false => (other, side.iter().copied().collect()),
        };
        out.s.push(s);
        out.su.push(su);
        out.v.push(v);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_thin_matrices_and_large_ranks_take_the_gram_path() {
        assert!(!gram_is_cheaper((4096, 4096), 32));
        assert!(!gram_is_cheaper((11008, 4096), 32));
        assert!(!gram_is_cheaper((18944, 3584), 4));
        assert!(gram_is_cheaper((18944, 3584), 8));
        assert!(gram_is_cheaper((3584, 18944), 8));
        assert!(gram_is_cheaper((4096, 4096), 33));
    }

    /// Σ_k (s_k u_k) v_kᵀ of `top`, m × n.
    fn head(top: &TopK, (m, n): (usize, usize)) -> Vec<f64> {
        let mut h = vec![0.0; m * n];
        for (su, v) in top.su.iter().zip(&top.v) {
            for i in 0..m {
                for j in 0..n {
                    h[i * n + j] += su[i] * v[j];
                }
            }
        }
        h
    }

    /// The Gram path, tall and wide (a wide matrix's columns gathered), gives the top triplets
    /// of faer's full SVD, and the Lanczos process the same head.
    #[test]
    fn the_gram_path_matches_a_full_svd_tall_and_wide() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f64 / (1u64 << 24) as f64 - 0.5) as f32
        };
        let (long, short, k) = (300, 60, 8);
        let tall: Vec<f32> = (0..long * short).map(|_| next()).collect();
        let wide: Vec<f32> = (0..short * long)
            .map(|e| tall[(e % long) * short + e / long])
            .collect();
        for (a, (m, n)) in [(&tall, (long, short)), (&wide, (short, long))] {
            assert!(gram_is_cheaper((m, n), k));
            let top = top_k(a, (m, n), k, 512, "a test matrix").unwrap();
            let mat = faer::Mat::from_fn(m, n, |i, j| f64::from(a[i * n + j]));
            let svd = mat.thin_svd().unwrap();
            let s = svd.S().column_vector();
            for (c, got) in top.s.iter().enumerate() {
                assert!(
                    (got - s[c]).abs() <= 1e-10 * s[0],
                    "σ{c}: {got} vs {}",
                    s[c]
                );
            }
            let want = TopK {
                s: (0..k).map(|c| s[c]).collect(),
                su: (0..k)
                    .map(|c| (0..m).map(|i| svd.U()[(i, c)] * s[c]).collect())
                    .collect(),
                v: (0..k)
                    .map(|c| (0..n).map(|j| svd.V()[(j, c)]).collect())
                    .collect(),
            };
            let lanczos = top_triplets(a, (m, n), k, 512, "a test matrix").unwrap();
            assert!(lanczos.converged);
            let lanczos = TopK {
                s: lanczos.triplets.iter().map(|x| x.s).collect(),
                su: lanczos
                    .triplets
                    .iter()
                    .map(|x| x.u.iter().map(|u| u * x.s).collect())
                    .collect(),
                v: lanczos.triplets.into_iter().map(|x| x.v).collect(),
            };
            let (h, w, l) = (
                head(&top, (m, n)),
                head(&want, (m, n)),
                head(&lanczos, (m, n)),
            );
            for (x, (y, z)) in h.iter().zip(w.iter().zip(&l)) {
                assert!((x - y).abs() <= 1e-9 * s[0] && (x - z).abs() <= 1e-9 * s[0]);
            }
        }
    }
}
