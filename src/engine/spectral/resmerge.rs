//! ResMerge's matrices (SPEC §4f, arXiv:2606.02252): each agent's task vector split into a
//! rank-K SVD head and a residual; the residuals merged into a backbone along their consensus
//! direction on the Frobenius sphere, the heads' mean added back, scaled by how well the heads
//! agree. A head is the top K singular triplets of τ, found by the Lanczos process of
//! `linalg::truncated_svd`, or — for a K in the dozens, or triplets it does not separate — from
//! the eigendecomposition of τ's Gram matrix on its short side, never a full SVD. The residuals' Gram matrix and the update are made block by
//! block, the residuals formed from τ and the heads' factors on the fly, so no agent's head or
//! residual is held whole: the T task vectors are gathered by one scan where they fit in
//! [`GATHER_BYTES`] (the heads then found in parallel), else one at a time, the residuals read
//! again by scans. The update is added to the base tile by tile, so every backend writes the
//! same bytes.

use super::refuse_nonfinite;
use crate::engine::scans::gather_taus;
use crate::linalg::top_k::top_k;
use crate::linalg::truncated_svd::MAX_STEPS;
use crate::scans::Scans;
use anyhow::Result;
use rayon::prelude::*;
use std::ops::ControlFlow;

/// ResMerge's parameters for one matrix (SPEC §4f).
pub(super) struct ResMergeParams {
    /// K: the singular directions of each agent's head.
    pub rank: usize,
    /// β where the residuals agree fully.
    pub beta_min: f64,
    /// β where they do not.
    pub beta_max: f64,
    /// ρ: the head correction's norm as a share of the backbone's.
    pub head_ratio: f64,
    /// The matrix is an attention or MLP projection (its residuals' agreement lowers β).
    pub family: bool,
}

/// One agent's head H = Σ_k s_k u_k v_kᵀ as its factors: columns s_k·u_k (m) and v_k (n).
struct Head {
    us: Vec<Vec<f64>>,
    vs: Vec<Vec<f64>>,
}

/// ResMerge's ε: norms at or below it count as zero, and it keeps quotients finite.
const RES_EPS: f64 = 1e-8;

/// `x` clamped to [0, 1].
fn clamp01(x: f64) -> f64 {
    x.clamp(0.0, 1.0)
}

/// ResMerge's update of an m × n matrix of `agents` agents, row-major (SPEC §4f): each agent's
/// τ = H + R, H the top-K singular triplets; the residual backbone A = Σ_t w_t R_t (the
/// residuals' consensus direction on the sphere with norm c^β · mean ‖R‖, or their mean); the
/// head correction C = ρ · S_H · ‖A‖ · H̄ / ‖H̄‖. Every inner product is taken from the Gram
/// matrices of the residuals and of the heads' factors, so no agent's H or R is held whole.
///
/// Where the T task vectors fit in [`GATHER_BYTES`] they are gathered by one scan and the heads
/// found in parallel; otherwise one agent's τ is gathered at a time and the residuals are read
/// again by two more scans. Both go through the same [`BLOCK`]s, so they give the same bits.
pub(super) fn update(
    scan: &mut dyn Scans,
    matrix: (usize, usize),
    agents: usize,
    params: &ResMergeParams,
) -> Result<Vec<f32>> {
    update_gathering(scan, matrix, agents, params, GATHER_BYTES)
}

/// [`update`], gathering the T task vectors at once where they take at most `gather_bytes`.
fn update_gathering(
    scan: &mut dyn Scans,
    (m, n): (usize, usize),
    agents: usize,
    params: &ResMergeParams,
    gather_bytes: usize,
) -> Result<Vec<f32>> {
    let matrix = (m, n);
    let mut update = vec![0.0f32; m * n];
    if agents * m * n * 4 <= gather_bytes {
        let taus = gather_taus(scan, m * n)?;
        for (t, tau) in taus.iter().enumerate() {
            refuse_nonfinite("resmerge", t, (0, n), tau)?;
        }
        let heads = taus
            .par_iter()
            .enumerate()
            .map(|(t, tau)| head(tau, matrix, params.rank, t, MAX_STEPS))
            .collect::<Result<Vec<Head>>>()?;
        let block = |b: usize| -> Vec<&[f32]> {
            let range = b * BLOCK..((b + 1) * BLOCK).min(m * n);
            taus.iter().map(|tau| &tau[range.clone()]).collect()
        };
        let parts: Vec<Vec<f64>> = (0..(m * n).div_ceil(BLOCK))
            .into_par_iter()
            .map(|b| block_gram(b * BLOCK, &block(b), &heads, n))
            .collect();
        let mix = Mix::of(&heads, &gram_of(parts, agents), params);
        update
            .par_chunks_mut(BLOCK)
            .enumerate()
            .for_each(|(b, out)| mix.block_update(b * BLOCK, &block(b), &heads, n, out));
    } else {
        let mut heads: Vec<Head> = Vec::with_capacity(agents);
        let mut tau = vec![0.0f32; m * n];
        for t in 0..agents {
            gather_agent(scan, t, &mut tau)?;
            refuse_nonfinite("resmerge", t, (0, n), &tau)?;
            heads.push(head(&tau, matrix, params.rank, t, MAX_STEPS)?);
        }
        drop(tau);
        let mut parts = Vec::new();
        scan_blocks(scan, agents, &mut |start, taus| {
            parts.push(block_gram(start, taus, &heads, n));
        })?;
        let mix = Mix::of(&heads, &gram_of(parts, agents), params);
        scan_blocks(scan, agents, &mut |start, taus| {
            let out = &mut update[start..start + taus[0].len()];
            mix.block_update(start, taus, &heads, n, out);
        })?;
    }
    Ok(update)
}

/// The most bytes of task vectors a matrix's update gathers at once (T · m · n · 4): above it,
/// one agent's τ at a time.
const GATHER_BYTES: usize = 1 << 30;

/// Elements of a block: the unit the residuals' Gram sums and the update are made in, whatever
/// the tiles a scan reads (each block's sums in a fixed order, the blocks' added in order).
const BLOCK: usize = 1 << 14;

/// Hands `visit` each [`BLOCK`] of the matrix in order — its first element and every agent's τ
/// over it — assembled from a scan's tiles.
fn scan_blocks(
    scan: &mut dyn Scans,
    agents: usize,
    visit: &mut dyn FnMut(usize, &[&[f32]]),
) -> Result<()> {
    let mut blocks: Vec<Vec<f32>> = vec![Vec::with_capacity(BLOCK); agents];
    let mut start = 0;
    let mut flush = |blocks: &mut Vec<Vec<f32>>, start: &mut usize| {
        let refs: Vec<&[f32]> = blocks.iter().map(Vec::as_slice).collect();
        visit(*start, &refs);
        *start += blocks[0].len();
        blocks.iter_mut().for_each(Vec::clear);
    };
    scan.tiles(&mut |tile| {
        let len = tile.tau[0].len();
        let mut at = 0;
        while at < len {
            let take = (BLOCK - blocks[0].len()).min(len - at);
            for (block, tau) in blocks.iter_mut().zip(tile.tau) {
                block.extend_from_slice(&tau[at..at + take]);
            }
            at += take;
            if blocks[0].len() == BLOCK {
                flush(&mut blocks, &mut start);
            }
        }
        Ok(ControlFlow::Continue(()))
    })?;
    if !blocks[0].is_empty() {
        flush(&mut blocks, &mut start);
    }
    Ok(())
}

/// Lanes of a block's dot products: [`LANES`] partial sums, added in lane order.
const LANES: usize = 8;

/// One block's Σ R_a·R_b for the pairs a ≤ b, at `a · T + b`.
fn block_gram(start: usize, taus: &[&[f32]], heads: &[Head], n: usize) -> Vec<f64> {
    let agents = taus.len();
    let rows = residuals(start, taus, heads, n);
    let mut gram = vec![0.0f64; agents * agents];
    for a in 0..agents {
        for b in a..agents {
            let mut lanes = [0.0f64; LANES];
            let (x, y) = (rows[a].chunks_exact(LANES), rows[b].chunks_exact(LANES));
            let tail: f64 = x
                .remainder()
                .iter()
                .zip(y.remainder())
                .map(|(p, q)| p * q)
                .sum();
            for (p, q) in x.zip(y) {
                for l in 0..LANES {
                    lanes[l] += p[l] * q[l];
                }
            }
            gram[a * agents + b] = lanes.iter().sum::<f64>() + tail;
        }
    }
    gram
}

/// The residuals' Gram matrix: the blocks' sums added in block order, made symmetric.
fn gram_of(parts: Vec<Vec<f64>>, agents: usize) -> Vec<f64> {
    let mut gram = vec![0.0f64; agents * agents];
    for part in parts {
        gram.iter_mut().zip(&part).for_each(|(g, p)| *g += p);
    }
    for a in 0..agents {
        for b in 0..a {
            gram[a * agents + b] = gram[b * agents + a];
        }
    }
    gram
}

/// How the update mixes the residuals and the heads: A + C = Σ_t w_t R_t + (c_h / T) Σ_t H_t.
struct Mix {
    weights: Vec<f64>,
    /// c_h / T.
    head_coef: f64,
}

impl Mix {
    /// The backbone's weights and the head correction from the residuals' Gram matrix.
    fn of(heads: &[Head], gram: &[f64], params: &ResMergeParams) -> Mix {
        let agents = heads.len();
        let weights = backbone_weights(gram, agents, params);
        let backbone_norm = (0..agents)
            .flat_map(|a| (0..agents).map(move |b| (a, b)))
            .map(|(a, b)| weights[a] * weights[b] * gram[a * agents + b])
            .sum::<f64>()
            .max(0.0)
            .sqrt();
        let c_h = head_correction(heads, agents, params.head_ratio, backbone_norm);
        Mix {
            weights,
            head_coef: c_h / agents as f64,
        }
    }

    /// The update over one block into `out`, each element rounded to f32 once.
    fn block_update(
        &self,
        start: usize,
        taus: &[&[f32]],
        heads: &[Head],
        n: usize,
        out: &mut [f32],
    ) {
        let rows = residuals(start, taus, heads, n);
        let mut sum = vec![0.0f64; out.len()];
        for (t, row) in rows.iter().enumerate() {
            let w = self.weights[t];
            sum.iter_mut().zip(row).for_each(|(s, r)| *s += w * r);
            add_head(&heads[t], self.head_coef, (start, n), &mut sum);
        }
        for (o, s) in out.iter_mut().zip(&sum) {
            *o = *s as f32;
        }
    }
}

/// Agent `t`'s τ of the matrix, whole, into `tau`, from a scan of its tiles.
fn gather_agent(scan: &mut dyn Scans, t: usize, tau: &mut [f32]) -> Result<()> {
    scan.tiles(&mut |tile| {
        let start = tile.start as usize;
        let values = &tile.tau[t];
        tau[start..start + values.len()].copy_from_slice(values);
        Ok(ControlFlow::Continue(()))
    })
}

/// Agent `t`'s head (SPEC §4f): the top K singular triplets of τ as `linalg::top_k` finds them,
/// none where τ = 0.
fn head(tau: &[f32], (m, n): (usize, usize), k: usize, t: usize, max_steps: usize) -> Result<Head> {
    let what = format!("model {}'s task vector", t + 1);
    let top = top_k(tau, (m, n), k, max_steps, &what)?;
    Ok(Head {
        us: top.su,
        vs: top.v,
    })
}

/// `values[e]` += coef · H[e] for the elements from tensor index `start` of a matrix of `n`
/// columns, H = Σ_k (s_k·u_k) v_kᵀ from `head`'s factors: each row's run as (coef · s·u[i]) · v.
fn add_head(head: &Head, coef: f64, (start, n): (usize, usize), values: &mut [f64]) {
    for (u, v) in head.us.iter().zip(&head.vs) {
        let mut at = 0;
        while at < values.len() {
            let (i, j) = ((start + at) / n, (start + at) % n);
            let run = (n - j).min(values.len() - at);
            let c = coef * u[i];
            values[at..at + run]
                .iter_mut()
                .zip(&v[j..j + run])
                .for_each(|(x, v)| *x += c * v);
            at += run;
        }
    }
}

/// Each agent's residual R_t = τ_t − H_t over the elements from tensor index `start` (`taus`),
/// in f64.
fn residuals(start: usize, taus: &[&[f32]], heads: &[Head], n: usize) -> Vec<Vec<f64>> {
    taus.iter()
        .zip(heads)
        .map(|(tau, head)| {
            let mut row: Vec<f64> = tau.iter().map(|&x| f64::from(x)).collect();
            // τ − H: −1 · u is −u exactly, and r + (−u)·v is r − u·v.
            add_head(head, -1.0, (start, n), &mut row);
            row
        })
        .collect()
}

/// The weights w_t of the residual backbone A = Σ_t w_t R_t (SPEC §4f), from the residuals'
/// Gram matrix: the consensus direction q_src scaled to c^β · mean ‖R_t‖, or the mean (1/T each)
/// where the residuals cancel or agree no better than chance (c ≤ 1/√T); zero when every
/// residual is.
fn backbone_weights(gram: &[f64], agents: usize, params: &ResMergeParams) -> Vec<f64> {
    let t = agents as f64;
    let norms: Vec<f64> = (0..agents)
        .map(|a| gram[a * agents + a].max(0.0).sqrt())
        .collect();
    if norms.iter().all(|&x| x <= RES_EPS) {
        return vec![0.0; agents];
    }
    let mean = vec![1.0 / t; agents];
    // ⟨q_a, q_b⟩ with q = R / (‖R‖ + ε), and ‖q_a‖.
    let qq =
        |a: usize, b: usize| gram[a * agents + b] / ((norms[a] + RES_EPS) * (norms[b] + RES_EPS));
    let q_norm = |a: usize| norms[a] / (norms[a] + RES_EPS);
    let cos = |a: usize, b: usize| qq(a, b) / (q_norm(a) * q_norm(b) + RES_EPS);
    let pairs: Vec<f64> = (0..agents)
        .flat_map(|a| (a + 1..agents).map(move |b| (a, b)))
        .map(|(a, b)| cos(a, b))
        .collect();
    let pair_mean = if pairs.is_empty() {
        1.0
    } else {
        pairs.iter().sum::<f64>() / pairs.len() as f64
    };
    let sum_norm = (0..agents)
        .flat_map(|a| (0..agents).map(move |b| (a, b)))
        .map(|(a, b)| qq(a, b))
        .sum::<f64>()
        .max(0.0)
        .sqrt();
    if sum_norm <= RES_EPS {
        return mean;
    }
    // q_src = Σ q / (‖Σ q‖ + ε); each q_t's cosine with it.
    let src_norm = sum_norm / (sum_norm + RES_EPS);
    let coherence = clamp01(
        (0..agents)
            .map(|a| {
                let dot = (0..agents).map(|b| qq(a, b)).sum::<f64>() / (sum_norm + RES_EPS);
                dot / (q_norm(a) * src_norm + RES_EPS)
            })
            .sum::<f64>()
            / t,
    );
    if coherence <= 1.0 / t.sqrt() {
        return mean;
    }
    let s_bar = clamp01((pair_mean + 1.0) * 0.5);
    let c_bar = clamp01((coherence + 1.0) * 0.5);
    let family = if params.family { 1.0 } else { 0.0 };
    let score = clamp01(0.5 * (s_bar + c_bar) * family);
    let beta = params.beta_max - (params.beta_max - params.beta_min) * score;
    let target = norms.iter().sum::<f64>() / t;
    let scale = coherence.powf(beta) * target / (sum_norm + RES_EPS);
    norms.iter().map(|&x| scale / (x + RES_EPS)).collect()
}

/// The head correction's coefficient c_h, C = c_h · H̄ (SPEC §4f): ρ · S_H · ‖A‖ / ‖H̄‖, S_H the
/// mean positive cosine between the agents' nonzero heads (1 with one such head, 0 with none);
/// 0 where ‖A‖ or ‖H̄‖ is at most ε.
fn head_correction(heads: &[Head], agents: usize, ratio: f64, backbone_norm: f64) -> f64 {
    let dot = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(a, b)| a * b).sum::<f64>();
    // ⟨H_a, H_b⟩ = Σ_k Σ_l ⟨s u_ak, s u_bl⟩ ⟨v_ak, v_bl⟩.
    let inner = |a: usize, b: usize| {
        let (x, y) = (&heads[a], &heads[b]);
        let mut sum = 0.0;
        for (u1, v1) in x.us.iter().zip(&x.vs) {
            for (u2, v2) in y.us.iter().zip(&y.vs) {
                sum += dot(u1, u2) * dot(v1, v2);
            }
        }
        sum
    };
    let gram: Vec<f64> = (0..agents * agents)
        .map(|k| inner(k / agents, k % agents))
        .collect();
    let norms: Vec<f64> = (0..agents)
        .map(|a| gram[a * agents + a].max(0.0).sqrt())
        .collect();
    let live: Vec<usize> = (0..agents).filter(|&a| norms[a] > RES_EPS).collect();
    let agreement = if live.is_empty() {
        0.0
    } else {
        let pairs: Vec<f64> = live
            .iter()
            .enumerate()
            .flat_map(|(i, &a)| live[i + 1..].iter().map(move |&b| (a, b)))
            .map(|(a, b)| {
                let cos = gram[a * agents + b] / (norms[a] * norms[b]) / (1.0 + RES_EPS);
                cos.max(0.0)
            })
            .collect();
        if pairs.is_empty() {
            1.0
        } else {
            clamp01(pairs.iter().sum::<f64>() / pairs.len() as f64)
        }
    };
    let budget = ratio * agreement;
    let t = agents as f64;
    let mean_norm = (gram.iter().sum::<f64>() / (t * t)).max(0.0).sqrt();
    if budget > 0.0 && backbone_norm > RES_EPS && mean_norm > RES_EPS {
        budget * backbone_norm / mean_norm
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::SplitMix64;
    use crate::linalg::truncated_svd::top_triplets;
    use crate::scans::memory::scan_of;

    /// A head the Lanczos process has not converged on within its steps comes from the Gram
    /// matrix, and is the full SVD's, as the converged process's is.
    #[test]
    fn an_unconverged_head_takes_the_full_svd() {
        let (m, n) = (60, 80);
        let mut rng = SplitMix64::new(9);
        let tau: Vec<f32> = (0..m * n)
            .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            .collect();
        let full = |h: &Head| -> Vec<f64> {
            let mut out = vec![0.0; m * n];
            for (u, v) in h.us.iter().zip(&h.vs) {
                for i in 0..m {
                    for j in 0..n {
                        out[i * n + j] += u[i] * v[j];
                    }
                }
            }
            out
        };
        let (few, all) = (3, MAX_STEPS);
        assert!(!top_triplets(&tau, (m, n), 2, few, "τ").unwrap().converged);
        let fallback = full(&head(&tau, (m, n), 2, 0, few).unwrap());
        let converged = full(&head(&tau, (m, n), 2, 0, all).unwrap());
        let exact = faer::Mat::from_fn(m, n, |i, j| f64::from(tau[i * n + j]));
        let svd = exact.thin_svd().unwrap();
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..2)
                    .map(|c| svd.S().column_vector()[c] * svd.U()[(i, c)] * svd.V()[(j, c)])
                    .sum();
                assert!((fallback[i * n + j] - want).abs() < 1e-9);
                assert!((converged[i * n + j] - want).abs() < 1e-9);
            }
        }
    }

    /// Gathering every τ at once and one at a time (the residuals read again by scans, in tiles
    /// that cut across the blocks) give the same bits.
    #[test]
    fn gathered_and_streamed_updates_are_the_same_bits() {
        let (m, n, agents) = (150, 260, 3);
        let mut rng = SplitMix64::new(5);
        let mut uniform = || (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        let common: Vec<f32> = (0..m * n).map(|_| uniform()).collect();
        let taus: Vec<Vec<f32>> = (0..agents)
            .map(|_| common.iter().map(|c| 0.1 * (c + uniform())).collect())
            .collect();
        let params = ResMergeParams {
            rank: 2,
            beta_min: 0.7,
            beta_max: 1.0,
            head_ratio: 0.2,
            family: true,
        };
        let run = |tile: usize, gather_bytes: usize| {
            let mut scan = scan_of(taus.clone(), tile);
            update_gathering(&mut scan, (m, n), agents, &params, gather_bytes).unwrap()
        };
        let gathered = run(4096, usize::MAX);
        assert!(gathered.iter().any(|&x| x != 0.0));
        for tile in [1000, BLOCK, 3 * BLOCK + 7] {
            let streamed = run(tile, 0);
            let same = gathered
                .iter()
                .zip(&streamed)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "tiles of {tile}");
        }
    }
}
