//! ResMerge's matrices (SPEC §4f, arXiv:2606.02252): each agent's task vector split into a
//! rank-K SVD head and a residual; the residuals merged into a backbone along their consensus
//! direction on the Frobenius sphere, the heads' mean added back, scaled by how well the heads
//! agree. Read whole by the same scan as Iso-C's and TSV-M's matrices
//! (`spectral::gather_taus`); the update is added to the base tile by tile, so every backend
//! writes the same bytes.

use super::spectral::{gather_taus, matrix_f64, thin_svd};
use crate::scans::Scans;
use anyhow::Result;

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

/// ResMerge's update of an m × n matrix, row-major (SPEC §4f): each agent's τ = H + R, H the
/// top-K singular triplets; the residual backbone A = Σ_t w_t R_t (the residuals' consensus
/// direction on the sphere with norm c^β · mean ‖R‖, or their mean); the head correction
/// C = ρ · S_H · ‖A‖ · H̄ / ‖H̄‖. Every inner product is taken from the Gram matrices of the
/// residuals and of the heads' factors, so no agent's H or R is held whole; the update A + C is
/// formed row by row at the end.
pub(super) fn update(
    scan: &mut dyn Scans,
    (m, n): (usize, usize),
    params: &ResMergeParams,
) -> Result<Vec<f32>> {
    let taus = gather_taus(scan, m * n)?;
    let agents = taus.len();
    let mut heads: Vec<Head> = Vec::with_capacity(agents);
    for (t, tau) in taus.iter().enumerate() {
        let norm = tau.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>();
        if norm <= 0.0 {
            heads.push(Head {
                us: Vec::new(),
                vs: Vec::new(),
            });
            continue;
        }
        let svd = thin_svd(
            matrix_f64(tau, (m, n)).as_ref(),
            &format!("model {}'s task vector", t + 1),
        )?;
        let (u, s, v) = (svd.U(), svd.S().column_vector(), svd.V());
        let k = params.rank.min(m.min(n));
        let us = (0..k)
            .map(|c| (0..m).map(|i| u[(i, c)] * s[c]).collect())
            .collect();
        let vs = (0..k)
            .map(|c| (0..n).map(|j| v[(j, c)]).collect())
            .collect();
        heads.push(Head { us, vs });
    }
    // The residuals' Gram matrix, rows of R_t formed one at a time.
    let mut gram = vec![0.0f64; agents * agents];
    let mut rows = vec![vec![0.0f64; n]; agents];
    for i in 0..m {
        residual_rows(&taus, &heads, i, n, &mut rows);
        for a in 0..agents {
            for b in a..agents {
                let d: f64 = rows[a].iter().zip(&rows[b]).map(|(x, y)| x * y).sum();
                gram[a * agents + b] += d;
            }
        }
    }
    for a in 0..agents {
        for b in 0..a {
            gram[a * agents + b] = gram[b * agents + a];
        }
    }
    let weights = backbone_weights(&gram, agents, params);
    let backbone_norm = (0..agents)
        .flat_map(|a| (0..agents).map(move |b| (a, b)))
        .map(|(a, b)| weights[a] * weights[b] * gram[a * agents + b])
        .sum::<f64>()
        .max(0.0)
        .sqrt();
    let head_coef = head_correction(&heads, agents, params.head_ratio, backbone_norm);
    // A + C, row by row: Σ_t w_t R_t + (c_h / T) Σ_t H_t.
    let mut update = vec![0.0f32; m * n];
    let mut sum = vec![0.0f64; n];
    for i in 0..m {
        residual_rows(&taus, &heads, i, n, &mut rows);
        sum.iter_mut().for_each(|x| *x = 0.0);
        for (t, row) in rows.iter().enumerate() {
            sum.iter_mut()
                .zip(row)
                .for_each(|(s, r)| *s += weights[t] * r);
            for (u, v) in heads[t].us.iter().zip(&heads[t].vs) {
                let c = head_coef / agents as f64 * u[i];
                sum.iter_mut().zip(v).for_each(|(s, v)| *s += c * v);
            }
        }
        for (out, s) in update[i * n..(i + 1) * n].iter_mut().zip(&sum) {
            *out = *s as f32;
        }
    }
    Ok(update)
}

/// Row `i` of each agent's residual R_t = τ_t − H_t into `rows`.
fn residual_rows(taus: &[Vec<f32>], heads: &[Head], i: usize, n: usize, rows: &mut [Vec<f64>]) {
    for ((tau, head), row) in taus.iter().zip(heads).zip(rows.iter_mut()) {
        for (r, &x) in row.iter_mut().zip(&tau[i * n..(i + 1) * n]) {
            *r = f64::from(x);
        }
        for (u, v) in head.us.iter().zip(&head.vs) {
            let c = u[i];
            row.iter_mut().zip(v).for_each(|(r, v)| *r -= c * v);
        }
    }
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
