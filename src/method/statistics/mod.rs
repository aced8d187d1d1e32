//! Per-tensor statistics of the mergekit-family methods, gathered by scans over the tensor's
//! tiles before its merge pass, and the combine rule built from them: exact rank cuts by
//! magnitude (`crate::select`), L1 norms for rescaling, Gram sums for Model Stock and the slerps
//! (per tensor, or per row or column), moments for slerp, arcee_fusion's row KL and fence. Sums are
//! f64 in a fixed order — element order, or per chunk of [`SCAN_CHUNK`] elements added in chunk
//! order — so every backend, tiling and thread count merges with the same coefficients.

mod coef_rows;
mod fusion;
mod kept;
mod l1;
mod sce;

use coef_rows::{coef_rows, dot, CoefRows};
use fusion::fusion_statistics;
pub use fusion::row_kl;
pub use kept::{Decisions, KeptFlags};
use l1::abs_sums;
use sce::sce_statistics;

use super::closed_form::{
    karcher_coefs, model_stock_t, multislerp_coefs, nuslerp_coefs, slerp_coefs,
};
use super::combine::{random_threshold, row_keep_mask, CombineSpec, Keep, Normalize, RankKeep};
use super::tensor_params::{BaseTerm, Sparsify, TensorParams, Vectors};
use crate::hash::hash_key;
use crate::scans::{lock, unlock, worker_states, Scans, SCAN_CHUNK};
use crate::select::{cut_of, rank_cuts};
use anyhow::Result;
use rayon::prelude::*;
use std::ops::ControlFlow;
use std::sync::Mutex;

/// Gathers the statistics `params` needs from scans of the tensor and builds its combine rule.
/// `numel` ≤ u32::MAX; `seed` and `name` key the random masks. With the rule, DELLA's keep
/// decisions ([`Decisions`]: its agents' keep is then [`Keep::Flagged`], read from them).
pub fn build_spec(
    params: &TensorParams,
    numel: u64,
    shape: &[usize],
    seed: u64,
    name: &str,
    present: &[usize],
    scan: &mut dyn Scans,
) -> Result<(CombineSpec, Option<Decisions>)> {
    let ranked = rank_rows(params, numel, shape)?;
    let rank_rows = ranked.slab;
    let masks = MaskKeys {
        seed,
        name,
        present,
    };
    // Rank cuts first: the masks must be known before any kept-element statistic.
    let (keep, by_rank) = keep_rules(params, numel, ranked.group(), &masks, scan)?;
    let rows = coef_rows(params, numel, shape);
    let mut sums = Sums::gather(params, (&keep, &by_rank), rows, ranked, numel, scan)?;
    let decisions = Decisions::of(by_rank, sums.kept.take(), (ranked.slab, ranked.stride));
    // SCE: the variance cut, then each agent's weight from its mean square on the kept elements.
    let (element_keep, sce_weights) = match params.base {
        BaseTerm::Sce { density } => sce_statistics(scan, params.weights.len(), numel, density)?,
        _ => (None, Vec::new()),
    };
    let fusion = match params.sparsify.contains(&Sparsify::Fusion) {
        true => Some(fusion_statistics(scan, numel, last_dim(numel, shape))?),
        false => None,
    };
    let coefs = coefficients(params, &sums, &sce_weights)?;
    let normalize = normalization(params, &sce_weights, element_keep.is_some());
    let spec = CombineSpec {
        delta: params.delta,
        keep,
        consensus: params.consensus,
        normalize,
        lambda: params.lambda as f32,
        row_len: rows.len,
        row_period: rows.period,
        coefs,
        sign_of_values: matches!(params.base, BaseTerm::Sce { .. }),
        rank_rows,
        fusion,
        tile_coefs: params.base == BaseTerm::Fisher,
        element_keep,
        nearswap: match params.base {
            BaseTerm::Nearswap { t } => Some(t as f32),
            _ => None,
        },
    };
    Ok((spec, decisions))
}

/// What keys a tensor's random masks: the seed, the tensor's name and each agent's index among
/// all agents (`present[t]`: agents lacking the tensor are skipped, not renumbered).
struct MaskKeys<'a> {
    seed: u64,
    name: &'a str,
    present: &'a [usize],
}

impl MaskKeys<'_> {
    fn of(&self, t: usize) -> [u32; 2] {
        hash_key(self.seed, self.name, self.present[t])
    }
}

/// Each agent's keep rule: rank cuts resolved to thresholds by [`rank_cuts`], random masks keyed
/// by [`MaskKeys`]; and beside them, each agent's rule by row rank (DELLA, `rank_group`
/// elements ranked together), whose keep is [`Keep::Flagged`]: its decisions ([`Decisions`])
/// are made on the host and read as flags.
fn keep_rules(
    params: &TensorParams,
    numel: u64,
    rank_group: u64,
    masks: &MaskKeys,
    scan: &mut dyn Scans,
) -> Result<(Vec<Keep>, Vec<Option<RankKeep>>)> {
    let mut wanted = Vec::new();
    for (t, s) in params.sparsify.iter().enumerate() {
        if let Sparsify::Ranks { lo, hi, high_first } = *s {
            for k in [lo, hi] {
                if k > 0 && k < numel {
                    wanted.push((t, k, high_first));
                }
            }
        }
    }
    let n = params.weights.len();
    let mut found = rank_cuts(scan, params.delta, (n, numel), &wanted)?.into_iter();
    let by_rank = params
        .sparsify
        .iter()
        .enumerate()
        .map(|(t, s)| match *s {
            Sparsify::RowRank { density, epsilon } => Some(RankKeep {
                p0: (density - epsilon) as f32,
                step: if rank_group > 1 {
                    (2.0 * epsilon / (rank_group - 1) as f64) as f32
                } else {
                    0.0
                },
                key: masks.of(t),
            }),
            _ => None,
        })
        .collect();
    let keep = params
        .sparsify
        .iter()
        .enumerate()
        .map(|(t, s)| match *s {
            Sparsify::All => Keep::All,
            Sparsify::Fusion => Keep::Flagged,
            Sparsify::Ranks { lo, hi, .. } => {
                let lo = cut_of(lo, numel, &mut found);
                let hi = cut_of(hi, numel, &mut found);
                Keep::Band { lo, hi }
            }
            Sparsify::Random { density } => Keep::Random {
                threshold: random_threshold(density),
                key: masks.of(t),
            },
            Sparsify::RowRank { .. } => Keep::Flagged,
        })
        .collect();
    Ok((keep, by_rank))
}

/// The f64 sums a tensor's coefficients come from, each over the whole tensor in a fixed order.
struct Sums {
    /// Per agent: (Σ|v|, Σ|v| over the kept elements), for agents that rescale.
    l1: Vec<(f64, f64)>,
    /// Whether agent t's sparsified vector is L1-rescaled.
    rescale: Vec<bool>,
    /// n × n Gram matrix of the task vectors or of the models (see [`BaseTerm::gram_of`]), one
    /// per coefficient row when the base term works per vector ([`BaseTerm::vectors`]).
    gram: Vec<f64>,
    /// Per coefficient row: Σθ₀², Σθ₁², Σθ₀θ₁ (slerp).
    rows: Vec<[f64; 3]>,
    /// DELLA: the keep decisions its L1 scan made, when it made every ranked agent's.
    kept: Option<KeptFlags>,
}

impl Sums {
    /// The sums `params` needs, in as few scans as they allow.
    fn gather(
        params: &TensorParams,
        (keep, by_rank): (&[Keep], &[Option<RankKeep>]),
        rows: CoefRows,
        rank_groups: RankRows,
        numel: u64,
        scan: &mut dyn Scans,
    ) -> Result<Sums> {
        let n = params.weights.len();
        let rescale: Vec<bool> = params
            .sparsify
            .iter()
            .map(|s| params.rescale && *s != Sparsify::All)
            .collect();
        let ranked: Vec<bool> = by_rank.iter().map(Option::is_some).collect();
        let want_rows = matches!(params.base, BaseTerm::Slerp { .. });
        let grams = match params.base.vectors() {
            Vectors::Whole => 1,
            _ => rows.count,
        };
        let mut sums = Sums {
            l1: vec![(0.0, 0.0); n],
            gram: vec![0.0; grams * n * n],
            rows: vec![[0.0; 3]; if want_rows { rows.count } else { 0 }],
            rescale,
            kept: None,
        };
        // Agents whose L1 norms a chunk scan gives (DELLA's need whole rows: tiles).
        let l1_agents: Vec<bool> = (0..n).map(|t| sums.rescale[t] && !ranked[t]).collect();
        let delta = params.delta;
        if want_rows {
            sums.l1_and_rows(keep, &l1_agents, delta, rows, scan)?;
        } else if l1_agents.iter().any(|&a| a) {
            sums.l1_any_order(keep, &l1_agents, delta, scan)?;
        }
        let ranked_l1: Vec<bool> = (0..n).map(|t| sums.rescale[t] && ranked[t]).collect();
        if ranked_l1.iter().any(|&a| a) {
            // The scan ranks every ranked agent: its decisions can serve the merge.
            if ranked_l1 == ranked {
                sums.kept = KeptFlags::new(numel, &ranked);
            }
            sums.l1_of_ranked_rows(by_rank, &ranked_l1, delta, rank_groups, scan)?;
        }
        match (params.base.gram_of(delta), params.base.vectors()) {
            (None, _) => {}
            (Some(of_tau), Vectors::Whole) => sums.gram(of_tau, scan)?,
            (Some(of_tau), _) => sums.gram_per_row(of_tau, rows, scan)?,
        }
        Ok(sums)
    }

    /// L1 norms alone: any order, each chunk's sums kept by chunk index and added in order
    /// after, so the f64 totals are those of an in-order scan.
    fn l1_any_order(
        &mut self,
        keep: &[Keep],
        agents: &[bool],
        delta: bool,
        scan: &mut dyn Scans,
    ) -> Result<()> {
        let n = agents.len();
        let workers = scan.workers();
        let parts = worker_states(workers, n, |_| Vec::<L1Part>::new());
        // Each worker's mask row, made once.
        let masks = worker_states(workers, 1, |_| vec![0u32; SCAN_CHUNK]);
        scan.any_order(1, delta, &|w, t, start, v| {
            if !agents[t] {
                return;
            }
            let mut mask = lock(&masks[w]);
            let mask = &mut mask[..v.len()];
            keep[t].mask_into(v, start as u32, &[], mask);
            let (all, kept) = abs_sums(v, mask);
            lock(&parts[w * n + t]).push((start, (all, kept)));
        })?;
        add_in_order(&mut self.l1, parts);
        Ok(())
    }

    /// L1 norms and slerp's moments per coefficient row in one scan of every agent at once, in
    /// any order: each chunk's sums kept by its place and added in order after.
    fn l1_and_rows(
        &mut self,
        keep: &[Keep],
        agents: &[bool],
        delta: bool,
        coef_rows: CoefRows,
        scan: &mut dyn Scans,
    ) -> Result<()> {
        let n = agents.len();
        let workers = scan.workers();
        let l1_parts = worker_states(workers, n, |_| Vec::<L1Part>::new());
        // Per worker: (first element, row, Σθ₀², Σθ₁², Σθ₀θ₁) of each run of a chunk in one row.
        let row_parts = worker_states(workers, 1, |_| Vec::<(u64, (usize, [f64; 3]))>::new());
        let masks = worker_states(workers, 1, |_| vec![0u32; SCAN_CHUNK]);
        scan.chunks_any_order(&|w, c| {
            for t in (0..n).filter(|&t| agents[t]) {
                let v = if delta { &c.tau[t] } else { &c.x[t] };
                let mut mask = lock(&masks[w]);
                let mask = &mut mask[..v.len()];
                keep[t].mask_into(v, c.start as u32, &[], mask);
                let (all, kept) = abs_sums(v, mask);
                lock(&l1_parts[w * n + t]).push((c.start, (all, kept)));
            }
            let mut rows = lock(&row_parts[w]);
            for (at, len) in coef_rows.runs(c.start, c.base.len()) {
                let i = (at - c.start) as usize;
                let (b, x) = (&c.base[i..i + len], &c.x[0][i..i + len]);
                rows.push((at, (coef_rows.of(at), [dot(b, b), dot(x, x), dot(b, x)])));
            }
        })?;
        add_in_order(&mut self.l1, l1_parts);
        for (row, m) in in_order(row_parts.into_iter().map(unlock)) {
            for (sum, part) in self.rows[row].iter_mut().zip(m) {
                *sum += part;
            }
        }
        Ok(())
    }

    /// DELLA's L1 norms: its masks need each row's ranks, so runs of whole slabs, on every
    /// worker at once; each slab's sums are kept and added in slab order, so no tiling or thread
    /// count changes them.
    fn l1_of_ranked_rows(
        &mut self,
        by_rank: &[Option<RankKeep>],
        agents: &[bool],
        delta: bool,
        ranked: RankRows,
        scan: &mut dyn Scans,
    ) -> Result<()> {
        let n = agents.len();
        let workers = scan.workers();
        let (slab, stride) = (ranked.slab.max(1), ranked.stride as usize);
        // Per (worker, agent): (slab, Σ|v|, Σ|kept v|) of each slab it ranked.
        let parts = worker_states(workers, n, |_| Vec::<L1Part>::new());
        let masks = worker_states(workers, 1, |_| Vec::<u32>::new());
        let kept = self.kept.as_ref();
        scan.slabs_any_order(slab, delta, &|w, t, start, v| {
            let (true, Some(rule)) = (agents[t], by_rank[t]) else {
                return;
            };
            let mut mask = lock(&masks[w]);
            row_keep_mask(v, (slab as usize, stride), start as u32, rule, &mut mask);
            let mask = &*mask;
            if let Some(k) = kept {
                k.record(t, start, mask);
            }
            let mut part = lock(&parts[w * n + t]);
            let slabs = v.chunks(slab as usize).zip(mask.chunks(slab as usize));
            for (j, (v, mask)) in slabs.enumerate() {
                let (all, kept_sum) = abs_sums(v, mask);
                part.push((start / slab + j as u64, (all, kept_sum)));
            }
        })?;
        add_in_order(&mut self.l1, parts);
        Ok(())
    }

    /// The Gram matrix of the task vectors (`of_tau`) or of the models, from chunks in any order:
    /// each chunk's dot products kept by its place and added in order after.
    fn gram(&mut self, of_tau: bool, scan: &mut dyn Scans) -> Result<()> {
        let n = self.l1.len();
        let pairs: Vec<(usize, usize)> = (0..n).flat_map(|a| (a..n).map(move |b| (a, b))).collect();
        let parts = worker_states(scan.workers(), 1, |_| Vec::<(u64, Vec<f64>)>::new());
        scan.chunks_any_order(&|w, c| {
            let v = if of_tau { c.tau } else { c.x };
            let dots = pairs.iter().map(|&(a, b)| dot(&v[a], &v[b])).collect();
            lock(&parts[w]).push((c.start, dots));
        })?;
        for dots in in_order(parts.into_iter().map(unlock)) {
            for (&(a, b), dot) in pairs.iter().zip(dots) {
                self.gram[a * n + b] += dot;
                if a != b {
                    self.gram[b * n + a] += dot;
                }
            }
        }
        Ok(())
    }

    /// One Gram matrix per coefficient row (model_stock's `filter_wise`, nuslerp without
    /// flattening), each sum over its row's elements in element order: tile by tile, the rows
    /// shared out in ranges among the workers, each adding its rows' elements in order.
    fn gram_per_row(&mut self, of_tau: bool, rows: CoefRows, scan: &mut dyn Scans) -> Result<()> {
        let n = self.l1.len();
        let shares = 4 * rayon::current_num_threads();
        let gram = &mut self.gram;
        scan.tiles(&mut |tile| {
            let v = if of_tau { tile.tau } else { tile.x };
            let end = tile.start + tile.base.len() as u64;
            // The rows the tile touches: a run of them, or with repeating rows all of them.
            let (lo, hi) = match rows.period {
                0 => (
                    (tile.start / rows.len) as usize,
                    (end.div_ceil(rows.len) as usize).min(rows.count),
                ),
                _ => (0, rows.count),
            };
            let per_part = (hi - lo).div_ceil(shares).max(1);
            let parts = gram[lo * n * n..hi * n * n].par_chunks_mut(per_part * n * n);
            parts.enumerate().for_each(|(p, g)| {
                let first = lo + p * per_part;
                let part = first..first + g.len() / (n * n);
                let runs = rows.runs_in(part, tile.start..end);
                // Each run cut where its row changes: one row's Gram matrix per piece.
                let pieces = runs.flat_map(|(at, len)| rows.runs(at, len));
                for (at, len) in pieces {
                    let g = &mut g[(rows.of(at) - first) * n * n..][..n * n];
                    let i0 = (at - tile.start) as usize;
                    // Pair by pair: each pair's sum still adds its elements in order.
                    for a in 0..n {
                        for b in a..n {
                            let (x, y) = (&v[a][i0..i0 + len], &v[b][i0..i0 + len]);
                            let mut sum = g[a * n + b];
                            for (&x, &y) in x.iter().zip(y) {
                                sum += x as f64 * y as f64;
                            }
                            g[a * n + b] = sum;
                            g[b * n + a] = sum;
                        }
                    }
                }
            });
            Ok(ControlFlow::Continue(()))
        })
    }

    /// Agent t's L1 rescale factor Σ|v| / Σ|kept v| (1 when it does not rescale).
    fn rescale_factor(&self, t: usize) -> f64 {
        let (all, kept) = self.l1[t];
        // Skipped below 1e-7 (SPEC §4), and where an infinite input makes a norm infinite (with
        // --allow-nonfinite): the infinite element then propagates alone, by IEEE rules, instead
        // of ∞/∞ = NaN scaling every finite element of the tensor.
        if self.rescale[t] && all >= 1e-7 && kept >= 1e-7 && all.is_finite() && kept.is_finite() {
            all / kept
        } else {
            1.0
        }
    }
}

/// The coefficient rows of the combine rule (see [`CombineSpec::coefs`]).
fn coefficients(params: &TensorParams, sums: &Sums, sce_weights: &[f64]) -> Result<Vec<f32>> {
    let n = params.weights.len();
    let delta = params.delta;
    // The base coefficient: 1 where out = θ₀ + Δ, 0 where Δ alone.
    let base = |on: bool| if on { 1.0 } else { 0.0 };
    let mut coefs = Vec::new();
    match params.base {
        BaseTerm::Add | BaseTerm::None => {
            coefs.push(base(params.base == BaseTerm::Add));
            coefs.extend((0..n).map(|t| (params.weights[t] * sums.rescale_factor(t)) as f32));
        }
        BaseTerm::ModelStock { .. } => {
            for gram in sums.gram.chunks(n * n) {
                let t = model_stock_t(gram, n);
                coefs.push((1.0 - t) as f32);
                coefs.extend((0..n).map(|_| (t / n as f64) as f32));
            }
        }
        BaseTerm::Slerp { t } => {
            for m in &sums.rows {
                let (a, b) = slerp_coefs(t, m);
                coefs.extend([a as f32, b as f32]);
            }
        }
        BaseTerm::Nuslerp { t, .. } => {
            for gram in sums.gram.chunks(n * n) {
                coefs.push(base(delta));
                let (a, b) = nuslerp_coefs(t, gram);
                coefs.extend([a as f32, b as f32]);
            }
        }
        BaseTerm::Multislerp { ref weights } => {
            coefs.push(base(delta));
            let c = multislerp_coefs(weights, &sums.gram)?;
            coefs.extend(c.into_iter().map(|c| c as f32));
        }
        BaseTerm::Nearswap { .. } => coefs.extend([1.0, 1.0]),
        // The per-element rows come with each tile; this row keeps λ for them.
        BaseTerm::Fisher => {
            coefs.push(0.0);
            coefs.extend(params.weights.iter().map(|&w| w as f32));
        }
        BaseTerm::Sce { .. } => {
            coefs.push(1.0);
            coefs.extend(sce_weights.iter().map(|&w| w as f32));
        }
        BaseTerm::Karcher { max_iter, tol } => {
            coefs.push(0.0);
            let c = karcher_coefs(&sums.gram, n, max_iter, tol);
            coefs.extend(c.into_iter().map(|c| c as f32));
        }
    }
    Ok(coefs)
}

/// How Δ is divided: per element by the agreeing weights (consensus), once by Σ w, or not.
fn normalization(params: &TensorParams, sce_weights: &[f64], variance_cut: bool) -> Normalize {
    let weights: Vec<f32> = if sce_weights.is_empty() {
        params.weights.iter().map(|&w| w as f32).collect()
    } else {
        sce_weights.iter().map(|&w| w as f32).collect()
    };
    if !params.normalize {
        Normalize::None
    } else if params.consensus {
        // SCE divides by max(Σ w, 1e-6); TIES by Σ w, or 1 where it is 0.
        let floor = if variance_cut || !sce_weights.is_empty() {
            1e-6
        } else {
            0.0
        };
        Normalize::PerElement(weights, floor)
    } else {
        let sum: f32 = weights.iter().sum();
        Normalize::Fixed(if sum.abs() < 1e-8 { 1.0 } else { 1.0 / sum })
    }
}

/// (place, (Σ|v|, Σ|kept v|)) of a run, chunk or slab an L1 scan summed.
type L1Part = (u64, (f64, f64));

/// Adds the workers' parts of each agent's L1 norms (`parts[w · n + t]`: (run, (Σ|v|, Σ|kept v|))
/// of each run worker w scanned of agent t) to `l1` in run order: the same sums whatever worker
/// scanned which run.
fn add_in_order(l1: &mut [(f64, f64)], parts: Vec<Mutex<Vec<L1Part>>>) {
    let n = l1.len();
    let mut parts: Vec<Vec<L1Part>> = parts.into_iter().map(unlock).collect();
    for (t, l) in l1.iter_mut().enumerate() {
        let runs = parts.iter_mut().skip(t).step_by(n).map(std::mem::take);
        for (all, kept) in in_order(runs) {
            l.0 += all;
            l.1 += kept;
        }
    }
}

/// The workers' parts of a sum — (place, what was summed there) of each chunk, run or slab a
/// worker scanned, no two at one place — in place order: added so, the sums are the same
/// whatever worker scanned what.
fn in_order<T>(parts: impl IntoIterator<Item = Vec<(u64, T)>>) -> impl Iterator<Item = T> {
    let mut all: Vec<(u64, T)> = parts.into_iter().flatten().collect();
    all.sort_unstable_by_key(|p| p.0);
    all.into_iter().map(|(_, part)| part)
}

/// How DELLA's ranks group a tensor's elements ([`row_keep_mask`]): slabs of `slab` elements (0: no
/// ranks), in which elements `stride` apart form one group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankRows {
    /// Elements of one slab (whole rows).
    pub slab: u64,
    /// Stride of a rank group within a slab (1: the slab is one row).
    pub stride: u64,
}

impl RankRows {
    /// Elements per group.
    pub fn group(&self) -> u64 {
        self.slab / self.stride.max(1)
    }
}

/// Elements per row along the last dimension (a vector whole).
fn last_dim(numel: u64, shape: &[usize]) -> u64 {
    match shape {
        [] | [_] => numel.max(1),
        [.., last] => (*last as u64).max(1),
    }
}

/// The length of the runs of elements the statistics scans need whole in each tile (0: none):
/// DELLA's rank slabs, arcee_fusion's rows.
pub fn scan_rows(params: &TensorParams, numel: u64, shape: &[usize]) -> Result<u64> {
    if params.sparsify.contains(&Sparsify::Fusion) {
        return Ok(last_dim(numel, shape));
    }
    Ok(rank_rows(params, numel, shape)?.slab)
}

/// DELLA's rank groups for a tensor of `shape` (slab 0 when no keep rule ranks): mergekit ranks
/// along dimension 1 after making a vector one row — a vector whole, a matrix's rows, and for
/// more dimensions [a, b, c, …] the b elements sharing every other index.
pub fn rank_rows(params: &TensorParams, numel: u64, shape: &[usize]) -> Result<RankRows> {
    if !params
        .sparsify
        .iter()
        .any(|s| matches!(s, Sparsify::RowRank { .. }))
    {
        return Ok(RankRows { slab: 0, stride: 1 });
    }
    Ok(match shape {
        [] | [_] => RankRows {
            slab: numel.max(1),
            stride: 1,
        },
        [_, rest @ ..] => {
            let slab: u64 = rest.iter().map(|&d| d as u64).product();
            RankRows {
                slab: slab.max(1),
                stride: (slab / (rest[0].max(1) as u64)).max(1),
            }
        }
    })
}
