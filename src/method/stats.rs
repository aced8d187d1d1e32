//! Per-tensor statistics of the mergekit-family methods, gathered by scans over the tensor's
//! tiles before its merge pass: exact rank cuts by magnitude (histograms, never a sort), L1 norms
//! for rescaling, Gram sums for Model Stock and row moments for slerp. Sums are f64 in element
//! order, so every backend merges with the same coefficients.

use super::combine::{
    hash_key, magnitude_key, random_threshold, CombineSpec, Keep, Normalize, RankCut,
};
use super::plan::{BaseTerm, Sparsify, TensorRecipe};
use anyhow::Result;

/// One tile's values: `base` = θ₀, `x[t]` = θ_t, `tau[t]` = θ_t − θ₀ in f32; `start` = tensor
/// index of element 0.
pub struct Values<'a> {
    pub start: u64,
    pub base: &'a [f32],
    pub x: &'a [Vec<f32>],
    pub tau: &'a [Vec<f32>],
}

impl Values<'_> {
    /// What the method sparsifies: task vectors or the models themselves.
    fn v(&self, delta: bool) -> &[Vec<f32>] {
        if delta {
            self.tau
        } else {
            self.x
        }
    }
}

/// What a scan does with each tile.
pub type Visit<'v> = dyn FnMut(&Values) -> Result<()> + 'v;

/// Runs the visit over every tile of the tensor, in order.
pub type Scan<'s> = dyn FnMut(&mut Visit) -> Result<()> + 's;

const BINS: usize = 1 << 16;

/// Resolves rank cuts (`(agent, k, high_first)`, 0 < k < n: the k largest, ties at the threshold
/// to the lower index first unless `high_first`) to exact thresholds.
fn rank_cuts(
    scan: &mut Scan,
    delta: bool,
    agents: usize,
    wanted: &[(usize, u64, bool)],
) -> Result<Vec<RankCut>> {
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    // Pass 1: histogram of the high 16 bits of each wanted agent's magnitude keys.
    let mut high = vec![Vec::new(); agents];
    for &(t, _, _) in wanted {
        high[t] = vec![0u64; BINS];
    }
    scan(&mut |tile| {
        for (t, h) in high.iter_mut().enumerate().filter(|(_, h)| !h.is_empty()) {
            for &x in &tile.v(delta)[t] {
                h[(magnitude_key(x) >> 16) as usize] += 1;
            }
        }
        Ok(())
    })?;
    // Walk down from the largest bin to the one holding rank k − 1.
    let locate = |h: &[u64], k: u64| -> (usize, u64) {
        let mut above = 0u64;
        for bin in (0..h.len()).rev() {
            if above + h[bin] >= k {
                return (bin, above);
            }
            above += h[bin];
        }
        unreachable!("k is at most the element count")
    };
    let coarse: Vec<(usize, u64)> = wanted
        .iter()
        .map(|&(t, k, _)| locate(&high[t], k))
        .collect();
    drop(high);
    // Pass 2: within each cut's bin, a histogram of the low 16 bits.
    let mut low = vec![vec![0u64; BINS]; wanted.len()];
    scan(&mut |tile| {
        for (c, &(t, _, _)) in wanted.iter().enumerate() {
            let bin = coarse[c].0 as u32;
            for &x in &tile.v(delta)[t] {
                let key = magnitude_key(x);
                if key >> 16 == bin {
                    low[c][(key & 0xffff) as usize] += 1;
                }
            }
        }
        Ok(())
    })?;
    let mut cuts = Vec::with_capacity(wanted.len());
    // (cut, agent, key, m): the cut's index goes just past the m-th tied element in index order.
    let mut ties = Vec::new();
    for (c, &(t, k, high_first)) in wanted.iter().enumerate() {
        let (bin, above) = coarse[c];
        let (fine, gt) = locate(&low[c], k - above);
        let key = ((bin as u32) << 16) | fine as u32;
        let need = k - above - gt;
        let equal = low[c][fine];
        // Lower first: the first `need` tied elements are inside. Higher first: all but the first
        // `equal − need`.
        let m = if high_first { equal - need } else { need };
        let all_or_none = if high_first { 0 } else { u32::MAX };
        cuts.push(RankCut {
            value: key,
            index: all_or_none,
            high_first,
        });
        if m > 0 && m < equal {
            ties.push((c, t, key, m));
        }
    }
    if ties.is_empty() {
        return Ok(cuts);
    }
    // Pass 3: where a cut splits the elements tied at its threshold, the index of the split.
    let mut seen = vec![0u64; ties.len()];
    scan(&mut |tile| {
        for (i, &(c, t, key, need)) in ties.iter().enumerate() {
            if seen[i] >= need {
                continue;
            }
            for (j, &x) in tile.v(delta)[t].iter().enumerate() {
                if magnitude_key(x) == key {
                    seen[i] += 1;
                    if seen[i] == need {
                        cuts[c].index = (tile.start + j as u64 + 1) as u32;
                        break;
                    }
                }
            }
        }
        Ok(())
    })?;
    Ok(cuts)
}

/// The cut holding ranks `< k` of `n` elements.
fn cut_of(k: u64, n: u64, found: &mut impl Iterator<Item = RankCut>) -> RankCut {
    if k == 0 {
        RankCut::EMPTY
    } else if k >= n {
        RankCut::FULL
    } else {
        found.next().expect("one cut was searched per rank")
    }
}

/// Gathers the statistics `recipe` needs from scans of the tensor and builds its combine rule.
/// `numel` ≤ u32::MAX; `seed` and `name` key the random masks.
pub fn build_spec(
    recipe: &TensorRecipe,
    numel: u64,
    shape: &[usize],
    seed: u64,
    name: &str,
    present: &[usize],
    scan: &mut Scan,
) -> Result<CombineSpec> {
    let n = recipe.weights.len();
    let delta = recipe.base == BaseTerm::Add;
    // Rank cuts first: the masks must be known before any kept-element statistic.
    let mut wanted = Vec::new();
    for (t, s) in recipe.sparsify.iter().enumerate() {
        if let Sparsify::Ranks { lo, hi, high_first } = *s {
            for k in [lo, hi] {
                if k > 0 && k < numel {
                    wanted.push((t, k, high_first));
                }
            }
        }
    }
    let found = rank_cuts(scan, delta, n, &wanted)?;
    let mut found = found.into_iter();
    let keep: Vec<Keep> = recipe
        .sparsify
        .iter()
        .enumerate()
        .map(|(t, s)| match *s {
            Sparsify::All => Keep::All,
            Sparsify::Ranks { lo, hi, .. } => {
                let lo = cut_of(lo, numel, &mut found);
                let hi = cut_of(hi, numel, &mut found);
                Keep::Band { lo, hi }
            }
            Sparsify::Random { density } => Keep::Random {
                threshold: random_threshold(density),
                key: hash_key(seed, name, present[t]),
            },
        })
        .collect();

    // One pass of moments when anything needs them.
    let rescale: Vec<bool> = recipe
        .sparsify
        .iter()
        .map(|s| recipe.rescale && *s != Sparsify::All)
        .collect();
    let row_len = match recipe.base {
        BaseTerm::Slerp { .. } => {
            (numel / shape.first().copied().unwrap_or(1).max(1) as u64).max(1)
        }
        _ => 0,
    };
    let rows = numel.checked_div(row_len).map_or(1, |r| r as usize);
    let want_l1 = rescale.iter().any(|&r| r);
    let want_gram = recipe.base == BaseTerm::ModelStock;
    let want_rows = matches!(recipe.base, BaseTerm::Slerp { .. });
    let mut l1 = vec![(0.0f64, 0.0f64); n];
    let mut gram = vec![0.0f64; n * n];
    let mut row_moments = vec![[0.0f64; 3]; if want_rows { rows } else { 0 }];
    if want_l1 || want_gram || want_rows {
        scan(&mut |tile| {
            for t in (0..n).filter(|&t| rescale[t]) {
                let (all, kept) = &mut l1[t];
                for (j, &x) in tile.v(delta)[t].iter().enumerate() {
                    let a = (x as f64).abs();
                    *all += a;
                    if keep[t].keeps(x, (tile.start + j as u64) as u32) {
                        *kept += a;
                    }
                }
            }
            if want_gram {
                for a in 0..n {
                    for b in a..n {
                        let dot: f64 = tile.tau[a]
                            .iter()
                            .zip(&tile.tau[b])
                            .map(|(&x, &y)| x as f64 * y as f64)
                            .sum();
                        gram[a * n + b] += dot;
                    }
                }
            }
            if want_rows {
                for (j, (&b, &x)) in tile.base.iter().zip(&tile.x[0]).enumerate() {
                    let m = &mut row_moments[((tile.start + j as u64) / row_len) as usize];
                    m[0] += b as f64 * b as f64;
                    m[1] += x as f64 * x as f64;
                    m[2] += b as f64 * x as f64;
                }
            }
            Ok(())
        })?;
    }

    let factor = |t: usize| -> f64 {
        let (all, kept) = l1[t];
        if rescale[t] && all >= 1e-7 && kept >= 1e-7 {
            all / kept
        } else {
            1.0
        }
    };
    let weights_f32: Vec<f32> = recipe.weights.iter().map(|&w| w as f32).collect();
    let mut coefs = Vec::with_capacity(rows * (n + 1));
    match recipe.base {
        BaseTerm::Add | BaseTerm::None => {
            coefs.push(if recipe.base == BaseTerm::Add {
                1.0
            } else {
                0.0
            });
            coefs.extend((0..n).map(|t| (recipe.weights[t] * factor(t)) as f32));
        }
        BaseTerm::ModelStock => {
            let t = model_stock_t(&gram, n);
            coefs.push((1.0 - t) as f32);
            coefs.extend((0..n).map(|_| (t / n as f64) as f32));
        }
        BaseTerm::Slerp { t } => {
            for m in &row_moments {
                let (a, b) = slerp_coefs(t, m);
                coefs.push(a as f32);
                coefs.push(b as f32);
            }
        }
    }
    let normalize = if !recipe.normalize {
        Normalize::None
    } else if recipe.consensus {
        Normalize::PerElement(weights_f32)
    } else {
        let sum: f32 = weights_f32.iter().sum();
        Normalize::Fixed(if sum.abs() < 1e-8 { 1.0 } else { 1.0 / sum })
    };
    Ok(CombineSpec {
        delta,
        keep,
        consensus: recipe.consensus,
        normalize,
        lambda: recipe.lambda as f32,
        row_len,
        coefs,
    })
}

/// Model Stock's interpolation t from the Gram sums of the task vectors (upper triangle):
/// cos = mean over pairs of dot / max(‖a‖‖b‖, 1e-6) clamped to [−1, 1]; t = N·cos / (1 + (N−1)·cos),
/// 0 where the denominator vanishes.
pub fn model_stock_t(gram: &[f64], n: usize) -> f64 {
    let norm = |a: usize| gram[a * n + a].sqrt();
    let mut sum = 0.0;
    let mut pairs = 0usize;
    for a in 0..n {
        for b in a + 1..n {
            sum += (gram[a * n + b] / (norm(a) * norm(b)).max(1e-6)).clamp(-1.0, 1.0);
            pairs += 1;
        }
    }
    let cos = sum / pairs.max(1) as f64;
    let den = 1.0 + (n as f64 - 1.0) * cos;
    if den.abs() < 1e-6 {
        0.0
    } else {
        n as f64 * cos / den
    }
}

/// Slerp's coefficients of (θ₀, θ₁) for one row from Σa², Σb², Σab: linear when the normalized
/// dot exceeds 0.9995 in magnitude, else sin((1−t)θ)/sin θ and sin(tθ)/sin θ.
pub fn slerp_coefs(t: f64, m: &[f64; 3]) -> (f64, f64) {
    let guard = |x: f64| if x > 1e-8 { x } else { 1.0 };
    let (na, nb) = (guard(m[0].sqrt()), guard(m[1].sqrt()));
    let dot = (m[2] / (na * nb)).clamp(-1.0, 1.0);
    if dot.abs() > 0.9995 {
        return (1.0 - t, t);
    }
    let theta = dot.acos();
    let s = theta.sin();
    (((1.0 - t) * theta).sin() / s, (t * theta).sin() / s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_of(v: Vec<Vec<f32>>, tile: usize) -> impl FnMut(&mut Visit) -> Result<()> {
        move |visit| {
            let len = v[0].len();
            let base = vec![0.0f32; len];
            let mut start = 0;
            while start < len {
                let end = (start + tile).min(len);
                let part: Vec<Vec<f32>> = v.iter().map(|a| a[start..end].to_vec()).collect();
                visit(&Values {
                    start: start as u64,
                    base: &base[start..end],
                    x: &part,
                    tau: &part,
                })?;
                start = end;
            }
            Ok(())
        }
    }

    /// Exact top-k with ties at the threshold going to lower indices, for any tiling.
    #[test]
    fn rank_cuts_are_exact_with_ties() {
        let v = vec![vec![0.5f32, -2.0, 1.0, 2.0, -1.0, 1.0, 0.0, 1.0]];
        for tile in [1, 3, 8] {
            // k = 4: 2, 2 (indices 1, 3) then two of the three 1.0s: indices 2 and 4.
            let cuts = rank_cuts(&mut scan_of(v.clone(), tile), true, 1, &[(0, 4, false)]).unwrap();
            assert_eq!(cuts[0].value, magnitude_key(1.0));
            assert_eq!(cuts[0].index, 5, "tile {tile}");
            let kept: Vec<usize> = (0..8)
                .filter(|&i| cuts[0].inside(magnitude_key(v[0][i]), i as u32))
                .collect();
            assert_eq!(kept, [1, 2, 3, 4]);
            // Higher index first: the 1.0s at indices 7 and 5.
            let cuts = rank_cuts(&mut scan_of(v.clone(), tile), true, 1, &[(0, 4, true)]).unwrap();
            let kept: Vec<usize> = (0..8)
                .filter(|&i| cuts[0].inside(magnitude_key(v[0][i]), i as u32))
                .collect();
            assert_eq!(kept, [1, 3, 5, 7], "tile {tile}");
        }
    }

    #[test]
    fn model_stock_t_by_hand() {
        // Two orthogonal task vectors: cos 0 → t 0 (keep the base). Two equal ones: cos 1 → t 1.
        assert_eq!(model_stock_t(&[1.0, 0.0, 0.0, 1.0], 2), 0.0);
        assert!((model_stock_t(&[4.0, 4.0, 0.0, 4.0], 2) - 1.0).abs() < 1e-12);
        // cos 0.5, N = 2 → 2·0.5 / 1.5 = 2/3.
        assert!((model_stock_t(&[1.0, 0.5, 0.0, 1.0], 2) - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn slerp_coefs_by_hand() {
        // Orthogonal unit rows, t = 0.5: θ = π/2, both coefficients sin(π/4).
        let (a, b) = slerp_coefs(0.5, &[1.0, 1.0, 0.0]);
        assert!((a - 0.5f64.sqrt()).abs() < 1e-12 && (b - a).abs() < 1e-12);
        // Parallel rows fall back to lerp.
        assert_eq!(slerp_coefs(0.25, &[1.0, 4.0, 2.0]), (0.75, 0.25));
    }
}
