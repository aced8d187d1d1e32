//! ResMerge's matrices (SPEC §4f, arXiv:2606.02252): each agent's task vector split into a
//! rank-K SVD head and a residual; the residuals merged into a backbone along their consensus
//! direction on the Frobenius sphere, the heads' mean added back, scaled by how well the heads
//! agree. Each agent's τ is gathered whole in turn for its head — the top K singular triplets by
//! the Lanczos process of `truncated_svd`, not a full SVD — then the residuals' Gram matrix and
//! the update are made element by element over scans of the tiles, the residuals formed from τ
//! and the heads' factors on the fly: a matrix costs one agent's τ in f32, the update in f32 and
//! the heads' vectors, whatever the number of agents. The update is added to the base tile by
//! tile, so every backend writes the same bytes.

use super::spectral::{matrix_f64, thin_svd, MAX_ELEMS};
use super::truncated_svd::top_triplets;
use crate::scans::{Scans, Values};
use anyhow::Result;
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
pub(super) fn update(
    scan: &mut dyn Scans,
    (m, n): (usize, usize),
    agents: usize,
    params: &ResMergeParams,
) -> Result<Vec<f32>> {
    let mut heads: Vec<Head> = Vec::with_capacity(agents);
    let mut tau = vec![0.0f32; m * n];
    for t in 0..agents {
        gather_agent(scan, t, &mut tau)?;
        heads.push(head(&tau, (m, n), params.rank, t)?);
    }
    drop(tau);
    // The residuals' Gram matrix, tile by tile.
    let mut gram = vec![0.0f64; agents * agents];
    let mut rows = vec![Vec::new(); agents];
    scan.tiles(&mut |tile| {
        residuals(tile, &heads, n, &mut rows);
        for a in 0..agents {
            for b in a..agents {
                let d: f64 = rows[a].iter().zip(&rows[b]).map(|(x, y)| x * y).sum();
                gram[a * agents + b] += d;
            }
        }
        Ok(ControlFlow::Continue(()))
    })?;
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
    // A + C, tile by tile: Σ_t w_t R_t + (c_h / T) Σ_t H_t.
    let mut update = vec![0.0f32; m * n];
    let mut sum = Vec::new();
    scan.tiles(&mut |tile| {
        residuals(tile, &heads, n, &mut rows);
        let start = tile.start as usize;
        sum.clear();
        sum.resize(rows[0].len(), 0.0f64);
        for (t, row) in rows.iter().enumerate() {
            sum.iter_mut()
                .zip(row)
                .for_each(|(s, r)| *s += weights[t] * r);
            let coef = head_coef / agents as f64;
            for (u, v) in heads[t].us.iter().zip(&heads[t].vs) {
                for_rows(start, sum.len(), n, |at, i, cols| {
                    let c = coef * u[i];
                    sum[at..at + cols.len()]
                        .iter_mut()
                        .zip(&v[cols])
                        .for_each(|(s, v)| *s += c * v);
                });
            }
        }
        for (out, s) in update[start..start + sum.len()].iter_mut().zip(&sum) {
            *out = *s as f32;
        }
        Ok(ControlFlow::Continue(()))
    })?;
    Ok(update)
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

/// Agent `t`'s head (SPEC §4f): the top K singular triplets of τ, none where τ = 0. The Lanczos
/// process finds them to a residual of 10⁻¹¹ σ₁ (`truncated_svd`); where it has not within its
/// step bound (top values too close together to separate), a matrix within [`MAX_ELEMS`] takes
/// faer's full SVD instead, a larger one the triplets reached.
fn head(tau: &[f32], (m, n): (usize, usize), k: usize, t: usize) -> Result<Head> {
    let what = format!("model {}'s task vector", t + 1);
    if tau.iter().all(|&x| x == 0.0) {
        return Ok(Head {
            us: Vec::new(),
            vs: Vec::new(),
        });
    }
    let top = top_triplets(tau, (m, n), k, &what)?;
    if top.converged || m * n > MAX_ELEMS {
        let (us, vs) = top
            .triplets
            .into_iter()
            .map(|x| (x.u.iter().map(|u| u * x.s).collect(), x.v))
            .unzip();
        return Ok(Head { us, vs });
    }
    let svd = thin_svd(matrix_f64(tau, (m, n)).as_ref(), &what)?;
    let (u, s, v) = (svd.U(), svd.S().column_vector(), svd.V());
    let k = k.min(m.min(n));
    let us = (0..k)
        .map(|c| (0..m).map(|i| u[(i, c)] * s[c]).collect())
        .collect();
    let vs = (0..k)
        .map(|c| (0..n).map(|j| v[(j, c)]).collect())
        .collect();
    Ok(Head { us, vs })
}

/// `visit(offset in the tile, row, that row's columns)` for each row segment of the `len`
/// elements from tensor index `start` of a matrix of `n` columns.
fn for_rows(
    start: usize,
    len: usize,
    n: usize,
    mut visit: impl FnMut(usize, usize, std::ops::Range<usize>),
) {
    let mut at = 0;
    while at < len {
        let (i, j) = ((start + at) / n, (start + at) % n);
        let run = (n - j).min(len - at);
        visit(at, i, j..j + run);
        at += run;
    }
}

/// Each agent's residual R_t = τ_t − H_t over the tile's elements, in f64, into `rows`.
fn residuals(tile: &Values, heads: &[Head], n: usize, rows: &mut [Vec<f64>]) {
    let start = tile.start as usize;
    for ((tau, head), row) in tile.tau.iter().zip(heads).zip(rows.iter_mut()) {
        row.clear();
        row.extend(tau.iter().map(|&x| f64::from(x)));
        for (u, v) in head.us.iter().zip(&head.vs) {
            for_rows(start, row.len(), n, |at, i, cols| {
                let c = u[i];
                row[at..at + cols.len()]
                    .iter_mut()
                    .zip(&v[cols])
                    .for_each(|(r, v)| *r -= c * v);
            });
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
