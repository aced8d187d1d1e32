//! The top K singular triplets of a matrix without its full SVD — all ResMerge needs of an
//! agent's task vector (its rank-K head, SPEC §4f). Golub–Kahan–Lanczos bidiagonalization with
//! full reorthogonalization, on the f32 matrix as it was gathered, in f64: each step multiplies
//! by A and by Aᵀ once (2·m·n multiply-adds) and keeps one more left and right basis vector, so a
//! step costs a read of the matrix and the memory is the matrix plus (m + n) f64 per step. The
//! Ritz triplets of the small bidiagonal B_j (faer's SVD of a j × j matrix) converge to the top
//! triplets of A from the largest down: a triplet is taken once its residual ‖Aᵀu − σv‖ =
//! β_j·|p_j| is at most [`TOLERANCE`]·σ₁. Where the process finds an invariant subspace (β_j ≈
//! 0: a low-rank τ, such as a LoRA agent's, or a repeated singular value) it restarts from a new
//! vector orthogonal to the basis, and stops where A maps that vector to zero. Every sum is taken
//! in a fixed order, so the triplets are the same whatever the thread count.

use crate::simd::multiversion;
use anyhow::{anyhow, Result};
use rayon::prelude::*;

/// One singular triplet: A v = s u, Aᵀ u = s v, ‖u‖ = ‖v‖ = 1.
pub struct Triplet {
    pub s: f64,
    pub u: Vec<f64>,
    pub v: Vec<f64>,
}

/// A triplet is converged when its residual is at most this share of the largest singular value.
const TOLERANCE: f64 = 1e-11;

/// β_j at or below this share of ‖A‖'s estimate ends the Krylov space (an invariant subspace).
const BREAKDOWN: f64 = 1e-12;

/// The Lanczos steps (basis vectors) after which a caller with a full SVD to fall back on stops
/// waiting for the top triplets (singular values so close together that hundreds of steps do not
/// separate them, or a K in the hundreds); past it the Ritz triplets are checked every 64 steps.
pub const MAX_STEPS: usize = 512;

/// Rows of A per parallel work item in Aᵀu: a function of the shape alone, so the partial sums
/// and the order they are added in do not depend on the thread count.
fn row_block(m: usize) -> usize {
    m.div_ceil(256).max(16).next_multiple_of(ROWS)
}

/// Lanes of the fixed-order sums: 16 f64 partial sums, combined in lane order, whatever the
/// instruction set (`multiversion!`), so every build gives the same bits.
const LANES: usize = 16;

/// Rows of A a matvec kernel takes at once: the loads of x (or the stores of Aᵀy) shared by four.
const ROWS: usize = 4;

multiversion! {
    /// Σ_j rows[r][j] · x[j] in f64 for each of [`ROWS`] rows of equal length, each over
    /// [`LANES`] partial sums (the same sums as one row alone).
    fn dot_rows(rows: [&[f32]; ROWS], x: &[f64]) -> [f64; ROWS] {
        let mut lanes = [[0.0f64; LANES]; ROWS];
        let whole = x.len() / LANES * LANES;
        for at in (0..whole).step_by(LANES) {
            let v = &x[at..at + LANES];
            for (row, acc) in rows.iter().zip(lanes.iter_mut()) {
                let r = &row[at..at + LANES];
                for l in 0..LANES {
                    acc[l] += f64::from(r[l]) * v[l];
                }
            }
        }
        let mut out = [0.0f64; ROWS];
        for ((row, acc), o) in rows.iter().zip(&lanes).zip(out.iter_mut()) {
            let mut tail = 0.0;
            for (&r, v) in row[whole..].iter().zip(&x[whole..]) {
                tail += f64::from(r) * v;
            }
            *o = acc.iter().sum::<f64>() + tail;
        }
        out
    }
}

multiversion! {
    /// Σ_j row[j] · x[j] in f64, over [`LANES`] partial sums (a row of a group shorter than
    /// [`ROWS`]).
    fn dot_row(row: &[f32], x: &[f64]) -> f64 {
        let mut lanes = [0.0f64; LANES];
        let mut rows = row.chunks_exact(LANES);
        let mut xs = x.chunks_exact(LANES);
        for (r, v) in (&mut rows).zip(&mut xs) {
            for l in 0..LANES {
                lanes[l] += f64::from(r[l]) * v[l];
            }
        }
        let mut tail = 0.0;
        for (&r, v) in rows.remainder().iter().zip(xs.remainder()) {
            tail += f64::from(r) * v;
        }
        lanes.iter().sum::<f64>() + tail
    }
}

multiversion! {
    /// out[j] += Σ_r c[r] · rows[r][j] in f64, the [`ROWS`] products added left to right first.
    fn add_rows(c: [f64; ROWS], rows: [&[f32]; ROWS], out: &mut [f64]) {
        let [r0, r1, r2, r3] = rows;
        for (j, o) in out.iter_mut().enumerate() {
            *o += c[0] * f64::from(r0[j])
                + c[1] * f64::from(r1[j])
                + c[2] * f64::from(r2[j])
                + c[3] * f64::from(r3[j]);
        }
    }
}

multiversion! {
    /// out[j] += c · row[j] in f64.
    fn add_row(c: f64, row: &[f32], out: &mut [f64]) {
        for (o, &r) in out.iter_mut().zip(row) {
            *o += c * f64::from(r);
        }
    }
}

multiversion! {
    /// Σ_j x[j] · y[j], over [`LANES`] partial sums.
    fn dot(x: &[f64], y: &[f64]) -> f64 {
        let mut lanes = [0.0f64; LANES];
        let mut xs = x.chunks_exact(LANES);
        let mut ys = y.chunks_exact(LANES);
        for (a, b) in (&mut xs).zip(&mut ys) {
            for l in 0..LANES {
                lanes[l] += a[l] * b[l];
            }
        }
        let mut tail = 0.0;
        for (a, b) in xs.remainder().iter().zip(ys.remainder()) {
            tail += a * b;
        }
        lanes.iter().sum::<f64>() + tail
    }
}

multiversion! {
    /// out[j] −= c · x[j].
    fn sub_scaled(c: f64, x: &[f64], out: &mut [f64]) {
        for (o, b) in out.iter_mut().zip(x) {
            *o -= c * b;
        }
    }
}

/// `out = A x` (A: m × n row-major f32), each row's dot product in a fixed order.
fn times(a: &[f32], n: usize, x: &[f64], out: &mut [f64]) {
    out.par_chunks_mut(ROWS)
        .zip(a.par_chunks(ROWS * n))
        .with_min_len(4)
        .for_each(|(o, rows)| match four_rows(rows, n) {
            Some(four) => o.copy_from_slice(&dot_rows(four, x)),
            None => {
                for (o, row) in o.iter_mut().zip(rows.chunks_exact(n)) {
                    *o = dot_row(row, x);
                }
            }
        });
}

/// `rows` (of `n` columns) as [`ROWS`] rows, or `None` where it holds fewer.
fn four_rows(rows: &[f32], n: usize) -> Option<[&[f32]; ROWS]> {
    (rows.len() == ROWS * n).then(|| std::array::from_fn(|r| &rows[r * n..(r + 1) * n]))
}

/// `out = Aᵀ y`: each block of [`row_block`] rows summed into its own partial ([`ROWS`] rows
/// at a time), the partials added in block order.
fn times_transposed(a: &[f32], n: usize, y: &[f64], out: &mut [f64]) {
    let block = row_block(y.len());
    let partials: Vec<Vec<f64>> = a
        .par_chunks(block * n)
        .zip(y.par_chunks(block))
        .map(|(rows, ys)| {
            let mut part = vec![0.0f64; n];
            let mut groups = rows.chunks_exact(ROWS * n).zip(ys.chunks_exact(ROWS));
            for (four, c) in &mut groups {
                let r: Vec<&[f32]> = four.chunks_exact(n).collect();
                add_rows(
                    [c[0], c[1], c[2], c[3]],
                    [r[0], r[1], r[2], r[3]],
                    &mut part,
                );
            }
            let done = ys.len() / ROWS * ROWS;
            for (row, &c) in rows[done * n..].chunks_exact(n).zip(&ys[done..]) {
                add_row(c, row, &mut part);
            }
            part
        })
        .collect();
    out.iter_mut().for_each(|o| *o = 0.0);
    for part in partials {
        out.iter_mut().zip(&part).for_each(|(o, p)| *o += p);
    }
}

fn norm(x: &[f64]) -> f64 {
    dot(x, x).sqrt()
}

/// `x` made orthogonal to the (orthonormal) `basis`: classical Gram–Schmidt twice ("twice is
/// enough"), which keeps the basis orthogonal to rounding.
fn orthogonalize(x: &mut [f64], basis: &[Vec<f64>]) {
    for _ in 0..2 {
        for b in basis {
            sub_scaled(dot(x, b), b, x);
        }
    }
}

/// A deterministic start (or restart) vector of length `len`: a fixed splitmix64 sequence,
/// uniform in [−1, 1).
fn start_vector(state: &mut u64, len: usize) -> Vec<f64> {
    (0..len)
        .map(|_| {
            *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = *state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

/// What the Lanczos process gave: the top triplets, and whether they converged within
/// [`MAX_STEPS`] steps (where not, the Ritz triplets reached, for a caller with no fallback).
pub struct Top {
    pub triplets: Vec<Triplet>,
    pub converged: bool,
}

/// The Lanczos process's state: the left and right bases U and V (one vector per step) and the
/// bidiagonal B_j's α (diagonal) and β (superdiagonal: β[j] couples step j to j + 1, 0 at a
/// restart); the current block begins at step `block_start`.
#[derive(Default)]
struct Basis {
    us: Vec<Vec<f64>>,
    vs: Vec<Vec<f64>>,
    alphas: Vec<f64>,
    betas: Vec<f64>,
    block_start: usize,
}

impl Basis {
    /// The top `k` Ritz triplets with the last step's β, and whether they are done: each
    /// residual at most [`TOLERANCE`]·σ₁, and that of the current block's own top triplet too —
    /// a block begun by a restart may yet rise above the others.
    fn check(&self, beta: f64, k: usize, what: &str) -> Result<(Vec<Triplet>, bool)> {
        let (triplets, residuals) = ritz(self, beta, k, what)?;
        let s1 = triplets.first().map_or(0.0, |t| t.s);
        let top_block = if self.block_start == 0 {
            0.0
        } else {
            ritz_top_residual(self, beta, what)?
        };
        let done = triplets.len() == k
            && residuals.iter().all(|&r| r <= TOLERANCE * s1)
            && top_block <= TOLERANCE * s1.max(f64::MIN_POSITIVE);
        Ok((triplets, done))
    }
}

/// `x / ‖x‖`, or `None` where x = 0.
fn unit(mut x: Vec<f64>) -> Option<Vec<f64>> {
    let nx = norm(&x);
    (nx > 0.0).then(|| {
        x.iter_mut().for_each(|v| *v /= nx);
        x
    })
}

/// The top `k` singular triplets of the m × n row-major matrix `a` (fewer where its rank is
/// below `k`: directions with σ = 0 are left out), largest first, in at most `max_steps` steps
/// (`usize::MAX`: until they converge or the basis spans A, where they are exact). `what` names
/// the matrix in an error.
pub fn top_triplets(
    a: &[f32],
    (m, n): (usize, usize),
    k: usize,
    max_steps: usize,
    what: &str,
) -> Result<Top> {
    let rank_bound = m.min(n);
    let k = k.min(rank_bound);
    // A wide matrix's right basis takes a step more than its left one before both are spent
    // (B_j is then j × (j + 1): the last α is 0).
    let steps = (rank_bound + 1).min(max_steps.max(1));
    let mut seed = 0x5EED_u64;
    let mut basis = Basis::default();
    let mut scale = 0.0f64;
    let mut next = unit(start_vector(&mut seed, n));
    let mut u = vec![0.0f64; m];
    let mut w = vec![0.0f64; n];
    while let Some(v) = next.take() {
        let j = basis.vs.len();
        // u_j = A v_j − β_{j−1} u_{j−1}, orthogonalized against U.
        times(a, n, &v, &mut u);
        if j > basis.block_start {
            sub_scaled(basis.betas[j - 1], &basis.us[j - 1], &mut u);
        }
        orthogonalize(&mut u, &basis.us);
        let alpha = norm(&u);
        scale = scale.max(alpha);
        let vanishes = alpha <= BREAKDOWN * scale;
        if vanishes && j == basis.block_start {
            // A maps a (re)start vector to zero: drawn at random orthogonal to V, that says A
            // vanishes on V's complement (with probability 1), and B's triplets are A's.
            break;
        }
        basis.vs.push(v);
        if vanishes {
            // A v_j lies in the span of U: α_j = 0, and u_j (which no Ritz vector uses) is 0.
            basis.alphas.push(0.0);
            basis.us.push(vec![0.0; m]);
        } else {
            basis.alphas.push(alpha);
            basis.us.push(u.iter().map(|x| x / alpha).collect());
        }
        // v_{j+1} = Aᵀ u_j − α_j v_j, orthogonalized against V.
        times_transposed(a, n, &basis.us[j], &mut w);
        sub_scaled(basis.alphas[j], &basis.vs[j], &mut w);
        orthogonalize(&mut w, &basis.vs);
        let beta = norm(&w);
        scale = scale.max(beta);
        let breakdown = beta <= BREAKDOWN * scale;
        let last = basis.vs.len() == steps;
        // Every step at first, then every 8, past MAX_STEPS every 64 (B's SVD costs j³).
        let period = if j < MAX_STEPS { 8 } else { 64 };
        if breakdown || last || j < 16 || j % period == period - 1 {
            let (triplets, done) = basis.check(beta, k, what)?;
            if (done && !breakdown) || last {
                let converged = done || basis.vs.len() > rank_bound;
                return Ok(Top {
                    triplets,
                    converged,
                });
            }
        }
        if breakdown && basis.vs.len() == n {
            // V spans every row space: nothing is left to restart into.
            break;
        } else if breakdown {
            // Restart from a new vector orthogonal to V, the coupling β 0.
            basis.betas.push(0.0);
            basis.block_start = basis.vs.len();
            let mut v = start_vector(&mut seed, n);
            orthogonalize(&mut v, &basis.vs);
            next = unit(v);
        } else {
            basis.betas.push(beta);
            next = Some(w.iter().map(|x| x / beta).collect());
        }
    }
    // Ended by a start vector A maps to zero, or by a restart with no room left: B's triplets
    // are exact for the space found, and A vanishes outside it.
    let triplets = if basis.alphas.is_empty() {
        Vec::new()
    } else {
        ritz(&basis, 0.0, k, what)?.0
    };
    Ok(Top {
        triplets,
        converged: true,
    })
}

/// The thin SVD of B (α on the diagonal, `betas[i]` at (i, i + 1)), as a dense matrix;
/// `what` names A in an error.
fn bidiagonal_svd(
    alphas: &[f64],
    betas: &[f64],
    what: &str,
) -> Result<faer::linalg::solvers::Svd<f64>> {
    let j = alphas.len();
    faer::Mat::from_fn(j, j, |r, c| {
        if r == c {
            alphas[r]
        } else if c == r + 1 {
            betas[r]
        } else {
            0.0
        }
    })
    .thin_svd()
    .map_err(|e| anyhow!("the SVD of {what}'s bidiagonal did not converge ({e:?})"))
}

/// The top `k` Ritz triplets of B_j (σ > 0) lifted to A — u = U p, v = V q — and each one's
/// residual β_j·|p_j| (`beta` the last step's β).
fn ritz(basis: &Basis, beta: f64, k: usize, what: &str) -> Result<(Vec<Triplet>, Vec<f64>)> {
    let Basis {
        us,
        vs,
        alphas,
        betas,
        ..
    } = basis;
    let j = alphas.len();
    let svd = bidiagonal_svd(alphas, &betas[..j - 1], what)?;
    let (p, s, q) = (svd.U(), svd.S().column_vector(), svd.V());
    let lift = |basis: &[Vec<f64>], coef: &dyn Fn(usize) -> f64| {
        let mut x = vec![0.0f64; basis[0].len()];
        for (i, b) in basis.iter().enumerate() {
            sub_scaled(-coef(i), b, &mut x);
        }
        x
    };
    let mut triplets = Vec::new();
    let mut residuals = Vec::new();
    for c in (0..k.min(j)).filter(|&c| s[c] > 0.0) {
        let u = lift(us, &|i| p[(i, c)]);
        let v = lift(&vs[..j], &|i| q[(i, c)]);
        residuals.push(beta * p[(j - 1, c)].abs());
        triplets.push(Triplet { s: s[c], u, v });
    }
    Ok((triplets, residuals))
}

/// The residual of the top Ritz triplet of the current block (steps `block_start`..j).
fn ritz_top_residual(basis: &Basis, beta: f64, what: &str) -> Result<f64> {
    let (from, j) = (basis.block_start, basis.alphas.len());
    let svd = bidiagonal_svd(&basis.alphas[from..], &basis.betas[from..j - 1], what)?;
    Ok(beta * svd.U()[(j - from - 1, 0)].abs())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic m × n matrix U diag(s) Vᵀ with random orthonormal-ish factors: `s`
    /// gives the singular values (the rest 0).
    fn planted(m: usize, n: usize, s: &[f64], seed: u64) -> Vec<f32> {
        let mut state = seed;
        let mut left: Vec<Vec<f64>> = Vec::new();
        let mut right: Vec<Vec<f64>> = Vec::new();
        for _ in s {
            let mut u = start_vector(&mut state, m);
            orthogonalize(&mut u, &left);
            let nu = norm(&u);
            left.push(u.iter().map(|x| x / nu).collect());
            let mut v = start_vector(&mut state, n);
            orthogonalize(&mut v, &right);
            let nv = norm(&v);
            right.push(v.iter().map(|x| x / nv).collect());
        }
        let mut a = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let x: f64 = (0..s.len()).map(|c| s[c] * left[c][i] * right[c][j]).sum();
                a[i * n + j] = x as f32;
            }
        }
        a
    }

    /// The top `k` triplets by faer's full thin SVD.
    fn by_full_svd(a: &[f32], (m, n): (usize, usize), k: usize) -> Vec<Triplet> {
        let mat = faer::Mat::from_fn(m, n, |i, j| f64::from(a[i * n + j]));
        let svd = mat.thin_svd().unwrap();
        (0..k)
            .map(|c| Triplet {
                s: svd.S().column_vector()[c],
                u: (0..m).map(|i| svd.U()[(i, c)]).collect(),
                v: (0..n).map(|j| svd.V()[(j, c)]).collect(),
            })
            .collect()
    }

    /// Σ_c s_c u_c v_cᵀ, which does not depend on the signs an SVD picks.
    fn head(t: &[Triplet], m: usize, n: usize) -> Vec<f64> {
        let mut h = vec![0.0; m * n];
        for x in t {
            for i in 0..m {
                for j in 0..n {
                    h[i * n + j] += x.s * x.u[i] * x.v[j];
                }
            }
        }
        h
    }

    fn check(a: &[f32], (m, n): (usize, usize), k: usize, tol: f64) -> Top {
        let top = top_triplets(a, (m, n), k, MAX_STEPS, "a test matrix").unwrap();
        let want = by_full_svd(a, (m, n), k);
        let s1 = want[0].s;
        for (g, w) in top.triplets.iter().zip(&want) {
            assert!((g.s - w.s).abs() <= tol * s1, "σ {} vs {}", g.s, w.s);
        }
        let (hg, hw) = (head(&top.triplets, m, n), head(&want, m, n));
        let err = hg
            .iter()
            .zip(&hw)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        assert!(err <= tol * s1, "head differs by {err} (σ₁ {s1})");
        top
    }

    #[test]
    fn top_triplets_match_a_full_svd() {
        // A decaying spectrum, and noise (top values close together), tall and wide.
        let decaying: Vec<f64> = (0..60).map(|i| 10.0 * 0.8f64.powi(i)).collect();
        for (m, n) in [(120, 300), (300, 120)] {
            let a = planted(m, n, &decaying, 7);
            for k in [1, 3] {
                assert!(check(&a, (m, n), k, 1e-9).converged);
            }
        }
        let mut state = 11u64;
        let noise: Vec<f32> = start_vector(&mut state, 200 * 260)
            .iter()
            .map(|&x| x as f32)
            .collect();
        assert!(check(&noise, (200, 260), 2, 1e-8).converged);
        // Small matrices, where the process runs out of room (j = min(m, n)).
        for (m, n) in [(12, 20), (20, 10), (8, 8), (2, 2), (3, 5)] {
            let a: Vec<f32> = start_vector(&mut state, m * n)
                .iter()
                .map(|&x| x as f32)
                .collect();
            for k in [1, 2] {
                check(&a, (m, n), k, 1e-9);
            }
        }
    }

    /// An m × n matrix Σ_c s_c x_c y_cᵀ with small whole x, y and s: exact in f32, so its rank
    /// is exactly `s.len()`.
    fn exact_low_rank(m: usize, n: usize, s: &[f32]) -> Vec<f32> {
        let x = |c: usize, i: usize| ((i * (c + 3) + c) % 5) as f32 - 2.0;
        let y = |c: usize, j: usize| ((j * (2 * c + 1) + 1) % 4) as f32 - 1.5;
        let mut a = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                a[i * n + j] = (0..s.len()).map(|c| s[c] * x(c, i) * y(c, j)).sum();
            }
        }
        a
    }

    /// Without a step bound, a K of a third of the rank on a flat spectrum converges or spans
    /// the matrix: the head is the full SVD's.
    #[test]
    fn an_unbounded_run_reaches_any_k() {
        let mut state = 17u64;
        let (m, n) = (70, 90);
        let a: Vec<f32> = start_vector(&mut state, m * n)
            .iter()
            .map(|&x| x as f32)
            .collect();
        let top = top_triplets(&a, (m, n), 25, usize::MAX, "a test matrix").unwrap();
        assert!(top.converged);
        assert_eq!(top.triplets.len(), 25);
        let (got, want) = (
            head(&top.triplets, m, n),
            head(&by_full_svd(&a, (m, n), 25), m, n),
        );
        let err = got
            .iter()
            .zip(&want)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        assert!(err < 1e-9, "head differs by {err}");
    }

    #[test]
    fn low_rank_and_repeated_values_restart() {
        // Rank 3 below k = 5: three triplets, exact.
        let a = exact_low_rank(80, 50, &[4.0, 2.0, 1.0]);
        let top = check(&a, (80, 50), 3, 1e-9);
        assert_eq!(top.triplets.len(), 3);
        let five = top_triplets(&a, (80, 50), 5, MAX_STEPS, "a test matrix").unwrap();
        assert_eq!(five.triplets.len(), 3, "σ = 0 directions are left out");
        assert!(five.converged);
        // Singular values repeated exactly (a scattered diagonal): one Krylov space holds one
        // copy of each; the restarts find the others.
        let (m, n) = (70, 90);
        let mut b = vec![0.0f32; m * n];
        let values = [3.0, 1.0, 3.0, 0.5, 3.0, 1.0, 0.25];
        for (c, &d) in values.iter().enumerate() {
            let (i, j) = ((c * 37) % m, (c * 53 + 11) % n);
            b[i * n + j] = d;
        }
        check(&b, (m, n), 3, 1e-9);
        // (The fourth is one of two σ = 1 directions: any is right, so only its value is.)
        let top = top_triplets(&b, (m, n), 4, MAX_STEPS, "a test matrix").unwrap();
        let s: Vec<f64> = top.triplets.iter().map(|t| t.s).collect();
        assert_eq!(s.len(), 4);
        for (g, w) in s.iter().zip([3.0, 3.0, 3.0, 1.0]) {
            assert!((g - w).abs() < 1e-12, "{s:?}");
        }
        // The zero matrix: no triplet.
        let zero = vec![0.0f32; 12 * 9];
        assert!(top_triplets(&zero, (12, 9), 1, MAX_STEPS, "zero")
            .unwrap()
            .triplets
            .is_empty());
    }

    #[test]
    fn the_triplets_do_not_depend_on_the_thread_count() {
        let a = planted(333, 129, &[5.0, 4.0, 3.0, 2.5, 2.0, 1.0], 9);
        let run = |threads| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| top_triplets(&a, (333, 129), 2, MAX_STEPS, "a").unwrap())
        };
        let (one, four) = (run(1), run(4));
        for (x, y) in one.triplets.iter().zip(&four.triplets) {
            assert_eq!(x.s.to_bits(), y.s.to_bits());
            assert!(x
                .u
                .iter()
                .zip(&y.u)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}
