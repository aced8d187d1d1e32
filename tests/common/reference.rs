//! The reference merges the tests compare with: SPEC §1's counts, §3's λ, §2's merge, element by
//! element in the order the SPEC fixes.

use super::{size_of, to_bytes, T};
use safetensors::tensor::Dtype;

/// SPEC §1 masks for one element.
pub fn active(base: f32, agents: &[f32], eps: f32) -> Vec<bool> {
    agents.iter().map(|&a| (a - base).abs() > eps).collect()
}

/// Written independently of the crate: global (unique, shared) counts per agent over all tensors.
pub fn reference_counts(base: &[T], agents: &[Vec<T>], eps: f32) -> Vec<(u64, u64)> {
    let n = agents.len();
    let mut counts = vec![(0u64, 0u64); n];
    for (i, b) in base.iter().enumerate() {
        for e in 0..b.values.len() {
            let vals: Vec<f32> = agents.iter().map(|a| a[i].values[e]).collect();
            let m = active(b.values[e], &vals, eps);
            let c = m.iter().filter(|&&x| x).count();
            for t in 0..n {
                if m[t] {
                    if c == 1 {
                        counts[t].0 += 1
                    } else {
                        counts[t].1 += 1
                    }
                }
            }
        }
    }
    counts
}

/// ρ = shared / unique from (unique, shared): 0 with no shared change, ∞ with no unique one.
fn rho(c: (u64, u64)) -> f64 {
    match c {
        (_, 0) => 0.0,
        (0, _) => f64::INFINITY,
        (u, s) => s as f64 / u as f64,
    }
}

/// λ from (unique, shared) by the paper rule.
pub fn lambda_paper(c: (u64, u64), r: f64, alpha: f64) -> f64 {
    1.0 + r * rho(c).min(alpha)
}

/// λ from (unique, shared) by the authors' released script.
pub fn lambda_official(c: (u64, u64), big_r: f64) -> f64 {
    1.0 + (big_r.max(1.0) - 1.0) * rho(c).min(1.0)
}

/// The merged bytes of one tensor per SPEC §2, computed the plain way.
pub fn reference_merge(base: &T, agents: &[&T], eps: f32, lambdas: &[f32], out: Dtype) -> Vec<u8> {
    reference_merge_shared(base, agents, eps, lambdas, out, false)
}

/// [`reference_merge`], with `consensus`: SPEC §2b's shared-region rule — where two or more agents
/// changed an element, only those whose τ has the sign of the sum of the changes (+ where it is
/// ≥ 0) are averaged.
pub fn reference_merge_shared(
    base: &T,
    agents: &[&T],
    eps: f32,
    lambdas: &[f32],
    out: Dtype,
    consensus: bool,
) -> Vec<u8> {
    let in_bytes = to_bytes(base.dtype, &base.values);
    let s = size_of(base.dtype);
    let mut bytes = Vec::new();
    for e in 0..base.values.len() {
        let b = base.values[e];
        let mut sum = 0.0f32;
        let mut c = 0usize;
        let mut last = 0;
        for (t, a) in agents.iter().enumerate() {
            let tau = a.values[e] - b;
            if tau.abs() > eps {
                sum += tau;
                c += 1;
                last = t;
            }
        }
        if c == 0 && out == base.dtype {
            bytes.extend_from_slice(&in_bytes[e * s..(e + 1) * s]);
            continue;
        }
        let v = match c {
            0 => b,
            1 => b + lambdas[last] * sum,
            c if consensus => {
                let (mut kept, mut k) = (0.0f32, 0usize);
                for a in agents {
                    let tau = a.values[e] - b;
                    let agrees = if sum >= 0.0 { tau > 0.0 } else { tau < 0.0 };
                    if tau.abs() > eps && agrees {
                        kept += tau;
                        k += 1;
                    }
                }
                assert!(k >= 1 && k <= c);
                b + kept / k as f32
            }
            // The correctly rounded quotient, as the paper authors' script computes it (SPEC §2).
            c => b + sum / c as f32,
        };
        bytes.extend(to_bytes(out, &[v]));
    }
    bytes
}
