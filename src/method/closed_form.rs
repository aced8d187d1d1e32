//! The closed-form f64 maths of the interpolating methods: each turns a tensor's Gram sums or row
//! moments into the coefficients of its combine rule (SPEC.md §4).

use anyhow::Result;

/// nuslerp's coefficients of (v₀, v₁) from their 2×2 Gram matrix: the slerp of the directions,
/// applied to the unnormalized vectors; lerp when the vectors are collinear.
pub fn nuslerp_coefs(t: f64, gram: &[f64]) -> (f64, f64) {
    let n0 = gram[0].sqrt().max(1e-7);
    let n1 = gram[3].sqrt().max(1e-7);
    let cos = (gram[1] / (n0 * n1)).clamp(-1.0, 1.0);
    if 1.0 - cos * cos <= 1e-16 {
        return (1.0 - t, t);
    }
    let theta = cos.acos();
    let s = theta.sin();
    (((1.0 - t) * theta).sin() / s, (t * theta).sin() / s)
}

/// multislerp's coefficients from the Gram matrix: the weighted mean of the unit vectors,
/// normalized and scaled by the weighted mean norm. (mergekit's tangent-space step sums to zero
/// exactly — Σ w_i (u_i − ⟨u_i, m̂⟩ m̂) = m − ‖m‖ m̂ — so it moves nothing but rounding.)
pub fn multislerp_coefs(weights: &[f64], gram: &[f64]) -> Result<Vec<f64>> {
    const EPS: f64 = 1e-8;
    let n = weights.len();
    let norm: Vec<f64> = (0..n).map(|i| gram[i * n + i].sqrt()).collect();
    let unit = |i: usize, j: usize| gram[i * n + j] / ((norm[i] + EPS) * (norm[j] + EPS));
    let mut mean_sq = 0.0;
    for i in 0..n {
        for j in 0..n {
            mean_sq += weights[i] * weights[j] * unit(i, j);
        }
    }
    let mean_norm = mean_sq.max(0.0).sqrt();
    // Every vector zero (a tensor no agent changed): the sum is zero too, whatever the weights.
    if norm.iter().all(|&x| x == 0.0) {
        return Ok(vec![0.0; n]);
    }
    if mean_norm < EPS {
        if n == 2 {
            return Ok(weights.to_vec());
        }
        anyhow::bail!(
            "multislerp: the weighted sum of the unit vectors is zero (antipodal inputs with balancing weights); use other weights"
        );
    }
    let avg_norm: f64 = weights.iter().zip(&norm).map(|(w, n)| w * n).sum();
    Ok((0..n)
        .map(|i| weights[i] / ((norm[i] + EPS) * mean_norm) * avg_norm)
        .collect())
}

/// karcher's coefficients from the Gram matrix of the models: the weighted Karcher mean of the
/// unit vectors (equal weights), iterated in the span of the inputs, scaled by the mean norm.
/// Angles and norms below `tol` — or zero, so `tol = 0` stays finite — end the step or the loop.
pub fn karcher_coefs(gram: &[f64], n: usize, max_iter: usize, tol: f64) -> Vec<f64> {
    let norm: Vec<f64> = (0..n).map(|i| gram[i * n + i].sqrt()).collect();
    // Below tol, or zero: with tol = 0 a zero angle or norm must not be divided by.
    let small = |x: f64| x < tol || x <= 0.0;
    let valid: Vec<usize> = (0..n).filter(|&i| norm[i] > tol).collect();
    if valid.is_empty() {
        return vec![0.0; n];
    }
    // Inner products of unit vectors, and of coefficient vectors over them.
    let u = |i: usize, j: usize| gram[i * n + j] / (norm[i] * norm[j]);
    // Zero coefficients skip u(i, j): an invalid input's norm may be 0.
    let dot = |a: &[f64], b: &[f64]| -> f64 {
        let mut s = 0.0;
        for (i, &ai) in a.iter().enumerate().filter(|(_, &x)| x != 0.0) {
            for (j, &bj) in b.iter().enumerate().filter(|(_, &x)| x != 0.0) {
                s += ai * bj * u(i, j);
            }
        }
        s
    };
    let alpha = 1.0 / valid.len() as f64;
    let mut mean = vec![0.0; n];
    for &i in &valid {
        mean[i] = alpha;
    }
    let mean_norm = dot(&mean, &mean).max(0.0).sqrt();
    if small(mean_norm) {
        mean = vec![0.0; n];
        mean[valid[0]] = 1.0;
    } else {
        mean.iter_mut().for_each(|a| *a /= mean_norm);
    }
    for _ in 0..max_iter {
        let mut tangent = vec![0.0; n];
        for &j in &valid {
            let mut e = vec![0.0; n];
            e[j] = 1.0;
            let d = dot(&mean, &e).clamp(-1.0, 1.0);
            let theta = d.acos();
            if small(theta) {
                continue;
            }
            let beta = alpha * theta / theta.sin();
            for i in 0..n {
                tangent[i] += beta * (e[i] - d * mean[i]);
            }
        }
        let tn = dot(&tangent, &tangent).max(0.0).sqrt();
        if small(tn) {
            break;
        }
        for i in 0..n {
            mean[i] = tn.cos() * mean[i] + tn.sin() * tangent[i] / tn;
        }
        let un = dot(&mean, &mean).max(0.0).sqrt();
        if !small(un) {
            mean.iter_mut().for_each(|a| *a /= un);
        }
    }
    // scale = Σ α_i ‖v_i‖ over every input (mergekit's α = 1/N for all of them).
    let scale: f64 = norm.iter().sum::<f64>() / n as f64;
    (0..n)
        .map(|i| {
            if norm[i] > 0.0 {
                scale * mean[i] / norm[i]
            } else {
                0.0
            }
        })
        .collect()
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
