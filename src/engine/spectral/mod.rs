//! The methods that decompose whole matrices: Iso-C (SPEC §4c: Σ τ_t = U S Vᵀ by a thin SVD, the
//! update α·mean(S)·U Vᵀ) and TSV-M (SPEC §4d: each agent's top 1/T singular directions, their
//! U and V made orthogonal, summed with their singular values). A matrix's task vectors are read
//! whole by a statistics scan; the SVDs are faer's, in f64. The update is computed once per
//! matrix on the host and added to the base tile by tile, so every backend writes the same
//! bytes. Tensors that are not matrices, or larger than [`MAX_ELEMS`] (ResMerge, which needs no
//! full SVD: its own bound), take the elementwise rule α·mean τ through the combine kernels
//! instead (`method::tensor_params`).

use super::truncated_svd::Triplet;
use crate::inputs::Inputs;
use crate::method::{Kind, Method};
use crate::scans::Scans;
use anyhow::{anyhow, Result};
use rayon::prelude::*;
use std::ops::ControlFlow;

/// The largest matrix decomposed: 2^25 elements (a 4096 × 8192 projection). Iso-C's SVD holds
/// the sum and U Vᵀ in f64 plus faer's factors, about 1 GiB at this size; TSV-M holds the T task
/// vectors in f32 and one agent's SVD at a time (T · 128 MiB + about 1 GiB). Larger matrices (a
/// big vocabulary's embeddings) take the elementwise rule, and the merge says so.
pub(super) const MAX_ELEMS: usize = 1 << 25;

/// The largest matrix ResMerge decomposes: 2^30 elements (Llama-3-405B's 53248 × 16384 MLP
/// projections are 0.81 · 2^30). Past 1 GiB of task vectors it holds one agent's τ and the update
/// in f32, 8 bytes an element (1.9 GB for a 70B model's 28672 × 8192 projections), and (m + n)
/// f64 per Lanczos step — a few hundred steps where K is small, at most min(m, n) + 1.
const RESMERGE_MAX_ELEMS: usize = 1 << 30;

/// The most bytes TSV-M's SVDs take when they run at once (the agents', then the two polar
/// factors'); above it they run one at a time.
const PARALLEL_SVD_BYTES: usize = 1 << 30;

/// Whether `kind`'s matrices are merged here (or by `resmerge`, on the same footing).
pub(super) fn decomposes(kind: Kind) -> bool {
    matches!(kind, Kind::IsoC | Kind::Tsv | Kind::ResMerge)
}

/// The matrix `kind` decomposes for tensor `name` of `shape` — a 2-D tensor of at least 2 × 2
/// and at most [`max_elems`] elements — unless the method leaves that kind of tensor to its
/// elementwise rule ([`left_by_name`]).
pub(super) fn decomposed(kind: Kind, name: &str, shape: &[usize]) -> Option<(usize, usize)> {
    if left_by_name(kind, name) {
        return None;
    }
    matrix_within(shape, max_elems(kind))
}

/// The largest matrix `kind` decomposes: [`MAX_ELEMS`] for the full SVDs, [`RESMERGE_MAX_ELEMS`] for
/// ResMerge's rank-K heads, which need no full SVD.
fn max_elems(kind: Kind) -> usize {
    match kind {
        Kind::ResMerge => RESMERGE_MAX_ELEMS,
        _ => MAX_ELEMS,
    }
}

/// Whether `kind` leaves tensor `name` to its elementwise rule whatever its shape: ResMerge's
/// embeddings, LM head and norms (SPEC §4f).
fn left_by_name(kind: Kind, name: &str) -> bool {
    use crate::names::Module;
    kind == Kind::ResMerge
        && matches!(
            Module::of(name),
            Module::Embed | Module::LmHead | Module::Norm
        )
}

/// The matrix decomposed for a tensor of `shape` — (rows, columns) of a 2-D tensor of at
/// least 2 × 2 and at most [`MAX_ELEMS`] elements — or `None`.
pub(super) fn matrix(shape: &[usize]) -> Option<(usize, usize)> {
    matrix_within(shape, MAX_ELEMS)
}

/// (rows, columns) of a 2-D tensor of `shape` of at least 2 × 2 and at most `max` elements.
fn matrix_within(shape: &[usize], max: usize) -> Option<(usize, usize)> {
    match *shape {
        [m, n] if m >= 2 && n >= 2 && m * n <= max => Some((m, n)),
        _ => None,
    }
}

/// The merge's warnings about a decomposing method: each matrix too large to decompose, merged
/// by the elementwise rule instead.
pub(super) fn warnings(inputs: &Inputs, method: &Method) -> Vec<String> {
    let kind = match method {
        Method::Combine(c) if decomposes(c.kind) => c.kind,
        _ => return Vec::new(),
    };
    inputs
        .tensors
        .iter()
        .filter(|plan| !left_by_name(kind, plan.name()))
        .filter_map(|plan| {
            // A matrix of any size, too large for `kind`.
            let (m, n) = matrix_within(plan.shape(), usize::MAX)?;
            (m * n > max_elems(kind)).then(|| {
                format!(
                    "{}: tensor '{}' ({m} × {n}) is larger than the {} elements rlmerge \
                     decomposes; it was merged by the elementwise rule (α · mean τ, SPEC §4c)",
                    kind.name(),
                    plan.name(),
                    max_elems(kind)
                )
            })
        })
        .collect()
}

/// `kind`'s update of an m × n matrix, row-major, from the scan of its tiles (of `agents`
/// agents' copies).
pub(super) fn update(
    kind: Kind,
    scan: &mut dyn Scans,
    matrix: (usize, usize),
    alpha: f64,
    agents: usize,
) -> Result<Vec<f32>> {
    match kind {
        Kind::Tsv => tsv_update(scan, matrix, alpha, agents),
        _ => iso_c_update(scan, matrix, alpha),
    }
}

/// Iso-C's update of an m × n matrix, row-major: α·mean(S)·U Vᵀ for Σ_t τ_t = U S Vᵀ, the sum
/// taken in f64 in agent order over the scan's tiles (whose task vectors are f32).
fn iso_c_update(scan: &mut dyn Scans, (m, n): (usize, usize), alpha: f64) -> Result<Vec<f32>> {
    let mut sum = vec![0.0f64; m * n];
    scan.tiles(&mut |tile| {
        let start = tile.start as usize;
        for tau in tile.tau {
            for (s, &t) in sum[start..start + tau.len()].iter_mut().zip(tau.iter()) {
                *s += f64::from(t);
            }
        }
        Ok(ControlFlow::Continue(()))
    })?;
    let a = faer::MatRef::from_row_major_slice(&sum, m, n);
    let svd = thin_svd(a, "the summed task vectors")?;
    let s = svd.S().column_vector();
    let r = m.min(n);
    let mean = (0..r).map(|i| s[i]).sum::<f64>() / r as f64;
    drop(sum);
    let uvt = svd.U() * svd.V().transpose();
    Ok(rounded(uvt.as_ref(), alpha * mean))
}

/// `values` (an m × n matrix, row-major f32) in f64.
pub(super) fn matrix_f64(values: &[f32], (m, n): (usize, usize)) -> faer::Mat<f64> {
    faer::Mat::from_fn(m, n, |i, j| f64::from(values[i * n + j]))
}

/// The numerical rank's threshold of an m × n matrix whose largest singular value is `s_max`:
/// s_max · max(m, n) · 2⁻⁵² — singular values at or below it are rounding noise (SPEC §4d, §4e).
fn rank_floor(s_max: f64, (m, n): (usize, usize)) -> f64 {
    s_max * m.max(n) as f64 * f64::EPSILON
}

/// The thin SVD of `a`; `what` names the matrix when it does not converge.
pub(super) fn thin_svd(
    a: faer::MatRef<f64>,
    what: &str,
) -> Result<faer::linalg::solvers::Svd<f64>> {
    a.thin_svd()
        .map_err(|e| anyhow!("the SVD of {what} did not converge ({e:?})"))
}

/// `scale · mat`, row-major, each element rounded once to f32.
fn rounded(mat: faer::MatRef<f64>, scale: f64) -> Vec<f32> {
    let (m, n) = (mat.nrows(), mat.ncols());
    let mut update = vec![0.0f32; m * n];
    for (i, row) in update.chunks_exact_mut(n).enumerate() {
        for (j, u) in row.iter_mut().enumerate() {
            *u = (scale * mat[(i, j)]) as f32;
        }
    }
    update
}

/// TSV-M's update of an m × n matrix, row-major (SPEC §4d): for each of the T agents in order,
/// the top k = ⌊min(m, n) / T⌋ singular triplets of τ_t (those above the numerical rank's
/// threshold); their left vectors side by side X_U (m × c), right vectors X_V (n × c), values s;
/// the update α · P(X_U) · diag(s) · P(X_V)ᵀ, P the orthogonal polar factor (U Vᵀ of a thin
/// SVD).
fn tsv_update(
    scan: &mut dyn Scans,
    (m, n): (usize, usize),
    alpha: f64,
    agents: usize,
) -> Result<Vec<f32>> {
    if m.min(n) < agents {
        // k = 0: no agent keeps a direction (the authors' code gives zero too).
        return Ok(vec![0.0; m * n]);
    }
    let taus = gather_taus(scan, m * n)?;
    let k = m.min(n) / agents;
    // Each agent's top k directions above the numerical rank's threshold: directions at or
    // below it carry nothing, and an SVD's basis of a null space is arbitrary — kept, they
    // would turn the others.
    let top = |(t, tau): (usize, &Vec<f32>)| -> Result<Vec<Triplet>> {
        let svd = thin_svd(
            matrix_f64(tau, (m, n)).as_ref(),
            &format!("model {}'s task vector", t + 1),
        )?;
        let s = svd.S().column_vector();
        let floor = rank_floor(s[0], (m, n));
        Ok((0..k)
            .filter(|&j| s[j] > floor)
            .map(|j| Triplet {
                s: s[j],
                u: svd.U().col(j).iter().copied().collect(),
                v: svd.V().col(j).iter().copied().collect(),
            })
            .collect())
    };
    // The agents' SVDs at once where they fit in PARALLEL_SVD_BYTES (each holds τ, U and V in
    // f64), else one at a time; faer's own threads do not keep two cores busy.
    let one_svd = (m * n + (m + n) * m.min(n)) * 8;
    let tops: Vec<_> = if agents * one_svd <= PARALLEL_SVD_BYTES {
        taus.par_iter()
            .enumerate()
            .map(top)
            .collect::<Result<_>>()?
    } else {
        taus.iter().enumerate().map(top).collect::<Result<_>>()?
    };
    drop(taus);
    let mut xu = faer::Mat::<f64>::zeros(m, agents * k);
    let mut xv = faer::Mat::<f64>::zeros(n, agents * k);
    let mut values = Vec::with_capacity(agents * k);
    for top in tops.into_iter().flatten() {
        let c = values.len();
        xu.col_mut(c)
            .iter_mut()
            .zip(&top.u)
            .for_each(|(x, &y)| *x = y);
        xv.col_mut(c)
            .iter_mut()
            .zip(&top.v)
            .for_each(|(x, &y)| *x = y);
        values.push(top.s);
    }
    let c = values.len();
    if c == 0 {
        return Ok(vec![0.0; m * n]);
    }
    let polar = |x: faer::MatRef<f64>| -> Result<faer::Mat<f64>> {
        let svd = thin_svd(x, "the agents' singular vectors")?;
        Ok(svd.U() * svd.V().transpose())
    };
    let (xu_c, xv_c) = (xu.as_ref().subcols(0, c), xv.as_ref().subcols(0, c));
    // The two polar factors at once, within the same bound (each SVD holds X, U and V).
    let (qu, qv) = if (m + n) * c * 3 * 8 <= PARALLEL_SVD_BYTES {
        rayon::join(|| polar(xu_c), || polar(xv_c))
    } else {
        (polar(xu_c), polar(xv_c))
    };
    let (mut qu, qv) = (qu?, qv?);
    drop((xu, xv));
    for (j, &s) in values.iter().enumerate() {
        qu.col_mut(j).iter_mut().for_each(|x| *x *= s);
    }
    let merged = &qu * qv.transpose();
    Ok(rounded(merged.as_ref(), alpha))
}

/// SVC's update of an m × n matrix, row-major (SPEC §4e): Δ_m = U Σ Vᵀ (thin SVD in f64); for
/// each direction r whose σ_r is above the numerical rank's threshold, each agent's response
/// a_r^i = u_rᵀ τ_i, its coefficient s_r^i = ⟨σ_r v_r, a_r^i⟩ / ‖a_r^i‖² (an agent with no response
/// along u_r counts α), γ_r = K / Σ_i max(α, s_r^i); the update U diag(γ ⊙ σ) Vᵀ, each element
/// rounded once to f32. Directions at or below the threshold keep γ = 1.
pub(super) fn svc_update(
    merged: &[f32],
    taus: &[Vec<f32>],
    (m, n): (usize, usize),
    alpha: f64,
) -> Result<Vec<f32>> {
    let svd = thin_svd(matrix_f64(merged, (m, n)).as_ref(), "the merged update")?;
    let (u, s, v) = (svd.U(), svd.S().column_vector(), svd.V());
    let r = m.min(n);
    let floor = rank_floor(s[0], (m, n));
    let mut sums = vec![0.0f64; r];
    for tau in taus {
        let t = matrix_f64(tau, (m, n));
        let a = u.transpose() * &t;
        for k in (0..r).filter(|&k| s[k] > floor) {
            let (mut norm2, mut dot) = (0.0f64, 0.0f64);
            for j in 0..n {
                let x = a[(k, j)];
                norm2 += x * x;
                dot += v[(j, k)] * x;
            }
            sums[k] += if norm2 > 0.0 {
                (s[k] * dot / norm2).max(alpha)
            } else {
                alpha
            };
        }
    }
    let agents = taus.len() as f64;
    let mut scaled = u.to_owned();
    for k in 0..r {
        // γ_r σ_r, or σ_r where the direction is below the threshold.
        let factor = if s[k] > floor {
            agents / sums[k] * s[k]
        } else {
            s[k]
        };
        scaled.col_mut(k).iter_mut().for_each(|x| *x *= factor);
    }
    let update = &scaled * v.transpose();
    Ok(rounded(update.as_ref(), 1.0))
}

/// Every agent's τ of an m × n matrix (`elems` elements), whole, from the scan of its tiles.
pub(super) fn gather_taus(scan: &mut dyn Scans, elems: usize) -> Result<Vec<Vec<f32>>> {
    let mut taus: Vec<Vec<f32>> = Vec::new();
    scan.tiles(&mut |tile| {
        if taus.is_empty() {
            taus = vec![vec![0.0f32; elems]; tile.tau.len()];
        }
        let start = tile.start as usize;
        for (all, tau) in taus.iter_mut().zip(tile.tau) {
            all[start..start + tau.len()].copy_from_slice(tau);
        }
        Ok(ControlFlow::Continue(()))
    })?;
    Ok(taus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resmerge_decomposes_matrices_the_full_svds_leave() {
        // A 7B model's MLP projection: 45 M elements, above the full SVDs' 2^25.
        let (mlp, shape) = ("model.layers.0.mlp.up_proj.weight", [11008, 4096]);
        assert_eq!(decomposed(Kind::IsoC, mlp, &shape), None);
        assert_eq!(decomposed(Kind::Tsv, mlp, &shape), None);
        assert_eq!(decomposed(Kind::ResMerge, mlp, &shape), Some((11008, 4096)));
        // Within the full SVDs' bound every decomposing method takes it; above ResMerge's own,
        // none; embeddings are ResMerge's elementwise rule whatever their size.
        let small = [4096, 8192];
        for kind in [Kind::IsoC, Kind::Tsv, Kind::ResMerge] {
            assert_eq!(decomposed(kind, mlp, &small), Some((4096, 8192)));
            assert_eq!(decomposed(kind, mlp, &[1 << 16, 1 << 15]), None);
            assert_eq!(decomposed(kind, mlp, &[4096]), None);
        }
        let embed = "model.embed_tokens.weight";
        assert_eq!(decomposed(Kind::ResMerge, embed, &[32000, 1024]), None);
        assert_eq!(
            decomposed(Kind::IsoC, embed, &[32000, 1024]),
            Some((32000, 1024))
        );
    }
}
